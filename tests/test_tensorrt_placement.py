"""One model, instances on the GPU and on each DLA core, one queue: each instance loads the plan built for
its device (``model.plan`` on the GPU, ``model.dla.plan`` on a DLA core).

No GPU or DLA exists here, so the hardware layer (``engine.Cuda``, ``engine.TrtEngine``) is replaced by
labelled test doubles: :class:`HostCuda` from tests/test_tensorrt_shm_outputs.py (host memory stands for
device memory) and :class:`RecordingEngine` below (records which plan and DLA core each instance asked
for, computes ``y = 2 x`` on the CPU from the bound addresses).  Everything above it runs for real: the
config parser, instance groups, the loader, the fallback choice, placement, the scheduler and the server.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_server import ModelState, Server
from edge_server.backends.base import InstanceSpec
from edge_server.backends.tensorrt import cache, engine, planning
from edge_server.backends.tensorrt.description import EngineDescription, ProfileRange, TensorDescription
from edge_server.backends.tensorrt.placement import dla_plan_path, place, plan_for
from edge_server.errors import ConfigError
from tests.test_tensorrt_shm_outputs import HostCuda

JETSON = planning.DeviceTraits(
    integrated=True, can_map_host_memory=True, host_register_supported=True, page_size=mmap.PAGESIZE
)
CAPS = engine.Capabilities(tensorrt="10.3.0", gpus=1, gpu_name="test-double GPU", dla_cores=2, traits=JETSON)


def _description(max_batch: int, source: str, width: int = 4) -> EngineDescription:
    return EngineDescription(
        (
            TensorDescription(
                "x",
                "INPUT",
                "TYPE_FP32",
                (-1, width),
                (ProfileRange((1, width), (max_batch, width), (max_batch, width)),),
            ),
            TensorDescription("y", "OUTPUT", "TYPE_FP32", (-1, width)),
        ),
        1,
        source=source,
    )


class RecordingContext:
    """Test double of ``engine.TrtContext``: y = 2 x, read from and written to the bound addresses."""

    def __init__(self, profile: int, rows: list[tuple[int, ...]]) -> None:
        self.profile = profile
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.rows = rows

    def select_profile(self, stream: Any) -> None:
        pass

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> None:
        self.shapes[name] = shape
        self.rows.append(shape)

    def output_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes["x"]

    def set_address(self, name: str, address: int) -> None:
        self.addresses[name] = address

    def enqueue(self, stream: Any) -> None:
        size = int(np.prod(self.shapes["x"])) * 4
        x = engine.host_view(self.addresses["x"], size).view(np.float32)
        engine.host_view(self.addresses["y"], size).view(np.float32)[:] = 2 * x

    def close(self) -> None:
        pass


class RecordingEngine:
    """Test double of ``engine.TrtEngine``: records (plan name, DLA core) and the shapes it ran; the DLA
    plan takes batch 1, the GPU plan up to ``gpu_max_batch``."""

    version = "test-double"
    opened: list[tuple[str, int | None]] = []
    engines: list[RecordingEngine] = []
    gpu_max_batch = 1
    dla_width = 4

    def __init__(self, plan: Path, *, dla_core: int | None = None) -> None:
        RecordingEngine.opened.append((plan.name, dla_core))
        RecordingEngine.engines.append(self)
        self.plan = plan
        self.dla = plan.name.endswith(".dla.plan")
        self.rows: list[tuple[int, ...]] = []  # input shapes this engine's contexts were given

    def describe(self) -> EngineDescription:
        if self.dla:
            return _description(1, str(self.plan), RecordingEngine.dla_width)
        return _description(RecordingEngine.gpu_max_batch, str(self.plan))

    def create_context(self, profile: int) -> RecordingContext:
        return RecordingContext(profile, self.rows)

    def close(self) -> None:
        pass


MIXED = """
name: "det"
platform: "tensorrt_plan"
max_batch_size: 1
instance_group [
  { count: 1, kind: KIND_GPU },
  { count: 1, kind: KIND_GPU, secondary_devices [ { kind: KIND_NVDLA, device_id: 0 } ] },
  { count: 1, kind: KIND_GPU, secondary_devices [ { kind: KIND_NVDLA, device_id: 1 } ] }
]
"""


@pytest.fixture
def hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hardware layer replaced by the doubles (see the module docstring)."""
    RecordingEngine.opened = []
    RecordingEngine.engines = []
    RecordingEngine.gpu_max_batch = 1
    RecordingEngine.dla_width = 4
    monkeypatch.setattr(engine, "probe", lambda: CAPS)
    monkeypatch.setattr(engine, "Cuda", lambda device: HostCuda(JETSON))
    monkeypatch.setattr(engine, "TrtEngine", RecordingEngine)


