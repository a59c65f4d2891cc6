"""Where a small KServe call's time goes: a bare grpcio server, Triton and edge-server, one run.

    .venv-bench/bin/python bench/bench_kserve_cost.py --quick    # ~1 minute
    .venv-bench/bin/python bench/bench_kserve_cost.py            # more calls, more rounds
    .venv-bench/bin/python bench/bench_kserve_cost.py --parts    # edge-server's own pieces, in process

Three servers answer the same ``tritonclient`` calls, interleaved round by round:

* ``bare grpcio``: bench/bench_kserve_floor.py's server (grpcio's thread-pool server, Triton's generated
  servicer, a canned ``ModelInfer`` response, nothing else): what any handler on grpcio starts from;
* ``triton``: ``tritonserver`` on bench/triton_models.py's ``tiny_py`` (python_backend, in its stub);
* ``edge-server``: the daemon on the same repository, ``tiny_py`` run in its own process.

Per server and call (gRPC ``ServerLive``, which does nothing; gRPC ``ModelInfer``, HTTP binary and HTTP
with input and output in system shared memory on the tiny model): the median latency, and the CPU the
server's processes spent per call (``/proc/PID/stat`` of the server and its children, over the timed
calls): the part of a round trip the server costs, which a loaded 2-core box turns into waiting.  The
client's CPU per call is printed beside it (the same calls for every server).

``--parts`` times edge-server's own steps of those calls in this process instead (timeit, best of 5):
the gRPC request's parse, decode and response encode, the tiny ``model.py`` through the data plane,
the tiny HTTP request's decode and response encode (binary, and with input and output in system
shared memory), and the shared-memory reads and writes a KServe request makes (the registry's
ownership and permission checks included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_kserve_floor import wait_ready  # noqa: E402
from bench.triton_models import build_repository, python_models, sample_inputs  # noqa: E402
from bench.triton_server import Tritonserver, TritonUnavailable, find_tritonserver  # noqa: E402
from tests.daemon import Daemon, free_port, kserve_flags  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
Case = tuple[int, Callable[[], Any]]  # the server's pid, one call


def process_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its live children (Triton's python_backend stubs)."""
    return sum(process_cpu_by_command(pid).values())


