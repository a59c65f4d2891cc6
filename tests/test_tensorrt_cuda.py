"""The CUDA layer's own logic without a GPU: finding cuda-python in either package layout, and the checks
around the calls (registration flags, clearing CUDA's last error, TensorRT's refusal of a profile).

The modules and objects standing in for cuda-python and TensorRT here are labelled test doubles: no GPU
or TensorRT exists on this machine.  The real calls are checked by name against the real bindings in
tests/test_tensorrt_api.py and run on a device by tests/test_tensorrt_gpu.py.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from edge_server.backends.tensorrt import engine
from edge_server.errors import BackendUnavailable, ModelExecutionError

OLD_LAYOUT_DOUBLE = '''"""Test double of cuda-python before 12.6.1: the runtime API is cuda.cudart."""
LAYOUT = "cuda.cudart (test double)"
'''


def _hide_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "cuda" or n.startswith("cuda.")]:
        monkeypatch.delitem(sys.modules, name)


def test_old_cuda_python_layout_is_found(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    package = tmp_path / "cuda"
    package.mkdir()
    (package / "__init__.py").write_text('"""Test double of the cuda package of cuda-python 12.2."""\n')
    (package / "cudart.py").write_text(OLD_LAYOUT_DOUBLE)
    _hide_cuda(monkeypatch)
    monkeypatch.syspath_prepend(str(tmp_path))
    runtime = engine.import_cudart()
    assert runtime.LAYOUT == "cuda.cudart (test double)"


def test_neither_layout_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "cuda").mkdir()
    (tmp_path / "cuda" / "__init__.py").write_text('"""Test double: a cuda package with no runtime API."""\n')
    _hide_cuda(monkeypatch)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BackendUnavailable, match="cuda-python is not installed"):
        engine.import_cudart()


def test_installed_layout_and_version() -> None:
    from cuda.bindings import runtime

    assert engine.import_cudart() is runtime
    assert engine.cuda_python_version()[:2].isdigit()


# -- Cuda.register: read-only frames, CUDA's last error -------------------------------------------------


class _Error(Enum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorHostMemoryAlreadyRegistered = 712


class FakeRuntime:
    """Test double of ``cuda.bindings.runtime``: the names Cuda.register uses, calls recorded."""

    cudaError_t = _Error
    cudaHostRegisterMapped = 2
    cudaHostRegisterReadOnly = 8

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> tuple[Any]:  # noqa: N802
        self.calls.append(("cudaHostRegister", (pointer, size, flags)))
        return (_Error.cudaErrorHostMemoryAlreadyRegistered if self.refuse else _Error.cudaSuccess,)

    def cudaGetLastError(self) -> tuple[Any]:  # noqa: N802
        self.calls.append(("cudaGetLastError", ()))
        return (_Error.cudaSuccess,)

    def cudaGetErrorString(self, error: Any) -> tuple[Any, bytes]:  # noqa: N802
        return (_Error.cudaSuccess, b"part of the range was already registered")


def _cuda(runtime: FakeRuntime) -> engine.Cuda:
    cuda = engine.Cuda.__new__(engine.Cuda)  # without cudaSetDevice: no GPU here
    cuda.rt = runtime
    cuda.device = 0
    return cuda


def test_register_flags() -> None:
    runtime = FakeRuntime()
    cuda = _cuda(runtime)
    cuda.register(4096, 8192)
    cuda.register(4096, 8192, read_only=True)
    assert [args[2] for _, args in runtime.calls] == [2, 2 | 8]


def test_refused_registration_clears_cudas_last_error() -> None:
    runtime = FakeRuntime(refuse=True)
    with pytest.raises(ModelExecutionError, match="cudaErrorHostMemoryAlreadyRegistered"):
        _cuda(runtime).register(4096, 8192)
    assert [name for name, _ in runtime.calls] == ["cudaHostRegister", "cudaGetLastError"]


# -- TrtContext.select_profile ------------------------------------------------------------------------


class FakeExecutionContext:
    """Test double of ``trt.IExecutionContext``: refuses the profiles it is told to."""

    def __init__(self, refused: set[int]) -> None:
        self.refused = refused

    def set_optimization_profile_async(self, profile: int, stream: int) -> bool:
        return profile not in self.refused


def test_refused_profile_is_a_precise_error() -> None:
    engine.TrtContext(FakeExecutionContext(set()), 1).select_profile(7)
    with pytest.raises(ModelExecutionError, match="refused optimization profile 1"):
        engine.TrtContext(FakeExecutionContext({1}), 1).select_profile(7)


def test_fake_runtime_names_are_real() -> None:
    """The doubles above use only names the real binding has (else they would test nothing)."""
    from cuda.bindings import runtime

    for name in (
        "cudaHostRegisterMapped",
        "cudaHostRegisterReadOnly",
        "cudaGetLastError",
        "cudaHostRegister",
    ):
        assert hasattr(runtime, name), name
    assert hasattr(runtime.cudaDeviceAttr, "cudaDevAttrHostRegisterReadOnlySupported")
