"""The ``edge-server`` command line, run as a real subprocess (local mode: no daemon)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.daemon import Daemon


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edge_server", *args], capture_output=True, text=True, timeout=120
    )


def test_models_lists_states(example_repository: Path) -> None:
    result = cli("models", "--model-repository", str(example_repository))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "VERSION", "STATE", "REASON"]
    rows = {line.split()[0]: line.split()[1:3] for line in lines[1:]}
    assert rows["digits"] == ["1", "READY"]
    assert rows["preprocess"] == ["1", "READY"]


def test_infer_image_prints_the_right_class(example_repository: Path) -> None:
    image = example_repository / "digits" / "samples" / "digit_7.png"
    result = cli("infer", "digits", "--image", str(image), "--model-repository", str(example_repository))
    assert result.returncode == 0, result.stderr
    assert "probabilities: float32 [1, 10]" in result.stdout
    assert "#1: 7 (" in result.stdout


def test_infer_npy_input(example_repository: Path, tmp_path: Path) -> None:
    x = np.arange(6, dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    result = cli(
        "infer",
        "identity",
        "--input",
        f"INPUT0={tmp_path / 'x.npy'}",
        "--model-repository",
        str(example_repository),
    )
    assert result.returncode == 0, result.stderr
    assert "OUTPUT0: float32 [6]" in result.stdout
    assert "[0. 1. 2. 3. 4. 5.]" in result.stdout


def test_infer_bad_input_is_a_clear_error(example_repository: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "bad.npy", np.zeros((2, 2), np.float64))
    result = cli(
        "infer",
        "identity",
        "--input",
        f"INPUT0={tmp_path / 'bad.npy'}",
        "--model-repository",
        str(example_repository),
    )
    assert result.returncode == 1
    assert "error [INVALID_ARGUMENT]: model 'identity' input 'INPUT0': expected TYPE_FP32" in result.stderr
    result = cli("infer", "nope", "--input", "x=y.npy", "--model-repository", str(example_repository))
    assert result.returncode == 1
    assert "error [MODEL_NOT_FOUND]: Request for unknown model: 'nope' is not found" in result.stderr


def test_models_and_infer_through_a_running_daemon(daemon: Daemon, example_repository: Path) -> None:
    result = cli("models", "--ipc", daemon.address)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split()[1:3] for line in result.stdout.splitlines()[1:]}
    assert rows["digits"] == ["1", "READY"] and rows["frame"] == ["1", "READY"]
    image = example_repository / "digits" / "samples" / "digit_5.png"
    result = cli(
        "infer",
        "digits",
        "--image",
        str(image),
        "--ipc",
        daemon.address,
        "--top",
        "1",
    )
    assert result.returncode == 0, result.stderr
    assert "#1: 5 (" in result.stdout  # labels.txt read from the daemon's repository on this box
    result = cli("infer", "nope", "--image", str(image), "--ipc", daemon.address)
    assert result.returncode == 1
    assert "error [MODEL_NOT_FOUND]" in result.stderr


PIXEL_CONFIG = """
name: "pixel"
backend: "python"
max_batch_size: 0
input [ { name: "image", data_type: TYPE_UINT8, dims: [ -1, -1, 3 ] } ]
output [ { name: "first", data_type: TYPE_UINT8, dims: [ 3 ] } ]
"""

PIXEL_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("first", pb_utils.get_input_tensor_by_name(r, "image").as_numpy()[0, 0])]
            )
            for r in requests
        ]
"""


def test_infer_image_sends_bgr_as_opencv_reads_unless_told(tmp_path: Path) -> None:
    import cv2

    repo = tmp_path / "repo"
    (repo / "pixel" / "1").mkdir(parents=True)
    (repo / "pixel" / "config.pbtxt").write_text(PIXEL_CONFIG)
    (repo / "pixel" / "1" / "model.py").write_text(PIXEL_MODEL)
    image = np.zeros((4, 6, 3), np.uint8)
    image[0, 0] = (10, 20, 30)  # blue, green, red: OpenCV's order
    cv2.imwrite(str(tmp_path / "px.png"), image)
    result = cli("infer", "pixel", "--image", str(tmp_path / "px.png"), "--model-repository", str(repo))
    assert result.returncode == 0, result.stderr
    assert "[10 20 30]" in result.stdout  # as cv2.imread gives it, as OpenCV-based models expect
    assert f"image {tmp_path / 'px.png'} -> input 'image': BGR uint8 [4, 6, 3]" in result.stdout
    result = cli(
        "infer", "pixel", "--image", str(tmp_path / "px.png"), "--channel-order", "rgb",
        "--model-repository", str(repo),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "[30 20 10]" in result.stdout and "input 'image': RGB uint8" in result.stdout
    result = cli("infer", "pixel", "--image", str(tmp_path / "px.png"), "--channel-order", "hsv")
    assert result.returncode == 2 and "invalid choice: 'hsv'" in result.stderr
