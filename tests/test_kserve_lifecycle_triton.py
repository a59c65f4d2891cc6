"""Model control over HTTP and gRPC as Triton's L0_lifecycle expects it (issue 28, third and fifth rounds).

What Triton's QA files expect is carried over as facts; each test drives the real daemon with the
real ``tritonclient``.  A model or version removed from a polled repository stays in the index as
UNAVAILABLE ("unloaded"), and requests for it get Triton's texts; every frontend's index (HTTP,
gRPC, IPC) is one list, models never loaded listed by name alone.
"""

from __future__ import annotations

import json
import shutil
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from edge_server.client import Client
from tests.daemon import Daemon, free_port, kserve_flags, wait_for
from tests.onnx_factory import affine_model

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CONFIG = """
name: "affine"
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


@pytest.fixture(scope="module")
def ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int, str]]:
    repo = tmp_path_factory.mktemp("lifecycle") / "repo"
    (repo / "affine").mkdir(parents=True)
    (repo / "affine" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    affine_model(repo / "affine" / "1" / "model.onnx")
    (repo / "zeros").mkdir()
    (repo / "zeros" / "config.pbtxt").write_text(textwrap.dedent(CONFIG).replace("affine", "zeros"))
    affine_model(repo / "zeros" / "1" / "model.onnx")
    affine_model(repo / "zeros" / "003" / "model.onnx")  # not version 3: Triton ignores leading zeros
    (repo / "later").mkdir()  # never loaded
    (repo / "later" / "config.pbtxt").write_text(textwrap.dedent(CONFIG).replace("affine", "later"))
    affine_model(repo / "later" / "1" / "model.onnx")
    root = tmp_path_factory.mktemp("sock")
    http_port, grpc_port = free_port(), free_port()
    flags = [
        *kserve_flags(http_port, grpc_port),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "affine",
        "--load-model",
        "zeros",
    ]
    daemon = Daemon(repo, f"ipc://{root}/t.sock", root / "t.log", *flags)
    daemon.start()
    try:
        yield http_port, grpc_port, f"ipc://{root}/t.sock"
    finally:
        assert daemon.stop() == 0, daemon.log()


def _clients(
    ports: tuple[int, int, str],
) -> list[httpclient.InferenceServerClient | grpcclient.InferenceServerClient]:
    return [
        httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}"),
        grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}"),
    ]


def _index(
    client: httpclient.InferenceServerClient | grpcclient.InferenceServerClient,
) -> list[tuple[str, str]]:
    if isinstance(client, httpclient.InferenceServerClient):
        return sorted((m["name"], m.get("state", "")) for m in client.get_model_repository_index())
    return sorted((m.name, m.state) for m in client.get_model_repository_index().models)


def test_unloading_an_unknown_model_succeeds_and_changes_nothing(ports: tuple[int, int, str]) -> None:
    """Triton: "Unload non-existing model, nothing should happen" (L0_lifecycle test_model_control)."""
    for client in _clients(ports):
        before = _index(client)
        client.unload_model("unknown_model")
        if isinstance(client, grpcclient.InferenceServerClient):  # (HTTP: not a URL of the API)
            client.unload_model("../etc")  # looked up by name, never joined to a path
        assert _index(client) == before
        assert client.is_model_ready("affine")
        assert not client.is_model_ready("unknown_model")
    http = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}")
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), np.float32))
    assert http.infer("affine", [inp]).as_numpy("OUTPUT0").shape == (1, 4)


def test_a_version_directory_with_leading_zeros_is_ignored(ports: tuple[int, int, str]) -> None:
    """Triton: "ignore version directory '003' which contains leading zeros" (L0_lifecycle)."""
    for client in _clients(ports):
        assert client.is_model_ready("zeros", "1")
        assert not client.is_model_ready("zeros", "3")
    http = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}")
    assert http.get_model_metadata("zeros")["versions"] == ["1"]


def test_the_index_lists_models_never_loaded_by_name(ports: tuple[int, int, str]) -> None:
    """Triton's index is the repositories' contents: a model not loaded has a row without a state."""
    http = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}")
    assert {"name": "later"} in http.get_model_repository_index()
    ready = urllib.request.Request(
        f"http://127.0.0.1:{ports[0]}/v2/repository/index", data=json.dumps({"ready": True}).encode()
    )
    with urllib.request.urlopen(ready) as response:
        assert "later" not in {row["name"] for row in json.loads(response.read())}
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[1]}")
    rows = [m for m in grpc.get_model_repository_index().models if m.name == "later"]
    assert [(m.state, m.version) for m in rows] == [("", "")]
    assert not http.is_model_ready("later")

    with Client(ports[2]) as ipc:  # one index for every frontend
        assert {"name": "later"} in ipc.models()
        assert {(m["name"], m.get("state")) for m in ipc.models()} >= {("affine", "READY"), ("later", None)}


@pytest.fixture
def polled(tmp_path: Path) -> Iterator[tuple[Path, int, int]]:
    repo = tmp_path / "repo"
    for name in ("affine", "other"):
        (repo / name).mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(
            textwrap.dedent(CONFIG).replace("affine", name) + "version_policy: { all { } }\n"
        )
        for version in (1, 2, 3):
            affine_model(repo / name / str(version) / "model.onnx")
    http_port, grpc_port = free_port(), free_port()
    flags = [
        *kserve_flags(http_port, grpc_port),
        "--model-control-mode",
        "poll",
        "--repository-quiet-secs",
        "0.5",
    ]
    daemon = Daemon(repo, f"ipc://{tmp_path}/p.sock", tmp_path / "p.log", *flags)
    daemon.start()
    try:
        yield repo, http_port, grpc_port
    finally:
        assert daemon.stop() == 0, daemon.log()


def _request(port: int, model: str, version: str = "") -> str:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, [tensor], model_version=version)
    with pytest.raises(InferenceServerException) as metadata:
        client.get_model_metadata(model, version)
    assert metadata.value.message() == info.value.message()
    return str(info.value.message())


def test_a_removed_version_stays_in_the_index_as_unavailable(polled: tuple[Path, int, int]) -> None:
    repo, http_port, grpc_port = polled
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    shutil.rmtree(repo / "affine" / "1")
    row = {"name": "affine", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    wait_for(lambda: row in http.get_model_repository_index(), timeout=30, what="version 1 unloaded")
    assert not http.is_model_ready("affine", "1")
    assert http.is_model_ready("affine", "2") and http.is_model_ready("affine", "3")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    rows = [
        (m.version, m.state, m.reason) for m in grpc.get_model_repository_index().models if m.name == "affine"
    ]
    assert ("1", "UNAVAILABLE", "unloaded") in rows
    text = _request(http_port, "affine", "1")
    assert text.startswith("Request for unknown model: 'affine' version 1 is not at ready state"), text


def test_a_removed_model_stays_in_the_index_as_unavailable(polled: tuple[Path, int, int]) -> None:
    repo, http_port, grpc_port = polled
    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    shutil.rmtree(repo / "affine")

    def unloaded() -> bool:  # its versions drain first (UNLOADING)
        rows = [row for row in http.get_model_repository_index() if row["name"] == "affine"]
        return len(rows) == 3 and all(
            row["state"] == "UNAVAILABLE" and row["reason"] == "unloaded" for row in rows
        )

    wait_for(unloaded, timeout=30, what="model unloaded")
    assert not http.is_model_ready("affine")
    assert http.is_server_ready()  # a model removed on purpose is not a model missing
    text = _request(http_port, "affine")
    assert text.startswith("Request for unknown model: 'affine' has no available versions"), text
    with pytest.raises(InferenceServerException, match="has no available versions"):
        grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}").get_model_metadata("affine")
    shutil.copytree(repo / "other", repo / "affine")  # back again: it serves, and its statistics start anew
    (repo / "affine" / "config.pbtxt").write_text(
        (repo / "other" / "config.pbtxt").read_text().replace("other", "affine")
    )
    wait_for(lambda: http.is_model_ready("affine", "1"), timeout=30, what="model back")
    stats = http.get_inference_statistics("affine")["model_stats"]
    assert [s["inference_stats"]["success"]["count"] for s in stats] == [0, 0, 0]
