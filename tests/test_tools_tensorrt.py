"""build-engine's plain parts (batch ranges, DLA rules, profile shapes, the atomic drop, the config it
writes) and doctor on this machine and on a recorded Jetson tree."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_server.backends.tensorrt import builder, engine
from edge_server.backends.tensorrt.description import load_description
from edge_server.cli import main
from edge_server.config import load_config_file
from edge_server.errors import ConfigError
from edge_server.tools import build_engine, doctor

DATA = Path(__file__).parent / "data"
HAS_GPU = engine.probe().usable


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """main() configures the root logger onto this test's captured stderr; put the old handlers back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "min_batch": 1,
        "opt_batch": None,
        "max_batch": None,
        "dla_core": None,
        "int8": False,
        "calib_images": None,
        "calib_cache": None,
    }
    base.update(kw)
    return argparse.Namespace(**base)


def test_batch_ranges() -> None:
    assert build_engine.batch_range(_args()) == (1, 8, 8)
    assert build_engine.batch_range(_args(max_batch=16, opt_batch=4)) == (1, 4, 16)
    assert build_engine.batch_range(_args(dla_core=0)) == (1, 1, 1)
    with pytest.raises(ConfigError, match="the DLA needs static shapes"):
        build_engine.batch_range(_args(dla_core=1, max_batch=4))
    with pytest.raises(ConfigError, match="1 <= min <= opt <= max"):
        build_engine.batch_range(_args(min_batch=4, max_batch=2))
    with pytest.raises(ConfigError, match="--int8 needs --calib-images"):
        build_engine.batch_range(_args(int8=True))


def test_profile_shapes() -> None:
    shapes = builder.profile_shapes([("input", (-1, 3, 64, 64)), ("scale", (1,))], (1, 4, 8))
    assert shapes == {"input": ((1, 3, 64, 64), (4, 3, 64, 64), (8, 3, 64, 64))}
    with pytest.raises(ConfigError, match="dynamic dimensions"):
        builder.profile_shapes([("images", (-1, 3, -1, -1))], (1, 1, 1))


def test_locate_and_next_version(tmp_path: Path) -> None:
    onnx = tmp_path / "repo" / "cnn" / "3" / "model.onnx"
    onnx.parent.mkdir(parents=True)
    (tmp_path / "repo" / "cnn" / "1").mkdir()
    args = argparse.Namespace(model=onnx, model_repository=None, name=None)
    assert build_engine.locate(args) == ((tmp_path / "repo").resolve(), "cnn")
    assert build_engine.next_version(tmp_path / "repo" / "cnn") == 4
    loose = argparse.Namespace(model=tmp_path / "det.onnx", model_repository=None, name=None)
    with pytest.raises(ConfigError, match="pass --model-repository"):
        build_engine.locate(loose)


def test_written_config_parses_and_matches_the_engine(tmp_path: Path) -> None:
    description = load_description(DATA / "tensorrt" / "cnn_fp16_two_profiles.json")
    config = build_engine.completed_config("cnn", description)
    target = build_engine.install(
        tmp_path / "cnn",
        2,
        {"model.plan": b"plan", "model.plan.json": b"{}"},
        build_engine.config_text(config, 1),
    )
    assert target == tmp_path / "cnn" / "2" and (target / "model.plan").read_bytes() == b"plan"
    assert [
        p.name for p in (tmp_path / "cnn").iterdir() if p.name.startswith(".")
    ] == []  # nothing left behind
    parsed, warnings = load_config_file(tmp_path / "cnn" / "config.pbtxt", default_name="cnn")
    assert parsed.backend == "tensorrt" and parsed.max_batch_size == 16 and warnings == []
    assert [(t.name, t.dims) for t in parsed.inputs] == [("input", (3, 64, 64))]
    (group,) = parsed.instance_groups
    assert [(d.kind, d.device_id) for d in group.secondary_devices] == [("KIND_NVDLA", 1)]
    with pytest.raises(ConfigError, match="already exists"):
        build_engine.install(tmp_path / "cnn", 2, {"model.plan": b"x"}, None)


