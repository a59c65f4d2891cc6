"""KServe v2 over HTTP with the real tritonclient.http against the real daemon, and hand-made requests
for everything a stock client never sends (malformed JSON, lying lengths, oversized bodies)."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
from tritonclient.utils import shared_memory as shm

from tests.daemon import EXAMPLES, gate_fifos, stop_daemon, wait_for
from tests.kserve_daemon import KServeDaemon, ort_run, start_kserve_daemon


@pytest.fixture
def client(kserve: KServeDaemon) -> httpclient.InferenceServerClient:
    c = httpclient.InferenceServerClient(kserve.http_url)
    yield c
    c.close()


def raw(
    kserve: KServeDaemon, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
):
    conn = http.client.HTTPConnection("127.0.0.1", kserve.http_port, timeout=10)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return response.status, response.read(), dict(response.getheaders())
    finally:
        conn.close()


def read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_health_and_server_metadata(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits")
    assert client.is_model_ready("digits", "1")
    assert not client.is_model_ready("no-such-model")
    meta = client.get_server_metadata()
    assert meta["name"] == "edge-server"
    assert {"binary_tensor_data", "model_repository", "statistics", "system_shared_memory"} <= set(
        meta["extensions"]
    )


def test_model_metadata_and_config(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("digits")
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert client.get_model_metadata("digits", "1") == meta
    config = client.get_model_config("digits")
    assert config["max_batch_size"] == 8
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("no-such-model")
    assert info.value.status() == "400"  # Triton's status for a name it does not know
    assert info.value.message() == "Request for unknown model: 'no-such-model' is not found"


@pytest.mark.parametrize("binary", [False, True])
def test_infer_equals_onnxruntime(
    client: httpclient.InferenceServerClient, ipc_repository: Path, binary: bool
) -> None:
    image = np.random.default_rng(1).random((3, 1, 8, 8), dtype=np.float32)
    tensor = httpclient.InferInput("image", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image, binary_data=binary)
    result = client.infer(
        "digits",
        [tensor],
        outputs=[httpclient.InferRequestedOutput("probabilities", binary_data=binary)],
        request_id="r-1",
    )
    expected = ort_run(ipc_repository, "digits", {"image": image})[0]
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected, rtol=1e-6)
    response = result.get_response()
    assert response["id"] == "r-1"
    assert response["model_version"] == "1"


def test_infer_with_compression_both_ways(
    client: httpclient.InferenceServerClient, ipc_repository: Path
) -> None:
    image = np.random.default_rng(2).random((1, 1, 8, 8), dtype=np.float32)
    tensor = httpclient.InferInput("image", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    expected = ort_run(ipc_repository, "digits", {"image": image})[0]
    for request_algorithm, response_algorithm in (("gzip", "deflate"), ("deflate", "gzip")):
        result = client.infer(
            "digits",
            [tensor],
            request_compression_algorithm=request_algorithm,
            response_compression_algorithm=response_algorithm,
        )
        np.testing.assert_allclose(result.as_numpy("probabilities"), expected, rtol=1e-6)


@pytest.mark.parametrize("binary", [False, True])
def test_string_tensors(client: httpclient.InferenceServerClient, binary: bool) -> None:
    text = np.array([b"hello", "w\u00f6rld".encode(), b""], dtype=object)
    tensor = httpclient.InferInput("TEXT", [3], "BYTES")
    tensor.set_data_from_numpy(text, binary_data=binary)
    result = client.infer(
        "text", [tensor], outputs=[httpclient.InferRequestedOutput("UPPER", binary_data=binary)]
    )
    upper = [v if isinstance(v, bytes) else v.encode() for v in result.as_numpy("UPPER").tolist()]
    assert upper == [b"HELLO", "W\u00f6RLD".encode(), b""]  # JSON data comes back as str


def test_bad_input_raises_with_our_message_and_code(client: httpclient.InferenceServerClient) -> None:
    image = np.zeros((1, 8, 8), dtype=np.float32)
    tensor = httpclient.InferInput("image", [1, 8, 8], "FP32")
    tensor.set_data_from_numpy(image)
    with pytest.raises(InferenceServerException) as info:
        client.infer("digits", [tensor])
    assert info.value.status() == "400"
    assert info.value.message() == (
        "model 'digits' input 'image': expected shape [batch, 1, 8, 8], got [1, 8, 8]"
    )
    wrong = httpclient.InferInput("nope", [1, 1, 8, 8], "FP32")
    wrong.set_data_from_numpy(image[None])
    with pytest.raises(InferenceServerException, match="nope"):
        client.infer("digits", [wrong])


def test_statistics_count_requests(client: httpclient.InferenceServerClient) -> None:
    def count() -> int:
        stats = client.get_inference_statistics("identity")["model_stats"]
        assert [s["version"] for s in stats] == ["1"]
        return int(stats[0]["inference_count"])

    before = count()
    tensor = httpclient.InferInput("INPUT0", [4], "FP32")
    tensor.set_data_from_numpy(np.arange(4, dtype=np.float32))
    for _ in range(3):
        np.testing.assert_array_equal(
            client.infer("identity", [tensor]).as_numpy("OUTPUT0"), np.arange(4, dtype=np.float32)
        )
    # A queued request's statistics are recorded just after its response is delivered: ask again.
    wait_for(lambda: count() == before + 3, what="the requests in the statistics")
    everything = client.get_inference_statistics()["model_stats"]
    assert {"identity", "digits"} <= {s["name"] for s in everything}
    assert client.get_inference_statistics("identity", "1")["model_stats"][0]["version"] == "1"


def test_unload_and_load(client: httpclient.InferenceServerClient) -> None:
    assert client.is_model_ready("cnn")
    client.unload_model("cnn")
    assert not client.is_model_ready("cnn")
    index = {row["name"]: row for row in client.get_model_repository_index()}
    assert index["cnn"]["state"] == "UNAVAILABLE"
    client.load_model("cnn")
    assert client.is_model_ready("cnn")
    client.unload_model("no-such-model")  # as in Triton: nothing to unload, nothing happens
    assert "no-such-model" not in {row["name"] for row in client.get_model_repository_index()}


def test_load_with_a_config_override(client: httpclient.InferenceServerClient) -> None:
    """Triton's load-time config (JSON) replaces config.pbtxt until the model is loaded without one."""
    config = client.get_model_config("cnn")
    assert config["max_batch_size"] == 16
    override = dict(config, max_batch_size=2)
    override.pop("dynamic_batching", None)
    client.load_model("cnn", config=json.dumps(override))
    try:
        assert client.get_model_config("cnn")["max_batch_size"] == 2
        assert client.get_model_metadata("cnn")["inputs"][0]["shape"] == [-1, 3, 64, 64]
        too_big = httpclient.InferInput("input", [4, 3, 64, 64], "FP32")
        too_big.set_data_from_numpy(np.zeros((4, 3, 64, 64), np.float32), binary_data=True)
        with pytest.raises(InferenceServerException, match="batch"):
            client.infer("cnn", [too_big])
        with pytest.raises(InferenceServerException, match="load failed for model .cnn.: ") as info:
            client.load_model("cnn", config=json.dumps({"max_batch_size": "lots"}))
        assert info.value.status() == "400"
        assert client.get_model_config("cnn")["max_batch_size"] == 2  # the failed load changed nothing
        with pytest.raises(InferenceServerException, match="file override"):
            client.load_model("cnn", files={"file:1/model.onnx": b"\0"})
    finally:
        client.load_model("cnn")  # back to the repository's config.pbtxt
    assert client.get_model_config("cnn")["max_batch_size"] == 16


