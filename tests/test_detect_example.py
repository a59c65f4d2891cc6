"""The detect-then-classify example on its bundled scenes: in-process, through the daemon, by script.

Every scene's truth (``scene_<i>.json``, written with the image) is checked: each placed tile is
found with IoU >= 0.5, the detector's class (tile colour) and the classifier's digit are right, and
nothing else is reported.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from edge_server import Server
from edge_server.client import Client
from tests.daemon import Daemon

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ("digits", "detector", "detect_preprocess", "detect_postprocess", "detect", "detect_classify")
CLASSES = ("red", "green", "blue")


def scenes(repo: Path) -> list[tuple[np.ndarray, list[dict[str, Any]]]]:
    samples = sorted((repo / "detect_classify" / "samples").glob("scene_*.png"))
    assert len(samples) >= 4
    return [
        (cv2.imread(str(p), cv2.IMREAD_COLOR), json.loads(p.with_suffix(".json").read_text())["objects"])
        for p in samples
    ]


def iou(a: np.ndarray, b: list[float]) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def check(outputs: dict[str, Any], truth: list[dict[str, Any]]) -> None:
    assert len(outputs["boxes"]) == len(truth), (outputs, truth)
    for obj in truth:
        overlaps = [iou(box, obj["box"]) for box in outputs["boxes"]]
        best = int(np.argmax(overlaps))
        assert overlaps[best] >= 0.5, (obj, outputs["boxes"])
        assert CLASSES[int(outputs["classes"][best])] == obj["class"]
        if "digits" in outputs:
            assert int(outputs["digits"][best]) == obj["digit"], obj
            assert outputs["labels"][best] == f"{obj['class']} {obj['digit']}".encode()


@pytest.fixture(scope="module")
def pipeline_repo(tmp_path_factory: pytest.TempPathFactory, example_repository: Path) -> Path:
    repo = tmp_path_factory.mktemp("detect") / "repo"
    for name in PIPELINE:
        shutil.copytree(example_repository / name, repo / name)
    return repo


def test_in_process_every_scene_is_detected_and_classified(pipeline_repo: Path) -> None:
    with Server(pipeline_repo) as server:
        crops = 0
        for frame, truth in scenes(pipeline_repo):
            check(server.infer("detect_classify", {"image": frame}), truth)
            crops += len(truth)
        (digits,) = server.statistics("digits")
        assert digits["inference_count"] == crops  # every crop went through the classifier's batcher


def test_the_ensemble_equals_its_steps_by_hand_and_the_bls_model(pipeline_repo: Path) -> None:
    with Server(pipeline_repo) as server:
        for frame, truth in scenes(pipeline_repo):
            ensemble = server.infer("detect", {"image": frame})
            check(ensemble, truth)
            pre = server.infer("detect_preprocess", {"image": frame})
            raw = server.infer("detector", {"images": pre["images"]})
            post = server.infer(
                "detect_postprocess",
                {"output0": raw["output0"], "letterbox": pre["letterbox"], "image": frame},
            )
            for name in ("boxes", "scores", "classes", "crops"):
                np.testing.assert_array_equal(ensemble[name], post[name])
            both = server.infer("detect_classify", {"image": frame})
            np.testing.assert_array_equal(both["boxes"], ensemble["boxes"])


def test_concurrent_frames_share_classifier_batches(pipeline_repo: Path) -> None:
    with Server(pipeline_repo) as server:
        frames = scenes(pipeline_repo)
        futures = [server.submit("detect_classify", {"image": frames[i % len(frames)][0]}) for i in range(16)]
        for i, future in enumerate(futures):
            check(future.result(timeout=60), frames[i % len(frames)][1])
        (digits,) = server.statistics("digits")
        crops = sum(len(frames[i % len(frames)][1]) for i in range(16))
        assert digits["inference_count"] == crops
        assert digits["execution_count"] <= 16  # a frame's crops travel as one request, never split


def test_an_empty_frame_has_no_detections(pipeline_repo: Path) -> None:
    with Server(pipeline_repo) as server:
        out = server.infer("detect_classify", {"image": np.zeros((120, 160, 3), np.uint8)})
        assert out["boxes"].shape == (0, 4) and out["digits"].shape == (0,)


@pytest.fixture(scope="module")
def detect_daemon(pipeline_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("detect_ipc")
    proc = Daemon(pipeline_repo, f"ipc://{root}/det.sock", root / "det.log")
    try:
        proc.start()
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def test_through_the_daemon_with_frames_in_shared_memory(detect_daemon: Daemon, pipeline_repo: Path) -> None:
    frames = scenes(pipeline_repo)
    with Client(detect_daemon.address, timeout=30) as client:
        region = client.create_shm_region(max(frame.nbytes for frame, _ in frames))
        try:
            for frame, truth in frames:
                check(client.infer("detect_classify", {"image": region.write(frame)}), truth)
                check(client.infer("detect", {"image": frame}), truth)  # inline frames, the ensemble
        finally:
            client.release_shm(region)


def test_the_readme_command_prints_the_detections(
    detect_daemon: Daemon, pipeline_repo: Path, tmp_path: Path
) -> None:
    sample = pipeline_repo / "detect_classify" / "samples" / "scene_0.png"
    out = tmp_path / "annotated.png"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "detect.py"),
            str(sample),
            "--ipc",
            detect_daemon.address,
            "--annotate",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    truth = json.loads(sample.with_suffix(".json").read_text())["objects"]
    assert proc.stdout.startswith(f"{len(truth)} detections in")
    for obj in truth:
        assert f"{obj['class']} {obj['digit']}" in proc.stdout
    annotated = cv2.imread(str(out))
    assert annotated is not None and annotated.shape == cv2.imread(str(sample)).shape
