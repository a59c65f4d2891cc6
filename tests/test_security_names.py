"""No API can make the daemon load a directory outside its repository (issue: path escape)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.errors import InvalidArgument, ModelNotFound
from edge_server.repository import check_model_name, scan
from tests.onnx_factory import affine_model

EVIL_MODEL = """
import pathlib

pathlib.Path(%(marker)r).write_text("pwned")


class TritonPythonModel:
    def execute(self, requests):
        return []
"""

EVIL_CONFIG = """
backend: "python"
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A repository, and outside it a model directory whose model.py leaves a marker when imported."""
    repo = tmp_path / "repo"
    affine_model(repo / "good" / "1" / "model.onnx")
    outside = tmp_path / "outside" / "evil"
    marker = tmp_path / "marker"
    (outside / "1").mkdir(parents=True)
    (outside / "config.pbtxt").write_text(EVIL_CONFIG)
    (outside / "1" / "model.py").write_text(EVIL_MODEL % {"marker": str(marker)})
    return repo, outside, marker


@pytest.mark.parametrize(
    "name",
    ["../outside/evil", "/abs/evil", "a/b", "..", ".", ".hidden", "x\0y", "a\\b", "", "n" * 256],
)
def test_names_that_are_not_plain_directory_entries_are_refused(name: str) -> None:
    # Triton's texts where Triton refuses the name too (empty, '/', '..'), ours for the rest
    refused = "plain directory name|must not contain path traversal characters|Model name cannot be empty"
    with pytest.raises(InvalidArgument, match=refused):
        check_model_name(name)


def test_load_cannot_escape_the_repository(layout: tuple[Path, Path, Path]) -> None:
    repo, outside, marker = layout
    with Server(repo, model_control_mode="explicit") as server:
        for name in ("../outside/evil", str(outside), "good/../../outside/evil"):
            with pytest.raises(InvalidArgument):
                server.load_model(name)
            server.unload_model(name)  # looked up, never joined to a path: unknown, a no-op
            with pytest.raises(InvalidArgument):
                server.infer(name, {"INPUT0": np.ones((1, 4), np.float32)})
        assert not marker.exists()
        server.load_model("good")  # plain names still work
        assert server.infer("good", {"INPUT0": np.ones((1, 4), np.float32)})["OUTPUT0"].shape == (1, 4)


def test_symlinked_model_and_version_leading_outside_are_refused(layout: tuple[Path, Path, Path]) -> None:
    repo, outside, marker = layout
    os.symlink(outside, repo / "linked")
    (repo / "good" / "2").symlink_to(outside / "1")
    assert "linked" not in scan(repo)
    assert set(scan(repo)["good"].versions) == {1}
    with Server(repo, model_control_mode="explicit") as server:
        with pytest.raises(ModelNotFound):
            server.load_model("linked")
        server.load_model("good")
        assert not marker.exists()


def test_huge_names_are_not_echoed_back_whole(layout: tuple[Path, Path, Path]) -> None:
    repo, _, _ = layout
    with Server(repo) as server:
        with pytest.raises(InvalidArgument) as info:
            server.infer("x" * 8_000_000, {"INPUT0": np.ones((1, 4), np.float32)})
    assert len(str(info.value)) < 400


def test_version_folders_that_are_not_int64_are_ignored(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    affine_model(repo / "m" / "1" / "model.onnx")
    affine_model(repo / "m" / str(2**64) / "model.onnx")
    affine_model(repo / "m" / "\u00b2" / "model.onnx")  # a unicode digit
    assert set(scan(repo)["m"].versions) == {1}
    with Server(repo) as server:
        assert [s.version for s in server.models()] == [1]
