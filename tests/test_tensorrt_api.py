"""Every TensorRT and CUDA name the TensorRT backend and the engine builder use exists in the real
bindings: TensorRT 8.6.1 (JetPack 6.0) and 10.3.0 (JetPack 6.1/6.2) member lists (tests/data/tensorrt-api,
read with dir() from the official bindings), and the installed cuda-python's ``cuda.bindings.runtime``.

The sources are read, not imported: each attribute reached from a TensorRT object is checked against the
class that object is, by the name it has in the code.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [
    ROOT / "edge_server/backends/tensorrt/engine.py",
    ROOT / "edge_server/backends/tensorrt/builder.py",
]
API = {
    version: json.loads((Path(__file__).parent / f"data/tensorrt-api/api_{version}.json").read_text())
    for version in ("8.6.1", "10.3.0")
}

# What each name in the sources refers to: the tensorrt module, or an instance of a TensorRT class.
RECEIVERS = {
    "trt": "module",
    "self._trt": "module",
    "self._runtime": "Runtime",
    "runtime": "Runtime",
    "self._engine": "ICudaEngine",
    "engine": "ICudaEngine",
    "self._context": "IExecutionContext",
    "builder": "Builder",
    "config": "IBuilderConfig",
    "network": "INetworkDefinition",
    "parser": "OnnxParser",
    "profile": "IOptimizationProfile",
    "layer": "ILayer",
}
CUDA_RECEIVERS = {"self.rt", "cuda.rt"}
# Attributes of the tensorrt module's own types that the member lists do not cover (nested classes).
NESTED_OK = {("Logger", "WARNING"), ("Logger", "ERROR"), ("IInt8EntropyCalibrator2", "__init__")}
# The member lists leave dunder names out; every tensorrt release has __version__.
MODULE_DUNDERS = {"__version__"}


def dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _annotate_parents(tree: ast.AST) -> None:
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent  # type: ignore[attr-defined]


def problems_in(source: str) -> list[str]:
    """Names the source uses that are missing from either TensorRT version or from cuda-python."""
    from cuda.bindings import runtime

    tree = ast.parse(source)
    _annotate_parents(tree)
    found = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(getattr(node, "parent", None), ast.Attribute):
            continue  # only the outermost attribute of each chain
        chain: list[str] = []
        current: ast.AST = node
        while isinstance(current, ast.Attribute):
            chain.insert(0, current.attr)
            receiver = dotted(current.value)
            if receiver in RECEIVERS or receiver in CUDA_RECEIVERS:
                key = (receiver, tuple(chain))
                if key not in seen:
                    seen.add(key)
                    found.extend(_check(RECEIVERS.get(receiver, "cuda"), tuple(chain), node.lineno, runtime))
                break
            current = current.value
    return found


def _check(kind: str, chain: tuple[str, ...], line: int, runtime: object) -> list[str]:
    errors = []
    if kind == "cuda":
        target: object = runtime
        for part in chain:
            if not hasattr(target, part):
                errors.append(f"line {line}: cuda.bindings.runtime has no {'.'.join(chain)}")
                break
            target = getattr(target, part)
        return errors
    for version, api in API.items():
        removed = {
            cls: set(API["8.6.1"]["classes"][cls]) - set(API["10.3.0"]["classes"][cls])
            for cls in API["8.6.1"]["classes"]
        }
        if kind == "module":
            name = chain[0]
            if name in MODULE_DUNDERS:
                continue
            if name not in api["module"]:
                errors.append(f"line {line}: tensorrt {version} has no trt.{name}")
            elif len(chain) > 1 and name in api["enums"] and chain[1] not in api["enums"][name]:
                errors.append(f"line {line}: tensorrt {version} enum {name} has no {chain[1]}")
            elif len(chain) > 1 and name in api["classes"] and chain[1] not in api["classes"][name]:
                errors.append(f"line {line}: tensorrt {version} {name} has no {chain[1]}")
            elif (
                len(chain) > 1
                and name not in api["enums"]
                and name not in api["classes"]
                and (name, chain[1]) not in NESTED_OK
            ):
                errors.append(f"line {line}: trt.{'.'.join(chain)} is not covered by the member lists")
        else:
            name = chain[0]
            if name not in api["classes"][kind]:
                errors.append(f"line {line}: tensorrt {version} {kind} has no {name}")
            if name in removed.get(kind, set()):
                errors.append(f"line {line}: {kind}.{name} was removed in TensorRT 10")
    return errors


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_tensorrt_and_cuda_name_exists(path: Path) -> None:
    assert problems_in(path.read_text()) == []


def test_the_sources_use_the_name_based_api() -> None:
    """The checker sees the calls that matter (a checker that saw nothing would pass anything)."""
    text = SOURCES[0].read_text() + SOURCES[1].read_text()
    for name in (
        "num_io_tensors",
        "get_tensor_name",
        "get_tensor_mode",
        "get_tensor_shape",
        "get_tensor_dtype",
        "get_tensor_profile_shape",
        "set_input_shape",
        "set_tensor_address",
        "execute_async_v3",
        "DLA_core",
        "build_serialized_network",
        "can_run_on_DLA",
        "set_memory_pool_limit",
        "cudaHostRegister",
        "cudaMemcpyAsync",
        "set_optimization_profile_async",
        "cudaHostRegisterReadOnly",
        "cudaDevAttrHostRegisterReadOnlySupported",
        "cudaGetLastError",
    ):
        assert f".{name}" in text, name


def test_no_name_removed_in_tensorrt_10_appears_anywhere() -> None:
    removed = set()
    for cls, names in API["8.6.1"]["classes"].items():
        removed |= set(names) - set(API["10.3.0"]["classes"][cls])
    removed -= {"max_batch_size"}  # also a ModelConfig field name in this project; checked per class above
    for path in SOURCES + [ROOT / "edge_server/backends/tensorrt/backend.py"]:
        text = path.read_text()
        assert [name for name in sorted(removed) if f".{name}(" in text or f".{name} " in text] == []


def test_the_checker_catches_removed_and_unknown_names() -> None:
    bad = (
        "def f(trt, self):\n"
        "    self._context.execute_async_v2([], 0)\n"
        "    self._engine.get_binding_shape(0)\n"
        "    config.max_workspace_size = 1\n"
        "    trt.TensorIOMode.BOTH\n"
        "    self.rt.cudaNoSuchCall()\n"
        "    builder.build_engine(network, config)\n"
    )
    problems = "\n".join(problems_in(bad))
    assert "IExecutionContext has no execute_async_v2" in problems
    assert "ICudaEngine.get_binding_shape was removed in TensorRT 10" in problems
    assert "IBuilderConfig.max_workspace_size was removed in TensorRT 10" in problems
    assert "enum TensorIOMode has no BOTH" in problems
    assert "cuda.bindings.runtime has no cudaNoSuchCall" in problems
    assert "Builder.build_engine was removed" in problems


def test_sticky_cuda_error_names_exist() -> None:
    from cuda.bindings import runtime

    from edge_server.backends.tensorrt.engine import STICKY_ERRORS

    assert [name for name in sorted(STICKY_ERRORS) if not hasattr(runtime.cudaError_t, name)] == []


def test_cuda_calls_pass_as_many_arguments_as_the_binding_takes() -> None:
    """``cuda.call(cuda.rt.cudaX, a, b)``: the count of a, b matches cudaX's signature in cuda-python."""
    from cuda.bindings import runtime

    checked = 0
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call) and dotted(node.func) in ("self.call", "cuda.call") and node.args
            ):
                continue
            target = dotted(node.args[0])
            if target is None or target.rsplit(".", 1)[0] not in CUDA_RECEIVERS:
                continue
            name = target.rsplit(".", 1)[1]
            signature = getattr(runtime, name).__doc__.splitlines()[0]
            params = [
                p for p in signature[signature.index("(") + 1 : signature.rindex(")")].split(",") if p.strip()
            ]
            assert len(node.args) - 1 == len(params), f"{path.name}:{node.lineno}: {name} takes {signature}"
            checked += 1
    assert checked >= 15
