"""``edge-server doctor``: what this device is and whether each compute device really runs a model.

It prints what it found (module, JetPack/L4T, power mode, DLA cores, TensorRT, cuda-python, CUDA driver
and runtime, the GPU, whether host memory registration works, ONNX Runtime's execution providers), then
runs a tiny model on every device it can reach (ONNX Runtime on the CPU and on CUDA, TensorRT on the GPU
and on each DLA core) and reports pass, fail or skip with timings.  Anything absent is a skip with the
reason, never a crash: this is the first command a user with new hardware runs.
"""

from __future__ import annotations

import argparse
import json
import mmap
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_server.errors import EdgeServerError

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
_SHAPE = (1, 3, 16, 16)


@dataclass
class Check:
    device: str
    status: str
    detail: str
    ms: float | None = None


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor", help="report this device and run a tiny model on each compute device"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--root", type=Path, default=Path("/"), help=argparse.SUPPRESS)  # recorded trees
    parser.set_defaults(tool_run=run)


def tiny_onnx() -> bytes | None:
    """A 1x1 convolution + ReLU with a dynamic batch (runs on the DLA too); None without ``onnx``."""
    try:
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    weight = np.linspace(-1, 1, 8 * 3, dtype=np.float32).reshape(8, 3, 1, 1)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
            helper.make_node("Relu", ["c"], ["y"]),
        ],
        "doctor",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8, 16, 16])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _timed(fn: Callable[[], Any], repeat: int = 20) -> tuple[Any, float]:
    out = fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    return out, (time.perf_counter() - start) * 1000 / repeat


def _ort_check(
    device: str, provider: str, model: bytes | None, x: np.ndarray
) -> tuple[Check, np.ndarray | None]:
    import onnxruntime as ort

    if model is None:
        return Check(
            device, SKIP, "the 'onnx' package is not installed (pip install 'edge-server[dla]')"
        ), None
    if provider not in ort.get_available_providers():
        return Check(device, SKIP, f"onnxruntime has no {provider}"), None
    try:
        session = ort.InferenceSession(model, providers=[provider])
        out, ms = _timed(lambda: session.run(None, {"x": x})[0])
    except Exception as exc:  # report any runtime failure as this device's failure
        return Check(device, FAIL, f"{type(exc).__name__}: {exc}"), None
    return Check(device, PASS, f"onnxruntime {provider}", ms), out


def _host_registration() -> str:
    from edge_server.backends.tensorrt.engine import Cuda

    buffer = mmap.mmap(-1, 1 << 20)
    view = np.frombuffer(buffer, dtype=np.uint8)
    try:
        cuda = Cuda(0)
        cuda.register(view.ctypes.data, view.nbytes)
        cuda.device_pointer(view.ctypes.data)
        cuda.unregister(view.ctypes.data)
        read_only = "supported" if cuda.traits().host_register_read_only else "not supported (copied)"
        return f"works (mapped, page-aligned); read-only frames: {read_only}"
    except EdgeServerError as exc:
        return f"fails: {exc.message}"
    finally:
        del view
        buffer.close()


