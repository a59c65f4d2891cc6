"""The TensorRT backend without a GPU: everything above the engine layer, against recorded engine
descriptions (labelled test data in tests/data/tensorrt), and the clear errors and ONNX fallback on a
machine without TensorRT."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edge_server import ModelState, Server
from edge_server.backends import backend_class
from edge_server.backends.base import InstanceSpec, LoadContext, TensorBackend
from edge_server.backends.tensorrt import cache, engine, fallback, planning
from edge_server.backends.tensorrt.config_check import complete_from_engine
from edge_server.backends.tensorrt.description import load_description
from edge_server.backends.tensorrt.placement import place
from edge_server.config import load_config_file
from edge_server.config.model import InstanceGroup, ModelConfig, SecondaryDevice, TensorSpec
from edge_server.errors import BackendUnavailable, ConfigError, InstanceFailed, InvalidArgument
from edge_server.loader import instance_specs
from edge_server.request import BatchItem
from edge_server.scheduler import inline
from edge_server.scheduler.scheduler import ModelScheduler
from edge_server.scheduler.stats import ModelStats

DATA = Path(__file__).parent / "data" / "tensorrt"
CNN = load_description(DATA / "cnn_fp16_two_profiles.json")
DIGITS_DLA = load_description(DATA / "digits_dla_static.json")
DETECTOR = load_description(DATA / "detector_fixed_batch.json")
HAS_GPU = engine.probe().usable


# -- optimization profiles --------------------------------------------------------------------------


@pytest.mark.parametrize(("batch", "profile"), [(1, 0), (4, 0), (5, 1), (16, 1)])
def test_smallest_profile_that_fits(batch: int, profile: int) -> None:
    assert planning.choose_profile(CNN, {"input": (batch, 3, 64, 64)}) == profile


def test_no_profile_fits() -> None:
    with pytest.raises(InvalidArgument, match="no optimization profile"):
        planning.choose_profile(CNN, {"input": (17, 3, 64, 64)})
    with pytest.raises(InvalidArgument, match="no optimization profile"):
        planning.choose_profile(CNN, {"input": (2, 3, 32, 32)})
    with pytest.raises(InvalidArgument, match="missing"):
        planning.choose_profile(CNN, {})


def test_static_engine_has_one_implicit_profile() -> None:
    assert planning.choose_profile(DIGITS_DLA, {"image": (1, 1, 8, 8)}) == 0
    with pytest.raises(InvalidArgument):
        planning.choose_profile(DIGITS_DLA, {"image": (2, 1, 8, 8)})


def test_max_batch_from_profiles() -> None:
    assert planning.max_batch_from_profiles(CNN) == 16
    assert planning.max_batch_from_profiles(DIGITS_DLA) == 0  # static: no batch axis
    assert planning.max_batch_from_profiles(DETECTOR) == 0  # profiles start at batch 2


# -- buffers ----------------------------------------------------------------------------------------


def test_buffers_grow_in_powers_of_two_up_to_the_engine_ceiling() -> None:
    ceiling = planning.ceiling_bytes(CNN, "input", 4)
    assert ceiling == 16 * 3 * 64 * 64 * 4
    sizer = planning.BufferSizer(ceiling=ceiling)
    one = 3 * 64 * 64 * 4
    assert sizer.grow_to(one) == 65536
    assert sizer.grow_to(one) is None  # same batch: kept
    assert sizer.grow_to(one // 2) is None  # smaller: never shrunk
    assert sizer.grow_to(5 * one) == 262144
    assert sizer.grow_to(16 * one) == ceiling  # capped at the largest the engine can take
    assert sizer.grow_to(ceiling) is None
    assert planning.BufferSizer(ceiling=0).grow_to(100) == 128  # outputs: no known ceiling
    assert planning.ceiling_bytes(CNN, "logits", 4) == 0


# -- host/device staging ----------------------------------------------------------------------------

JETSON = planning.DeviceTraits(integrated=True, can_map_host_memory=True, host_register_supported=True)
DESKTOP = planning.DeviceTraits(integrated=False, can_map_host_memory=True, host_register_supported=True)
FRAME = 1920 * 1080 * 3


@pytest.mark.parametrize(
    ("traits", "address", "size", "decision"),
    [
        (JETSON, 0x7F0000000000, FRAME, planning.MAP),  # a page-aligned frame in shared memory
        (JETSON, 0x7F0000000040, FRAME, planning.PINNED_COPY),  # not page-aligned
        (JETSON, 0x7F0000000000, 4096, planning.PINNED_COPY),  # too small to be worth pinning
        (DESKTOP, 0x7F0000000000, FRAME, planning.PINNED_COPY),  # discrete GPU: DMA from pinned memory
        (
            planning.DeviceTraits(integrated=True, can_map_host_memory=True, host_register_supported=False),
            0x7F0000000000,
            FRAME,
            planning.PINNED_COPY,
        ),
    ],
)
def test_input_staging(traits: planning.DeviceTraits, address: int, size: int, decision: str) -> None:
    assert planning.input_staging(traits, address, size) == decision


def test_outputs_live_in_mapped_host_memory_on_integrated_gpus() -> None:
    assert planning.output_in_host_memory(JETSON)
    assert not planning.output_in_host_memory(DESKTOP)


# -- config check and auto-complete -----------------------------------------------------------------


def test_auto_complete_from_engine() -> None:
    config = complete_from_engine(ModelConfig(name="cnn", backend="tensorrt", source="cnn"), CNN)
    assert config.max_batch_size == 16 and config.dynamic_batching is not None
    assert config.platform == "tensorrt_plan"
    assert config.inputs == (TensorSpec("input", "TYPE_FP32", (3, 64, 64)),)
    assert config.outputs == (TensorSpec("logits", "TYPE_FP32", (10,)),)
    static = complete_from_engine(ModelConfig(name="d", backend="tensorrt"), DIGITS_DLA)
    assert static.max_batch_size == 0 and static.inputs[0].dims == (1, 1, 8, 8)


def _cnn_config(**changes: object) -> ModelConfig:
    base = ModelConfig(
        name="cnn",
        backend="tensorrt",
        max_batch_size=8,
        inputs=(TensorSpec("input", "TYPE_FP32", (3, 64, 64)),),
        outputs=(TensorSpec("logits", "TYPE_FP32", (10,)),),
        source="cnn/config.pbtxt",
    )
    return base.replace(**changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_batch_size": 32}, "max_batch_size 32 exceeds the engine's optimization profiles"),
        (
            {"inputs": (TensorSpec("images", "TYPE_FP32", (3, 64, 64)),)},
            "input 'images' is not in the engine",
        ),
        (
            {"inputs": (TensorSpec("input", "TYPE_FP16", (3, 64, 64)),)},
            "has data_type TYPE_FP16 but the engine",
        ),
        ({"inputs": (TensorSpec("input", "TYPE_FP32", (3, 32, 32)),)}, "has dims [3, 32, 32] but the engine"),
        ({"outputs": (TensorSpec("logits", "TYPE_FP32", (10, 1)),)}, "output 'logits' has dims [10, 1]"),
    ],
)
def test_config_mismatches_are_load_errors(changes: dict[str, object], message: str) -> None:
    assert complete_from_engine(_cnn_config(), CNN).max_batch_size == 8
    with pytest.raises(ConfigError) as info:
        complete_from_engine(_cnn_config(**changes), CNN)
    assert message in info.value.message


def test_batching_config_against_an_engine_that_cannot_batch() -> None:
    config = ModelConfig(
        name="det",
        backend="tensorrt",
        max_batch_size=4,
        inputs=(TensorSpec("images", "TYPE_FP32", (3, -1, -1)),),
        outputs=(TensorSpec("boxes", "TYPE_FP32", (100, 4)),),
    )
    with pytest.raises(ConfigError, match="no batch axis"):
        complete_from_engine(config, DETECTOR)


# -- placement --------------------------------------------------------------------------------------

PLACEMENT_CONFIG = """
name: "multi"
platform: "tensorrt_plan"
max_batch_size: 0
instance_group [
  { count: 1, kind: KIND_GPU, gpus: [ 0 ] },
  { count: 1, kind: KIND_GPU, secondary_devices [ { kind: KIND_NVDLA, device_id: 0 } ] },
  { count: 1, kind: KIND_GPU, secondary_devices [ { kind: KIND_NVDLA, device_id: 1 } ] }
]
"""


class _FakeGpuBackend(TensorBackend):
    """Stands in for a backend class that reports a GPU (KIND_AUTO resolution only)."""

    @classmethod
    def gpu_available(cls) -> bool:
        return True


def test_instance_groups_resolve_to_gpu_and_dla_cores(tmp_path: Path) -> None:
    path = tmp_path / "config.pbtxt"
    path.write_text(PLACEMENT_CONFIG)
    config, _ = load_config_file(path, default_name="multi")
    specs = instance_specs(config, _FakeGpuBackend, cpu_count=4)
    assert [(s.kind, s.device_id) for s in specs] == [("KIND_GPU", 0), ("KIND_DLA", 0), ("KIND_DLA", 1)]
    placements = [
        place(s, gpu_count=1, dla_cores=2, engine_dla_core=None, engine_known=False).label for s in specs
    ]
    assert placements == ["cuda:0", "dla:0", "dla:1"]
    auto = instance_specs(config.replace(instance_groups=()), _FakeGpuBackend, cpu_count=4)
    assert [(s.kind, s.device_id) for s in auto] == [("KIND_GPU", 0)]  # KIND_AUTO picks the GPU


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        (InstanceSpec("m_0", "KIND_CPU"), {}, "not KIND_CPU"),
        (InstanceSpec("m_0", "KIND_GPU", 1), {}, "asks for GPU 1 but this machine has 1 GPU"),
        (InstanceSpec("m_0", "KIND_DLA", 2), {}, "DLA core 2 but this device has 2 DLA core(s)"),
        (InstanceSpec("m_0", "KIND_DLA", 0), {"dla_cores": 0}, "this device has no DLA"),
        (InstanceSpec("m_0", "KIND_GPU"), {"engine_dla_core": 0}, "built for the DLA (core 0)"),
        (InstanceSpec("m_0", "KIND_DLA", 1), {"engine_dla_core": None}, "engine was built for the GPU"),
        (InstanceSpec("m_0", "KIND_GPU"), {"gpu_count": 0}, "no CUDA GPU"),
    ],
)
def test_placement_mismatches(spec: InstanceSpec, kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"gpu_count": 1, "dla_cores": 2, "engine_dla_core": None, "engine_known": True}
    args.update(kwargs)
    with pytest.raises(ConfigError) as info:
        place(spec, **args)  # type: ignore[arg-type]
    assert message in info.value.message


def test_dla_engine_loads_on_any_existing_core() -> None:
    spec = InstanceSpec("m_0", "KIND_DLA", 1)
    assert place(spec, gpu_count=1, dla_cores=2, engine_dla_core=0, engine_known=True).label == "dla:1"


# -- engine cache record ----------------------------------------------------------------------------


def test_engine_record_and_mismatches(tmp_path: Path) -> None:
    plan, onnx = tmp_path / "model.plan", tmp_path / "model.onnx"
    plan.write_bytes(b"plan")
    onnx.write_bytes(b"onnx v1")
    key = cache.EngineKey("Jetson AGX Orin 64GB", 0, "10.3.0", cache.sha256_file(onnx))
    cache.write_record(plan, key)
    assert cache.read_record(plan) == key
    assert cache.mismatches(key, device="Jetson AGX Orin 64GB", tensorrt="10.3.0.26", onnx=onnx) == []
    reasons = cache.mismatches(key, device="Jetson Orin NX 16GB", tensorrt="8.6.2", onnx=onnx)
    assert reasons == [
        "the plan was built with TensorRT 10.3.0; this machine has TensorRT 8.6.2",
        "the plan was built on 'Jetson AGX Orin 64GB'; this device is 'Jetson Orin NX 16GB'",
    ]
    onnx.write_bytes(b"onnx v2")
    assert cache.mismatches(key, device="", tensorrt="", onnx=onnx) == [
        "model.onnx changed since the plan was built from it"
    ]
    cache.record_path(plan).write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable engine record"):
        cache.read_record(plan)
    assert cache.read_record(tmp_path / "other.plan") is None


# -- without TensorRT: clear errors, ONNX fallback --------------------------------------------------


def test_registered_and_importable_without_tensorrt() -> None:
    cls = backend_class("tensorrt")
    assert cls.__name__ == "TensorRTBackend" and cls.allows_inline is False


@pytest.mark.skipif(HAS_GPU, reason="this machine has TensorRT and a GPU")
def test_missing_tensorrt_is_named() -> None:
    caps = engine.probe()
    assert not caps.usable
    text = "; ".join(caps.missing)
    assert "TensorRT not installed" in text or "CUDA" in text
    with pytest.raises(BackendUnavailable, match="the TensorRT backend cannot run here"):
        backend_class("tensorrt").complete_config(
            ModelConfig(name="m", backend="tensorrt"), Path("model.plan")
        )


def _plan_repository(root: Path, example_repository: Path, *, with_onnx: bool, dla: bool = False) -> Path:
    version = root / "cnn" / "1"
    version.mkdir(parents=True)
    (version / "model.plan").write_bytes(b"not a real plan: only a GPU machine could build one")
    groups = (
        "instance_group [ { count: 1, kind: KIND_GPU,"
        " secondary_devices [ { kind: KIND_NVDLA, device_id: 0 } ] } ]"
        if dla
        else ""
    )
    (root / "cnn" / "config.pbtxt").write_text(
        f'name: "cnn"\nplatform: "tensorrt_plan"\nmax_batch_size: 8\n{groups}\n'
    )
    if with_onnx:
        shutil.copy(example_repository / "cnn/1/model.onnx", version / "model.onnx")
    return root


@pytest.mark.skipif(HAS_GPU, reason="this machine has TensorRT and a GPU: the plan would be tried")
def test_plan_with_onnx_serves_the_onnx(tmp_path: Path, example_repository: Path) -> None:
    repo = _plan_repository(tmp_path, example_repository, with_onnx=True, dla=True)
    with Server(repo) as server:
        (status,) = server.models()
        assert status.state == ModelState.READY
        assert status.reason.startswith("serving model.onnx through onnxruntime: ")
        assert server.model_config("cnn").backend == "onnxruntime"
        x = np.random.default_rng(0).random((2, 3, 64, 64), dtype=np.float32)
        out = server.infer("cnn", {"input": x})["logits"]
    expected = ort.InferenceSession(str(repo / "cnn/1/model.onnx")).run(None, {"input": x})[0]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(HAS_GPU, reason="this machine has TensorRT and a GPU: the plan would be tried")
def test_plan_and_onnx_without_config(tmp_path: Path, example_repository: Path) -> None:
    version = tmp_path / "cnn" / "1"
    version.mkdir(parents=True)
    (version / "model.plan").write_bytes(b"not a real plan")
    shutil.copy(example_repository / "cnn/1/model.onnx", version / "model.onnx")
    with Server(tmp_path) as server:
        (status,) = server.models()
        assert status.state == ModelState.READY and "serving model.onnx through onnxruntime" in status.reason
        config = server.model_config("cnn")
    assert (config.backend, config.max_batch_size) == ("onnxruntime", 4)  # auto-completed from the ONNX


@pytest.mark.skipif(HAS_GPU, reason="this machine has TensorRT and a GPU: the plan would be tried")
def test_plan_alone_says_what_is_missing(tmp_path: Path, example_repository: Path) -> None:
    repo = _plan_repository(tmp_path, example_repository, with_onnx=False)
    with Server(repo) as server:
        (status,) = server.models()
    assert status.state == ModelState.UNAVAILABLE
    assert "model.plan cannot serve here" in status.reason
    assert "TensorRT not installed" in status.reason or "CUDA" in status.reason


def test_fallback_reasons_for_a_stale_plan(tmp_path: Path) -> None:
    (tmp_path / "model.plan").write_bytes(b"plan")
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    cache.write_record(tmp_path / "model.plan", cache.EngineKey("Orin", None, "8.6.2", "0" * 64))
    caps = engine.Capabilities(tensorrt="10.3.0", gpus=1, gpu_name="Orin")
    config = ModelConfig(name="m", backend="tensorrt", instance_groups=())
    choice = fallback.choose(config, tmp_path, caps=caps)
    assert choice.config.backend == "onnxruntime" and choice.config.model_filename == "model.onnx"
    assert "built with TensorRT 8.6.2; this machine has TensorRT 10.3.0" in choice.note
    assert "model.onnx changed since the plan was built" in choice.note
    (tmp_path / "model.onnx").unlink()
    with pytest.raises(BackendUnavailable, match="built with TensorRT 8.6.2"):
        fallback.choose(config, tmp_path, caps=caps)
    cache.record_path(tmp_path / "model.plan").unlink()
    assert fallback.choose(config, tmp_path, caps=caps).note == ""  # no record: TensorRT decides


# -- the scheduler never runs a TensorRT instance on the caller's thread ----------------------------


class _Recorder(TensorBackend):
    """A CPU test double with TensorRT's opt-out; records which thread ran it."""

    allows_inline = False

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.output_names = ("y",)
        self.batched = False

    @classmethod
    def complete_config(cls, config: ModelConfig, model_path: Path) -> ModelConfig:
        return config

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        self.threads.append(threading.current_thread().name)
        return {"y": inputs["x"]}

    def close(self) -> None:
        pass


