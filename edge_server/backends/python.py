"""Python models: ``<version>/model.py`` with Triton's ``TritonPythonModel`` interface.

Each instance imports the file as its own module object and makes its own model object, so instances
share no state.  User code runs in the instance's worker thread (Triton runs a stub process per
instance; on a Jetson the saved copies matter more than the isolation).  Anything user code raises, or
an error it returns for one request, becomes that request's error; the daemon carries on.

A model may also return a plain ``{name: ndarray}`` dict per request instead of an InferenceResponse.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.backends import pb_utils
from edge_server.backends.base import Backend, BatchItem, LoadContext, Result, Timing
from edge_server.config.model import DynamicBatching, ModelConfig, TensorSpec
from edge_server.errors import ConfigError, ModelExecutionError
from edge_server.request import ResponseSink

log = logging.getLogger(__name__)

# Triton model files import this name; it must resolve before any model.py is executed.
sys.modules.setdefault("triton_python_backend_utils", pb_utils)

_CLASS_NAME = "TritonPythonModel"
# A fresh module name per instance and per reload, so no state leaks between them (next() is atomic).
_module_numbers = itertools.count(1)


def _import_model(path: Path) -> ModuleType:
    number = next(_module_numbers)
    module_name = f"_edge_server_model_{path.parent.parent.name}_{path.parent.name}_{number}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ConfigError(f"{path}: importing the model failed: {exc!r}") from exc
    if not hasattr(module, _CLASS_NAME):
        raise ConfigError(f"{path}: defines no class {_CLASS_NAME}")
    return module


class _Discard(ResponseSink):
    """Where a decoupled model's responses go when nobody streams them (warm-up samples)."""

    def deliver(self, outputs: Any, error: Any, final: bool) -> None:
        pass


def _stream(item: BatchItem) -> ResponseSink:
    if item.stream is None:
        item.stream = _Discard()
    return item.stream


def _tensor_from_dict(spec: dict[str, Any]) -> TensorSpec:
    reshape = spec.get("reshape", {}).get("shape")
    return TensorSpec(
        name=str(spec["name"]),
        data_type=str(spec["data_type"]),
        dims=tuple(int(d) for d in spec["dims"]),
        reshape=tuple(int(d) for d in reshape) if reshape is not None else None,
        optional=bool(spec.get("optional", False)),
    )


