"""A 1080p-sized output into a client's shared memory: written in place by the runtime against copied.

    .venv/bin/python bench/bench_shm_outputs.py [--runs 7] [--frames 100] [--json FILE]
    .venv/bin/python bench/bench_shm_outputs.py --short

The model is ``y = x + 1`` on a 1080 x 1920 x 3 UINT8 frame (6.2 MB in, 6.2 MB out), so that the
output's cost is visible beside the model's.  Two levels, each case interleaved run by run, medians of
the runs' means:

* **backend**: ONNX Runtime alone, output into a mapped memfd: ``session.run`` and a copy into the
  mapping (what the daemon did before output destinations) against IOBinding with the output bound
  to the mapping (what it does now for outputs of fixed shape);
* **IPC**: the real daemon, frame in and output out through one sealed shared-memory region:
  ``direct`` (model ``frame_add``, fixed output dims: IOBinding), ``copied after the run`` (model
  ``frame_add_dyn``, same graph, output dims ``[-1, -1, -1]``: run, then one copy on the instance's
  thread), and ``frontend pwrite`` (an unsealed /dev/shm region: never mapped, ``pwrite`` by the
  frontend), plus the output sent inline as a ZeroMQ frame for reference.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_server.client import Client  # noqa: E402
from edge_server.client.shm import SharedMemoryRegion  # noqa: E402
from tests.daemon import Daemon  # noqa: E402

SHAPE = (1080, 1920, 3)
CONFIG = """
name: "%(name)s"
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "x", data_type: TYPE_UINT8, dims: [ 1080, 1920, 3 ] } ]
output [ { name: "y", data_type: TYPE_UINT8, dims: [ %(dims)s ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""


def model_bytes() -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])],
        "frame_add",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, list(SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, ["h", "w", "c"])],
        [numpy_helper.from_array(np.ones(1, np.uint8), "one")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def repository(root: Path) -> Path:
    repo = root / "repo"
    for name, dims in (("frame_add", "1080, 1920, 3"), ("frame_add_dyn", "-1, -1, -1")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.onnx").write_bytes(model_bytes())
        (repo / name / "config.pbtxt").write_text(CONFIG % {"name": name, "dims": dims})
    return repo


def mean_us(call: Callable[[], Any], count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        call()
    return (time.perf_counter() - start) / count * 1e6


def backend_cases(frames: int) -> dict[str, Callable[[], float]]:
    """ONNX Runtime alone: run + copy into a mapped memfd against IOBinding into it."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model_bytes(), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).integers(0, 255, SHAPE, dtype=np.uint8)
    nbytes = x.nbytes
    fd = os.memfd_create("bench-out", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    target = np.frombuffer(mm, np.uint8, count=nbytes).reshape(SHAPE)

    def copy() -> None:
        (y,) = session.run(["y"], {"x": x})
        np.copyto(target, y)

    def direct() -> None:
        binding = session.io_binding()
        binding.bind_cpu_input("x", x)
        binding.bind_output("y", "cpu", 0, np.uint8, SHAPE, target.ctypes.data)
        session.run_with_iobinding(binding)

    copy()
    assert (target == x + 1).all()
    target[...] = 0
    direct()
    assert (target == x + 1).all()
    return {
        "backend: run + copy into shm": lambda: mean_us(copy, frames),
        "backend: IOBinding into shm": lambda: mean_us(direct, frames),
    }


def ipc_cases(client: Client, frames: int) -> dict[str, Callable[[], float]]:
    x = np.random.default_rng(1).integers(0, 255, SHAPE, dtype=np.uint8)
    region = client.create_shm_region(2 * x.nbytes + mmap.PAGESIZE)
    sent = region.write(x)
    out_offset = (x.nbytes // mmap.PAGESIZE + 1) * mmap.PAGESIZE
    posix = SharedMemoryRegion(x.nbytes, posix=True, prefix=client.shm_prefix)
    client.register_shm(posix)

    def into(model: str, ref: Any) -> Callable[[], Any]:
        return lambda: client.infer(model, {"x": sent}, outputs={"y": ref})

    cases = {
        "IPC: direct (IOBinding)": into("frame_add", region.output(offset=out_offset)),
        "IPC: copied after the run (instance)": into("frame_add_dyn", region.output(offset=out_offset)),
        "IPC: frontend pwrite (unsealed region)": into("frame_add", posix.output()),
        "IPC: output inline (ZeroMQ frame)": into("frame_add", None),
    }
    for call in cases.values():  # warm up, and check every path's answer
        y = call()["y"]
        assert (np.asarray(y) == x + 1).all()
    return {name: (lambda call=call: mean_us(call, frames)) for name, call in cases.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--frames", type=int, default=100, help="requests per run and case")
    parser.add_argument("--short", action="store_true", help="2 runs of 10 frames")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.short:
        args.runs, args.frames = 2, 10
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="es-bench-out-") as tmp:
        root = Path(tmp)
        daemon = Daemon(repository(root), f"ipc://{root}/d.sock", root / "daemon.log")
        try:
            daemon.start()
            with Client(daemon.address, timeout=60) as client:
                cases = {**backend_cases(args.frames), **ipc_cases(client, args.frames)}
                for _ in range(args.runs):
                    for name, measure in cases.items():
                        results.setdefault(name, []).append(measure())
                status = {r["name"]: r["outputs"] for r in client.shm_status()}
        finally:
            daemon.stop()
    print(f"1080p UINT8 frame in and out, medians of {args.runs} runs x {args.frames} requests (us/request)")
    for name, values in results.items():
        print(
            f"  {name:42s} {statistics.median(values):9.0f}   (runs: {', '.join(f'{v:.0f}' for v in values)})"
        )
    print(f"  paths counted by the daemon (shm_status): {status}")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "shm_status": status}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