def test_request_parameters_reach_the_model_and_are_checked(client: httpclient.InferenceServerClient) -> None:
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], np.int32))
    result = client.infer(
        "params", [tensor], request_id="h1", parameters={"mode": "fast", "level": 3, "flag": True}
    )
    seen = json.loads(result.as_numpy("PARAMS")[0])
    assert seen["parameters"] == {"mode": "fast", "level": 3, "flag": True}
    assert seen["request_id"] == "h1"
    # The model's InferenceResponse(parameters=...) is the response's JSON "parameters", as in Triton,
    # with the outputs in JSON and in the binary extension alike.
    echoed = {"seen": 3, "model": "params", "echo": True}
    assert result.get_response()["parameters"] == echoed
    binary = client.infer("params", [tensor], outputs=[httpclient.InferRequestedOutput("PARAMS", True)])
    assert binary.get_response()["parameters"] == {**echoed, "seen": 0}
    assert binary.get_response()["outputs"][0]["parameters"]["binary_data_size"] > 0
    # a number with a fraction is Triton's double_param: it reaches the model too (L0_parameters)
    ratio = client.infer("params", [tensor], parameters={"ratio": 0.5}).as_numpy("PARAMS")
    assert json.loads(ratio[0])["parameters"] == {"ratio": 0.5}
    with pytest.raises(InferenceServerException, match="must be a bool, a number or a string"):
        client.infer("params", [tensor], parameters={"nested": [1, 2]})


