"""The OCR example (models_ocr/): its answers equal rapidocr_onnxruntime's own pipeline, frame for frame.

One daemon serves a repository made by ``edge_server.examples.make_ocr`` (as ``edge-server
make-examples --ocr`` makes it); frames drawn with OpenCV's ``putText`` go to it through shared
memory, and every box, string and score must equal what ``RapidOCR()(frame)`` answers in this
process with the package's defaults.  The frames cover: the bundled samples (one holds an
upside-down line, which the orientation classifier must turn), seven lines in one frame (two chunks
of 6 for the per-crop models, joined by their batchers), a wide low frame (the package's black
bands) and a frame with no text.  Then the example client reads the sample folder.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from edge_server.client import Client
from tests.daemon import Daemon

rapidocr = pytest.importorskip("rapidocr_onnxruntime", reason="the OCR example needs rapidocr_onnxruntime")

ROOT = Path(__file__).resolve().parents[1]
MODELS = (
    "text_detection",
    "text_classification",
    "text_recognition",
    "ocr_det_preprocess",
    "ocr_det_postprocess",
    "ocr_detect",
    "ocr",
)


def drawn(size: tuple[int, int], lines: list[tuple[str, int, int, float]], grey: int = 240) -> np.ndarray:
    width, height = size
    frame = np.full((height, width, 3), grey, np.uint8)
    for text, x, y, scale in lines:
        cv2.putText(frame, text, (x, y), cv2.FONT_HERSHEY_SIMPLEX, scale, (20, 20, 20), 2, cv2.LINE_AA)
    return frame


def frames_to_read(repo: Path) -> list[np.ndarray]:
    samples = sorted((repo / "ocr" / "samples").glob("frame_*.png"))
    assert len(samples) == 3
    seven = [(f"LINE {i} CAM{i + 1}", 12, 28 + 34 * i, 0.8) for i in range(7)]
    return [
        *(cv2.imread(str(p), cv2.IMREAD_COLOR) for p in samples),
        drawn((260, 260), seven),
        drawn((400, 40), [("WIDE 123", 8, 30, 0.8)]),  # w / h > 8: banded above and below
        np.full((96, 128, 3), 128, np.uint8),  # nothing to read
    ]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edge_server.examples import make_ocr

    path = tmp_path_factory.mktemp("ocr") / "repo"
    assert make_ocr.make(path) == 0
    return path


@pytest.fixture(scope="module")
def daemon(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ocr_ipc")
    proc = Daemon(repo, f"ipc://{root}/ocr.sock", root / "ocr.log")
    try:
        proc.start(timeout=120)
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def reference(frames: list[np.ndarray]) -> list[list[Any]]:
    from rapidocr_onnxruntime import RapidOCR

    engine = RapidOCR()
    return [engine(frame)[0] or [] for frame in frames]


def test_the_daemon_answers_as_the_package_does(repo: Path, daemon: Daemon) -> None:
    frames = frames_to_read(repo)
    expected = reference(frames)
    assert [len(e) for e in expected] == [2, 2, 2, 7, 1, 0]  # the frames read as drawn
    assert expected[2][0][1] == "edge-server2026"  # the upside-down line, turned by the classifier
    with Client(daemon.address) as client:
        states = {m["name"]: m["state"] for m in client.models()}
        assert states == dict.fromkeys(MODELS, "READY"), states
        region = client.create_shm_region(max(f.nbytes for f in frames))
        try:
            answers = [client.infer("ocr", {"image": region.write(frame)}) for frame in frames]
        finally:
            client.release_shm(region)
        recognition = client.statistics("text_recognition")[0]
    for frame_index, (answer, lines) in enumerate(zip(answers, expected, strict=True)):
        assert answer["boxes"].dtype == np.float32 and answer["boxes"].shape == (len(lines), 4, 2)
        assert [t.decode() for t in answer["texts"]] == [line[1] for line in lines], frame_index
        assert answer["boxes"].tolist() == [line[0] for line in lines], frame_index
        assert answer["scores"].tolist() == [line[2] for line in lines], frame_index
    # Every crop went through the recogniser's scheduler (the 7-line frame as two chunks, 6 + 1).
    assert recognition["inference_count"] == sum(len(e) for e in expected)


def test_the_example_client_reads_the_sample_folder(repo: Path, daemon: Daemon, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "ocr.py"),
            str(repo / "ocr" / "samples"),
            "--ipc",
            daemon.address,
            "--annotate",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    for text in ("'KA01AB1234'", "'SPEEDLIMIT40'", "'Jetson Orin'", "'Gate 7'", "'edge-server2026'"):
        assert text in result.stdout, result.stdout
    assert "frame_0.png (320x240): 2 lines" in result.stdout
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["frame_0.png", "frame_1.png", "frame_2.png"]


def test_the_example_client_reads_every_nth_frame_of_a_video(
    repo: Path, daemon: Daemon, tmp_path: Path
) -> None:
    frame = cv2.imread(str(repo / "ocr" / "samples" / "frame_0.png"), cv2.IMREAD_COLOR)
    video = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(
        str(video), cv2.VideoWriter_fourcc(*"MJPG"), 10, (frame.shape[1], frame.shape[0])
    )
    assert writer.isOpened()
    for _ in range(3):
        writer.write(frame)
    writer.release()
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "ocr.py"),
            str(video),
            "--every",
            "2",
            "--ipc",
            daemon.address,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert [line.split(" (")[0] for line in result.stdout.splitlines() if not line.startswith(" ")] == [
        "clip.avi#0",
        "clip.avi#2",
    ]
    assert "'KA01AB1234'" in result.stdout
