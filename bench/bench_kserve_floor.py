"""The floor under our KServe frontends: bare grpcio, h2 and uvicorn servers answering the same calls.

    .venv/bin/python bench/bench_kserve_floor.py --quick     # ~30 seconds
    .venv/bin/python bench/bench_kserve_floor.py             # more calls, more rounds

What a KServe frontend written in CPython can reach at best on this machine: each bare server runs in a
process of its own, answers ``ModelInfer`` with a canned response of the right shape and does nothing
else (no validation, no data plane, no model), and is called by the same ``tritonclient`` calls as
edge-server's own frontends, which run beside them in the same run (the ``tiny_py``/``frame_py``
``model.py`` models of bench/triton_models.py; ``frame_py`` also reduces the frame to its means, which
the bare servers skip, so its row holds that compute too).

* ``bare grpcio``: ``grpc.server`` with a thread pool, Triton's generated ``GRPCInferenceService``
  servicer, default options; ``bare grpcio, our options``: the options edge-server's frontend sets
  (message bounds).
* ``bare grpc loop``: no grpcio server: grpc core's completion queue (grpcio's Cython layer) polled by
  one thread that answers each call itself, as edge-server's ``ModelInfer`` is answered; ``listener
  off``: the same with grpc's ``event_engine_listener`` experiment off, as edge-server runs it (the
  polling thread reads the connections too: edge_server.kserve.grpc_env).
* ``bare h2``: no grpcio: gRPC's unary calls on h2's pure-Python HTTP/2 state machine (``h2`` from PyPI,
  not a dependency: ``pip install h2``; the row is skipped without it) in an asyncio protocol (uvloop
  when present); it parses each request and serializes each response, as a real server must.
* ``bare uvicorn``: a bare ASGI app under uvicorn (httptools, uvloop when present) that reads the body,
  parses the JSON header of the binary tensor extension and answers a binary output.

Payloads: ``tiny`` (1x16 FP32 in and out) and ``frame`` (1080x1920x3 UINT8 in, 3 x FP32 out).  Cases
alternate round by round; latency medians over every call of every round, and the CPU the server's
process (children included) spent per call over every timed call (bench_kserve_cost.process_cpu).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_server.kserve import grpc_env  # noqa: E402

WORKLOADS = {"tiny": ("INPUT", "OUTPUT", "FP32"), "frame": ("frame", "means", "UINT8")}


# -- the bare servers (run as `bench_kserve_floor.py --serve KIND PORT`) ------------------------------


def _canned(model: str) -> tuple[str, str, list[int], bytes]:
    if model.startswith("frame"):
        return "means", "FP32", [3], np.zeros(3, np.float32).tobytes()
    return "OUTPUT", "FP32", [1, 16], np.zeros(16, np.float32).tobytes()


def serve_grpc(port: int, tuned: bool) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from edge_server.kserve.grpc_frontend import server_options

    class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def ServerLive(self, request: Any, context: Any) -> Any:
            return service_pb2.ServerLiveResponse(live=True)

        def ModelInfer(self, request: Any, context: Any) -> Any:
            name, datatype, shape, raw = _canned(request.model_name)
            response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
            response.outputs.add(name=name, datatype=datatype, shape=shape)
            response.raw_output_contents.append(raw)
            return response

    options = server_options(64 << 20) if tuned else [("grpc.max_receive_message_length", 64 << 20)]
    server = grpc.server(ThreadPoolExecutor(max_workers=16), options=options)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def serve_grpc_loop(port: int) -> None:
    """grpc core's completion queue polled by one thread that answers each call itself (no workers).

    What edge-server's ``ModelInfer`` does on grpcio's own loop (edge_server.kserve.grpc_infer), bare.
    """
    from grpc._cython import cygrpc
    from tritonclient.grpc import service_pb2

    queue = cygrpc.CompletionQueue()
    server = cygrpc.Server((("grpc.max_receive_message_length", 64 << 20),), False)
    server.register_completion_queue(queue)
    server.add_http2_port(f"127.0.0.1:{port}".encode(), None)
    server.start()
    asked, ended = object(), object()

    def answer(method: bytes, message: bytes) -> bytes:
        if not method.endswith(b"/ModelInfer"):
            return service_pb2.ServerLiveResponse(live=True).SerializeToString()
        request = service_pb2.ModelInferRequest.FromString(message)
        name, datatype, shape, raw = _canned(request.model_name)
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(raw)
        return response.SerializeToString()

    server.request_call(queue, queue, asked)
    while True:
        event = queue.poll()
        if event.completion_type != cygrpc.CompletionType.operation_complete or event.tag is ended:
            continue
        if event.tag is asked:
            server.request_call(queue, queue, asked)
            call = event.call
            receive = (cygrpc.ReceiveMessageOperation(0),)
            call.start_server_batch(receive, (call, event.call_details.method))
            continue
        call, method = event.tag
        ops = (
            cygrpc.SendInitialMetadataOperation(None, 0),
            cygrpc.SendMessageOperation(answer(method, event.batch_operations[0].message()), 0),
            cygrpc.SendStatusFromServerOperation(None, cygrpc.StatusCode.ok, b"", 0),
            cygrpc.ReceiveCloseOnServerOperation(0),
        )
        call.start_server_batch(ops, ended)


def serve_h2(port: int) -> None:
    """gRPC's unary calls on h2's HTTP/2 state machine and an asyncio (uvloop) protocol: no grpcio.

    Just what tritonclient's ``ServerLive`` and ``ModelInfer`` need, done as a real server must: the
    request is parsed (gzip inflated where the message says so), the response serialized per call,
    received data acknowledged; windows of 16 MiB and 1 MiB frames so that a frame is not dribbled in.
    """
    import asyncio
    import zlib

    from h2.config import H2Configuration
    from h2.connection import H2Connection
    from h2.events import DataReceived, RequestReceived, StreamEnded, StreamReset
    from h2.exceptions import ProtocolError
    from h2.settings import SettingCodes
    from tritonclient.grpc import service_pb2

    from edge_server.kserve.http_frontend import _loop_impl

    window = 16 << 20
    frame = 1 << 20  # fewer, bigger DATA frames cost h2 less: 1 MiB beat 16 KiB, 64 KiB and 16 MiB
    bound = 64 << 20  # the message bound the grpcio servers get
    prefix = "/inference.GRPCInferenceService/"

    def answer(method: bytes, message: bytes) -> tuple[bytes, int]:
        if method == b"ServerLive":
            service_pb2.ServerLiveRequest.FromString(message)
            return service_pb2.ServerLiveResponse(live=True).SerializeToString(), 0
        if method == b"ModelInfer":
            request = service_pb2.ModelInferRequest.FromString(message)
            name, datatype, shape, raw = _canned(request.model_name)
            response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
            response.outputs.add(name=name, datatype=datatype, shape=shape)
            response.raw_output_contents.append(raw)
            return response.SerializeToString(), 0
        return b"", 12  # UNIMPLEMENTED

    class Grpc(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.conn = H2Connection(H2Configuration(client_side=False, header_encoding=None))
            self.conn.initiate_connection()
            # Not by replacing local_settings: the connection keeps the 16 KiB frame bound it was made
            # with and refuses bigger frames (FRAME_SIZE_ERROR); these count once the client acks them.
            self.conn.update_settings(
                {SettingCodes.INITIAL_WINDOW_SIZE: window, SettingCodes.MAX_FRAME_SIZE: frame}
            )
            # And accepted at once: h2 sets its frame bound once per receive_data, so the client's ACK
            # and a big DATA frame in one read failed that frame (FRAME_SIZE_ERROR, the connection lost).
            self.conn.max_inbound_frame_size = frame
            self.conn.increment_flow_control_window(window - 65535)
            self.streams: dict[int, tuple[dict[bytes, bytes], bytearray]] = {}
            transport.write(self.conn.data_to_send())

        def data_received(self, data: bytes) -> None:
            try:
                events = self.conn.receive_data(data)
            except ProtocolError:
                self.transport.write(self.conn.data_to_send())
                self.transport.close()
                return
            for event in events:
                if isinstance(event, RequestReceived):
                    self.streams[event.stream_id] = (dict(event.headers), bytearray())
                elif isinstance(event, DataReceived):
                    self.streams[event.stream_id][1].extend(event.data)
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, StreamEnded):
                    self.respond(event.stream_id, *self.streams.pop(event.stream_id))
                elif isinstance(event, StreamReset):
                    self.streams.pop(event.stream_id, None)
            self.transport.write(self.conn.data_to_send())

        def respond(self, stream_id: int, headers: dict[bytes, bytes], body: bytearray) -> None:
            path = headers.get(b":path", b"").decode("latin-1")
            message = bytes(body[5:])
            if body[:1] == b"\x01":  # compressed, as the grpc-encoding header says
                if headers.get(b"grpc-encoding") != b"gzip":
                    raise ValueError(
                        f"compressed message with grpc-encoding {headers.get(b'grpc-encoding')!r}"
                    )
                inflate = zlib.decompressobj(wbits=31)  # gzip; bounded, as a hostile client demands
                message = inflate.decompress(message, bound + 1)
                if len(message) > bound or not inflate.eof:
                    raise ValueError("compressed message too large or truncated")
            payload, status = (
                answer(path.removeprefix(prefix).encode(), message) if path.startswith(prefix) else (b"", 12)
            )
            conn = self.conn
            conn.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
            if status == 0:
                data = b"\x00" + len(payload).to_bytes(4, "big") + payload
                if len(data) > conn.local_flow_control_window(stream_id):
                    raise RuntimeError("response larger than the client's window (a real server would wait)")
                step = conn.max_outbound_frame_size
                for at in range(0, len(data), step):
                    conn.send_data(stream_id, data[at : at + step])
            conn.send_headers(stream_id, [(b"grpc-status", str(status).encode())], end_stream=True)

    async def run() -> None:
        server = await asyncio.get_running_loop().create_server(Grpc, "127.0.0.1", port)
        await server.serve_forever()

    if _loop_impl() == "uvloop":
        import uvloop

        uvloop.run(run())
    else:
        asyncio.run(run())


def serve_uvicorn(port: int) -> None:
    import uvicorn

    from edge_server.kserve.http_frontend import _loop_impl
    from edge_server.kserve.http_protocol import http_protocol
    from edge_server.limits import Limits

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        headers = dict(scope["headers"])
        length = int(headers.get(b"inference-header-content-length", len(body)))
        header = json.loads(body[:length]) if body else {}
        model = scope["path"].split("/")[3] if scope["path"].startswith("/v2/models/") else ""
        if not model:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        name, datatype, shape, raw = _canned(model)
        params = {"binary_data_size": len(raw)}
        out = {"name": name, "datatype": datatype, "shape": shape, "parameters": params}
        text = json.dumps({"model_name": model, "id": header.get("id", ""), "outputs": [out]}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/octet-stream"),
                    (b"inference-header-content-length", str(len(text)).encode()),
                    (b"content-length", str(len(text) + len(raw)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": text + raw})

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        http=http_protocol(Limits(), 64 << 20),
        loop=_loop_impl(),
        lifespan="off",
        log_config=None,
        access_log=False,
        server_header=False,
        date_header=False,
    )


# -- the client side ------------------------------------------------------------------------------


def wait_ready(http_port: int | None, grpc_port: int | None, timeout: float = 60.0) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    deadline = time.monotonic() + timeout
    while True:
        try:
            if http_port is not None:
                httpclient.InferenceServerClient(f"127.0.0.1:{http_port}").is_server_live()
            if grpc_port is not None:
                grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}").is_server_live()
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def calls(
    stack: ExitStack, http_port: int | None, grpc_port: int | None, model: str, workload: str, x: np.ndarray
) -> dict[str, Callable[[], Any]]:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    name, out, datatype = WORKLOADS[workload]
    made: dict[str, Callable[[], Any]] = {}
    if http_port is not None:
        hc = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
        stack.callback(hc.close)
        hin = httpclient.InferInput(name, list(x.shape), datatype)
        hin.set_data_from_numpy(x, binary_data=True)
        hout = [httpclient.InferRequestedOutput(out, binary_data=True)]
        made["HTTP"] = lambda: hc.infer(model, [hin], outputs=hout)
    if grpc_port is not None:
        gc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        stack.callback(gc.close)
        gin = grpcclient.InferInput(name, list(x.shape), datatype)
        gin.set_data_from_numpy(x)
        made["gRPC"] = lambda: gc.infer(model, [gin])
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="few calls, two rounds (~30 seconds)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-edge", action="store_true", help="the bare servers only")
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        kind, port = args.serve[0], int(args.serve[1])
        if kind == "uvicorn":
            serve_uvicorn(port)
        elif kind == "h2":
            serve_h2(port)
        elif kind.startswith("grpc-loop"):
            serve_grpc_loop(port)
        else:
            serve_grpc(port, tuned=kind == "grpc-tuned")
        return 0

    from bench.bench_kserve_cost import process_cpu
    from bench.triton_models import build_repository, sample_inputs
    from tests.daemon import Daemon, free_port, kserve_flags

    rounds = args.rounds or (2 if args.quick else 4)
    counts = {"tiny": 300, "frame": 10} if args.quick else {"tiny": 2000, "frame": 40}
    inputs = sample_inputs()
    servers: dict[str, tuple[int | None, int | None, str]] = {}  # label -> http port, grpc port, model suffix
    pids: dict[str, int] = {}  # label -> the server's process (its CPU, children included)
    with tempfile.TemporaryDirectory(prefix="bench-floor-") as tmp, ExitStack() as stack:
        for label, kind, is_http in (
            ("bare grpcio", "grpc", False),
            ("bare grpcio, our options", "grpc-tuned", False),
            ("bare grpc loop", "grpc-loop", False),
            ("bare grpc loop, listener off", "grpc-loop-listener-off", False),
            *([("bare h2", "h2", False)] if importlib.util.find_spec("h2") else []),
            ("bare uvicorn", "uvicorn", True),
        ):
            port = free_port()
            env = dict(os.environ)
            if kind.endswith("listener-off"):
                env[grpc_env.VARIABLE] = "-" + grpc_env.EXPERIMENT
            proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, str(port)], cwd=ROOT, env=env)
            stack.callback(proc.wait, 10)
            stack.callback(proc.terminate)
            servers[label] = (port, None, "") if is_http else (None, port, "")
            pids[label] = proc.pid
        if not args.no_edge:
            root = Path(tmp)
            repo = build_repository(root / "repo")
            http_port, grpc_port = free_port(), free_port()
            daemon = Daemon(
                repo, f"ipc://{root}/edge.sock", root / "daemon.log", *kserve_flags(http_port, grpc_port)
            )
            stack.callback(daemon.stop)
            daemon.start(timeout=180)
            servers["edge-server model.py"] = (http_port, grpc_port, "_py")
            pids["edge-server model.py"] = daemon.pid
        for http_port, grpc_port, _ in servers.values():
            wait_ready(http_port, grpc_port)
        cases: dict[tuple[str, str, str], Callable[[], Any]] = {}
        for label, (http_port, grpc_port, suffix) in servers.items():
            for workload in WORKLOADS:
                made = calls(stack, http_port, grpc_port, workload + suffix, workload, inputs[workload])
                for transport, call in made.items():
                    cases[(workload, transport, label)] = call
        samples: dict[tuple[str, str, str], list[float]] = {key: [] for key in cases}
        cpu = dict.fromkeys(cases, 0.0)
        for r in range(rounds):
            for key, call in cases.items():
                for _ in range(3):
                    call()
                times = samples[key]
                cpu0 = process_cpu(pids[key[2]])
                for _ in range(counts[key[0]]):
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
                cpu[key] += process_cpu(pids[key[2]]) - cpu0
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)

    labels = list(servers)
    print(
        f"\npython {sys.version.split()[0]}, {rounds} rounds; latency median over every call / "
        "the server's CPU per call (its process and children, over every timed call), µs\n"
    )
    print("| payload | transport | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for workload in WORKLOADS:
        for transport in ("HTTP", "gRPC"):
            cells = []
            for label in labels:
                times = samples.get((workload, transport, label))
                per_call = cpu[(workload, transport, label)] / len(times) if times else 0.0
                cells.append(
                    f"{statistics.median(times) * 1e6:,.0f} / {per_call * 1e6:,.0f}" if times else "—"
                )
            print(f"| {workload} | {transport} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