class PythonBackend(Backend):
    @classmethod
    def complete_config(cls, config: ModelConfig, model_path: Path) -> ModelConfig:
        module = _import_model(model_path)
        model_cls = getattr(module, _CLASS_NAME)
        auto = getattr(model_cls, "auto_complete_config", None)
        if auto is not None:
            holder = pb_utils.ModelConfig(config.to_triton_dict())
            try:
                result = auto(holder)
            except Exception as exc:
                raise ConfigError(f"{model_path}: auto_complete_config failed: {exc!r}") from exc
            completed = (result or holder).as_dict()
            max_batch_size = int(completed.get("max_batch_size", config.max_batch_size))
            batching = config.dynamic_batching
            if batching is None and "dynamic_batching" in completed and max_batch_size > 0:
                batching = DynamicBatching()  # set_dynamic_batching(): Triton's defaults
            config = config.replace(
                max_batch_size=max_batch_size,
                inputs=tuple(_tensor_from_dict(t) for t in completed.get("input", [])),
                outputs=tuple(_tensor_from_dict(t) for t in completed.get("output", [])),
                dynamic_batching=batching,
            )
        if not config.outputs:
            raise ConfigError(f"{config.source or model_path}: a Python model must declare its outputs")
        return config

    def __init__(self, ctx: LoadContext) -> None:
        self._config = ctx.config
        self._name = ctx.instance.name
        module = _import_model(ctx.model_path)
        self._model = getattr(module, _CLASS_NAME)()
        self._out_dtypes = {t.name: dtypes.to_numpy(t.data_type) for t in ctx.config.outputs}
        args = {
            "model_config": pb_utils.serialize_config(ctx.config.to_triton_dict()),
            "model_instance_kind": "CPU",
            "model_instance_name": ctx.instance.name,
            "model_instance_device_id": str(ctx.instance.device_id),
            "model_repository": str(ctx.version_dir.parent),
            "model_version": str(ctx.version),
            "model_name": ctx.config.name,
        }
        initialize = getattr(self._model, "initialize", None)
        if initialize is not None:
            try:
                initialize(args)
            except Exception as exc:
                raise ConfigError(f"{ctx.model_path}: initialize() failed: {exc!r}") from exc

    def execute(self, batch: Sequence[BatchItem], timing: Timing) -> list[Result]:
        requests = [self._request(item) for item in batch]
        t0 = time.perf_counter_ns()
        try:
            responses = self._model.execute(requests)
        except Exception as exc:
            log.warning("%s: execute() raised:\n%s", self._name, traceback.format_exc())
            error = ModelExecutionError(f"model {self._config.name!r} raised {exc!r}")
            if not self._config.decoupled:
                raise error from exc
            for item in batch:  # ends every stream the model left open; finished ones refuse it
                _stream(item).put(None, error, final=True)
            responses = None
        finally:
            timing.compute_infer_ns += time.perf_counter_ns() - t0
        if self._config.decoupled:
            # Responses went through the senders (maybe still going, from the model's own threads).
            if responses is not None:
                log.warning("%s: a decoupled model's execute() should return None; ignoring", self._name)
            return [{} for _ in batch]
        if not isinstance(responses, list | tuple) or len(responses) != len(batch):
            got = len(responses) if isinstance(responses, list | tuple) else type(responses).__name__
            raise ModelExecutionError(
                f"model {self._config.name!r}: execute() must return one response per request "
                f"({len(batch)}), returned {got}"
            )
        return [self._convert(response, item) for response, item in zip(responses, batch, strict=True)]

    def _request(self, item: BatchItem) -> pb_utils.InferenceRequest:
        sender = None
        if self._config.decoupled:
            stream = _stream(item)

            def emit(response: pb_utils.InferenceResponse | None, final: bool) -> bool:
                if response is None:
                    return stream.put(None, None, final=final)
                result = self._convert(response, item)
                if isinstance(result, Exception):
                    return stream.put(None, result, final=final)
                return stream.put(result, None, final=final)

            sender = pb_utils.InferenceResponseSender(emit, lambda: stream.cancelled)
        return pb_utils.InferenceRequest(
            item.inputs,
            item.requested_outputs,
            item.request_id,
            parameters=item.parameters,
            correlation_id=item.correlation_id,
            flags=item.flags,
            timeout=item.timeout_us,
            sender=sender,
        )

    def _convert(self, response: Any, item: BatchItem) -> Result:
        model = self._config.name
        if isinstance(response, pb_utils.InferenceResponse):
            error = response.error()
            if error is not None:
                message = error.message() if isinstance(error, pb_utils.TritonError) else str(error)
                return ModelExecutionError(f"model {model!r}: {message}")
            outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
        elif isinstance(response, dict):
            outputs = response
        else:
            return ModelExecutionError(
                f"model {model!r}: execute() returned {type(response).__name__}, expected InferenceResponse"
            )
        result: dict[str, np.ndarray] = {}
        for name in item.requested_outputs:
            if name not in outputs:
                return ModelExecutionError(f"model {model!r} did not produce output {name!r}")
            array = np.asarray(outputs[name])
            expected = self._out_dtypes[name]
            if array.dtype != expected and not (expected.kind == "O" and array.dtype.kind in "OSU"):
                return ModelExecutionError(
                    f"model {model!r}: output {name!r} has dtype {array.dtype}, config says {expected}"
                )
            result[name] = array
        return result

    def close(self) -> None:
        finalize = getattr(self._model, "finalize", None)
        if finalize is not None:
            try:
                finalize()
            except Exception:
                log.exception("%s: finalize() raised", self._name)
        self._model = None
