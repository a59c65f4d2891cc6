"""The TensorRT backend's CUDA layer on a real GPU, where TensorRT itself cannot be installed.

Marked ``gpu`` and skipped with the reason where cuda-python or a CUDA GPU is missing (every CI machine).
tests/test_tensorrt_gpu.py needs TensorRT too; the GPU machines lent to this project have CUDA but no
TensorRT (its library wheels come from NVIDIA's own index, which they cannot reach), so this file checks
what does not need TensorRT on real hardware:

* ``engine.Cuda`` (cuda-python) itself: pinned staging and copies, a client's shared-memory span mapped
  for the device and read and written in place (what a Jetson does with a frame), read-only mapping,
  and a refused registration that leaves no error behind for the next call;
* the whole TensorRT backend in the real daemon, with real device buffers, streams and copies, around a
  labelled test double of the ``tensorrt`` module (tests/tensorrt_standin: its engine copies each
  input to its output with cudaMemcpyAsync on the backend's stream), over the IPC client with inline
  tensors and with input and output in the client's shared memory, from several threads at once.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server.backends.tensorrt import engine, planning
from edge_server.client import Client
from edge_server.errors import BackendUnavailable, ModelExecutionError
from edge_server.platform import gpus
from tests.daemon import Daemon, gate_fifos, start_daemon, stop_daemon


def _cuda_missing() -> str:
    try:
        engine.Cuda(0)
    except (BackendUnavailable, ModelExecutionError) as exc:
        return exc.message
    return ""


MISSING = _cuda_missing()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(MISSING), reason=f"needs a CUDA GPU: {MISSING}")]

STANDIN = Path(__file__).parent / "tensorrt_standin"
ROW = 256 * 1024  # FP32 values per row: 1 MiB, at least planning.MIN_MAP_BYTES, so a Jetson maps it
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def cuda() -> engine.Cuda:
    return engine.Cuda(0)


def _span(data: bytes, *, read_only: bool = False) -> tuple[mmap.mmap, int]:
    """A client's shared-memory span (a sealed memfd, page-aligned), mapped here; and its address."""
    fd = os.memfd_create("edge-server-gpu-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, data)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        span = mmap.mmap(
            fd, len(data), prot=mmap.PROT_READ if read_only else mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fd)
    return span, np.frombuffer(span, np.uint8).ctypes.data


def _device_copy(cuda: engine.Cuda, dst: int, src: int, size: int, stream: object) -> None:
    """A copy the GPU makes between two device addresses (a mapped span's device address included)."""
    kind = cuda.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    cuda.call(cuda.rt.cudaMemcpyAsync, dst, src, size, kind, stream)


def _device_address(cuda: engine.Cuda, address: int) -> int:
    """Where the device reads registered host memory (the backend's choice, TensorRTBackend._map)."""
    return address if cuda.traits().host_pointer_is_device_pointer else cuda.device_pointer(address)


def _read_back(cuda: engine.Cuda, device: int, size: int, stream: object) -> bytes:
    """``size`` bytes of device memory, copied to the host once the stream's work is done."""
    back = np.zeros(size, np.uint8)
    cuda.copy_to_host(back.ctypes.data, device, size, stream)
    cuda.synchronize(stream)
    return back.tobytes()


def test_the_probe_finds_the_gpu_the_loader_sees(cuda: engine.Cuda) -> None:
    caps = engine.probe()
    assert caps.gpus >= 1 and caps.gpu_name, caps
    assert caps.cuda_driver and caps.cuda_runtime and caps.cuda_python, caps
    assert caps.traits == cuda.traits()
    assert 0 in gpus.gpu_ids(), "the device nodes do not show GPU 0, so instance_group would refuse it"
    if caps.traits is not None and not caps.traits.integrated:  # a discrete GPU: computed on the device
        assert not planning.output_in_host_memory(caps.traits)
        assert planning.output_staging(caps.traits, 0, 1 << 20) == planning.DEVICE_COPY
    if not caps.tensorrt:
        assert any("TensorRT" in reason for reason in caps.missing), caps.missing


