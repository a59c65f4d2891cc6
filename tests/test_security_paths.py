"""Code only from the repository, even for operators: config paths stay inside the version directory.

An operator's config override (HTTP repository load with ``config``) or a config.pbtxt naming a model
file, a warm-up data file or an initial-state file by an absolute path, a ``..`` path or a symlink
leading out of the version directory is refused, and the version that served goes on serving.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.daemon import EXAMPLES, ipc_repository, ipc_root
from tests.kserve_daemon import KServeDaemon, kserve

__all__ = ["ipc_repository", "ipc_root", "kserve"]


@pytest.fixture()
def outside(tmp_path: Path) -> Path:
    """A model file outside the repository: an ONNX model the daemon would happily run."""
    target = tmp_path / "elsewhere" / "model.onnx"
    target.parent.mkdir()
    shutil.copy(EXAMPLES / "identity" / "1" / "model.onnx", target)
    return target


@pytest.fixture()
def http(kserve: KServeDaemon) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(kserve.http_url)
    try:
        yield client
    finally:
        client.close()


def override(filename: str) -> str:
    config = {
        "name": "identity",
        "backend": "onnxruntime",
        "max_batch_size": 0,
        "default_model_filename": filename,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    }
    return json.dumps(config)


def still_serves(http: httpclient.InferenceServerClient) -> bool:
    x = httpclient.InferInput("INPUT0", [2], "FP32")
    x.set_data_from_numpy(np.array([1, 2], np.float32))
    return bool(http.infer("identity", [x]).as_numpy("OUTPUT0").tolist() == [1, 2])


def test_an_override_cannot_name_a_model_file_by_an_absolute_path(
    http: httpclient.InferenceServerClient, outside: Path
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        http.load_model("identity", config=override(str(outside)))
    assert "outside" in caught.value.message() and "default_model_filename" in caught.value.message()
    assert still_serves(http)


def test_an_override_cannot_climb_out_with_dotdot(
    http: httpclient.InferenceServerClient, kserve: KServeDaemon, outside: Path
) -> None:
    version_dir = kserve.daemon.repository / "identity" / "1"
    relative = Path("../" * len(version_dir.parts)) / outside.relative_to("/")
    assert (version_dir / relative).resolve() == outside.resolve()
    with pytest.raises(InferenceServerException) as caught:
        http.load_model("identity", config=override(str(relative)))
    assert "outside" in caught.value.message()
    assert still_serves(http)


def test_a_symlink_in_the_version_directory_cannot_lead_out(
    http: httpclient.InferenceServerClient, kserve: KServeDaemon, outside: Path
) -> None:
    link = kserve.daemon.repository / "identity" / "1" / "linked.onnx"
    link.symlink_to(outside)
    try:
        with pytest.raises(InferenceServerException) as caught:
            http.load_model("identity", config=override("linked.onnx"))
        assert "outside" in caught.value.message()
    finally:
        link.unlink()
    assert still_serves(http)
    http.load_model("identity")  # back to config.pbtxt


@pytest.mark.parametrize(
    ("relative", "why"),
    [
        ("/etc/passwd", "absolute"),
        ("../../x", "leads outside"),
        ("", "absolute or empty"),
        ("a/../../x", "leads outside"),
    ],
)
def test_every_config_path_is_resolved_inside_its_directory(tmp_path: Path, relative: str, why: str) -> None:
    """The one rule behind the model file, warm-up data and initial state (edge_server.paths)."""
    from edge_server.errors import ConfigError
    from edge_server.paths import inside

    base = tmp_path / "model" / "1"
    (base / "warmup").mkdir(parents=True)
    (base / "warmup" / "data.bin").write_bytes(b"\0")
    assert inside(base / "warmup", "data.bin", "input_data_file") == (base / "warmup" / "data.bin").resolve()
    assert inside(base, "warmup/../warmup/data.bin", "x") == (base / "warmup" / "data.bin").resolve()
    with pytest.raises(ConfigError, match=why):
        inside(base / "warmup", relative, "input_data_file")


def test_a_warmup_file_outside_the_warmup_directory_fails_the_load(tmp_path: Path) -> None:
    from edge_server.errors import EdgeServerError
    from edge_server.server import Server

    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "identity", repo / "identity", ignore=shutil.ignore_patterns("samples"))
    (repo / "identity" / "1" / "warmup").mkdir()  # so that the kernel could walk the ".." path
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    config = (repo / "identity" / "config.pbtxt").read_text() + (
        'model_warmup [ { name: "w" batch_size: 1 inputs { key: "INPUT0" value: { data_type: TYPE_FP32 '
        'dims: [ 4 ] input_data_file: "../../../../secret.bin" } } } ]\n'
    )
    (repo / "identity" / "config.pbtxt").write_text(config)
    with Server(repo, model_control_mode="explicit") as server:
        with pytest.raises(EdgeServerError, match="leads outside"):
            server.load_model("identity")


def test_a_label_file_outside_the_model_directory_is_refused(tmp_path: Path) -> None:
    from edge_server.errors import EdgeServerError
    from edge_server.server import Server

    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "identity", repo / "identity", ignore=shutil.ignore_patterns("samples"))
    config = (repo / "identity" / "config.pbtxt").read_text()
    (repo / "identity" / "config.pbtxt").write_text(
        config.replace('name: "OUTPUT0"', 'name: "OUTPUT0"\n    label_filename: "../../etc/labels.txt"')
    )
    with Server(repo, model_control_mode="explicit") as server:
        with pytest.raises(EdgeServerError, match="label_filename .* leads outside"):
            server.load_model("identity")