def _trt_check(device: str, model: bytes, dla_core: int | None, x: np.ndarray, expected: np.ndarray) -> Check:
    from edge_server.backends.base import InstanceSpec, LoadContext
    from edge_server.backends.tensorrt import builder
    from edge_server.backends.tensorrt.backend import TensorRTBackend
    from edge_server.backends.tensorrt.config_check import complete_from_engine
    from edge_server.backends.tensorrt.engine import TrtEngine
    from edge_server.config.model import ModelConfig

    try:
        with tempfile.TemporaryDirectory() as temp:
            onnx_path, plan = Path(temp) / "model.onnx", Path(temp) / "model.plan"
            onnx_path.write_bytes(model)
            batch = (1, 1, 1) if dla_core is not None else (1, 1, 4)
            options = builder.BuildOptions(
                fp16=True,
                dla_core=dla_core,
                gpu_fallback=True,
                workspace_bytes=64 << 20,
                profile={"x": tuple((b, 3, 16, 16) for b in batch)},  # type: ignore[dict-item]
            )
            started = time.perf_counter()
            result = builder.build(onnx_path, options, progress=lambda line: None)
            build_s = time.perf_counter() - started
            plan.write_bytes(result.plan)
            trt_engine = TrtEngine(plan, dla_core=dla_core)
            config = complete_from_engine(
                ModelConfig(name="doctor", backend="tensorrt"), trt_engine.describe()
            )
            trt_engine.close()
            kind = "KIND_GPU" if dla_core is None else "KIND_DLA"
            spec = InstanceSpec("doctor_0", kind, dla_core or 0)
            backend = TensorRTBackend(LoadContext(config, 1, Path(temp), plan, spec))
            try:
                out, ms = _timed(lambda: backend.run({"x": x}, ["y"])["y"])
            finally:
                backend.close()
    except Exception as exc:  # a device that fails is reported, not fatal
        message = exc.message if isinstance(exc, EdgeServerError) else f"{type(exc).__name__}: {exc}"
        return Check(device, FAIL, message)
    error = float(np.max(np.abs(out - expected)))
    if error > 2e-2:
        return Check(device, FAIL, f"differs from onnxruntime by {error:.3g} (FP16 tolerance 2e-2)", ms)
    fallback = f", {len(result.layers_on_gpu)} layer(s) on the GPU" if result.layers_on_gpu else ""
    return Check(
        device, PASS, f"TensorRT FP16, built in {build_s:.1f} s, max error {error:.1g}{fallback}", ms
    )


def collect(root: Path = Path("/")) -> dict[str, Any]:
    """Everything doctor reports, as data."""
    import onnxruntime as ort

    from edge_server.backends.tensorrt.engine import probe
    from edge_server.platform import platform_report

    caps = probe()
    platform = platform_report(
        root, runtime_dla_cores=caps.dla_cores if caps.tensorrt else None, run_nvpmodel=True
    )
    mode = platform.power_mode
    found = {
        "platform": platform.summary,
        "module": platform.module or "-",
        "jetpack": platform.jetpack or "-",
        "l4t": platform.l4t or "-",
        "power mode": f"{mode.name or '?'} (id {mode.id}, from {mode.source})" if mode else "-",
        "DLA cores": f"{platform.dla_cores} ({platform.dla_cores_source})" if platform.is_jetson else "-",
        "tensorrt": caps.tensorrt or "not installed",
        "cuda-python": caps.cuda_python or "not installed",
        "cuda driver / runtime": f"{caps.cuda_driver} / {caps.cuda_runtime}" if caps.cuda_driver else "-",
        "gpu": caps.gpu_name or "none found",
        "integrated gpu": str(caps.traits.integrated) if caps.traits else "-",
        "host registration": _host_registration() if caps.traits else "-",
        "onnxruntime": f"{ort.__version__}, providers {ort.get_available_providers()}",
    }
    if caps.missing:
        found["tensorrt backend"] = "unavailable: " + "; ".join(caps.missing)
    model = tiny_onnx()
    x = np.random.default_rng(0).random(_SHAPE, dtype=np.float32)
    cpu, expected = _ort_check("cpu (onnxruntime)", "CPUExecutionProvider", model, x)
    checks = [cpu, _ort_check("cuda (onnxruntime)", "CUDAExecutionProvider", model, x)[0]]
    if not caps.usable or model is None or expected is None:
        reason = "; ".join(caps.missing) or "no reference output from the CPU run"
        checks.append(Check("gpu (TensorRT)", SKIP, reason))
    else:
        checks.append(_trt_check("gpu (TensorRT)", model, None, x, expected))
        for core in range(caps.dla_cores):
            checks.append(_trt_check(f"dla:{core} (TensorRT)", model, core, x, expected))
    if caps.usable and caps.dla_cores == 0:
        checks.append(Check("dla (TensorRT)", SKIP, "TensorRT reports no DLA cores on this device"))
    return {
        "found": found,
        "checks": [asdict(c) for c in checks],
        "ok": all(c.status != FAIL for c in checks),
    }


def run(args: argparse.Namespace) -> int:
    report = collect(args.root)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        width = max(len(k) for k in report["found"])
        for key, value in report["found"].items():
            print(f"{key:<{width}}  {value}")
        print()
        for check in report["checks"]:
            timing = f"{check['ms']:.3f} ms" if check["ms"] is not None else "-"
            print(f"{check['status']:<4}  {check['device']:<20} {timing:>10}  {check['detail']}")
    return 0 if report["ok"] else 1
