"""Detect-then-classify pipeline benchmark: cameras through the daemon against a plain Python loop.

    .venv/bin/python bench/bench_pipeline.py [--runs 5] [--seconds 3] [--cameras 1 4 8] [--json FILE]
    .venv/bin/python bench/bench_pipeline.py --short        # 1 run of 1 s per case
    git archive main | tar -x -C /tmp/before                # before/after in one run:
    .venv/bin/python bench/bench_pipeline.py --cameras 8 --baseline-tree /tmp/before

Three daemons serve the example pipeline (``detect_classify``: the ``detect`` ensemble, then every
crop of a frame to ``digits`` as one request): the classifier's dynamic batching as shipped (500 us
queue delay), dynamic batching without a queue delay, and none (each frame's crops run as their own
batch, in the calling thread when the classifier is idle).  Each camera is a
thread with its own ``Client`` that writes the bundled sample scenes (256x192 BGR) into its own
registered shared-memory region and waits for the answer, one frame in flight, as a camera loop
does.  The floor is the same pipeline as a plain in-process loop calling ONNX Runtime directly
(letterbox, detector, decode + NMS + crops, classifier), one frame after another.

Cases alternate within each run, so that noise from other processes falls on all of them alike; the
table shows the median over runs of frames per second, the classifier's mean crops per batch
(from its statistics: inferences / executions), and the daemon's CPU time and voluntary context
switches per frame (summed over its threads in ``/proc``: on a shared machine these move less than
frames per second do).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edge_server.client import Client  # noqa: E402
from edge_server.examples.make_detect import crop_input  # noqa: E402
from tests.daemon import Daemon  # noqa: E402

PIPELINE = ("digits", "detector", "detect_preprocess", "detect_postprocess", "detect", "detect_classify")


VARIANTS = ("batching on", "batching, no delay", "batching off")
CROP_BATCH = 32  # the classifier's max_batch_size where it batches


def repositories(root: Path, thread_policy: str | None = None, source: Path = ROOT) -> dict[str, Path]:
    """The pipeline three times: the classifier as shipped (dynamic batching, 500 us queue delay),
    with dynamic batching but no queue delay, and without dynamic batching."""
    if not (ROOT / "models" / "detector" / "1" / "model.onnx").exists():
        subprocess.run([sys.executable, str(ROOT / "models" / "make_models.py")], check=True)
    repos = {}
    for i, variant in enumerate(VARIANTS):
        repo = root / f"repo{i}"
        for name in PIPELINE:
            shutil.copytree(source / "models" / name, repo / name, ignore=shutil.ignore_patterns("samples"))
            (repo / name / "1").mkdir(exist_ok=True)  # make_models.py makes those a tree lacks
            for onnx in (ROOT / "models" / name / "1").glob("*.onnx"):
                shutil.copy(onnx, repo / name / "1" / onnx.name)
        if thread_policy is not None:  # in place of the shipped setting, before dynamic_batching
            for name in ("detector", "digits"):
                path = repo / name / "config.pbtxt"
                text = re.sub(r'parameters \[ \{ key: "thread_policy".*\]\n', "", path.read_text())
                value = f'{{ string_value: "{thread_policy}" }}'
                path.write_text(f'parameters [ {{ key: "thread_policy" value: {value} }} ]\n' + text)
        config = repo / "digits" / "config.pbtxt"
        text = config.read_text()
        head = text[: text.index("dynamic_batching")]
        if variant != "batching off":
            # Room for the crops of several frames (a frame sends up to 8): with the shipped 8, two
            # frames of 4-5 crops never fit one batch and the queue delay is waited for nothing.
            head = head.replace("max_batch_size: 8", f"max_batch_size: {CROP_BATCH}")
        if variant == "batching on":
            config.write_text(head + text[text.index("dynamic_batching") :])
        elif variant == "batching, no delay":
            config.write_text(head + "dynamic_batching { }\n")
        else:
            config.write_text(head)
        repos[variant] = repo
    return repos


def scenes() -> list[np.ndarray]:
    samples = sorted((ROOT / "models" / "detect_classify" / "samples").glob("scene_*.png"))
    return [cv2.imread(str(p), cv2.IMREAD_COLOR) for p in samples]


# -- the floor: the same pipeline as a plain loop over ONNX Runtime ----------------------------------


class PlainLoop:
    """What a team writes without a server: one loop, the models' sessions called directly."""

    def __init__(self) -> None:
        import onnxruntime as ort

        # The daemon's session options for a one-instance model: every core, no spinning (threads
        # that spin after a run steal the cores from the Python code between runs: half the speed).
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = os.cpu_count() or 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CPUExecutionProvider"]
        self.detector = ort.InferenceSession(
            str(ROOT / "models/detector/1/model.onnx"), opts, providers=providers
        )
        self.digits = ort.InferenceSession(
            str(ROOT / "models/digits/1/model.onnx"), opts, providers=providers
        )

    def __call__(self, frame: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        size = 128
        height, width = frame.shape[:2]
        scale = min(size / width, size / height)
        new_w, new_h = round(width * scale), round(height * scale)
        pad_x, pad_y = (size - new_w) // 2, (size - new_h) // 2
        canvas = np.full((size, size, 3), 114, np.uint8)
        canvas[pad_y : pad_y + new_h, pad_x : pad_x + new_w] = cv2.resize(frame, (new_w, new_h))
        images = canvas[:, :, ::-1].transpose(2, 0, 1)[None].astype(np.float32) / 255.0
        raw = self.detector.run(["output0"], {"images": images})[0][0].T
        classes = raw[:, 4:].argmax(axis=1)
        scores = raw[np.arange(len(raw)), 4 + classes]
        keep = scores >= 0.5
        c, s, cls = raw[keep, :4], scores[keep], classes[keep]
        cx, cy, w, h = (c[:, 0] - pad_x) / scale, (c[:, 1] - pad_y) / scale, c[:, 2] / scale, c[:, 3] / scale
        boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
        xywh = [[float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])] for b in boxes]
        kept = np.asarray(
            cv2.dnn.NMSBoxesBatched(xywh, s.tolist(), cls.tolist(), 0.5, 0.45), np.int64
        ).reshape(-1)
        boxes = boxes[kept]
        crops = []
        for box in boxes:
            side = max(1, int(round((box[2] - box[0] + box[3] - box[1]) / 2)))
            x1 = max(0, int(round((box[0] + box[2] - side) / 2)))
            y1 = max(0, int(round((box[1] + box[3] - side) / 2)))
            crops.append(crop_input(frame[y1 : y1 + side, x1 : x1 + side]))
        digits = np.zeros(0, np.int64)
        if crops:
            digits = self.digits.run(["probabilities"], {"image": np.stack(crops)})[0].argmax(axis=1)
        return boxes, digits


