"""The example repository from a wheel: built with ``pip wheel . --no-deps``, its contents checked, then
the generator run from the unpacked wheel outside the source tree (``python -m edge_server
make-examples DIR``), as an installed edge-server runs it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.daemon import ROOT

STATIC = [
    "digits/config.pbtxt",
    "digits/labels.txt",
    "identity/config.pbtxt",
    "preprocess/1/model.py",
    "detect_classify/1/model.py",
]


@pytest.mark.slow
def test_the_wheel_ships_the_generator_and_makes_the_examples(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    pytest.importorskip("sklearn")
    pytest.importorskip("cv2")
    # From a clean copy of the tree: setuptools reuses a checkout's build/ folder, stale files and all.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "*.onnx", "samples"
        ),
    )
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q",
         "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("edge_server-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    assert {"edge_server/examples/make_models.py", "edge_server/examples/make_detect.py"} <= names
    assert {f"edge_server/examples/repository/{rel}" for rel in STATIC} <= names
    assert not [n for n in names if n.endswith((".onnx", ".npy", ".png"))]  # built on demand, not shipped
    assert not [n for n in names if n.startswith("edge_server/examples/repository/") and n.endswith("s.py")]

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    where = subprocess.run(
        [sys.executable, "-c", "import edge_server; print(edge_server.__file__)"],
        cwd=outside, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert where.stdout.startswith(str(tmp_path / "site")), where.stdout  # the wheel's copy, not the checkout
    repo = outside / "repo"
    made = subprocess.run(
        [sys.executable, "-m", "edge_server", "make-examples", str(repo)],
        cwd=outside, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert f"next: edge-server serve --model-repository {repo}" in made.stdout
    for rel in STATIC:
        assert (repo / rel).read_bytes() == (ROOT / "models" / rel).read_bytes()
    for model in ("identity", "digits", "cnn", "detector"):
        assert (repo / model / "1" / "model.onnx").stat().st_size > 0
    assert (repo / "digits" / "samples" / "digit_7.png").is_file()
    assert not (repo / "make_models.py").exists()

    # The OCR example: its hand-written files ship too; its models come from rapidocr_onnxruntime.
    from edge_server.examples import make_ocr

    assert {f"edge_server/examples/ocr_repository/{rel}" for rel in make_ocr.STATIC_FILES} <= names
    if importlib.util.find_spec("rapidocr_onnxruntime") is None:
        return
    ocr = outside / "ocr"
    made = subprocess.run(
        [sys.executable, "-m", "edge_server", "make-examples", "--ocr", str(ocr)],
        cwd=outside, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    for rel in make_ocr.STATIC_FILES:
        assert (ocr / rel).read_bytes() == (ROOT / "models_ocr" / rel).read_bytes()
    for model in make_ocr.ONNX_FILES:
        assert (ocr / model / "1" / "model.onnx").stat().st_size > 0
    assert (ocr / "ocr" / "characters.txt").is_file() and (ocr / "ocr" / "samples" / "frame_0.png").is_file()
