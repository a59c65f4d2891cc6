"""Sixteen camera streams through a small stateful model, with and without sequence batching.

    .venv/bin/python bench/bench_sequence.py [--short] [--cameras 16] [--frames 300] [--hidden 512]

The model is a recurrent cell (``S_OUT = tanh(x W + S_IN U)``, ``y = S_OUT V``) whose state the
server keeps per camera (``sequence_batching.state``).  Every camera is a thread that sends its frames
one after another (each waits for the previous answer, as a tracker would), through the in-process API.
Variants, each on one CPU instance:

* ``oldest, batch 16``: the sequence batcher's ``oldest`` strategy batches one frame of up to 16
  cameras per execution;
* ``oldest, batch 1``: the same sequence batcher without batching (max_batch_size 1);
* ``direct, batch 16``: every camera pinned to a slot of the instance;
* ``client state, no batching``: no sequence batcher at all: each client carries its state and sends it
  with every frame (what one does without server-side state), one request per execution;
* ``client state, dynamic batching``: the same, through the dynamic batcher (16 rows at most).

Prints a Markdown table: frames/s over all cameras, median and p99 latency per frame.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_server import Server  # noqa: E402


def recurrent_cell(path: Path, hidden: int) -> None:
    rng = np.random.default_rng(0)
    f = TensorProto.FLOAT
    weights = {
        name: numpy_helper.from_array(
            (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32), name
        )
        for name in ("W", "U", "V")
    }
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("MatMul", ["S_IN", "U"], ["su"]),
        helper.make_node("Add", ["xw", "su"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["S_OUT"]),
        helper.make_node("MatMul", ["S_OUT", "V"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cell",
        [helper.make_tensor_value_info(n, f, ["batch", hidden]) for n in ("x", "S_IN")],
        [helper.make_tensor_value_info(n, f, ["batch", hidden]) for n in ("y", "S_OUT")],
        list(weights.values()),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def sequence_config(name: str, hidden: int, strategy: str, max_batch_size: int) -> str:
    return f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: {max_batch_size}
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {hidden} ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ {hidden} ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 10000000
  {strategy}
  state [ {{ input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_FP32 dims: [ {hidden} ] }} ]
}}
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""


def plain_config(name: str, hidden: int, *, batching: bool) -> str:
    tensors = [
        f'{{ name: "{n}" data_type: TYPE_FP32 dims: [ {hidden} ] }}' for n in ("x", "S_IN", "y", "S_OUT")
    ]
    return f"""
name: "{name}"
backend: "onnxruntime"
max_batch_size: {16 if batching else 1}
input [ {tensors[0]}, {tensors[1]} ]
output [ {tensors[2]}, {tensors[3]} ]
{"dynamic_batching { }" if batching else ""}
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""


VARIANTS = {
    "oldest, batch 16": ("seq_oldest16", "oldest { max_candidate_sequences: 64 }", 16),
    "oldest, batch 1": ("seq_oldest1", "oldest { max_candidate_sequences: 64 }", 1),
    "direct, batch 16": ("seq_direct16", "direct { }", 16),
}


def run_cameras(
    server: Server, model: str, cameras: int, frames: int, hidden: int, client_state: bool
) -> tuple[float, list[float]]:
    """(frames/s over all cameras, per-frame latencies in ms)."""
    latencies: list[list[float]] = [[] for _ in range(cameras)]
    barrier = threading.Barrier(cameras + 1)

    def camera(index: int) -> None:
        rng = np.random.default_rng(index)
        xs = rng.standard_normal((frames, 1, hidden)).astype(np.float32)
        state = np.zeros((1, hidden), np.float32)
        mine = latencies[index]
        barrier.wait()
        for step in range(frames):
            began = time.perf_counter()
            if client_state:
                out = server.infer(model, {"x": xs[step], "S_IN": state})
                state = out["S_OUT"]
            else:
                server.infer(
                    model,
                    {"x": xs[step]},
                    correlation_id=index + 1,
                    sequence_start=step == 0,
                    sequence_end=step == frames - 1,
                )
            mine.append((time.perf_counter() - began) * 1000)

    threads = [threading.Thread(target=camera, args=(i,)) for i in range(cameras)]
    for t in threads:
        t.start()
    barrier.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    return cameras * frames / elapsed, [v for per in latencies for v in per]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cameras", type=int, default=16)
    parser.add_argument("--frames", type=int, default=300, help="frames per camera")
    parser.add_argument("--hidden", type=int, default=512, help="state and frame feature size")
    parser.add_argument("--short", action="store_true", help="a quick run: 60 frames per camera")
    args = parser.parse_args()
    frames = 60 if args.short else args.frames
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        for name, strategy, mbs in VARIANTS.values():
            (repo / name).mkdir()
            (repo / name / "config.pbtxt").write_text(sequence_config(name, args.hidden, strategy, mbs))
            recurrent_cell(repo / name / "1" / "model.onnx", args.hidden)
        for name, batching in (("plain", False), ("plain_batched", True)):
            (repo / name).mkdir()
            (repo / name / "config.pbtxt").write_text(plain_config(name, args.hidden, batching=batching))
            recurrent_cell(repo / name / "1" / "model.onnx", args.hidden)
        rows = []
        with Server(repo) as server:
            runs = [(label, name, False) for label, (name, _, _) in VARIANTS.items()]
            runs.append(("client state, no batching", "plain", True))
            runs.append(("client state, dynamic batching", "plain_batched", True))
            for label, model, client_state in runs:
                run_cameras(server, model, args.cameras, 5, args.hidden, client_state)  # warm up
                rate, lat = run_cameras(server, model, args.cameras, frames, args.hidden, client_state)
                stats = server.statistics(model)[0]
                mean_batch = stats["inference_count"] / max(stats["execution_count"], 1)
                rows.append((label, rate, float(np.median(lat)), float(np.percentile(lat, 99)), mean_batch))
    print(f"\n{args.cameras} cameras x {frames} frames, hidden {args.hidden}, one CPU instance\n")
    print("| variant | frames/s | median ms | p99 ms | mean batch |")
    print("|---|---:|---:|---:|---:|")
    for label, rate, p50, p99, mean_batch in rows:
        print(f"| {label} | {rate:,.0f} | {p50:.2f} | {p99:.2f} | {mean_batch:.1f} |")


if __name__ == "__main__":
    main()