def test_pinned_staging_round_trips_through_device_memory(cuda: engine.Cuda) -> None:
    size = 6 << 20  # a 1080p frame
    data = RNG.integers(0, 256, size, dtype=np.uint8)
    stream = cuda.create_stream()
    host, device = cuda.host_alloc(size), cuda.malloc(size)
    try:
        engine.host_view(host, size)[:] = data
        cuda.copy_to_device(device, host, size, stream)
        cuda.synchronize(stream)
        engine.host_view(host, size)[:] = 0
        span, address = _span(bytes(size))  # the output lands in a client's (pageable) span
        cuda.copy_to_host(address, device, size, stream)
        cuda.synchronize(stream)
        assert bytes(span) == data.tobytes()
        span.close()
    finally:
        cuda.free(device)
        cuda.free_host(host)
        cuda.destroy_stream(stream)


def test_a_clients_span_mapped_for_the_device_is_read_and_written_in_place(cuda: engine.Cuda) -> None:
    traits = cuda.traits()
    if not traits.host_register_supported:
        pytest.skip("this device cannot register host memory")
    size = 1 << 20
    data = RNG.integers(0, 256, size, dtype=np.uint8).tobytes()
    span, address = _span(data)
    stream = cuda.create_stream()
    device = cuda.malloc(size)
    try:
        cuda.register(address, size)
        try:
            mapped = _device_address(cuda, address)
            _device_copy(cuda, device, mapped, size, stream)  # the GPU reads the span itself
            cuda.call(cuda.rt.cudaMemsetAsync, mapped, 0x5A, size, stream)  # and writes into it
            cuda.synchronize(stream)
            assert bytes(span) == b"\x5a" * size
            assert _read_back(cuda, device, size, stream) == data
        finally:
            cuda.unregister(address)
    finally:
        cuda.free(device)
        cuda.destroy_stream(stream)
        span.close()


def test_a_read_only_span_is_mapped_only_where_the_device_allows_it(cuda: engine.Cuda) -> None:
    traits = cuda.traits()
    size = 1 << 20
    data = RNG.integers(0, 256, size, dtype=np.uint8).tobytes()
    span, address = _span(data, read_only=True)  # a sealed frame the daemon maps read-only
    try:
        if not traits.host_register_read_only:
            assert planning.input_staging(traits, address, size, read_only=True) == planning.PINNED_COPY
            return
        stream = cuda.create_stream()
        device = cuda.malloc(size)
        cuda.register(address, size, read_only=True)
        try:
            _device_copy(cuda, device, _device_address(cuda, address), size, stream)
            assert _read_back(cuda, device, size, stream) == data
        finally:
            cuda.unregister(address)
            cuda.free(device)
            cuda.destroy_stream(stream)
    finally:
        span.close()


def test_a_refused_registration_leaves_no_error_for_the_next_call(cuda: engine.Cuda) -> None:
    """The backend maps an output span and, when CUDA refuses (pages an input's registration already
    covers), copies instead: the refusal must not surface as the next unrelated call's error."""
    if not cuda.traits().host_register_supported:
        pytest.skip("this device cannot register host memory")
    size = 1 << 20
    span, address = _span(bytes(size))
    cuda.register(address, size)
    try:
        with pytest.raises(ModelExecutionError, match="cudaHostRegister"):
            cuda.register(address, size)
        (error,) = cuda.rt.cudaGetLastError()
        assert error == cuda.rt.cudaError_t.cudaSuccess
        stream = cuda.create_stream()
        cuda.free(cuda.malloc(4096))
        cuda.synchronize(stream)
        cuda.destroy_stream(stream)
    finally:
        cuda.unregister(address)
        span.close()


def test_a_failed_call_names_the_call_and_cudas_reason(cuda: engine.Cuda) -> None:
    with pytest.raises(ModelExecutionError, match=r"cudaMalloc failed: cudaErrorMemoryAllocation"):
        cuda.malloc(1 << 60)
    cuda.free(cuda.malloc(4096))  # and the device is still usable