def test_gpu_instances_never_run_inline() -> None:
    config = ModelConfig(
        name="gpu",
        backend="tensorrt",
        inputs=(TensorSpec("x", "TYPE_FP32", (1,)),),
        outputs=(TensorSpec("y", "TYPE_FP32", (1,)),),
    )
    backend = _Recorder()
    scheduler = ModelScheduler(config, [("gpu_0", backend)], ModelStats("gpu", 1))
    try:
        for _ in range(50):  # enough for the scheduler to measure the model as cheap
            item = BatchItem(inputs={"x": np.ones(1, np.float32)}, batch_size=1, requested_outputs=("y",))
            scheduler.submit(item, ((1,),), budget=inline.FRONTEND).result(timeout=5)
    finally:
        scheduler.stop()
    assert backend.threads and all(name == "edge-gpu_0" for name in backend.threads)


def test_load_context_type_is_what_the_backend_takes() -> None:
    assert LoadContext.__dataclass_fields__.keys() >= {"config", "model_path", "instance"}


# -- an instance whose device context is lost is replaced while the others serve ----------------------


class _LostContext(TensorBackend):
    """Stands in for a TensorRT instance whose CUDA context dies (sticky error) after ``healthy_runs``."""

    allows_inline = False  # as TensorRT's

    def __init__(self, tag: float, healthy_runs: int = 10**9) -> None:
        self.tag = tag
        self.left = healthy_runs
        self.closed = 0
        self.output_names = ("y",)
        self.batched = False

    @classmethod
    def complete_config(cls, config: ModelConfig, model_path: Path) -> ModelConfig:
        return config

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        if self.left <= 0:
            raise InstanceFailed(
                "cudaStreamSynchronize failed: cudaErrorIllegalAddress: an illegal memory access"
            )
        self.left -= 1
        return {"y": np.full(1, self.tag, np.float32)}

    def close(self) -> None:
        self.closed += 1


