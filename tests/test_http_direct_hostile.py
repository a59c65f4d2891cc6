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
from tests.daemon import Gate, stop_daemon, wait_for
from tests.kserve_daemon import KServeDaemon, start_kserve_daemon
from tests.test_kserve_http import _identity_request as infer
from tests.test_kserve_http import _responses as responses

OLD_PATH = b"Content-Encoding: identity"  # a body only the ASGI app reads: uvicorn's request cycle answers
IDLE_S = 1  # the daemon's --idle-timeout-secs (also its header and body timeouts)
USER_BODY_BYTES = 256 << 10  # its --max-client-body-bytes


@pytest.fixture(scope="module")
def short(ipc_root: Path, ipc_repository: Path) -> Iterator[KServeDaemon]:
    """One daemon with one-second idle, header and body timeouts, and a small body budget per user."""
    timeouts = ("--idle-timeout-secs", "--header-timeout-secs", "--body-timeout-secs")
    flags = [part for flag in timeouts for part in (flag, str(IDLE_S))]
    flags += ["--max-client-body-bytes", str(USER_BODY_BYTES)]
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
def test_a_connection_idle_after_its_answer_is_closed(short: KServeDaemon, path: str) -> None:
    """After its answer, a keep-alive connection that sends nothing more is closed at the idle timeout,
    without a 408 (there is no request to answer)."""
    with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
        sock.sendall(infer(np.ones(2, np.float32), *([OLD_PATH] if path == "cycle" else [])))
        ((head, _),) = responses(sock, 1)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert until_closed(sock) == b""


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


