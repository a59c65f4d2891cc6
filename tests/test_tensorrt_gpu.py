"""The TensorRT backend and build-engine on real hardware: marked ``gpu`` (and ``jetson`` for DLA), and
skipped with the reason where TensorRT, cuda-python or a CUDA GPU is missing.

Each builds a plan from the bundled cnn ONNX with ``build-engine`` and compares the TensorRT answers with
ONNX Runtime's on the same ONNX within FP16 tolerance.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_server import ModelState, Server
from edge_server.backends.tensorrt import cache, engine
from edge_server.backends.tensorrt.description import description_from_json
from edge_server.cli import main
from tests.daemon import start_daemon, wait_for

CAPS = engine.probe()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CAPS.usable, reason="needs TensorRT and a CUDA GPU: " + "; ".join(CAPS.missing)),
]
RTOL, ATOL = 2e-2, 2e-2  # FP16 engine against FP32 ONNX Runtime


@pytest.fixture(scope="module")
def plan_repository(tmp_path_factory: pytest.TempPathFactory, example_repository: Path) -> Path:
    """A repository whose cnn is built by build-engine: FP16, batch profile 1..16."""
    repo = tmp_path_factory.mktemp("trt")
    onnx = example_repository / "cnn" / "1" / "model.onnx"
    code = main(
        [
            "build-engine",
            str(onnx),
            "--model-repository",
            str(repo),
            "--name",
            "cnn",
            "--fp16",
            "--max-batch",
            "16",
        ]
    )
    assert code == 0
    return repo


def _reference(example_repository: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(example_repository / "cnn/1/model.onnx"))
    return session.run(None, {"input": x})[0]


def test_build_writes_plan_record_config_and_onnx(plan_repository: Path) -> None:
    version = plan_repository / "cnn" / "1"
    assert {p.name for p in version.iterdir()} == {"model.plan", "model.plan.json", "model.onnx"}
    record = cache.read_record(version / "model.plan")
    assert record is not None and record.tensorrt == CAPS.tensorrt and record.dla_core is None
    description = engine.TrtEngine(version / "model.plan").describe()
    assert description_from_json(description.to_json()) == description  # the recorded-data format holds
    assert [t.profiles[0].max[0] for t in description.inputs] == [16]


def test_load_and_infer_matches_onnxruntime(plan_repository: Path, example_repository: Path) -> None:
    rng = np.random.default_rng(0)
    with Server(plan_repository) as server:
        (status,) = server.models()
        assert status.state == ModelState.READY and status.reason == ""  # the plan serves, no fallback
        assert server.model_config("cnn").backend == "tensorrt"
        for batch in (1, 3, 16, 2):  # profile choice and buffer growth, then a smaller batch again
            x = rng.random((batch, 3, 64, 64), dtype=np.float32)
            out = server.infer("cnn", {"input": x})["logits"]
            np.testing.assert_allclose(out, _reference(example_repository, x), rtol=RTOL, atol=ATOL)


def test_two_instances_serve_one_queue(
    tmp_path: Path, plan_repository: Path, example_repository: Path
) -> None:
    config = plan_repository / "cnn" / "config.pbtxt"
    text = config.read_text().replace("count: 1, kind: KIND_GPU", "count: 2, kind: KIND_GPU")
    repo = tmp_path / "repo"
    (repo / "cnn").mkdir(parents=True)
    (repo / "cnn" / "config.pbtxt").write_text(text)
    shutil.copytree(plan_repository / "cnn" / "1", repo / "cnn" / "1")
    x = np.random.default_rng(1).random((1, 3, 64, 64), dtype=np.float32)
    expected = _reference(example_repository, x)
    with Server(repo) as server:
        futures = [server.submit("cnn", {"input": x}) for _ in range(64)]
        for future in futures:
            np.testing.assert_allclose(future.result(30)["logits"], expected, rtol=RTOL, atol=ATOL)
        assert server.models()[0].reason == ""


def test_shared_memory_outputs(tmp_path: Path, plan_repository: Path, example_repository: Path) -> None:
    from edge_server.client import Client

    daemon = start_daemon(tmp_path, plan_repository, "trt.sock")
    try:
        with Client(daemon.address, timeout=60) as client:
            region = client.create_shm_region(1 << 20)
            x = np.random.default_rng(2).random((4, 3, 64, 64), dtype=np.float32)
            out = client.infer(
                "cnn", {"input": region.write(x)}, outputs={"logits": region.output(offset=1 << 19)}
            )
            np.testing.assert_allclose(out["logits"], _reference(example_repository, x), rtol=RTOL, atol=ATOL)
            assert np.shares_memory(out["logits"], region.array(np.uint8, (160,), offset=1 << 19))
            # Written by the instance (DMA on a discrete GPU, pinned copy on Jetson), not the frontend.
            (status,) = [r for r in client.shm_status() if r["name"] == region.name]
            assert status["outputs"]["frontend"] == 0
            assert status["outputs"]["direct"] + status["outputs"]["copied"] == 1
            big = np.random.default_rng(3).random((16, 3, 64, 64), dtype=np.float32)
            frame = client.create_shm_region(8 << 20)  # page-aligned spans: mapped for the GPU on Jetson
            out = client.infer(
                "cnn", {"input": frame.write(big)}, outputs={"logits": frame.output(offset=4 << 20)}
            )
            np.testing.assert_allclose(
                out["logits"], _reference(example_repository, big), rtol=RTOL, atol=ATOL
            )
    finally:
        daemon.stop()


def _build_cnn_for_dla(example_repository: Path, repo: Path, *extra: str) -> int:
    """``edge-server build-engine`` of the example CNN for DLA core 0 (FP16, GPU fallback) into ``repo``."""
    onnx = example_repository / "cnn" / "1" / "model.onnx"
    return main(
        ["build-engine", str(onnx), "--model-repository", str(repo), "--name", "cnn"]
        + ["--fp16", "--dla-core", "0", "--gpu-fallback", *extra]
    )


@pytest.mark.jetson
@pytest.mark.skipif(CAPS.dla_cores == 0, reason="needs a DLA core (Jetson AGX Orin, Orin NX, Xavier)")
def test_dla_build_and_load(tmp_path: Path, example_repository: Path) -> None:
    assert _build_cnn_for_dla(example_repository, tmp_path) == 0
    x = np.random.default_rng(3).random((1, 3, 64, 64), dtype=np.float32)
    with Server(tmp_path) as server:
        (status,) = server.models()
        assert status.state == ModelState.READY, status.reason
        out = server.infer("cnn", {"input": x})["logits"]
    np.testing.assert_allclose(out, _reference(example_repository, x), rtol=5e-2, atol=5e-2)


def test_stale_plan_is_rebuilt_on_load(
    tmp_path: Path, plan_repository: Path, example_repository: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(plan_repository / "cnn", repo / "cnn")
    plan = repo / "cnn" / "1" / "model.plan"
    old = cache.read_record(plan)
    assert old is not None
    cache.write_record(
        plan, cache.EngineKey(old.device, None, "1.0.0", old.onnx_sha256)
    )  # "another TensorRT"
    with Server(repo, engine_build="on-load") as server:
        (status,) = server.models()
        assert "serving model.onnx through onnxruntime" in status.reason and "rebuilding" in status.reason
        wait_for(
            lambda: server.model_config("cnn").backend == "tensorrt", timeout=600, what="the rebuilt plan"
        )
        x = np.random.default_rng(4).random((2, 3, 64, 64), dtype=np.float32)
        out = server.infer("cnn", {"input": x})["logits"]
    np.testing.assert_allclose(out, _reference(example_repository, x), rtol=RTOL, atol=ATOL)
    assert cache.read_record(plan).tensorrt == CAPS.tensorrt  # type: ignore[union-attr]


@pytest.mark.jetson
@pytest.mark.skipif(CAPS.dla_cores == 0, reason="needs a DLA core (Jetson AGX Orin, Orin NX, Xavier)")
def test_gpu_and_dla_instances_of_one_model(tmp_path: Path, example_repository: Path) -> None:
    """build-engine --also-gpu: model.plan on the GPU, model.dla.plan on every DLA core, one queue."""
    assert _build_cnn_for_dla(example_repository, tmp_path, "--also-gpu") == 0
    version = tmp_path / "cnn" / "1"
    assert cache.read_record(version / "model.plan").dla_core is None  # type: ignore[union-attr]
    assert cache.read_record(version / "model.dla.plan").dla_core == 0  # type: ignore[union-attr]
    x = np.random.default_rng(5).random((1, 3, 64, 64), dtype=np.float32)
    with Server(tmp_path) as server:
        (status,) = server.models()
        assert status.state == ModelState.READY and status.reason == "", status.reason
        futures = [server.submit("cnn", {"input": x}) for _ in range(32)]
        for future in futures:
            np.testing.assert_allclose(
                future.result(60)["logits"], _reference(example_repository, x), rtol=5e-2, atol=5e-2
            )


def test_recordless_plan_tensorrt_cannot_read_serves_the_onnx(
    tmp_path: Path, example_repository: Path
) -> None:
    version = tmp_path / "cnn" / "1"
    version.mkdir(parents=True)
    (version / "model.plan").write_bytes(b"\0" * 4096)  # no record, not a plan: TensorRT refuses it
    shutil.copy(example_repository / "cnn/1/model.onnx", version / "model.onnx")
    (tmp_path / "cnn" / "config.pbtxt").write_text(
        'name: "cnn"\nplatform: "tensorrt_plan"\nmax_batch_size: 8\n'
    )
    with Server(tmp_path) as server:
        (status,) = server.models()
        assert status.state == ModelState.READY and "could not deserialize" in status.reason