def _log_count(kserve: KServeDaemon, text: str) -> int:
    return kserve.daemon.log_path.read_text(errors="replace").count(text)


def _register_and_drop(client: httpclient.InferenceServerClient, name: str) -> None:
    """A shared-memory registration: the daemon logs it at debug level."""
    handle = shm.create_shared_memory_region(name, "/" + name, 64)
    try:
        client.register_system_shared_memory(name, "/" + name, 64)
        client.unregister_system_shared_memory(name)
    finally:
        shm.destroy_shared_memory_region(handle)


def test_log_settings_apply_and_both_transports_agree(
    client: httpclient.InferenceServerClient, kserve: KServeDaemon
) -> None:
    """What one transport changes, the process does and the other transport reports."""
    grpc = grpcclient.InferenceServerClient(kserve.grpc_url)
    before = client.get_log_settings()
    assert before == {
        "log_file": "",
        "log_info": True,
        "log_warning": True,
        "log_error": True,
        "log_verbose_level": 0,  # the test daemon runs without --log-verbose
        "log_format": "default",
    }
    try:
        for level in (0, 1, 0):
            assert client.update_log_settings({"log_verbose_level": level})["log_verbose_level"] == level
            settings = grpc.get_log_settings(as_json=True)["settings"]
            assert int(settings["log_verbose_level"].get("uint32_param", 0)) == level
            name = f"edge-server-{os.getpid()}-log-{level}"
            seen = _log_count(kserve, f"registered region {name}")
            _register_and_drop(client, name)
            assert _log_count(kserve, f"registered region {name}") - seen == level  # debug lines at 1 only
        # log_info off over gRPC: HTTP reports it, and the daemon's info lines are dropped until it is on
        changed = "log settings changed by a client"
        seen = _log_count(kserve, changed)
        grpc.update_log_settings({"log_info": False})
        assert client.get_log_settings()["log_info"] is False
        client.update_log_settings({"log_warning": True})
        assert _log_count(kserve, changed) == seen
        grpc.update_log_settings({"log_info": True})
        assert _log_count(kserve, changed) == seen + 1
        assert client.get_log_settings() == before
    finally:
        client.update_log_settings({"log_verbose_level": 0, "log_info": True})
        grpc.close()


