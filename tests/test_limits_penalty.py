"""The penalty box of the daemon's one budget (edge_server.limits): unit tests, no sockets."""

from __future__ import annotations

import os

import pytest

from edge_server import limits
from edge_server.limits import Limits

STRANGER = 23456


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    return now


def test_a_penalized_uid_is_refused_and_its_penalty_doubles_with_repeats(clock: list[float]) -> None:
    budget = Limits()
    budget.penalize(STRANGER, "sent a bomb")
    refusal = budget.penalty(STRANGER)
    assert refusal is not None and "sent a bomb" in refusal and "1 s" in refusal
    assert budget.connect(STRANGER).refusal == refusal
    assert budget.connect(STRANGER + 1).refusal is None  # others are not touched
    clock[0] += limits.PENALTY_S
    assert budget.penalty(STRANGER) is None
    budget.penalize(STRANGER, "again")  # a repeat soon after: twice as long
    clock[0] += limits.PENALTY_S
    assert budget.penalty(STRANGER) is not None
    clock[0] += limits.PENALTY_S
    assert budget.penalty(STRANGER) is None
    for _ in range(20):
        budget.penalize(STRANGER, "again and again")
    assert f"{limits.MAX_PENALTY_S:g} s" in (budget.penalty(STRANGER) or "")
    clock[0] += 3 * limits.MAX_PENALTY_S  # long quiet: the next offence starts from the first penalty
    budget.penalize(STRANGER, "once more")
    assert f"refused for {limits.PENALTY_S:g} s" in (budget.penalty(STRANGER) or "")
    assert budget.status()["penalized"] == 23


def test_the_daemons_own_uid_and_unknown_peers_are_never_penalized(clock: list[float]) -> None:
    budget = Limits()
    budget.penalize(None, "a remote TCP client: they all share None")
    budget.penalize(os.geteuid(), "the daemon's own user")
    assert budget.penalty(None) is None and budget.penalty(os.geteuid()) is None
    assert budget.status()["penalized"] == 0
