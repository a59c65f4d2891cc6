"""What a row costs at each batch size: where dynamic batching can pay on this machine, and where not.

    .venv/bin/python bench/bench_batch_cost.py            # about a minute
    .venv/bin/python bench/bench_batch_cost.py --rounds 5

Dynamic batching saves time only where a model's cost per row falls as its batch grows.  This times
ONNX Runtime directly (no server) at each batch size, for the models whose batching the other
benchmarks measure, with the session settings the daemon gives them:

* ``digits``: the example pipeline's crop classifier (``models/digits``), one intra-op thread and no
  spinning, as its config ships.  A frame of the sample scenes sends 4.5 crops on average, so the
  pipeline's batches start at about 5 rows: cross-frame batching can only gain what the rows beyond
  that save (``gain`` below, batch 5 against the largest);
* ``crop CNN``: a secondary classifier of a real size for this CPU (64x64 crops, four 3x3 conv/ReLU/pool
  stages, random weights: only its timing matters here), on one thread and on every core without
  spinning (the daemon's ``split`` policy for a model alone);
* ``anchor CNN``: bench/triton_models.py's 1.4 GFLOP CNN at 224x224 with a default session, the model
  of bench_baselines.py's ``cnn_batch`` (its 8 clients send one image each: ``gain`` is batch 1
  against batch 8).

Batch sizes alternate within each round; the table shows medians over rounds of each batch size's
median time per run.  A ``gain`` near 1.00x means batching has nothing to win on this CPU: what the
batcher does on a Jetson (TensorRT on the GPU or a DLA, where per-row cost falls steeply with the
batch) must be measured there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.triton_models import cnn_flops, cnn_graph  # noqa: E402
from edge_server.examples.make_models import median_run_seconds  # noqa: E402

CROP_SIZE = 64
CROP_CHANNELS = (3, 32, 64, 128, 128)


@dataclass
class Case:
    label: str
    path: Path
    input_name: str
    row_shape: tuple[int, ...]
    threads: int  # 0: ONNX Runtime's default session (one thread per core, spinning)
    batches: tuple[int, ...]
    gain_from: int  # the batch a request brings anyway; gain = its per-row cost / the largest batch's


def session(case: Case) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    if case.threads:
        options.intra_op_num_threads = case.threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(case.path), options, providers=["CPUExecutionProvider"])


def cases(workdir: Path) -> list[Case]:
    digits = ROOT / "models" / "digits" / "1" / "model.onnx"
    if not digits.exists():
        sys.exit(f"{digits} is missing: run models/make_models.py (or ./run serve) first")
    crop = workdir / "crop_cnn.onnx"
    cnn_graph(crop, size=CROP_SIZE, channels=CROP_CHANNELS, batch="batch")
    anchor = workdir / "anchor_cnn.onnx"
    cnn_graph(anchor, batch="batch")
    small = (1, 2, 5, 8, 16, 32)
    cores = os.cpu_count() or 1
    return [
        Case("digits (8x8 MLP)", digits, "image", (1, 8, 8), 1, small, 5),
        Case("crop CNN (64x64)", crop, "input", (3, CROP_SIZE, CROP_SIZE), 1, small, 5),
        Case("crop CNN (64x64)", crop, "input", (3, CROP_SIZE, CROP_SIZE), cores, small, 5),
        Case("anchor CNN (224x224)", anchor, "input", (3, 224, 224), 0, (1, 2, 4, 8), 1),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.3, help="seconds of runs per batch size and round")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="es-batch-cost-") as tmp:
        table = cases(Path(tmp))
        sessions = [session(case) for case in table]
        per_run: dict[tuple[int, int], list[float]] = {}
        for _ in range(args.rounds):
            for index, (case, sess) in enumerate(zip(table, sessions, strict=True)):
                for batch in case.batches:
                    x = rng.random((batch, *case.row_shape), dtype=np.float32)
                    seconds = median_run_seconds(sess, {case.input_name: x}, args.budget)
                    per_run.setdefault((index, batch), []).append(seconds)
    print(f"\nONNX Runtime alone, median of {args.rounds} round(s); cpu count {os.cpu_count()}")
    print(
        f"crop CNN: {cnn_flops(CROP_SIZE, CROP_CHANNELS) / 1e6:.0f} MFLOP per crop; anchor CNN: "
        f"{cnn_flops() / 1e9:.2f} GFLOP per image\n"
    )
    print(f"{'model':<22} {'threads':>7}  {'batch: us per row':<62} {'gain':>6} {'us saved/request':>17}")
    for index, case in enumerate(table):
        row = {b: statistics.median(per_run[(index, b)]) / b * 1e6 for b in case.batches}
        cells = "  ".join(f"{b}: {us:,.1f}" if us < 10 else f"{b}: {us:,.0f}" for b, us in row.items())
        largest = row[case.batches[-1]]
        gain = row[case.gain_from] / largest
        saved = case.gain_from * (row[case.gain_from] - largest)
        threads = str(case.threads) if case.threads else "default"
        print(f"{case.label:<22} {threads:>7}  {cells:<62} {gain:5.2f}x {saved:17,.0f}")
    print(
        "\ngain: per-row cost at the batch a request brings anyway (the 5 crops of a frame; 1 image) over "
        "the largest batch's;\nus saved/request: what joining it into the largest batch saves that request "
        "(negative: costs).\nThe dynamic batcher wins only what these save, beside its own costs; on the "
        "Jetson, measure it again."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