def process_cpu_by_command(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid`` and its live children (every thread, ended ones too), per command name."""
    used: dict[str, float] = {}
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/stat") as f:
                stat = f.read()
            with open(f"/proc/{current}/task/{current}/children") as f:
                todo += [int(child) for child in f.read().split()]
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        used[name] = used.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICKS
    return used


def client_cpu() -> float:
    times = os.times()
    return times.user + times.system


def server_cases(
    stack: ExitStack, pid: int, http_port: int | None, grpc_port: int, model: str
) -> dict[str, Case]:
    """One server's calls: gRPC ServerLive and ModelInfer; HTTP and HTTP + system shm where it has HTTP."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as tshm

    x = sample_inputs()["tiny"]
    wait_ready(http_port, grpc_port)
    gc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    stack.callback(gc.close)
    gin = grpcclient.InferInput("INPUT", [1, 16], "FP32")
    gin.set_data_from_numpy(x)
    cases: dict[str, Case] = {
        "gRPC ServerLive": (pid, gc.is_server_live),
        "gRPC ModelInfer": (pid, partial(gc.infer, model, [gin])),
    }
    if http_port is None:
        return cases
    hc = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    stack.callback(hc.close)
    hin = httpclient.InferInput("INPUT", [1, 16], "FP32")
    hin.set_data_from_numpy(x, binary_data=True)
    cases["HTTP infer"] = (
        pid,
        partial(hc.infer, model, [hin], outputs=[httpclient.InferRequestedOutput("OUTPUT")]),
    )
    regions = {}
    for role in ("in", "out"):
        key = f"/es-cost-{os.getpid()}-{grpc_port}-{role}"
        handle = tshm.create_shared_memory_region(f"cost-{role}", key, x.nbytes)
        stack.callback(tshm.destroy_shared_memory_region, handle)
        hc.register_system_shared_memory(f"cost-{role}", key, x.nbytes)
        stack.callback(hc.unregister_system_shared_memory, f"cost-{role}")
        regions[role] = handle
    tshm.set_shared_memory_region(regions["in"], [x])
    sin = httpclient.InferInput("INPUT", [1, 16], "FP32")
    sin.set_shared_memory("cost-in", x.nbytes)
    sout = httpclient.InferRequestedOutput("OUTPUT", binary_data=True)
    sout.set_shared_memory("cost-out", x.nbytes)
    cases["HTTP + system shm infer"] = (pid, partial(hc.infer, model, [sin], outputs=[sout]))
    return cases


def measure(args: argparse.Namespace) -> None:
    rounds = args.rounds or (3 if args.quick else 6)
    calls = 300 if args.quick else 1000
    cases: dict[tuple[str, str], Case] = {}
    with tempfile.TemporaryDirectory(prefix="bench-kserve-cost-") as tmp, ExitStack() as stack:
        root = Path(tmp)
        repo = build_repository(root / "repo")
        port = free_port()
        bare = subprocess.Popen(
            [sys.executable, str(ROOT / "bench/bench_kserve_floor.py"), "--serve", "grpc", str(port)]
        )
        stack.callback(bare.wait, 10)
        stack.callback(bare.terminate)
        for name, case in server_cases(stack, bare.pid, None, port, "tiny").items():
            cases[("bare grpcio", name)] = case
        if not args.no_triton:
            try:
                http_port, grpc_port = free_port(), free_port()
                triton = Tritonserver(
                    find_tritonserver(None), repo, python_models(), root, http_port, grpc_port
                )
                stack.callback(triton.stop)
                triton.start()
                assert triton.proc is not None
                for name, case in server_cases(
                    stack, triton.proc.pid, http_port, grpc_port, "tiny_py"
                ).items():
                    cases[("triton", name)] = case
            except TritonUnavailable as exc:
                print(f"Triton skipped: {exc}", file=sys.stderr)
        http_port, grpc_port = free_port(), free_port()
        daemon = Daemon(
            repo, f"ipc://{root}/edge.sock", root / "daemon.log", *kserve_flags(http_port, grpc_port),
            "--allow-client-shm", "true",
        )  # fmt: skip
        stack.callback(daemon.stop)
        daemon.start(timeout=180)
        for name, case in server_cases(stack, daemon.pid, http_port, grpc_port, "tiny_py").items():
            cases[("edge-server", name)] = case

        times: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
        server_cpu = dict.fromkeys(cases, 0.0)
        own_cpu = dict.fromkeys(cases, 0.0)
        for r in range(rounds):
            for key, (pid, call) in cases.items():
                time.sleep(0.1)
                for _ in range(20):
                    call()
                cpu0, own0 = process_cpu(pid), client_cpu()
                for _ in range(calls):
                    start = time.perf_counter_ns()
                    call()
                    times[key].append((time.perf_counter_ns() - start) / 1000)
                server_cpu[key] += process_cpu(pid) - cpu0
                own_cpu[key] += client_cpu() - own0
            print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)

    total = rounds * calls
    print(f"\n{rounds} rounds of {calls} calls per case, interleaved; medians; CPU over every timed call\n")
    print("| call | server | latency, µs | server CPU per call, µs | client CPU per call, µs |")
    print("|---|---|---|---|---|")
    for key in sorted(times, key=lambda key: (key[1], key[0])):
        server, name = key
        print(
            f"| {name} | {server} | {statistics.median(times[key]):,.0f} | "
            f"{server_cpu[key] / total * 1e6:,.0f} | {own_cpu[key] / total * 1e6:,.0f} |"
        )


def http_rows(
    service: Any, peer: Any, x: Any, outputs: dict[str, Any], calls: int
) -> list[tuple[str, float]]:
    """The tiny HTTP request's decode and its response's encode (kserve/rest.py), binary and shm."""
    import json

    from edge_server.kserve import rest

    def body(input_params: dict[str, Any], output_params: dict[str, Any]) -> bytes:
        tensor = {"name": "INPUT", "shape": [1, 16], "datatype": "FP32", "parameters": input_params}
        return json.dumps(
            {"inputs": [tensor], "outputs": [{"name": "OUTPUT", "parameters": output_params}]}
        ).encode()

    header = body({"binary_data_size": x.nbytes}, {"binary_data": True})
    binary = header + x.tobytes()
    shm = body(
        {"shared_memory_region": "in", "shared_memory_byte_size": x.nbytes},
        {"shared_memory_region": "out", "shared_memory_byte_size": x.nbytes},
    )

    def call(data: bytes, length: int | None) -> None:
        rest.encode(service, rest.decode(service, "tiny_py", "", data, length, peer), outputs, peer)

    return [
        ("HTTP: decode and encode, binary", best(partial(call, binary, len(header)), calls)),
        ("HTTP: decode and encode, system shm in and out", best(partial(call, shm, None), calls)),
    ]