def _repository(root: Path, *, dla_plan: bool = True) -> Path:
    version = root / "det" / "1"
    version.mkdir(parents=True)
    (root / "det" / "config.pbtxt").write_text(MIXED)
    (version / "model.plan").write_bytes(b"gpu plan (test double)")
    cache.write_record(version / "model.plan", cache.EngineKey("test-double GPU", None, "10.3.0", ""))
    if dla_plan:
        (version / "model.dla.plan").write_bytes(b"dla plan (test double)")
        cache.write_record(version / "model.dla.plan", cache.EngineKey("test-double GPU", 0, "10.3.0", ""))
    return root


def test_gpu_and_dla_instances_of_one_model_load_their_own_plans(hardware: None, tmp_path: Path) -> None:
    repo = _repository(tmp_path)
    with Server(repo) as server:
        (status,) = server.models()
        assert status.state == ModelState.READY, status.reason
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        for _ in range(6):  # one queue, three instances
            np.testing.assert_array_equal(server.infer("det", {"x": x})["y"], 2 * x)
    instances = [opened for opened in RecordingEngine.opened if opened != ("model.plan", None)]
    assert ("model.plan", None) in RecordingEngine.opened  # the GPU instance (and the config check)
    assert instances == [("model.dla.plan", 0), ("model.dla.plan", 1)]


def test_dla_instances_without_a_dla_plan_say_how_to_build_one(hardware: None, tmp_path: Path) -> None:
    repo = _repository(tmp_path, dla_plan=False)
    with Server(repo) as server:
        (status,) = server.models()
    assert status.state == ModelState.UNAVAILABLE
    assert "built for the GPU and no DLA plan (model.dla.plan)" in status.reason
    assert "--also-gpu" in status.reason


def test_batch_one_dla_plans_serve_a_batching_model_row_by_row(hardware: None, tmp_path: Path) -> None:
    """The GPU plan batches up to 4, the DLA plan takes 1 row: DLA instances run a batch in pieces.

    Only the DLA instances here (the config is still completed from model.plan), so that every request
    goes through the pieces; the mixed queue is the test above.
    """
    repo = _repository(tmp_path)
    config = repo / "det" / "config.pbtxt"
    text = config.read_text().replace("max_batch_size: 1", "max_batch_size: 4")
    config.write_text(text.replace("  { count: 1, kind: KIND_GPU },\n", ""))
    RecordingEngine.gpu_max_batch = 4
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with Server(repo) as server:
        (status,) = server.models()
        assert status.state == ModelState.READY, status.reason
        for _ in range(4):
            np.testing.assert_array_equal(server.infer("det", {"x": x})["y"], 2 * x)
    dla = [engine_ for engine_ in RecordingEngine.engines if engine_.dla]
    assert len(dla) == 2 and sum(len(e.rows) for e in dla) == 4 * 3  # three pieces of one row a request
    assert {shape for e in dla for shape in e.rows} == {(1, 4)}


def test_a_dla_plan_that_does_not_match_the_config_is_a_load_error(hardware: None, tmp_path: Path) -> None:
    repo = _repository(tmp_path)
    RecordingEngine.dla_width = 5
    with Server(repo) as server:
        (status,) = server.models()
    assert status.state == ModelState.UNAVAILABLE
    assert "model.dla.plan: input 'x' has dims [4] but the engine has [5]" in status.reason


def test_plan_for_each_device(tmp_path: Path) -> None:
    plan = tmp_path / "detector.plan"  # default_model_filename: the DLA plan follows its name
    plan.write_bytes(b"x")
    gpu, dla = InstanceSpec("d_0", "KIND_GPU"), InstanceSpec("d_1", "KIND_DLA", 1)
    assert dla_plan_path(plan) == tmp_path / "detector.dla.plan"
    assert plan_for(gpu, plan) == plan and plan_for(dla, plan) == plan  # no DLA plan: the model's
    dla_plan_path(plan).write_bytes(b"y")
    assert plan_for(gpu, plan) == plan and plan_for(dla, plan) == tmp_path / "detector.dla.plan"


def test_gpu_instance_on_a_dla_only_plan_names_the_fix() -> None:
    with pytest.raises(ConfigError, match="--also-gpu"):
        place(InstanceSpec("m_0", "KIND_GPU"), gpu_count=1, dla_cores=2, engine_dla_core=0, engine_known=True)


def test_batch_chunks() -> None:
    one = _description(1, "dla")
    assert planning.batch_chunks(one, 1) == [(0, 1)]
    assert planning.batch_chunks(one, 3) == [(0, 1), (1, 2), (2, 3)]
    four = _description(4, "gpu")
    assert planning.batch_chunks(four, 4) == [(0, 4)]
    assert planning.batch_chunks(four, 6) == [(0, 4), (4, 6)]
