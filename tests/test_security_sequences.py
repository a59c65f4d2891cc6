"""Sequences next to strangers: a sequence belongs to whoever started it, and a start never waits forever.

Correlation ids are the client's own: another local user continuing or ending a sequence it did not
start gets a precise error (its state is never read nor changed), and may use the same id for a
sequence of its own.  A start that finds every slot held waits at most its timeout (or the model's
``max_sequence_idle_microseconds``), then gets QUEUE_FULL instead of waiting without end.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import pytest

from edge_server.client import Client
from tests.daemon import build_repository, start_daemon, stop_daemon, wait_for
from tests.kserve_daemon import KServeDaemon, start_kserve_daemon
from tests.sequence_models import DIRECT, accumulate_config, accumulate_onnx, write_model
from tests.users import STRANGER, needs_root, open_socket, public_directory, run_as

# The running sum of a sequence (state kept by the server); one slot: one instance, batches of 1;
# a slot is held for a minute of idleness.
IDLE_US = 60_000_000

# One request of a sequence over HTTP, as any client sends it: prints [status, body].
STEP = r"""
import http.client, json, sys
port, corrid, value, flags = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
params = {"sequence_id": corrid, "sequence_start": "s" in flags, "sequence_end": "e" in flags}
if "t" in flags:
    params["timeout"] = 300000