@pytest.mark.skipif(HAS_GPU, reason="this machine has TensorRT and a GPU")
def test_build_engine_here_says_what_is_missing(
    example_repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    onnx = example_repository / "cnn" / "1" / "model.onnx"
    code = main(["build-engine", str(onnx), "--model-repository", str(tmp_path), "--fp16"])
    assert code == 1
    err = capsys.readouterr().err
    assert "BACKEND_UNAVAILABLE" in err and "the TensorRT backend cannot run here" in err
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_doctor_runs_here(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    checks = {c["device"]: c for c in report["checks"]}
    assert checks["cpu (onnxruntime)"]["status"] == "PASS" and checks["cpu (onnxruntime)"]["ms"] > 0
    if not HAS_GPU:
        assert checks["gpu (TensorRT)"]["status"] == "SKIP"
        assert report["found"]["tensorrt backend"].startswith("unavailable: ")
    assert "CPUExecutionProvider" in report["found"]["onnxruntime"]


def test_doctor_table_on_a_recorded_jetson_tree(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor.run(argparse.Namespace(json=False, root=DATA / "jetson_sysfs" / "agx_orin")) == 0
    out = capsys.readouterr().out
    assert "Jetson AGX Orin 64GB, JetPack 6.0 (L4T 36.3.0)" in out
    assert "MAXN (id 0, from status file)" in out
    assert "PASS  cpu (onnxruntime)" in out


def test_also_gpu_config_places_the_gpu_and_every_dla_core(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--also-gpu goes with --dla-core"):
        build_engine.batch_range(_args(also_gpu=True))
    assert build_engine.batch_range(_args(also_gpu=True, dla_core=0)) == (1, 8, 8)  # the GPU plan's range
    assert build_engine.dla_batch((1, 8, 8)) == (1, 1, 1)
    assert build_engine.batch_range(_args(also_gpu=True, dla_core=0, min_batch=4, max_batch=4)) == (4, 4, 4)
    with pytest.raises(ConfigError, match="cannot serve a queue that batches other sizes"):
        build_engine.batch_range(_args(also_gpu=True, dla_core=0, min_batch=2, max_batch=8))
    description = load_description(DATA / "tensorrt" / "cnn_fp16_two_profiles.json")
    config = build_engine.completed_config("cnn", description)
    path = tmp_path / "config.pbtxt"
    path.write_text(build_engine.config_text(config, 0, gpu_too=True, dla_cores=2))
    parsed, warnings = load_config_file(path, default_name="cnn")
    assert warnings == []
    assert [
        (g.kind, [(d.kind, d.device_id) for d in g.secondary_devices]) for g in parsed.instance_groups
    ] == [
        ("KIND_GPU", []),
        ("KIND_GPU", [("KIND_NVDLA", 0)]),
        ("KIND_GPU", [("KIND_NVDLA", 1)]),
    ]
    path.write_text(build_engine.config_text(config, None))
    (group,) = load_config_file(path, default_name="cnn")[0].instance_groups
    assert group.kind == "KIND_GPU" and group.secondary_devices == ()


class _CalibratorBase:
    """Test double of ``trt.IInt8EntropyCalibrator2`` (no TensorRT here): a plain base class."""

    def __init__(self) -> None:
        pass


FAKE_TRT = argparse.Namespace(IInt8EntropyCalibrator2=_CalibratorBase)  # test double of the tensorrt module


def test_int8_from_a_calibration_cache_alone(tmp_path: Path) -> None:
    table = tmp_path / "det.cache"
    table.write_bytes(b"TRT-8601-EntropyCalibration2\ninput: 3c010a14\n")
    options = builder.BuildOptions(int8=True, calibration_cache=table)
    assert builder.checked_options(options, print) == options
    calibrator = builder.calibrator_for(FAKE_TRT, network=None, options=options)
    assert isinstance(calibrator, _CalibratorBase)
    assert calibrator.read_calibration_cache() == table.read_bytes()
    assert calibrator.get_batch(["input"]) is None  # never asks for images
    calibrator.write_calibration_cache(b"other")
    assert table.read_bytes().startswith(b"TRT-8601")  # the cache it came from is kept
    missing = builder.BuildOptions(int8=True, calibration_cache=tmp_path / "nope.cache")
    with pytest.raises(ConfigError, match="nope.cache does not exist"):
        builder.checked_options(missing, print)


def test_dla_build_without_a_precision_is_fp16() -> None:
    lines: list[str] = []
    options = builder.checked_options(builder.BuildOptions(dla_core=0), lines.append)
    assert options.fp16 and not options.int8
    assert lines == ["the DLA runs FP16 or INT8 only: building FP16 (pass --fp16 or --int8 to choose)"]
    lines.clear()
    int8 = builder.BuildOptions(dla_core=1, int8=True, calibration_images=Path("calib"))
    assert builder.checked_options(int8, lines.append) == int8 and lines == []
    assert (
        builder.checked_options(builder.BuildOptions(), lines.append) == builder.BuildOptions()
    )  # GPU: FP32