def test_log_settings_report_the_daemons_flags(tmp_path: Path) -> None:
    """GET /v2/logging says what --log-verbose and --log-format set, over HTTP and gRPC."""
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "identity", repo / "identity", ignore=shutil.ignore_patterns("samples"))
    gate_fifos(tmp_path)
    server = start_kserve_daemon(tmp_path, repo, "v.sock", "--log-verbose", "2", "--log-format", "ISO8601")
    try:
        http = httpclient.InferenceServerClient(server.http_url)
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        settings = http.get_log_settings()
        assert (settings["log_verbose_level"], settings["log_format"]) == (2, "ISO8601")
        over_grpc = grpc.get_log_settings(as_json=True)["settings"]
        assert over_grpc["log_verbose_level"]["uint32_param"] == 2
        assert over_grpc["log_format"]["string_param"] == "ISO8601"
        http.close()
        grpc.close()
    finally:
        assert stop_daemon(server.daemon) == 0, server.daemon.log()


LOG_REFUSED = [
    ({"log_format": "ISO8601"}, "log_format cannot change while the daemon runs"),
    ({"log_file": "/tmp/edge.log"}, "log_file is not supported"),
    ({"log_verbose_level": -1}, "log_verbose_level must be an unsigned integer"),
    ({"log_info": "yes"}, "log_info must be a boolean"),
    ({"log_nonsense": True}, "unknown log setting 'log_nonsense'"),
    ({"log_verbose_level": 1, "log_format": "json"}, "log_format"),  # all or nothing
]


@pytest.mark.parametrize(("changes", "message"), LOG_REFUSED, ids=[str(c) for c, _ in LOG_REFUSED])
def test_log_settings_refused_name_the_setting(
    client: httpclient.InferenceServerClient, kserve: KServeDaemon, changes: dict[str, object], message: str
) -> None:
    before = client.get_log_settings()
    with pytest.raises(InferenceServerException, match=message) as info:
        client.update_log_settings(changes)
    assert info.value.status() == "400"
    assert client.get_log_settings() == before
    if all(type(v) is not str or k in ("log_format", "log_file") for k, v in changes.items()):
        if all(type(v) is not int or v >= 0 for v in changes.values()):  # what gRPC can carry
            grpc = grpcclient.InferenceServerClient(kserve.grpc_url)
            try:
                with pytest.raises(InferenceServerException, match=message) as info:
                    grpc.update_log_settings(changes)
                assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
            finally:
                grpc.close()
    assert client.get_log_settings() == before


def test_trace_settings_same_on_both_and_changes_refused(
    client: httpclient.InferenceServerClient, kserve: KServeDaemon
) -> None:
    grpc = grpcclient.InferenceServerClient(kserve.grpc_url)
    try:
        current = client.get_trace_settings()
        assert current["trace_level"] == ["OFF"]
        over_grpc = grpc.get_trace_settings(as_json=True)["settings"]
        assert {k: v["value"] for k, v in over_grpc.items()} == {
            k: v if isinstance(v, list) else [v] for k, v in current.items()
        }
        # what leaves tracing off is accepted, on both, globally and for a model
        assert client.update_trace_settings(settings={"trace_level": ["OFF"]}) == current
        assert client.update_trace_settings("digits", settings={"trace_rate": None}) == current
        grpc.update_trace_settings(settings={"trace_level": ["OFF"], "trace_count": None})
        for changes, name in (
            ({"trace_level": ["TIMESTAMPS"]}, "trace_level"),
            ({"trace_rate": "1"}, "trace_rate"),
        ):
            with pytest.raises(
                InferenceServerException, match=f"trace setting {name} .* is not supported"
            ) as info:
                client.update_trace_settings("digits", settings=changes)
            assert info.value.status() == "400"
            with pytest.raises(InferenceServerException, match=f"trace setting {name}") as info:
                grpc.update_trace_settings(settings=changes)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        with pytest.raises(InferenceServerException, match="unknown trace setting 'tracing'"):
            client.update_trace_settings(settings={"tracing": "on"})
        assert client.get_trace_settings() == current
    finally:
        grpc.close()