@pytest.mark.parametrize("path", ["direct", "cycle"])
def test_nothing_pipelined_behind_a_body_refused_as_it_arrives_runs(short: KServeDaemon, path: str) -> None:
    """A body over the user's budget is refused as it arrives (503; the rest is read and dropped until the
    close): a control request pipelined behind it in the same read is not run."""
    big = infer(np.ones(USER_BODY_BYTES // 4 + 64, np.float32), *([OLD_PATH] if path == "cycle" else []))
    unload = b"POST /v2/repository/models/text/unload HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
    try:
        with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
            sock.sendall(big + unload)
            data = until_closed(sock)
        assert statuses(data) == [b"503"] and b"--max-client-body-bytes" in data, data
        with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
            sock.sendall(b"GET /v2/models/text/ready HTTP/1.1\r\nHost: x\r\n\r\n")
            ((head, _),) = responses(sock, 1)
        assert head.startswith(b"HTTP/1.1 200"), head  # still loaded
    finally:
        with Client(short.daemon.address, timeout=30) as client:
            client.load_model("text")


@pytest.mark.parametrize("path", ["direct", "cycle"])
def test_a_connection_whose_body_was_refused_is_closed_after_its_linger(
    short: KServeDaemon, path: str
) -> None:
    """A body over the user's budget, sent whole: its 503 and the end of the daemon's side of the stream, then
    the close once the linger is over, although the client keeps its side open."""

    def connections() -> int:
        with Client(short.daemon.address, timeout=10) as client:
            return int(client.ipc_status()["limits"]["connections"])

    wait_for(lambda: connections() == 1, what="no HTTP connection but the status client's")
    big = infer(np.ones(USER_BODY_BYTES // 4 + 64, np.float32), *([OLD_PATH] if path == "cycle" else []))
    with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
        sock.sendall(big)
        data = until_closed(sock)  # the 503, then the daemon's end of stream
        assert statuses(data) == [b"503"], data
        wait_for(lambda: connections() == 1, timeout=10 * IDLE_S, what="the daemon to close the connection")


@pytest.mark.parametrize("path", ["direct", "cycle"])
def test_an_answer_that_closes_the_connection_reaches_a_client_still_sending(
    short: KServeDaemon, path: str
) -> None:
    """A malformed body is answered 400 and the connection closed while the next request's body (pipelined
    behind it) is still arriving: the close lingers, so that the client reads its 400, not a reset."""
    bad = b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n%s\r\n{{{{{" % (
        OLD_PATH + b"\r\n" if path == "cycle" else b""
    )
    behind = infer(np.ones(USER_BODY_BYTES // 5, np.float32))  # within the user's body budget
    data, reset = b"", False
    with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
        try:
            sock.sendall(bad + behind)
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionError:
            reset = True
    assert statuses(data) == [b"400"] and not reset, (data, reset)


def errors_logged(server: KServeDaemon) -> int:
    """Error lines in the daemon's log (a write after the end of a stream, an exception out of the app)."""
    return len(re.findall(r"^\S+ \S+ E ", server.daemon.log_path.read_text(errors="replace"), re.MULTILINE))


@pytest.mark.parametrize("path", ["direct", "cycle"])
def test_garbage_behind_an_answer_that_closes_the_connection_is_not_answered(
    short: KServeDaemon, path: str
) -> None:
    """A malformed body answered 400 with a close, then bytes no parser takes in the same read: one answer,
    the end of the stream, and nothing written after it (no error logged for a write after the end)."""
    bad = b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n%s\r\n{{{{{" % (
        OLD_PATH + b"\r\n" if path == "cycle" else b""
    )
    before = errors_logged(short)
    with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
        sock.sendall(bad + b"GARBAGE\x01 / HTTP/1.1\r\n\r\n")
        data = until_closed(sock)
    assert statuses(data) == [b"400"], data
    with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")  # the loop is past that read
        assert responses(sock, 1)[0][0].startswith(b"HTTP/1.1 200")
    assert errors_logged(short) == before, short.daemon.log()


_X = np.arange(3, dtype=np.float32)
_PLAIN = infer(_X)
_HEAD, _, _BODY = _PLAIN.partition(b"\r\n\r\n")
_LENGTH = b"Content-Length: %d" % len(_BODY)

HOSTILE = {
    "two-content-lengths": _HEAD + b"\r\n" + _LENGTH + b"\r\n\r\n" + _BODY,
    "two-different-content-lengths": _HEAD + b"\r\nContent-Length: 5\r\n\r\n" + _BODY,
    "content-length-and-chunked": _HEAD + b"\r\nTransfer-Encoding: chunked\r\n\r\n" + _BODY,
    "content-length-and-odd-te": _HEAD + b"\r\ntRANSFER-encoding : chunked\r\n\r\n" + _BODY,
    "te-chunked-identity": _HEAD + b"\r\nTransfer-Encoding: chunked, identity\r\n\r\n" + _BODY,
    "content-length-plus": _PLAIN.replace(_LENGTH, b"Content-Length: +%d" % len(_BODY)),
    "content-length-spaces": _PLAIN.replace(_LENGTH, b"Content-Length:  %d " % len(_BODY)),
    "content-length-zeros": _PLAIN.replace(_LENGTH, b"Content-Length: 000%d" % len(_BODY)),
    "absolute-uri": _PLAIN.replace(b"POST /v2", b"POST http://x/v2", 1),
    "query": _PLAIN.replace(b"/infer HTTP", b"/infer?a=b HTTP", 1),
    "dot-dot": _PLAIN.replace(b"/v2/models/", b"/v2/models/../models/", 1),
    "percent": _PLAIN.replace(b"/identity/", b"/identit%79/", 1),
    "not-ascii": _PLAIN.replace(b"/identity/", "/idéntity/".encode(), 1),
    "long-name": _PLAIN.replace(b"/identity/", b"/" + b"a" * 60000 + b"/", 1),
    "http-1.0-keep-alive": _PLAIN.replace(b"HTTP/1.1", b"HTTP/1.0", 1).replace(
        b"Host: x", b"Host: x\r\nConnection: keep-alive"
    ),
    "bad-inference-header-length": _PLAIN.replace(b"Length: 1", b"Length: x1", 1),
    "upgrade": _PLAIN.replace(b"Host: x", b"Host: x\r\nConnection: Upgrade\r\nUpgrade: websocket"),
}


@pytest.mark.parametrize("request_bytes", list(HOSTILE.values()), ids=list(HOSTILE))
def test_a_hostile_request_is_answered_as_uvicorns_cycle_answers_it(
    short: KServeDaemon, request_bytes: bytes
) -> None:
    """Smuggling and parsing oddities, each followed by a request on the same connection: the statuses, the
    error texts and the close are the same on both paths (most are refused by the parser before either)."""
    replies = []
    for extra in (b"", OLD_PATH + b"\r\n"):
        with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
            sock.sendall(
                request_bytes.replace(b"Host: x\r\n", b"Host: x\r\n" + extra, 1)
                + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            data = until_closed(sock)
        errors = re.findall(rb'"error": ?"([^"]*)"', data)
        replies.append((statuses(data), errors, b"connection: close" in data.lower()))
    assert replies[0] == replies[1]


def test_the_body_budget_comes_back_after_direct_requests_cut_off_or_left_unread(
    short: KServeDaemon, gate: Gate
) -> None:
    """Clients gone mid-body, gone before reading their answer, or gone while their request waits for an
    instance: every body byte counted for them is given back."""
    request = infer(np.ones(8, np.float32))
    for cut in (len(request) - 3, len(request)):
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
                sock.sendall(request[:cut])
    sock = socket.create_connection(("127.0.0.1", short.http_port), timeout=30)
    sock.sendall(infer(np.ones(8, np.float32), model=b"gate"))
    gate.wait_started(1)
    assert body_bytes_in_flight(short) > 0
    sock.close()
    gate.release(1)
    wait_for(lambda: body_bytes_in_flight(short) == 0, what="the body budget to come back")


@pytest.mark.parametrize("sent", ["headers", "part-of-the-body"])
def test_a_direct_request_that_stops_short_is_timed_out(short: KServeDaemon, sent: str) -> None:
    """A small inference whose headers or body stop short gets its 408 and the close, as any other."""
    cut = _PLAIN.index(b"\r\n\r\n") + (4 if sent == "headers" else len(_BODY) - 1)
    if sent == "headers":
        cut -= 6  # inside the last header
    with socket.create_connection(("127.0.0.1", short.http_port), timeout=30) as sock:
        sock.sendall(_PLAIN[:cut])
        data = until_closed(sock)
    what = b"headers" if sent == "headers" else b"body"
    assert statuses(data) == [b"408"] and b"its request " + what in data, data