def _one_instance_config() -> ModelConfig:
    return ModelConfig(
        name="gpu",
        backend="tensorrt",
        inputs=(TensorSpec("x", "TYPE_FP32", (1,)),),
        outputs=(TensorSpec("y", "TYPE_FP32", (1,)),),
    )


def _ask(scheduler: ModelScheduler) -> dict[str, np.ndarray] | Exception:
    item = BatchItem(inputs={"x": np.ones(1, np.float32)}, batch_size=1, requested_outputs=("y",))
    future = scheduler.submit(item, ((1,),))
    try:
        return future.result(timeout=10)
    except Exception as exc:
        return exc


def test_failed_instance_is_replaced() -> None:
    broken = _LostContext(tag=1.0, healthy_runs=1)
    fresh = _LostContext(tag=2.0)
    reloaded: list[int] = []

    def restart(index: int) -> TensorBackend:
        reloaded.append(index)
        return fresh

    scheduler = ModelScheduler(
        _one_instance_config(), [("gpu_0", broken)], ModelStats("gpu", 1), restart=restart
    )
    try:
        first, second = _ask(scheduler), _ask(scheduler)
        assert isinstance(first, dict) and first["y"][0] == 1.0
        assert isinstance(second, InstanceFailed) and second.code == "INSTANCE_FAILED"
        third = _ask(scheduler)  # served by the replacement (after the restart back-off)
        assert isinstance(third, dict) and third["y"][0] == 2.0
    finally:
        scheduler.stop()
    assert reloaded == [0] and broken.closed == 1 and fresh.closed == 1  # each closed exactly once