def floor_fps(loop: PlainLoop, frames: list[np.ndarray], seconds: float) -> tuple[float, float, float]:
    """Frames per second, and per frame: CPU milliseconds and voluntary context switches of the
    process (the loop's thread plus ONNX Runtime's pool)."""
    before = process_counters(os.getpid())
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        loop(frames[count % len(frames)])
        count += 1
    after = process_counters(os.getpid())
    return (
        count / (time.perf_counter() - start),
        (after[0] - before[0]) / count * 1e3,
        (after[1] - before[1]) / count,
    )


def process_counters(pid: int) -> tuple[float, int]:
    """(CPU seconds, voluntary context switches) of every thread of process ``pid`` so far.

    ``/proc/PID/status`` counts only the main thread's switches; each thread has its own under
    ``task/``.  Threads that ended meanwhile drop out of the sum: the daemon's workers live as long as
    it does, but it starts short-lived ones (its heap-trim timers), whose few switches are not counted.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14 and 15)
    switches = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        switches += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended after listing (ESRCH: while read)
            pass
    return cpu, switches


class TreeDaemon(Daemon):
    """The daemon of another source tree (``--baseline-tree``: a checkout of the code before a change),
    for before/after in one run: ``python -m edge_server`` resolves to the tree it is started in."""

    def __init__(self, tree: Path, repository: Path, address: str, log_path: Path) -> None:
        super().__init__(repository, address, log_path)
        self.tree = tree

    def start(self, timeout: float = 60.0) -> TreeDaemon:
        command = [sys.executable, "-m", "edge_server", "serve", "--model-repository", str(self.repository)]
        command += ["--ipc", self.address, "--allow-http", "false", "--allow-grpc", "false"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*command, "--allow-metrics", "false"], cwd=self.tree, stdout=log, stderr=subprocess.STDOUT
            )
        self.wait_ready(timeout)
        return self


# -- cameras through the daemon ---------------------------------------------------------------------


def camera(
    address: str,
    frames: list[np.ndarray],
    gates: tuple[threading.Barrier, threading.Barrier],
    stop_at: list[float],
    out: list[int],
) -> None:
    with Client(address, timeout=60) as client:
        region = client.create_shm_region(max(f.nbytes for f in frames))
        try:
            client.infer("detect_classify", {"image": region.write(frames[0])})  # connected and warm
            gates[0].wait()
            gates[1].wait()
            count = 0
            while time.perf_counter() < stop_at[0]:
                client.infer("detect_classify", {"image": region.write(frames[count % len(frames)])})
                count += 1
            out.append(count)
        finally:
            client.release_shm(region)


def digits_counts(address: str) -> tuple[int, int, int]:
    """The classifier's (crops, executions, nanoseconds spent executing) so far."""
    with Client(address, timeout=30) as client:
        (stats,) = client.statistics("digits")
    infer_ns = int(stats["inference_stats"]["compute_infer"]["ns"])
    return int(stats["inference_count"]), int(stats["execution_count"]), infer_ns


