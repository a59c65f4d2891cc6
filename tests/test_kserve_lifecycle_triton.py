"""Model control over HTTP and gRPC as Triton's L0_lifecycle expects it (issue 28, third round).

What Triton's QA files expect is carried over as facts; each test drives the real daemon with the
real ``tritonclient``.
"""

from __future__ import annotations

import json
import textwrap
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.daemon import Daemon, free_port, kserve_flags
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
def ports(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
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
        yield http_port, grpc_port
    finally:
        assert daemon.stop() == 0, daemon.log()


def _clients(
    ports: tuple[int, int],
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


def test_unloading_an_unknown_model_succeeds_and_changes_nothing(ports: tuple[int, int]) -> None:
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


def test_a_version_directory_with_leading_zeros_is_ignored(ports: tuple[int, int]) -> None:
    """Triton: "ignore version directory '003' which contains leading zeros" (L0_lifecycle)."""
    for client in _clients(ports):
        assert client.is_model_ready("zeros", "1")
        assert not client.is_model_ready("zeros", "3")
    http = httpclient.InferenceServerClient(f"127.0.0.1:{ports[0]}")
    assert http.get_model_metadata("zeros")["versions"] == ["1"]


def test_the_index_lists_models_never_loaded_by_name(ports: tuple[int, int]) -> None:
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
