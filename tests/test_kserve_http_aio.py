"""``tritonclient.http.aio`` works on every call, because HTTP compresses only inference responses.

aiohttp always sends ``Accept-Encoding: gzip, deflate``, and the aio client decodes the bodies of
metadata, config, index and statistics calls as text without inflating them (Triton's QA:
``L0_http/python_http_aio_test.py``).  Triton compresses only ``/infer`` responses, and so do we.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient

from tests.daemon import Daemon, free_port, kserve_flags
from tests.onnx_factory import affine_model

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CONFIG = """
name: "affine"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


@pytest.fixture(scope="module")
def http_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("aio")
    repository = root / "repo"
    (repository / "affine").mkdir(parents=True)
    (repository / "affine" / "config.pbtxt").write_text(textwrap.dedent(CONFIG))
    affine_model(repository / "affine" / "1" / "model.onnx", offset=1.0)
    http_port = free_port()
    daemon = Daemon(repository, f"ipc://{root}/a.sock", root / "a.log", *kserve_flags(http_port, free_port()))
    daemon.start()
    try:
        yield f"127.0.0.1:{http_port}"
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_the_aio_client_reads_every_answer(http_url: str) -> None:
    async def calls() -> None:
        client = aioclient.InferenceServerClient(http_url)
        try:
            assert await client.is_server_live()
            assert await client.is_server_ready()
            assert await client.is_model_ready("affine")
            assert (await client.get_server_metadata())["name"] == "edge-server"
            assert (await client.get_model_metadata("affine"))["name"] == "affine"
            assert (await client.get_model_config("affine"))["max_batch_size"] == 8
            index = await client.get_model_repository_index()
            assert [(m["name"], m["state"]) for m in index] == [("affine", "READY")]
            stats = await client.get_inference_statistics("affine")
            assert stats["model_stats"][0]["name"] == "affine"
            x = np.arange(8, dtype=np.float32).reshape(2, 4)
            tensor = aioclient.InferInput("INPUT0", [2, 4], "FP32")
            tensor.set_data_from_numpy(x)
            result = await client.infer("affine", [tensor], response_compression_algorithm="gzip")
            assert result.as_numpy("OUTPUT0").tolist() == (x + 1).tolist()
        finally:
            await client.close()

    asyncio.run(calls())


def _get(url: str, method: str, path: str, body: bytes | None = None) -> http.client.HTTPResponse:
    host, port = url.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request(method, path, body=body, headers={"Accept-Encoding": "gzip, deflate"})
    response = conn.getresponse()
    response.read_body = response.read()  # type: ignore[attr-defined]
    conn.close()
    return response


def test_only_inference_responses_are_compressed(http_url: str) -> None:
    for method, path in [
        ("GET", "/v2"),
        ("GET", "/v2/models/affine"),
        ("GET", "/v2/models/affine/config"),
        ("GET", "/v2/models/affine/stats"),
        ("POST", "/v2/repository/index"),
    ]:
        response = _get(http_url, method, path, b"{}" if method == "POST" else None)
        assert response.status == 200, path
        assert response.getheader("Content-Encoding") is None, path
        json.loads(response.read_body)  # type: ignore[attr-defined]
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    for path in ("/v2/models/affine/infer", "/v2/models/affine/versions/1/infer"):
        response = _get(http_url, "POST", path, json.dumps(body).encode())
        assert response.status == 200
        assert response.getheader("Content-Encoding") == "gzip"
        answer = json.loads(gzip.decompress(response.read_body))  # type: ignore[attr-defined]
        assert answer["outputs"][0]["data"] == [2, 3, 4, 5]
    # the synchronous client asks for compressed infer responses explicitly, and inflates them
    client = httpclient.InferenceServerClient(http_url)
    tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    out = client.infer("affine", [tensor], response_compression_algorithm="deflate").as_numpy("OUTPUT0")
    assert out.tolist() == [[2, 2, 2, 2]]
    client.close()
