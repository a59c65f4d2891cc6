"""KServe v2 over gRPC with the real tritonclient.grpc against the real daemon."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.daemon import Gate, wait_for
from tests.kserve_daemon import KServeDaemon, ort_run


@pytest.fixture
def client(kserve: KServeDaemon) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(kserve.grpc_url)
    yield c
    c.close()


def test_health_and_metadata(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits")
    assert not client.is_model_ready("no-such-model")
    assert client.get_server_metadata(as_json=True)["name"] == "edge-server"
    meta = client.get_model_metadata("digits", as_json=True)
    assert meta["inputs"] == [{"name": "image", "datatype": "FP32", "shape": ["-1", "1", "8", "8"]}]
    config = client.get_model_config("digits", as_json=True)["config"]
    assert config["max_batch_size"] == 8
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("no-such-model")
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"  # Triton's status for a name it does not know


def test_infer_raw_contents_equal_onnxruntime(
    client: grpcclient.InferenceServerClient, ipc_repository: Path
) -> None:
    image = np.random.default_rng(3).random((4, 1, 8, 8), dtype=np.float32)
    tensor = grpcclient.InferInput("image", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    result = client.infer("digits", [tensor], request_id="g-1")
    expected = ort_run(ipc_repository, "digits", {"image": image})[0]
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected, rtol=1e-6)
    response = result.get_response()
    assert response.id == "g-1"
    assert response.model_version == "1"


def test_string_tensors(client: grpcclient.InferenceServerClient) -> None:
    text = np.array([b"abc", b"", "\u00e9".encode()], dtype=object)
    tensor = grpcclient.InferInput("TEXT", [3], "BYTES")
    tensor.set_data_from_numpy(text)
    result = client.infer("text", [tensor], outputs=[grpcclient.InferRequestedOutput("UPPER")])
    assert result.as_numpy("UPPER").tolist() == [b"ABC", b"", "\u00e9".encode()]


def test_bad_input_raises_with_our_message_and_code(client: grpcclient.InferenceServerClient) -> None:
    tensor = grpcclient.InferInput("image", [1, 8, 8], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 8, 8), dtype=np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("digits", [tensor])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert info.value.message() == (
        "model 'digits' input 'image': expected shape [batch, 1, 8, 8], got [1, 8, 8]"
    )


def test_statistics_and_repository(client: grpcclient.InferenceServerClient) -> None:
    tensor = grpcclient.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.ones(2, dtype=np.float32))

    def count() -> int:
        stats = client.get_inference_statistics("identity", as_json=True)["model_stats"][0]
        return int(stats.get("inference_count", 0))  # proto JSON leaves zeros out

    before = count()
    client.infer("identity", [tensor])
    # A queued request's statistics are recorded just after its response is delivered: ask again.
    wait_for(lambda: count() == before + 1, what="the request in the statistics")
    names = {m["name"] for m in client.get_model_repository_index(as_json=True)["models"]}
    assert {"identity", "digits", "text"} <= names
    client.unload_model("cnn")
    assert not client.is_model_ready("cnn")
    client.load_model("cnn")
    assert client.is_model_ready("cnn")
    config = client.get_model_config("cnn", as_json=True)["config"]
    config["max_batch_size"] = 2
    config.pop("dynamic_batching", None)
    client.load_model("cnn", config=json.dumps(config))
    try:
        assert client.get_model_config("cnn", as_json=True)["config"]["max_batch_size"] == 2
    finally:
        client.load_model("cnn")
    assert client.get_model_config("cnn", as_json=True)["config"]["max_batch_size"] == 16


def test_stream_many_in_flight_with_errors_inline(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for k in range(20):
            tensor = grpcclient.InferInput("INPUT0", [3], "FP32")
            tensor.set_data_from_numpy(np.full(3, k, dtype=np.float32))
            client.async_stream_infer("identity", [tensor], request_id=str(k))
        bad = grpcclient.InferInput("INPUT0", [3], "INT32")
        bad.set_data_from_numpy(np.zeros(3, dtype=np.int32))
        client.async_stream_infer("identity", [bad], request_id="bad")
        seen = {}
        errors = []
        for _ in range(21):
            result, error = results.get(timeout=10)
            if error is not None:
                errors.append(error)
            else:
                response = result.get_response()  # type: ignore[attr-defined]
                seen[response.id] = result.as_numpy("OUTPUT0")  # type: ignore[attr-defined]
    finally:
        client.stop_stream()
    assert sorted(seen, key=int) == [str(k) for k in range(20)]
    for key, value in seen.items():
        np.testing.assert_array_equal(value, np.full(3, int(key), dtype=np.float32))
    assert len(errors) == 1 and "expected TYPE_FP32" in str(errors[0])


def test_stream_requests_overlap(client: grpcclient.InferenceServerClient, kserve: KServeDaemon) -> None:
    """Two requests on one stream are in the model at once: the second is not held behind the first.

    Their answers are written in the order the requests came, as Triton's stream handler does for a
    model that is not decoupled (test_kserve_response_order.py).
    """
    gate = kserve.daemon.gate
    assert isinstance(gate, Gate)

    def identity_count() -> int:
        stats = client.get_inference_statistics("identity", as_json=True)["model_stats"][0]
        # tritonclient's JSON of a protobuf message leaves out fields at 0: a model never run has no count
        return int(stats["inference_stats"]["success"].get("count", 0))

    before = identity_count()
    results: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for k in range(2):
            tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
            tensor.set_data_from_numpy(np.full(1, k, dtype=np.float32))
            client.async_stream_infer("identity", [tensor], request_id=f"i{k}")
        tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
        tensor.set_data_from_numpy(np.ones(1, dtype=np.float32))
        client.async_stream_infer("gate", [tensor], request_id="gated")
        gate.wait_started(1)
        client.async_stream_infer("identity", [tensor], request_id="after")
        first = [results.get(timeout=10) for _ in range(2)]
        assert [r.get_response().id for r, _ in first] == ["i0", "i1"]  # type: ignore[attr-defined]
        wait_for(lambda: identity_count() == before + 3, what="'after' to run beside the gated request")
        assert results.empty()  # its answer waits for the gated one's
        gate.release(1)
        last = [results.get(timeout=10) for _ in range(2)]
        assert [(r.get_response().id, e) for r, e in last] == [("gated", None), ("after", None)]  # type: ignore[attr-defined]
    finally:
        gate.settle()
        client.stop_stream()


def test_cuda_shared_memory_is_unimplemented(client: grpcclient.InferenceServerClient) -> None:
    """Registering is refused; none is ever registered, so the status is empty and unregistering a no-op."""
    with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported") as info:
        client.register_cuda_shared_memory("x", b"aGFuZGxl", 0, 16)  # the client decodes it: base64
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert not client.get_cuda_shared_memory_status().regions
    client.unregister_cuda_shared_memory()


def test_log_settings_update_and_refusal(client: grpcclient.InferenceServerClient) -> None:
    """gRPC's LogSettings applies what HTTP's /v2/logging applies (tests/test_kserve_http.py has both)."""
    settings = client.get_log_settings(as_json=True)["settings"]
    assert settings["log_info"]["bool_param"] is True
    assert settings["log_format"]["string_param"] == "default"
    try:
        answer = client.update_log_settings({"log_verbose_level": 1, "log_warning": False}, as_json=True)
        assert answer["settings"]["log_verbose_level"]["uint32_param"] == 1
        assert answer["settings"]["log_warning"].get("bool_param", False) is False
        with pytest.raises(InferenceServerException, match="log_format cannot change") as info:
            client.update_log_settings({"log_verbose_level": 0, "log_format": "json"})
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
        now = client.get_log_settings(as_json=True)["settings"]
        assert now["log_verbose_level"]["uint32_param"] == 1  # refused: nothing changed
    finally:
        client.update_log_settings({"log_verbose_level": 0, "log_warning": True})
    settings = client.get_log_settings(as_json=True)["settings"]
    assert settings["log_warning"]["bool_param"] is True
    assert settings["log_verbose_level"]["uint32_param"] == 0


def collect(results: queue.Queue[tuple[object, object]], until_finals: int) -> list[tuple[object, object]]:
    """Stream callbacks until ``until_finals`` responses carried triton_final_response=true."""
    got = []
    finals = 0
    while finals < until_finals:
        result, error = results.get(timeout=10)
        got.append((result, error))
        if result is not None:
            params = result.get_response().parameters  # type: ignore[attr-defined]
            finals += bool(params["triton_final_response"].bool_param)
    return got


def test_stream_decoupled_model_many_responses_then_final(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        values = grpcclient.InferInput("IN", [3], "INT32")
        values.set_data_from_numpy(np.array([7, 8, 9], np.int32))
        delays = grpcclient.InferInput("DELAY", [3], "UINT32")
        delays.set_data_from_numpy(np.full(3, 2, np.uint32))
        client.async_stream_infer(
            "repeat", [values, delays], request_id="rep", enable_empty_final_response=True
        )
        square = grpcclient.InferInput("IN", [1], "INT32")
        square.set_data_from_numpy(np.array([0], np.int32))
        client.async_stream_infer("square", [square], request_id="sq0", enable_empty_final_response=True)
        got = collect(results, until_finals=2)
    finally:
        client.stop_stream()
    assert all(error is None for _, error in got)
    by_id: dict[str, list[object]] = {}
    for result, _ in got:
        by_id.setdefault(result.get_response().id, []).append(result)  # type: ignore[attr-defined]
    repeat = by_id["rep"]
    assert [int(r.as_numpy("OUT")[0]) for r in repeat[:-1]] == [7, 8, 9]  # type: ignore[attr-defined]
    assert [bool(r.get_response().parameters["triton_final_response"].bool_param) for r in repeat] == [
        False,
        False,
        False,
        True,
    ]  # type: ignore[attr-defined]
    assert len(repeat[-1].get_response().outputs) == 0  # type: ignore[attr-defined]
    assert len(by_id["sq0"]) == 1  # n = 0: only the empty final


def test_stream_decoupled_error_mid_stream(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([1], np.int32))
        client.async_stream_infer("flaky", [tensor], enable_empty_final_response=True)
        got = []
        while True:
            result, error = results.get(timeout=10)
            got.append((result, error))
            if result is not None and result.get_response().parameters["triton_final_response"].bool_param:  # type: ignore[attr-defined]
                break
    finally:
        client.stop_stream()
    kinds = [
        "error" if error is not None else ("final" if not r.get_response().outputs else "out")
        for r, error in got
    ]  # type: ignore[union-attr]
    assert kinds == ["out", "error", "out", "final"]
    assert "second response failed" in str(got[1][1])


def test_decoupled_model_over_unary_infer_says_to_stream(client: grpcclient.InferenceServerClient) -> None:
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([2], np.int32))
    with pytest.raises(
        InferenceServerException, match="doesn't support models with decoupled transaction policy"
    ):
        client.infer("square", [tensor])


def test_parameters_reach_the_model(client: grpcclient.InferenceServerClient) -> None:
    import json

    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], np.int32))
    result = client.infer(
        "params",
        [tensor],
        request_id="p1",
        parameters={"mode": "fast", "level": 3, "flag": True},
        sequence_id=42,
        sequence_start=True,
    )
    seen = json.loads(result.as_numpy("PARAMS")[0])
    assert seen["parameters"] == {"mode": "fast", "level": 3, "flag": True}
    assert seen["request_id"] == "p1"
    assert seen["correlation_id"] == 42
    assert seen["flags"] == 1  # SEQUENCE_START
    # The model's InferenceResponse(parameters=...) is the response's InferParameter map, as in Triton.
    params = result.get_response().parameters  # type: ignore[attr-defined]
    assert params["seen"].int64_param == 3
    assert params["model"].string_param == "params"
    assert params["echo"].bool_param is True
    assert result.get_response(as_json=True)["parameters"] == {
        "seen": {"int64_param": "3"},
        "model": {"string_param": "params"},
        "echo": {"bool_param": True},
    }


def test_typed_contents_and_raw_counts_with_the_bare_stub(kserve: KServeDaemon) -> None:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(kserve.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="identity")
        tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[3])
        tensor.contents.fp32_contents.extend([1.5, 2.5, -3.0])
        response = stub.ModelInfer(request)
        assert np.frombuffer(response.raw_output_contents[0], "<f4").tolist() == [1.5, 2.5, -3.0]

        request.raw_input_contents.append(np.zeros(3, np.float32).tobytes())  # one raw entry too many
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "raw_input_contents has 1 entries" in info.value.details()

        short = service_pb2.ModelInferRequest(model_name="identity")
        short.inputs.add(name="INPUT0", datatype="FP32", shape=[4])
        short.raw_input_contents.append(b"\0" * 12)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(short)
        assert "needs 16 bytes, got 12" in info.value.details()

        huge = service_pb2.ModelInferRequest(model_name="identity")
        huge.inputs.add(
            name="INPUT0", datatype="FP32", shape=[2**28, 2**28]
        )  # under 2^59 elements: refused by size
        huge.raw_input_contents.append(b"\0" * 16)
        with pytest.raises(grpc.RpcError, match="needs 288230376151711744 bytes, got 16"):
            stub.ModelInfer(huge)

        past = service_pb2.ModelInferRequest(model_name="identity")
        past.inputs.add(name="INPUT0", datatype="FP32", shape=[2**32, 2**32])
        past.raw_input_contents.append(b"\0" * 16)
        with pytest.raises(grpc.RpcError, match="causes total element count to exceed maximum size"):
            stub.ModelInfer(past)  # Triton's text for a count past 64 bits


def test_closing_the_stream_cancels_in_the_model(kserve: KServeDaemon, ipc_root: Path) -> None:
    """The bare stub, so that the test owns the request iterator (tritonclient's stop_stream with
    cancel_requests leaves its request thread blocked on an empty queue)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    log = ipc_root / "repeat.log"

    def lines() -> int:
        return log.read_text().count("\n") if log.exists() else 0

    before = lines()
    request = service_pb2.ModelInferRequest(model_name="repeat")
    request.inputs.add(name="IN", datatype="INT32", shape=[50])
    request.inputs.add(name="DELAY", datatype="UINT32", shape=[50])
    request.raw_input_contents.append(np.arange(50, dtype="<i4").tobytes())
    request.raw_input_contents.append(np.full(50, 20, "<u4").tobytes())  # a second in all
    done = queue.Queue[None]()

    def requests() -> Iterator[object]:
        yield request
        done.get(timeout=30)  # keep the request side open until the test is finished

    with grpc.insecure_channel(kserve.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        responses = stub.ModelStreamInfer(requests())
        first = next(responses)
        assert first.error_message == ""
        responses.cancel()
        done.put(None)
    wait_for(lambda: lines() > before, what="the model to finish the request")
    sent, cancelled = map(int, log.read_text().splitlines()[-1].split())
    assert cancelled == 1 and sent < 50
