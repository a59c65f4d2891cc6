"""Triton's load-time file overrides: ``config`` plus ``file:<path>`` parameters make a model of files
sent with the load (L0_backend_python model_control, L0_http).  The files are staged in a directory
of the daemon's own, never written into the repository; paths are plain relative names; loading
without them goes back to the repository's files.  Python models keep Triton's stub-name rule.
"""

from __future__ import annotations

import base64
import json
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.error import HTTPError

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.daemon import Daemon, free_port, kserve_flags

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * SCALE)]))
        return out
"""
CONFIG = {
    "backend": "python",
    "max_batch_size": 4,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
}


def model_py(scale: int) -> bytes:
    return textwrap.dedent(MODEL).replace("SCALE", str(scale)).encode()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int, int]]:
    root = tmp_path_factory.mktemp("load_files")
    repo = root / "repo"
    (repo / "kept" / "1").mkdir(parents=True)
    (repo / "kept" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 4\n'
        'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]\n'
    )
    (repo / "kept" / "1" / "model.py").write_bytes(model_py(1))
    http_port, grpc_port = free_port(), free_port()
    flags = [*kserve_flags(http_port, grpc_port), "--model-control-mode", "explicit"]
    d = Daemon(repo, f"ipc://{root}/d.sock", root / "d.log", *flags)
    d.start()
    try:
        yield repo, http_port, grpc_port
    finally:
        assert d.stop() == 0, d.log()


def _load(port: int, name: str, parameters: dict) -> tuple[int, str]:
    body = json.dumps({"parameters": parameters}).encode()
    url = f"http://127.0.0.1:{port}/v2/repository/models/{urllib.request.quote(name)}/load"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=60) as r:
            return r.status, r.read().decode()
    except HTTPError as exc:
        return exc.code, exc.read().decode()


def _double(client: httpclient.InferenceServerClient, name: str) -> list[float]:
    tensor = httpclient.InferInput("INPUT0", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.array([[1.0, 2.0]], np.float32))
    return client.infer(name, [tensor]).as_numpy("OUTPUT0").ravel().tolist()  # type: ignore[union-attr]


def test_a_model_made_of_files_sent_with_the_load(daemon: tuple[Path, int, int]) -> None:
    repo, http_port, grpc_port = daemon
    before = sorted(p.relative_to(repo) for p in repo.rglob("*"))
    config = json.dumps(dict(CONFIG, name="sent"))
    code = base64.b64encode(model_py(2)).decode()
    assert _load(http_port, "sent", {"config": config, "file:/1/model.py": code}) == (200, "")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}")
    try:
        assert _double(client, "sent") == [2.0, 4.0]
        # gRPC sends bytes; the files replace the repository's for a model it has, until loaded without
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        grpc.load_model(
            "kept", config=json.dumps(dict(CONFIG, name="kept")), files={"file:1/model.py": model_py(3)}
        )
        assert _double(client, "kept") == [3.0, 6.0]
        grpc.load_model("kept")
        assert _double(client, "kept") == [1.0, 2.0]
        grpc.close()
        client.unload_model("sent")
        assert not client.is_model_ready("sent")
    finally:
        client.close()
    assert sorted(p.relative_to(repo) for p in repo.rglob("*")) == before  # nothing written there


@pytest.mark.parametrize(
    ("key", "text"),
    [
        ("file:1/../../evil.py", "plain names"),
        ("file:1/.hidden.py", "plain names"),
        ("file:" + "A" * 256, "failed to poll from model repository"),
    ],
)
def test_file_paths_are_plain_relative_names(daemon: tuple[Path, int, int], key: str, text: str) -> None:
    _, http_port, _ = daemon
    status, body = _load(http_port, "bad", {"config": json.dumps(CONFIG), key: "YQ=="})
    assert status == 400 and text in json.loads(body)["error"], body
    # Triton's head, which its clients match (L0_lifecycle test_file_override_security)
    assert json.loads(body)["error"].startswith("failed to load 'bad', failed to poll from model repository")


def test_files_need_a_config_and_base64(daemon: tuple[Path, int, int]) -> None:
    _, http_port, _ = daemon
    status, body = _load(http_port, "bad", {"file:1/model.py": "YQ=="})
    assert status == 400 and "need the model's config" in json.loads(body)["error"], body
    assert json.loads(body)["error"].startswith("failed to load 'bad', failed to poll from model repository")
    status, body = _load(http_port, "bad", {"config": json.dumps(CONFIG), "file:1/model.py": "not base64!"})
    assert status == 400 and "must be base64" in json.loads(body)["error"], body


def test_python_model_names_keep_tritons_stub_rule(daemon: tuple[Path, int, int]) -> None:
    _, http_port, _ = daemon
    code = base64.b64encode(model_py(2)).decode()
    for name in ("model;test", "model$test", "model(test)"):
        config = json.dumps(dict(CONFIG, name=name))
        status, body = _load(http_port, name, {"config": config, "file:/1/model.py": code})
        assert status != 200 and "Invalid stub name: contains invalid characters" in body, body
    config = json.dumps(dict(CONFIG, name="model-with-hyphens"))
    assert _load(http_port, "model-with-hyphens", {"config": config, "file:/1/model.py": code})[0] == 200