def best(call: Callable[[], Any], number: int = 20000) -> float:
    """Microseconds per call: the best of 5 timeit repeats (the least disturbed on a shared machine)."""
    call()
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def parts(calls: int = 20000) -> None:
    """edge-server's steps of a tiny gRPC and a shared-memory KServe call, timed in this process."""
    from tritonclient.grpc import service_pb2

    from edge_server.kserve import grpc_codec
    from edge_server.kserve.grpc_wire import parse_infer_request
    from edge_server.kserve.service import KServeService
    from edge_server.kserve.shm import Peer, SystemSharedMemory
    from edge_server.server import Server

    rows: list[tuple[str, float]] = []
    x = sample_inputs()["tiny"]
    raw = x.tobytes()
    peer = Peer("127.0.0.1", 40000, 8001, uid=os.getuid())
    shm = SystemSharedMemory(max_input_bytes=1 << 26)
    paths = [f"/dev/shm/es-parts-{os.getpid()}-{role}" for role in ("in", "out")]
    with tempfile.TemporaryDirectory(prefix="bench-kserve-parts-") as tmp, ExitStack() as cleanup:
        cleanup.callback(shm.close)
        for role, path in zip(("in", "out"), paths, strict=True):
            with open(path, "wb") as f:
                f.write(bytes(x.nbytes))
            cleanup.callback(os.unlink, path)
            shm.register(role, os.path.basename(path), 0, x.nbytes, peer)
        server = Server(
            build_repository(Path(tmp) / "repo"), load_models=["tiny_py"], model_control_mode="explicit"
        )
        cleanup.callback(server.close)
        service = KServeService(server, shm=shm)
        message = service_pb2.ModelInferRequest(model_name="tiny_py")
        message.inputs.add(name="INPUT", datatype="FP32", shape=[1, 16])
        message.raw_input_contents.append(raw)
        data = message.SerializeToString()
        wire = parse_infer_request(data)
        request, wants = grpc_codec.decode(service, wire.message, peer, wire.raw)
        outputs = service.submit(request).result()
        decode = partial(grpc_codec.decode, service, wire.message, peer)

        def output() -> None:
            lease = shm.check_output("out", 0, x.nbytes, peer, "output 'OUTPUT'")
            shm.write("out", 0, x.nbytes, raw, peer, "output 'OUTPUT'", lease)
            lease.close()

        rows += [
            ("gRPC: parse the request (grpc_wire)", best(partial(parse_infer_request, data), calls)),
            ("gRPC: decode to a data-plane request", best(decode, calls)),
            ("tiny model.py through the data plane", best(lambda: service.submit(request).result(), calls)),
            ("gRPC: encode and serialize the response", best(
                lambda: grpc_codec.encode(service, request, wants, outputs, peer).SerializeToString(), calls
            )),
            *http_rows(service, peer, x, outputs, calls),
            ("shm: an input read (lookup, owner and permission, pread)", best(
                lambda: shm.read("in", 0, x.nbytes, x.nbytes, peer, "input 'INPUT'"), calls
            )),
            ("shm: an output held, then written (pwrite)", best(output, calls)),
            ("one fstat(2), for scale", best(partial(os.fstat, 0), calls)),
        ]  # fmt: skip
    print("\n| edge-server step (in process, best of 5) | µs |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.1f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls, three rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-triton", action="store_true")
    parser.add_argument("--parts", action="store_true", help="edge-server's own steps, in this process")
    parser.add_argument("--calls", type=int, default=20000, help="--parts: calls per timing (best of 5)")
    args = parser.parse_args(argv)
    if args.parts:
        parts(args.calls)
    else:
        measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