def test_instance_that_cannot_be_reloaded_leaves_service_and_the_others_serve() -> None:
    broken = _LostContext(tag=1.0, healthy_runs=0)
    healthy = _LostContext(tag=3.0)

    def restart(index: int) -> TensorBackend:
        raise BackendUnavailable("the GPU is gone")

    scheduler = ModelScheduler(
        _one_instance_config(), [("gpu_0", broken), ("gpu_1", healthy)], ModelStats("gpu", 1), restart=restart
    )
    try:
        answers = [_ask(scheduler) for _ in range(40)]
    finally:
        scheduler.stop()
    failures = [a for a in answers if isinstance(a, Exception)]
    assert len(failures) <= 1 and all(isinstance(a, InstanceFailed) for a in failures)
    assert all(a["y"][0] == 3.0 for a in answers if isinstance(a, dict))
    assert broken.closed == 1 and healthy.closed == 1


# -- a plan without its record that TensorRT cannot deserialize falls back to the ONNX ----------------


class _DeserializingEngine:
    """Test double of ``engine.TrtEngine`` (no TensorRT here): deserializes only bytes it recognizes,
    and fails on anything else the way the real one does when ``deserialize_cuda_engine`` returns None."""

    GOOD = b"plan (test double)"

    def __init__(self, plan: Path, *, dla_core: int | None = None) -> None:
        if plan.read_bytes() != self.GOOD:
            raise ConfigError(
                f"{plan}: TensorRT 10.3.0 could not deserialize this plan; plans are tied to the TensorRT "
                "version and the device they were built on: rebuild it with 'edge-server build-engine'"
            )

    def close(self) -> None:
        pass