tensor = {"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}
body = {"inputs": [tensor], "parameters": params}
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
conn.request("POST", "/v2/models/acc/infer", json.dumps(body).encode())
reply = conn.getresponse()
print(json.dumps([reply.status, reply.read().decode()]))
"""


@pytest.fixture(scope="module")
def server() -> Iterator[KServeDaemon]:
    with public_directory() as root:
        repo = build_repository(root)
        write_model(
            repo, "acc", accumulate_config("acc", DIRECT, max_batch_size=1, idle_us=IDLE_US), accumulate_onnx
        )
        daemon = start_kserve_daemon(root, repo, "s.sock")
        open_socket(daemon.daemon.address)
        try:
            yield daemon
        finally:
            assert stop_daemon(daemon.daemon) == 0, daemon.daemon.log()


def step(server: KServeDaemon, corrid: int, value: int, flags: str = "") -> tuple[int, str]:
    """One request as this (root) process."""
    params = {"sequence_id": corrid, "sequence_start": "s" in flags, "sequence_end": "e" in flags}
    if "t" in flags:
        params["timeout"] = 300000
    body = {"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}]}
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    try:
        conn.request("POST", "/v2/models/acc/infer", json.dumps({**body, "parameters": params}).encode())
        reply = conn.getresponse()
        return reply.status, reply.read().decode()
    finally:
        conn.close()


def stranger_step(server: KServeDaemon, corrid: int, value: int, flags: str = "") -> tuple[int, str]:
    status, body = run_as(
        STRANGER, STRANGER, [], STEP, str(server.http_port), str(corrid), str(value), flags or "-"
    )
    return status, body


def total(reply: tuple[int, str]) -> int:
    status, body = reply
    assert status == 200, body
    return int(json.loads(body)["outputs"][0]["data"][0])


@needs_root
def test_another_user_cannot_continue_or_end_a_sequence(server: KServeDaemon) -> None:
    assert total(step(server, 42, 5, "s")) == 5
    for flags in ("-", "e"):
        status, body = stranger_step(server, 42, 1000, flags)
        assert status == 400, body
        assert "sequence 42 to model" in body and "is not in progress" in body and "started it" in body
    # Nor restart it: a stranger's START on the id is a sequence of its own, which waits for a slot
    # (the only one is the owner's) and is refused at its timeout; the owner's sum is not reset.
    status, body = stranger_step(server, 42, 1000, "st")
    assert status == 503 and "QUEUE_FULL" in body, body
    assert total(step(server, 42, 2, "e")) == 7  # the owner's sum never saw the stranger's values


@needs_root
def test_a_start_that_finds_every_slot_held_gets_queue_full(server: KServeDaemon) -> None:
    assert total(step(server, 7, 1, "s")) == 1  # holds the only slot, for a minute of idleness
    try:
        status, body = stranger_step(server, 8, 1, "st")  # the same start with a timeout: 0.3 s
        assert status == 503, body
        assert "QUEUE_FULL" in body and "no free slot" in body
        status, body = step(server, 9, 1, "st")
        assert status == 503 and "QUEUE_FULL" in body, body
    finally:
        assert total(step(server, 7, 1, "e")) == 2
    assert total(step(server, 9, 4, "se")) == 4  # the slot is free again


@needs_root
def test_a_users_flood_of_starts_does_not_make_anothers_wait_for_all_of_it(server: KServeDaemon) -> None:
    """Sequences waiting for a slot take it user after user, as the dynamic batcher's queue serves them.

    One user holds the only slot and queues three more STARTs; a stranger's START queued after them
    gets the slot after one of them, not after all three (first come, first served, it waited for each
    of them to idle out and was refused at its own bound).
    """
    with Client(server.daemon.address, timeout=60) as observer:

        def backlog() -> int:
            return int(observer.statistics("acc")[0]["sequence_stats"]["backlog"])

        assert total(step(server, 20, 1, "s")) == 1  # holds the only slot
        with ThreadPoolExecutor(4) as pool:
            flood = {}
            for corrid in (21, 22, 23):
                flood[corrid] = pool.submit(step, server, corrid, corrid, "s")
                wait_for(lambda n=corrid - 20: backlog() == n, 60, what="the flood's starts to wait")
            theirs = pool.submit(stranger_step, server, 30, 5, "s")
            wait_for(lambda: backlog() == 4, 60, what="the stranger's start to wait")
            assert total(step(server, 20, 1, "e")) == 2
            assert total(flood[21].result(timeout=120)) == 21  # the flooder's turn
            assert total(step(server, 21, 0, "e")) == 21
            done, _ = wait([theirs, flood[22]], timeout=120, return_when=FIRST_COMPLETED)
            assert done == {theirs}, "the flood's next start took the slot before the stranger's"
            assert total(theirs.result()) == 5
            assert total(stranger_step(server, 30, 1, "e")) == 6
            for corrid in (22, 23):
                assert total(flood[corrid].result(timeout=120)) == corrid
                assert total(step(server, corrid, 0, "e")) == corrid


def test_the_same_id_names_different_sequences_for_different_clients(tmp_path: object) -> None:
    """In-process callers and IPC clients of one uid share their ids; the unit rule, without sockets."""
    from concurrent.futures import Future

    import numpy as np

    from edge_server.backends.base import BatchItem
    from edge_server.config.parser import parse_config_text
    from edge_server.errors import InvalidArgument
    from edge_server.request import REQUEST_FLAG_SEQUENCE_START
    from edge_server.scheduler.sequence import SequenceScheduler
    from edge_server.scheduler.stats import ModelStats

    text = accumulate_config("acc", DIRECT, max_batch_size=1, idle_us=IDLE_US)
    config, _ = parse_config_text(text, source="test", default_name="acc")
    scheduler = SequenceScheduler(config, [], ModelStats("acc", 1), tmp_path)  # type: ignore[arg-type]
    try:
        inputs = {"INPUT": np.zeros((1, 1), np.int32)}
        mine = BatchItem(inputs, 1, (), correlation_id=3, flags=REQUEST_FLAG_SEQUENCE_START, owner=1000)
        theirs = BatchItem(inputs, 1, (), correlation_id=3, flags=REQUEST_FLAG_SEQUENCE_START, owner=2000)
        assert isinstance(scheduler.submit(mine, ()), Future)
        assert isinstance(scheduler.submit(theirs, ()), Future)  # its own sequence 3, not an error
        assert scheduler.holds(3, 1000) and scheduler.holds(3, 2000) and not scheduler.holds(3, None)
        with pytest.raises(InvalidArgument, match="not in progress"):
            scheduler.submit(BatchItem(inputs, 1, (), correlation_id=3, owner=3000), ())
    finally:
        scheduler.stop(grace=0.1)


def test_ipc_clients_sequences_belong_to_their_uid() -> None:
    """Over IPC, the owner is the peer's uid: a second connection of the same user continues it."""
    from edge_server.client import Client

    with public_directory() as root:
        repo = build_repository(root)
        write_model(
            repo, "acc", accumulate_config("acc", DIRECT, max_batch_size=1, idle_us=IDLE_US), accumulate_onnx
        )
        daemon = start_daemon(root, repo, "i.sock")
        try:
            import numpy as np

            x = {"INPUT": np.array([[3]], np.int32)}
            with Client(daemon.address) as first, Client(daemon.address) as second:
                assert first.infer("acc", x, sequence_id=11, sequence_start=True)["OUTPUT"].tolist() == [[3]]
                assert second.infer("acc", x, sequence_id=11, sequence_end=True)["OUTPUT"].tolist() == [[6]]
        finally:
            assert stop_daemon(daemon) == 0, daemon.log()