# -- the TensorRT backend in the daemon, real CUDA around a stand-in engine -----------------------------


def _standin_plan(row: int, max_batch: int) -> bytes:
    tensor = {"data_type": "FLOAT", "shape": [-1, row]}
    profile = [[1, row], [4, row], [max_batch, row]]
    return json.dumps(
        {
            "edge_server_standin": 1,
            "num_profiles": 1,
            "copies": {"y": "x"},
            "tensors": [
                {"name": "x", "mode": "INPUT", "profiles": [profile], **tensor},
                {"name": "y", "mode": "OUTPUT", **tensor},
            ],
        }
    ).encode()


CONFIG = """
name: "copy"
platform: "tensorrt_plan"
max_batch_size: 8
input [{ name: "x" data_type: TYPE_FP32 dims: [ %(row)d ] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [ %(row)d ] }]
instance_group [{ kind: KIND_GPU count: 2 gpus: [ 0 ] }]
dynamic_batching { max_queue_delay_microseconds: 2000 }
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    repo = tmp_path_factory.mktemp("gpu_repo")
    (repo / "copy" / "1").mkdir(parents=True)
    (repo / "copy" / "config.pbtxt").write_text(CONFIG % {"row": ROW})
    (repo / "copy" / "1" / "model.plan").write_bytes(_standin_plan(ROW, 8))
    root = tmp_path_factory.mktemp("gpu_run")
    gate_fifos(root)
    path = os.pathsep.join(p for p in (str(STANDIN), os.environ.get("PYTHONPATH", "")) if p)
    proc = start_daemon(root, repo, "gpu.sock", env={**os.environ, "PYTHONPATH": path})
    try:
        yield proc
    finally:
        assert stop_daemon(proc) == 0, proc.log()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=60) as c:
        yield c


def test_the_backend_serves_on_the_gpu(client: Client, daemon: Daemon) -> None:
    (model,) = client.models()
    assert model["state"] == "READY", (model, daemon.log())
    assert "engine model.plan on cuda:0" in daemon.log()
    x = RNG.standard_normal((3, ROW)).astype(np.float32)
    assert client.infer("copy", {"x": x})["y"].tobytes() == x.tobytes()


def test_input_and_output_in_the_clients_shared_memory(client: Client) -> None:
    region = client.create_shm_region(8 * ROW * 4)
    try:
        for rows in (1, 2):
            x = RNG.standard_normal((rows, ROW)).astype(np.float32)
            ref = region.write(x)
            size = x.nbytes
            out = client.infer(
                "copy", {"x": ref}, outputs={"y": region.output(offset=4 * ROW * 4, byte_size=size)}
            )
            y = out["y"]
            assert y.tobytes() == x.tobytes()
            assert np.shares_memory(y, region.array(np.uint8, (size,), offset=4 * ROW * 4))
    finally:
        client.release_shm(region)


def test_concurrent_clients_each_get_their_own_rows_back(daemon: Daemon) -> None:
    """Six clients at once on two instances, each with its own CUDA stream and buffers: every answer
    holds the client's own rows, however the scheduler batched them."""
    failures: list[str] = []
    rows_sent = [0] * 6

    def one_client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(daemon.address, timeout=60) as c:
            for _ in range(25):
                x = rng.standard_normal((int(rng.integers(1, 3)), ROW)).astype(np.float32)
                rows_sent[seed] += len(x)
                if c.infer("copy", {"x": x})["y"].tobytes() != x.tobytes():
                    failures.append(f"client {seed}: rows of another request, or stale ones")

    with Client(daemon.address, timeout=60) as c:
        before = int(c.statistics("copy")[0]["inference_count"])
    threads = [threading.Thread(target=one_client, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    with Client(daemon.address, timeout=60) as c:
        after = int(c.statistics("copy")[0]["inference_count"])
    assert after - before == sum(rows_sent)
