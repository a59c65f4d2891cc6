"""--engine-build on-load: the background rebuilder's queue, atomic plan replacement, record, reload
callback and systemd notification.  The TensorRT build itself needs a GPU, so these tests hand the
rebuilder a labelled stand-in for ``builder.build`` that returns fixed bytes; the GPU path is in
tests/test_tensorrt_gpu.py."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from edge_server import Server
from edge_server.backends.tensorrt import cache, engine, fallback
from edge_server.backends.tensorrt.builder import BuildOptions, BuildResult
from edge_server.backends.tensorrt.rebuild import EngineRebuilder, Job, sd_notify
from edge_server.config.model import InstanceGroup, ModelConfig, SecondaryDevice
from edge_server.errors import InvalidArgument

USABLE = engine.Capabilities(tensorrt="10.3.0", gpus=1, gpu_name="Orin")  # what probe() says on a Jetson


class StandInBuild:
    """Replaces the GPU-only TensorRT build: records jobs, can block or fail on request."""

    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.called = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail = False

    def __call__(self, job: Job, progress: object) -> BuildResult:
        self.jobs.append(job)
        self.called.set()
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("builder exploded")
        return BuildResult(plan=b"new plan", tensorrt="10.3.0", layers_on_gpu=(), seconds=0.1)


def _job(tmp_path: Path) -> Job:
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    (tmp_path / "model.plan").write_bytes(b"old plan")
    return Job(
        "cnn", tmp_path / "model.onnx", tmp_path / "model.plan", "Orin", BuildOptions(fp16=True), (1, 8, 8)
    )


def test_rebuild_replaces_plan_and_record_then_reloads(tmp_path: Path) -> None:
    built = threading.Event()
    names: list[str] = []
    stand_in = StandInBuild()
    rebuilder = EngineRebuilder(lambda name: (names.append(name), built.set()), build=stand_in)
    try:
        job = _job(tmp_path)
        assert rebuilder.request(job)
        assert built.wait(10)
    finally:
        rebuilder.close()
    assert names == ["cnn"] and (tmp_path / "model.plan").read_bytes() == b"new plan"
    assert cache.read_record(job.plan) == cache.EngineKey("Orin", None, "10.3.0", cache.sha256_file(job.onnx))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.plan", "model.plan.json"]


def test_duplicate_requests_are_coalesced_and_failures_survived(tmp_path: Path) -> None:
    stand_in = StandInBuild()
    stand_in.release.clear()
    stand_in.fail = True
    calls: list[str] = []
    rebuilder = EngineRebuilder(calls.append, build=stand_in)
    try:
        job = _job(tmp_path)
        assert rebuilder.request(job)
        assert not rebuilder.request(job)  # queued or building: not twice
        stand_in.release.set()
        for _ in range(200):  # the failed job leaves the pending set; a new request is taken again
            if rebuilder.request(job):
                break
            threading.Event().wait(0.01)
        else:
            pytest.fail("the rebuilder did not recover from a failed build")
    finally:
        rebuilder.close()
    assert calls == [] and (tmp_path / "model.plan").read_bytes() == b"old plan"
    assert not rebuilder.request(job)  # closed


def test_fallback_queues_a_gpu_rebuild(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"onnx")  # no plan at all
    stand_in = StandInBuild()
    stand_in.release.clear()
    rebuilder = EngineRebuilder(lambda name: None, build=stand_in)
    try:
        config = ModelConfig(name="cnn", backend="tensorrt", max_batch_size=8)
        choice = fallback.choose(config, tmp_path, caps=USABLE, rebuilder=rebuilder)
        assert choice.config.backend == "onnxruntime"
        assert choice.note == (
            "serving model.onnx through onnxruntime: no model.plan; rebuilding the plan in the background "
            "(--engine-build on-load)"
        )
        dla = config.replace(
            instance_groups=(
                InstanceGroup(kind="KIND_GPU", secondary_devices=(SecondaryDevice("KIND_NVDLA", 0),)),
            )
        )
        assert (
            "DLA plans are not rebuilt on load"
            in fallback.choose(dla, tmp_path, caps=USABLE, rebuilder=rebuilder).note
        )
        assert stand_in.called.wait(10)  # the builder thread took the GPU job
    finally:
        stand_in.release.set()
        rebuilder.close()
    (job,) = stand_in.jobs
    assert job.batch == (1, 8, 8) and job.options.fp16 and job.device == "Orin"


def test_server_engine_build_option(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="engine_build must be one of"):
        Server(tmp_path, engine_build="always")
    with Server(tmp_path, engine_build="on-load") as server:
        assert server.models() == []
    assert not any(t.name == "edge-engine-build" for t in threading.enumerate())


def test_sd_notify_reaches_the_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        sd_notify("EXTEND_TIMEOUT_USEC=30000000")
        receiver.settimeout(5)
        assert receiver.recv(100) == b"EXTEND_TIMEOUT_USEC=30000000"
    monkeypatch.delenv("NOTIFY_SOCKET")
    sd_notify("ignored")  # not under systemd: nothing happens
    assert os.environ.get("NOTIFY_SOCKET") is None