USABLE = engine.Capabilities(tensorrt="10.3.0", gpus=1, gpu_name="test-double GPU")


def test_recordless_plan_that_does_not_deserialize_serves_the_onnx(
    tmp_path: Path, example_repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine, "probe", lambda: USABLE)
    monkeypatch.setattr(engine, "TrtEngine", _DeserializingEngine)
    repo = _plan_repository(tmp_path, example_repository, with_onnx=True)  # garbage plan, no record
    with Server(repo) as server:
        (status,) = server.models()
        assert status.state == ModelState.READY, status.reason
        assert status.reason.startswith("serving model.onnx through onnxruntime: model.plan has no engine")
        assert "could not deserialize this plan" in status.reason
        x = np.random.default_rng(1).random((2, 3, 64, 64), dtype=np.float32)
        out = server.infer("cnn", {"input": x})["logits"]
    expected = ort.InferenceSession(str(repo / "cnn/1/model.onnx")).run(None, {"input": x})[0]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_recordless_plan_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine, "TrtEngine", _DeserializingEngine)
    config = ModelConfig(name="m", backend="tensorrt", instance_groups=())
    (tmp_path / "model.plan").write_bytes(_DeserializingEngine.GOOD)
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    assert fallback.choose(config, tmp_path, caps=USABLE).note == ""  # it deserializes: the plan serves
    (tmp_path / "model.plan").write_bytes(b"from trtexec on another TensorRT")
    assert "could not deserialize" in fallback.choose(config, tmp_path, caps=USABLE).note
    (tmp_path / "model.onnx").unlink()
    assert fallback.choose(config, tmp_path, caps=USABLE).note == ""  # nothing to fall back to: load says


def test_stale_dla_plan_of_a_mixed_model_falls_back(tmp_path: Path) -> None:
    (tmp_path / "model.plan").write_bytes(b"gpu")
    (tmp_path / "model.dla.plan").write_bytes(b"dla")
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    cache.write_record(tmp_path / "model.plan", cache.EngineKey("test-double GPU", None, "10.3.0", ""))
    cache.write_record(tmp_path / "model.dla.plan", cache.EngineKey("test-double GPU", 0, "8.6.2", ""))
    mixed = ModelConfig(
        name="m",
        backend="tensorrt",
        instance_groups=(
            InstanceGroup(kind="KIND_GPU"),
            InstanceGroup(kind="KIND_GPU", secondary_devices=(SecondaryDevice("KIND_NVDLA", 0),)),
        ),
    )
    note = fallback.choose(mixed, tmp_path, caps=USABLE).note
    assert "model.dla.plan: the plan was built with TensorRT 8.6.2" in note
    gpu_only = mixed.replace(instance_groups=(InstanceGroup(kind="KIND_GPU"),))
    assert fallback.choose(gpu_only, tmp_path, caps=USABLE).note == ""  # no DLA instance: not its plan