def test_cuda_shared_memory_is_not_supported(client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported") as info:
        client.register_cuda_shared_memory("x", b"handle", 0, 16)
    assert info.value.status() == "501"
    assert client.get_cuda_shared_memory_status() == []  # none is ever registered
    client.unregister_cuda_shared_memory()


# -- what stock clients never send ------------------------------------------------------------------


def test_malformed_json_is_400(kserve: KServeDaemon) -> None:
    status, body, _ = raw(kserve, "POST", "/v2/models/identity/infer", b"{not json")
    assert status == 400
    assert "not valid JSON" in json.loads(body)["error"]
    status, body, _ = raw(kserve, "POST", "/v2/models/identity/infer", b'{"inputs": "x"}')
    assert status == 400
    assert "'inputs' must be a list" in json.loads(body)["error"]


def test_wrong_lengths_are_400(kserve: KServeDaemon) -> None:
    header = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}
            ]
        }
    ).encode()
    data = np.ones(2, dtype=np.float32).tobytes()
    status, body, _ = raw(
        kserve,
        "POST",
        "/v2/models/identity/infer",
        header + data,
        {"Inference-Header-Content-Length": str(len(header) + 100)},
    )
    assert status == 400 and "Inference-Header-Content-Length" in json.loads(body)["error"]
    status, body, _ = raw(
        kserve,
        "POST",
        "/v2/models/identity/infer",
        header + data[:4],
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400 and "past the end of the body" in json.loads(body)["error"]
    status, body, _ = raw(
        kserve,
        "POST",
        "/v2/models/identity/infer",
        header + data + b"xx",
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 400 and "belong to no input" in json.loads(body)["error"]
    # An HTTP Content-Length shorter than the body: the server reads what was declared, which is no JSON.
    with socket.create_connection(("127.0.0.1", kserve.http_port), timeout=10) as sock:
        sock.sendall(
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n" + header
        )
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 400")


def test_oversized_body_is_refused_before_it_is_read(kserve: KServeDaemon) -> None:
    with socket.create_connection(("127.0.0.1", kserve.http_port), timeout=10) as sock:
        sock.sendall(
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n{"
        )
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413")
    assert b"exceeds the maximum allowed input size of" in reply
    bomb = gzip.compress(b" " * (40 << 20))  # inflates past the daemon's 32 MiB limit
    status, body, _ = raw(kserve, "POST", "/v2/models/identity/infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "inflated" in json.loads(body)["error"]


def test_unknown_routes_and_methods(kserve: KServeDaemon) -> None:
    status, body, _ = raw(kserve, "GET", "/v2/nothing/here")
    assert status == 404 and "no such endpoint" in json.loads(body)["error"]
    status, body, _ = raw(kserve, "GET", "/v2/models/identity/infer")
    assert status == 405
    status, body, _ = raw(kserve, "GET", "/v2/models/identity/versions/x")
    assert status == 400 and "version" in json.loads(body)["error"]


def test_daemon_still_serves_after_all_that(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_ready()


def test_a_taken_port_stops_the_daemon_with_the_reason(ipc_root: Path, ipc_repository: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"ADDRESS_IN_USE.*cannot bind 127.0.0.1:{port}"):
            start_kserve_daemon(ipc_root, ipc_repository, "taken.sock", "--http-port", str(port))


def test_many_in_flight_through_the_dynamic_batcher(kserve: KServeDaemon, ipc_repository: Path) -> None:
    """32 requests from 8 connections at once to a batching model: each gets its own answer."""
    images = np.random.default_rng(7).random((32, 1, 3, 64, 64), dtype=np.float32)
    expected = ort_run(ipc_repository, "cnn", {"input": images[:, 0]})[0]
    c = httpclient.InferenceServerClient(kserve.http_url, concurrency=8)
    try:
        pending = []
        for image in images:
            tensor = httpclient.InferInput("input", list(image.shape), "FP32")
            tensor.set_data_from_numpy(image, binary_data=True)
            pending.append(c.async_infer("cnn", [tensor]))
        for k, request in enumerate(pending):
            np.testing.assert_allclose(
                request.get_result().as_numpy("logits")[0], expected[k], rtol=1e-4, atol=1e-5
            )
    finally:
        c.close()


def test_a_chunked_body_is_counted_as_it_arrives(kserve: KServeDaemon) -> None:
    chunk = b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", kserve.http_port), timeout=30) as sock:
        sock.sendall(
            b"POST /v2/models/identity/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        try:
            for _ in range(40):  # 40 MiB against the daemon's 32 MiB limit
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed while we were still sending
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413")


def test_endless_headers_are_400_not_memory(kserve: KServeDaemon) -> None:
    line = b"X-Junk: " + b"a" * 8000 + b"\r\n"
    with socket.create_connection(("127.0.0.1", kserve.http_port), timeout=30) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(2000):  # 16 MB of headers against the 64 KiB bound
                sock.sendall(line)
        except OSError:
            pass  # answered and closed while we were still sending
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 400")


def test_responses_on_one_connection_pipelined_continued_and_closed(kserve: KServeDaemon) -> None:
    """Heads and bodies leave together (the frontend's one-write transport): pipelined requests on one
    connection each get a whole response, ``Expect: 100-continue`` gets its interim answer first, and
    an error that closes the connection still sends its response before the close."""
    with socket.create_connection(("127.0.0.1", kserve.http_port), timeout=10) as sock:
        sock.sendall(
            b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n" * 3 + b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        reply = b""
        while reply.count(b"HTTP/1.1 200") < 4 or not reply.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
        assert reply.count(b"HTTP/1.1 200") == 4 and b'"name":"edge-server"' in reply
        body = b'{"ready": true}'
        sock.sendall(
            b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(body)
        )
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        reply = b""
        while not reply.endswith(b"]"):
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and b'"name":"digits"' in reply
        sock.sendall(
            b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n"
        )
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413") and reply.endswith(b"}")


def _identity_request(
    x: np.ndarray, *headers: bytes, version: bytes = b"1.1", model: bytes = b"identity"
) -> bytes:
    """A binary-tensor inference request to ``model`` as tritonclient sends one, with extra header lines."""
    header = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32",
                     "parameters": {"binary_data_size": x.nbytes}}]}
    ).encode()  # fmt: skip
    body = header + x.tobytes()
    lines = [
        b"POST /v2/models/%s/infer HTTP/%s" % (model, version),
        b"Host: x",
        b"Inference-Header-Content-Length: %d" % len(header),
        b"Content-Length: %d" % len(body),
        *headers,
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _responses(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` whole responses (head, body) read off ``sock``, by their Content-Length."""
    buffer, found = b"", []
    while len(found) < count:
        end = buffer.find(b"\r\n\r\n")
        if end >= 0:
            head = buffer[:end]
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(buffer) >= end + 4 + length:
                found.append((head, buffer[end + 4 : end + 4 + length]))
                buffer = buffer[end + 4 + length :]
                continue
        chunk = sock.recv(65536)
        assert chunk, f"closed after {len(found)} of {count} responses: {buffer[:200]!r}"
        buffer += chunk
    return found


def _measured(kserve: KServeDaemon) -> None:
    """Requests to ``identity`` first, so that it runs inline, in the frontend's thread: its first run on its
    worker, and then until their moving average is under the inline budget (edge_server.scheduler.inline)."""
    with socket.create_connection(("127.0.0.1", kserve.http_port), timeout=30) as sock:
        for _ in range(50):
            sock.sendall(_identity_request(np.ones(3, np.float32)))
            assert _responses(sock, 1)[0][0].startswith(b"HTTP/1.1 200")


def test_pipelined_inferences_are_answered_in_order_while_one_waits(kserve: KServeDaemon) -> None:
    """A small inference is answered by its connection when nothing else of it is in flight; one pipelined
    behind a request that waits for an instance must still be answered after that one."""
    gate = kserve.daemon.gate
    assert gate is not None
    _measured(kserve)
    x = np.arange(4, dtype=np.float32)
    with socket.create_connection(("127.0.0.1", kserve.http_port), timeout=30) as sock:
        try:
            sock.sendall(
                _identity_request(x, model=b"gate") + _identity_request(x + 1) + _identity_request(x + 2)
            )
            gate.wait_started(1)
            gate.release(1)
            answers = _responses(sock, 3)
        finally:
            gate.settle()
    assert [head.split(b"\r\n")[0] for head, _ in answers] == [b"HTTP/1.1 200 OK"] * 3
    outputs = [json.loads(body)["outputs"][0]["data"] for _, body in answers]
    assert outputs == [x.tolist(), (x + 1).tolist(), (x + 2).tolist()]


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"headers": [b"Accept-Encoding: gzip"]},
        {"headers": [b"Connection: close"]},
        {"version": b"1.0"},
        {"model": b"nonexistent"},
        {"model": b"identity/versions/7"},
    ],
    ids=["plain", "gzip-answer", "connection-close", "http-1.0", "unknown-model", "unknown-version"],
)
def test_an_inference_answered_by_its_connection_reads_as_one_the_app_answers(
    kserve: KServeDaemon, variant: dict
) -> None:
    """The same request answered by the connection (small, uncompressed body) and by the ASGI app (sent
    with ``Content-Encoding: identity``, which only the app reads): byte for byte the same response, and
    the connection closed after it where HTTP/1.0 or ``Connection: close`` asks for that."""
    _measured(kserve)
    x = np.arange(6, dtype=np.float32)
    extra = variant.get("headers", [])
    version, model = variant.get("version", b"1.1"), variant.get("model", b"identity")
    closes = version == b"1.0" or b"Connection: close" in extra
    replies = []
    for more in ([], [b"Content-Encoding: identity"]):
        with socket.create_connection(("127.0.0.1", kserve.http_port), timeout=30) as sock:
            sock.sendall(_identity_request(x, *extra, *more, version=version, model=model))
            (reply,) = _responses(sock, 1)
            if closes:
                assert read_until_closed(sock) == b""
            else:  # still open: it answers the next request
                sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _responses(sock, 1)[0][0].startswith(b"HTTP/1.1 200")
        replies.append(reply)
    assert replies[0] == replies[1]
    head, body = replies[0]
    if model == b"identity":
        assert head.startswith(b"HTTP/1.1 200")
        if extra and b"gzip" in extra[0]:
            # no clock in the answer (gzip's MTIME 0): the same answer is the same bytes in any second
            assert body[:2] == b"\x1f\x8b" and body[4:8] == b"\0\0\0\0", body[:10]
            body = gzip.decompress(body)
        assert json.loads(body)["outputs"][0]["data"] == x.tolist()
    else:
        assert head.split(b" ")[1] in (b"400", b"404") and b"unknown model" in body, replies


def test_a_read_of_many_pipelined_inferences_is_answered_in_order(kserve: KServeDaemon) -> None:
    """The first request of a read may be answered by its connection, the rest by uvicorn's cycles in turn:
    each gets its own answer, in order."""
    _measured(kserve)
    xs = [np.full(3, k, np.float32) for k in range(40)]
    with socket.create_connection(("127.0.0.1", kserve.http_port), timeout=30) as sock:
        sock.sendall(b"".join(_identity_request(x) for x in xs))
        answers = _responses(sock, len(xs))
        sock.sendall(_identity_request(xs[0]))  # and the connection still answers the next one
        answers += _responses(sock, 1)
    assert [head.split(b" ")[1] for head, _ in answers] == [b"200"] * (len(xs) + 1)
    assert [json.loads(body)["outputs"][0]["data"] for _, body in answers] == [
        x.tolist() for x in xs + xs[:1]
    ]
