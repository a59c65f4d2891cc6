"""Hostile clients against the inference requests an HTTP connection answers itself (kserve/http_protocol.py).

Each test sends the same bytes twice where it can: as a request the connection answers itself (a small
uncompressed inference body) and with ``Content-Encoding: identity``, which only uvicorn's request cycle
and the ASGI app read, so that the old path is the reference the new one must match.
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import Client
from tests.daemon import Gate, stop_daemon
from tests.kserve_daemon import KServeDaemon, start_kserve_daemon
from tests.test_kserve_http import _identity_request as infer
from tests.test_kserve_http import _responses as responses

OLD_PATH = b"Content-Encoding: identity"  # a body only the ASGI app reads: uvicorn's request cycle answers
IDLE_S = 1  # the daemon's --idle-timeout-secs (also its header and body timeouts)


@pytest.fixture(scope="module")
def short(ipc_root: Path, ipc_repository: Path) -> Iterator[KServeDaemon]:
    """One daemon with one-second idle, header and body timeouts."""
    timeouts = ("--idle-timeout-secs", "--header-timeout-secs", "--body-timeout-secs")
    flags = [part for flag in timeouts for part in (flag, str(IDLE_S))]
    server = start_kserve_daemon(ipc_root, ipc_repository, "hostile.sock", *flags)
    try:
        yield server
    finally:
        assert stop_daemon(server.daemon) == 0, server.daemon.log()


@pytest.fixture
def gate(short: KServeDaemon) -> Iterator[Gate]:
    assert short.daemon.gate is not None
    yield short.daemon.gate
    short.daemon.gate.settle()


def until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:  # a reset after the answers
        pass
    return data


def statuses(data: bytes) -> list[bytes]:
    return re.findall(rb"HTTP/1\.1 (\d+)", data)


def body_bytes_in_flight(server: KServeDaemon) -> int:
    with Client(server.daemon.address, timeout=10) as client:
        return int(client.ipc_status()["limits"]["body_bytes_in_flight"])


@pytest.mark.parametrize("path", ["direct", "cycle"])
def test_a_request_pipelined_behind_a_direct_answer_is_not_cut_by_the_idle_timeout(
    short: KServeDaemon, gate: Gate, path: str
) -> None:
    """The idle timeout is for a connection with nothing in flight: a request pipelined in the same read
    behind one the connection answered itself, waiting longer than that timeout for its model, is answered."""
    x = np.arange(4, dtype=np.float32)
    first = infer(x, *([OLD_PATH] if path == "cycle" else []), model=b"nonexistent")
    with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
        sock.sendall(first + infer(x, model=b"gate"))
        gate.wait_started(1)
        time.sleep(3 * IDLE_S)  # the gated request is still in flight: the connection must stay
        gate.release(1)
        (first_head, _), (head, body) = responses(sock, 2)
    assert first_head.startswith(b"HTTP/1.1 400") and head.startswith(b"HTTP/1.1 200"), head
    assert json.loads(body)["outputs"][0]["data"] == x.tolist()


@pytest.mark.parametrize("path", ["direct", "cycle"])
def test_nothing_pipelined_behind_an_answer_that_closes_the_connection_runs(
    short: KServeDaemon, gate: Gate, path: str
) -> None:
    """An answer with ``connection: close`` (a malformed body) ends the connection: the requests pipelined
    behind it in the same read are neither answered nor run, whichever path answered the first."""
    bad = b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n%s\r\n{{{{{" % (
        OLD_PATH + b"\r\n" if path == "cycle" else b""
    )
    live = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
        sock.sendall(bad + infer(np.ones(2, np.float32), model=b"gate") + live)
        data = until_closed(sock)
    assert statuses(data) == [b"400"] and b"connection: close" in data, data
    with pytest.raises(TimeoutError):
        gate.wait_started(1, timeout=2 * IDLE_S)