def daemon_fps(
    address: str, pid: int, frames: list[np.ndarray], cameras: int, seconds: float
) -> tuple[float, float, float, float, float]:
    """Frames per second over all cameras, the classifier's mean crops per batch meanwhile, its
    execution time per crop in microseconds (what batching can save: at most this per crop), and the
    daemon's CPU milliseconds and voluntary context switches per frame."""
    counts: list[int] = []
    stop_at = [0.0]
    gates = (threading.Barrier(cameras + 1), threading.Barrier(cameras + 1))
    threads = [
        threading.Thread(target=camera, args=(address, frames, gates, stop_at, counts))
        for _ in range(cameras)
    ]
    for thread in threads:
        thread.start()
    gates[0].wait()  # every camera connected and warm
    before = digits_counts(address)
    counters = process_counters(pid)
    begin = time.perf_counter()
    stop_at[0] = begin + seconds
    gates[1].wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - begin
    cpu, switches = (b - a for a, b in zip(counters, process_counters(pid), strict=True))
    after = digits_counts(address)
    crops = max(after[0] - before[0], 1)
    frames_done = max(sum(counts), 1)
    return (
        sum(counts) / elapsed,
        crops / max(after[1] - before[1], 1),
        (after[2] - before[2]) / crops / 1e3,
        cpu / frames_done * 1e3,
        switches / frames_done,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="per case and run")
    parser.add_argument("--cameras", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--short", action="store_true", help="1 run of 1 s per case")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--thread-policy",
        choices=("default", "split"),
        default=None,
        help="the ONNX models' thread_policy, in place of their shipped thread settings",
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="also run every case on the daemon and models of this source tree (before/after in one run)",
    )
    args = parser.parse_args()
    if args.short:
        args.runs, args.seconds = 1, 1.0
    frames = scenes()
    loop = PlainLoop()
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="es-pipeline-") as tmp:
        root = Path(tmp)
        daemons: dict[str, Daemon] = {}
        if args.baseline_tree is not None:
            tree = args.baseline_tree.resolve()
            for variant, repo in repositories(root / "baseline", args.thread_policy, tree).items():
                daemons[f"{variant} (baseline)"] = TreeDaemon(
                    tree, repo, f"ipc://{repo}.sock", Path(f"{repo}.log")
                )
        for variant, repo in repositories(root, args.thread_policy).items():
            daemons[variant] = Daemon(repo, f"ipc://{repo}.sock", Path(f"{repo}.log"))
        try:
            for daemon in daemons.values():
                daemon.start()
            for _ in range(args.runs):
                fps, cpu, switches = floor_fps(loop, frames, args.seconds)
                results.setdefault("floor", []).append(fps)
                results.setdefault("floor cpu ms", []).append(cpu)
                results.setdefault("floor switches", []).append(switches)
                for cameras in args.cameras:
                    for variant, daemon in daemons.items():
                        fps, per_batch, us, cpu, switches = daemon_fps(
                            daemon.address, daemon.pid, frames, cameras, args.seconds
                        )
                        results.setdefault(f"{variant} x{cameras}", []).append(fps)
                        results.setdefault(f"{variant} x{cameras} cpu ms", []).append(cpu)
                        results.setdefault(f"{variant} x{cameras} switches", []).append(switches)
                        results.setdefault(f"{variant} x{cameras} crops/batch", []).append(per_batch)
                        results.setdefault(f"{variant} x{cameras} us/crop", []).append(us)
        finally:
            for daemon in daemons.values():
                daemon.stop()
    report(results, args)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def report(results: dict[str, list[float]], args: argparse.Namespace) -> None:
    med = {key: statistics.median(values) for key, values in results.items()}
    floor = med["floor"]
    print(f"\nmedian of {args.runs} run(s), {args.seconds:g} s per case; cpu count {os.cpu_count()}")
    print(
        f"plain in-process loop over ONNX Runtime (the floor): {floor:.1f} frames/s, "
        f"{med['floor cpu ms']:.2f} ms CPU and {med['floor switches']:.1f} voluntary context switches "
        "per frame\n"
    )
    header = f"{'classifier':<31} {'cameras':>7} {'frames/s':>9} {'x floor':>8} {'crops/batch':>12}"
    print(header + f" {'classifier us/crop':>19} {'daemon cpu ms/frame':>20} {'switches/frame':>15}")
    variants = list(VARIANTS)
    if args.baseline_tree is not None:
        variants += [f"{variant} (baseline)" for variant in VARIANTS]
    for variant in variants:
        for cameras in args.cameras:
            key = f"{variant} x{cameras}"
            fps, per_batch, us = med[key], med[f"{key} crops/batch"], med[f"{key} us/crop"]
            cpu, switches = med[f"{key} cpu ms"], med[f"{key} switches"]
            print(
                f"{variant:<31} {cameras:>7} {fps:9.1f} {fps / floor:8.2f} {per_batch:12.2f} {us:19.1f}"
                f" {cpu:20.2f} {switches:15.1f}"
            )


if __name__ == "__main__":
    sys.exit(main())
