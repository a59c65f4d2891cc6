"""Python models: ``<version>/model.py`` with Triton's ``TritonPythonModel`` interface.

Each instance imports the file as its own module object and makes its own model object, so instances
share no state.  By default user code runs in the instance's worker thread (no copies, no round trip);
with ``parameters { key: "isolation" value: { string_value: "process" } }`` each instance runs in a
process of its own (``python_process.py``), as in Triton, so that a crash of user code fails only
that instance's requests.  Anything user code raises, or an error it returns for one request,
becomes that request's error; the daemon carries on.

A model may also return a plain ``{name: ndarray}`` dict per request instead of an InferenceResponse.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import sys
import time
import traceback
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.backends import pb_asyncio, pb_context, pb_imports, pb_readiness, pb_single, pb_utils
from edge_server.backends.base import Backend, BatchItem, LoadContext, Result, Timing
from edge_server.config.model import DynamicBatching, ModelConfig, TensorSpec
from edge_server.errors import (
    AlreadyExists,
    Cancelled,
    ConfigError,
    EdgeServerError,
    InvalidArgument,
    ModelExecutionError,
    ModelUnknownError,
    NotFound,
    Unavailable,
    Unsupported,
)
from edge_server.model_readiness import ReadinessProbe
from edge_server.request import Outputs, Rescheduled, ResponseSink

log = logging.getLogger(__name__)

# Triton model files import this name; it must resolve before any model.py is executed.
sys.modules.setdefault("triton_python_backend_utils", pb_utils)

_CLASS_NAME = "TritonPythonModel"
# args["model_instance_kind"], as Triton writes it
_INSTANCE_KINDS = {"KIND_CPU": "CPU", "KIND_GPU": "GPU", "KIND_DLA": "GPU"}


def _import_model(path: Path, model_name: str) -> tuple[ModuleType, pb_imports.ImportScope]:
    """``model.py`` in an import scope of its own (its sibling ``.py`` files importable, see pb_imports)."""
    scope = pb_imports.ImportScope(path, model_name)
    try:
        module = scope.load_model(path)
    except Exception as exc:
        scope.close()
        raise ConfigError(f"{path}: importing the model failed: {exc!r}") from exc
    if not hasattr(module, _CLASS_NAME):
        scope.close()
        raise ConfigError(f"{path}: defines no class {_CLASS_NAME}")
    return module, scope


class _Discard(ResponseSink):
    """Where a decoupled model's responses go when nobody streams them (warm-up samples)."""

    def deliver(self, outputs: Any, error: Any, final: bool) -> None:
        pass


def _stream(item: BatchItem) -> ResponseSink:
    if item.stream is None:
        item.stream = _Discard()
    return item.stream


# TritonError code -> the error the client gets.  INTERNAL (and any other) stays EXECUTION_FAILED:
# the model failed, and the client cannot do better by changing the request; UNKNOWN keeps its own
# code (Triton's gRPC status UNKNOWN, HTTP 400).
_ERRORS_BY_TRITON_CODE: dict[int, type[EdgeServerError]] = {
    pb_utils.TritonError.INVALID_ARG: InvalidArgument,
    pb_utils.TritonError.NOT_FOUND: NotFound,
    pb_utils.TritonError.UNAVAILABLE: Unavailable,
    pb_utils.TritonError.UNSUPPORTED: Unsupported,
    pb_utils.TritonError.ALREADY_EXISTS: AlreadyExists,
    pb_utils.TritonError.CANCELLED: Cancelled,
    pb_utils.TritonError.UNKNOWN: ModelUnknownError,
}


def model_error(instance: str, error: object) -> EdgeServerError:
    """The error a client sees for a ``TritonError`` (or anything else) a model returned or raised.

    Triton's texts, which its clients and QA match: a ``TritonError``'s message as the model wrote
    it; for any other exception, "Failed to process the request(s) for model '<instance>', message:
    <type>: <text>".
    """
    if isinstance(error, pb_utils.TritonError):
        cls = _ERRORS_BY_TRITON_CODE.get(error.code(), ModelExecutionError)
        return cls(error.message())
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    return ModelExecutionError(f"Failed to process the request(s) for model {instance!r}, message: {text}")


def _tensor_from_dict(spec: dict[str, Any]) -> TensorSpec:
    reshape = (spec.get("reshape") or {}).get("shape")
    return TensorSpec(
        name=str(spec["name"]),
        data_type=str(spec.get("data_type", "TYPE_INVALID")),
        dims=tuple(int(d) for d in spec.get("dims", ())),
        reshape=tuple(int(d) for d in reshape) if reshape is not None else None,
        optional=bool(spec.get("optional", False)),
        format=str(spec.get("format", "FORMAT_NONE")),
        label_filename=str(spec.get("label_filename", "")),
    )


def run_auto_complete(config: ModelConfig, model_cls: Any, model_path: Path) -> dict[str, Any]:
    """Run the model's ``auto_complete_config``; the config it made, as Triton's JSON-shaped dict."""
    holder = pb_utils.ModelConfig(config.to_triton_dict())
    try:
        with pb_context.running(pb_context.ModelContext(config.name, model_path.parent)):
            result = model_cls.auto_complete_config(holder)
    except Exception as exc:
        raise ConfigError(f"{model_path}: auto_complete_config failed: {exc}") from exc
    if result is None:
        raise ConfigError(
            f"{model_path}: auto_complete_config returned None; it must return the config object it "
            "was given (as Triton requires)"
        )
    if not isinstance(result, pb_utils.ModelConfig):
        raise ConfigError(
            f"{model_path}: auto_complete_config returned {type(result).__name__}, "
            "expected the pb_utils.ModelConfig it was given"
        )
    return result.as_dict()


def apply_auto_complete(config: ModelConfig, completed: dict[str, Any]) -> ModelConfig:
    """Take back from an auto-completed config what Triton lets a model change."""
    max_batch_size = int(completed.get("max_batch_size", config.max_batch_size))
    batching = config.dynamic_batching
    if batching is None and "dynamic_batching" in completed and max_batch_size > 0:
        batching = DynamicBatching()  # set_dynamic_batching(): Triton's defaults
    policy = completed.get("model_transaction_policy") or {}
    return config.replace(
        max_batch_size=max_batch_size,
        inputs=tuple(_tensor_from_dict(t) for t in completed.get("input", [])),
        outputs=tuple(_tensor_from_dict(t) for t in completed.get("output", [])),
        dynamic_batching=batching,
        decoupled=bool(policy.get("decoupled", config.decoupled)),
    )


#: config.pbtxt ``parameters`` key choosing where a Python model runs; see isolation_mode()
ISOLATION_KEY = "isolation"
ISOLATION_MODES = ("thread", "process")
DEFAULT_ISOLATION = "thread"


def isolation_mode(config: ModelConfig) -> str:
    """``thread`` (in the daemon, the default) or ``process`` (a process of its own per instance).

    ``process`` contains crashes of user code (``os._exit``, a segfault in native code, an OOM kill):
    they fail that instance's requests with INSTANCE_FAILED and the instance is restarted; the cost is
    a round trip to the child per batch (docs/python-models.md, "Which to choose", with numbers).
    """
    mode = config.parameters.get(ISOLATION_KEY, DEFAULT_ISOLATION)
    if mode not in ISOLATION_MODES:
        raise ConfigError(
            f"{config.source or config.name}: parameters {{ key: {ISOLATION_KEY!r} }} must be one of "
            f"{list(ISOLATION_MODES)}, got {mode!r}"
        )
    return mode


def complete_in_thread(config: ModelConfig, model_path: Path) -> dict[str, Any] | None:
    """Import ``model.py`` here and run its ``auto_complete_config`` (None when it has none)."""
    module, scope = _import_model(model_path, config.name)
    try:
        model_cls = getattr(module, _CLASS_NAME)
        if not hasattr(model_cls, "auto_complete_config"):
            return None
        return run_auto_complete(config, model_cls, model_path)
    finally:
        scope.close()


def _instance_count(config: ModelConfig) -> int:
    """How many instances the loader makes of ``config`` (a copy per GPU or DLA core of a group)."""
    return (
        sum(
            group.count * max(1, len(group.secondary_devices) or len(group.gpus))
            for group in config.instance_groups
        )
        or 1
    )


# Triton's python_backend refuses these in a model's name (its stub's name); its QA checks the text.
_STUB_NAME_CHARS = frozenset(";|&$`<>()[]{}\\\"'*?~#!")


def check_stub_name(name: str) -> None:
    """Triton's rule for a Python model's name: none of :data:`_STUB_NAME_CHARS` (ConfigError)."""
    if not _STUB_NAME_CHARS.isdisjoint(name):
        raise ConfigError(f"Invalid stub name: contains invalid characters (model name {name!r})")


class PythonBackend(Backend):
    @classmethod
    def complete_config(cls, config: ModelConfig, model_path: Path) -> ModelConfig:
        check_stub_name(config.name)
        if isolation_mode(config) == "process":  # model.py is not even imported by the daemon
            from edge_server.backends.python_process import complete_in_process

            completed = complete_in_process(config, model_path)
        else:
            completed = complete_in_thread(config, model_path)
        if completed is not None:
            config = apply_auto_complete(config, completed)
        if not config.outputs:
            raise ConfigError(f"{config.source or model_path}: a Python model must declare its outputs")
        return config

    @classmethod
    def create(cls, ctx: LoadContext) -> Backend:
        if isolation_mode(ctx.config) == "process":
            from edge_server.backends.python_process import IsolatedPythonBackend

            return IsolatedPythonBackend(ctx)
        return cls(ctx)

    def __init__(self, ctx: LoadContext) -> None:
        self._config = ctx.config
        self._name = ctx.instance.name
        self._context = pb_context.ModelContext(
            ctx.instance.name,
            ctx.version_dir,
            models=ctx.models,
            model_name=ctx.config.name,
            model_version=ctx.version,
            instances=_instance_count(ctx.config),
        )
        self._executing = dataclasses.replace(self._context, executing=True)
        module, self._scope = _import_model(ctx.model_path, ctx.config.name)
        self._loop = pb_asyncio.ModelLoop(ctx.instance.name, self._context)  # ``async def execute``
        try:
            with pb_context.running(self._context):
                self._model = getattr(module, _CLASS_NAME)()
        except BaseException:
            self._scope.close()
            raise
        # BLS from the model's own threads: found by the scope's package, model.py's and its helpers'
        pb_context.register_module(self._scope.package, self._context)
        self._out_dtypes = {t.name: dtypes.to_numpy(t.data_type) for t in ctx.config.outputs}
        self._dtype_warned: set[str] = set()
        if ctx.config.sequence_batching is not None:  # implicit state outputs come back like outputs
            for state in ctx.config.sequence_batching.states:
                self._out_dtypes[state.output_name] = dtypes.to_numpy(state.data_type)
        # Exactly Triton's keys and formats (all strings); "model_repository" is the model's directory.
        args = {
            "model_config": pb_utils.serialize_config(ctx.config.to_triton_dict()),
            "model_instance_kind": _INSTANCE_KINDS.get(ctx.instance.kind, "CPU"),
            "model_instance_name": ctx.instance.name,
            "model_instance_device_id": str(ctx.instance.device_id),
            "model_repository": str(ctx.version_dir.parent),
            "model_version": str(ctx.version),
            "model_name": ctx.config.name,
        }
        initialize = getattr(self._model, "initialize", None)
        if initialize is not None:
            try:
                with pb_context.running(self._context):
                    initialize(args)
            except Exception as exc:
                pb_context.unregister_module(self._scope.package)
                self._scope.close()
                raise ConfigError(f"{ctx.model_path}: initialize() failed: {exc!r}") from exc
        # A cheap model may run on the caller's thread (the scheduler measures it first): a thread
        # hand-off costs more than a small model.py.  Not a decoupled model (its responses may outlive
        # execute()) nor an ``async def execute`` (its event loop cannot run on a frontend's loop).
        execute = getattr(self._model, "execute", None)
        self.allows_inline = not ctx.config.decoupled and not inspect.iscoroutinefunction(execute)
        if inspect.iscoroutinefunction(execute):
            self._loop.start()
        # A model.py may call models (BLS): never run it on a worker that holds an instance of its own
        # (a scheduler worker delivering a finished batch: scheduler.inline.delivering).
        self.calls_models = True
        #: whether the model defines ``is_ready`` (Triton's user-defined readiness function)
        self.has_readiness = pb_readiness.has_readiness(self._model)
        if self.has_readiness:
            self.readiness_probe = ReadinessProbe(self._name, self.model_ready)

    def model_ready(self) -> bool:
        """The model's ``is_ready()`` answer, unbounded (the probe and the isolated daemon side bound it)."""
        return pb_readiness.call_is_ready(self._model, self._loop, self._context)

    def execute(self, batch: Sequence[BatchItem], timing: Timing) -> list[Result]:
        requests = [self._request(item) for item in batch]
        t0 = time.perf_counter_ns()
        try:
            previous = pb_context.mark(self._executing)  # pb_context.running(), minus a generator
            # BLS calls take the turns of the request the model reads, else of the batch's first
            acting = pb_context.act_for(batch[0].client if batch else None)
            try:
                responses = self._model.execute(requests)
                if inspect.iscoroutine(responses):  # ``async def execute``: on the model's loop, as Triton
                    if self._config.decoupled:  # not waited for: its responses go through the senders
                        self._loop.spawn_then(responses, self._executing, partial(self._async_done, batch))
                        responses = None
                    else:
                        responses = self._loop.run(responses, self._executing)
            finally:
                pb_context.stop_acting(acting)
                pb_context.mark(previous)
        except (Exception, SystemExit) as exc:  # sys.exit() or an argparse error in the model's code too
            if not isinstance(exc, pb_utils.TritonError):  # raised instead of returned: fails every request
                log.warning("%s: execute() raised:\n%s", self._name, traceback.format_exc())
            error = model_error(self._name, exc)
            if not self._config.decoupled:
                answers = pb_single.sent(requests)
                if not any(answers):
                    raise error from exc
                # requests the model answered through its sender before it failed keep that answer
                return [
                    error if a is None else self._convert(a, i) for a, i in zip(answers, batch, strict=True)
                ]
            for item in batch:  # ends every stream the model left open; finished ones refuse it
                _stream(item).put(None, error, final=True)
            return [{} for _ in batch]  # nothing is rescheduled after a failed execute()
        finally:
            timing.compute_infer_ns += time.perf_counter_ns() - t0
        if self._config.decoupled:
            # Responses went through the senders (maybe still going, from the model's own threads).
            if responses is not None:  # Triton's error, to every request whose stream is still open
                refused = self._must_return_none()
                for item in batch:
                    _stream(item).put(None, refused, final=True)  # refused where already finished
                return [{} for _ in batch]
            return [self._decoupled_result(r, item) for r, item in zip(requests, batch, strict=True)]
        flags = [request.release_flags() for request in requests]
        records = pb_single.singles(requests)
        del requests  # a sender the model dropped unused is noticed when it is collected
        # sent through a sender: they answer (a returned one is dropped); maybe still to come
        responses = pb_single.answers(self._config.name, records, responses)
        if not isinstance(responses, list | tuple) or len(responses) != len(batch):
            got = len(responses) if isinstance(responses, list | tuple) else type(responses).__name__
            raise ModelExecutionError(
                f"model {self._config.name!r}: execute() must return one response per request "
                f"({len(batch)}), returned {got}"
            )
        return [
            response
            if isinstance(response, EdgeServerError)
            else self._convert(response, item)
            if flag != pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
            else self._rescheduled(response)
            for response, item, flag in zip(responses, batch, flags, strict=True)
        ]

    # -- request rescheduling (Triton >= 23.11) ---------------------------------------------------

    def _reschedule_refused(self) -> EdgeServerError | None:
        """The error for a RESCHEDULE release when the config does not allow it (None: allowed)."""
        seq = self._config.sequence_batching
        if seq is not None and seq.iterative_sequence:
            return None
        return ModelExecutionError(
            f"model {self._config.name!r}: a request was released with "
            "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, but the model is not configured for request "
            "rescheduling; add sequence_batching { iterative_sequence: true } to its config.pbtxt"
        )

    def _rescheduled(self, response: Any) -> Result:
        """A non-decoupled model's rescheduled request: it must have answered ``None``, as in Triton."""
        refused = self._reschedule_refused()
        if refused is not None:
            return refused
        if response is not None:
            return ModelExecutionError(  # Triton's text, its typo too (Triton's QA matches it)
                "Expected a None object in the execute function return list for reschduled request "
                f"(model {self._config.name!r} returned {type(response).__name__})"
            )
        return Rescheduled()

    def _decoupled_result(self, request: pb_utils.InferenceRequest, item: BatchItem) -> Result:
        """``{}`` (the stream carries the answers), or Rescheduled: the stream stays open for the next run."""
        if request.release_flags() != pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            return {}
        request._abandoned.detach()  # type: ignore[attr-defined]  # its stream goes on in the next run
        refused = self._reschedule_refused()
        if refused is not None:
            _stream(item).put(None, refused, final=True)  # refused if the model already ended it
            return {}
        return Rescheduled()

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
            abandoned = weakref.finalize(sender, _abandoned, stream, self._config.name)
            abandoned.atexit = False
        request = pb_utils.InferenceRequest._incoming(
            self._config.name,
            item.inputs,
            item.requested_outputs,
            request_id=item.request_id,
            parameters=item.parameters,
            correlation_id=item.correlation_id,
            flags=item.flags,
            timeout=item.timeout_us,
            sender=sender,
            sender_factory=None if sender is not None else pb_single.make_sender,
            client=item.client,
        )
        if sender is not None:
            request._abandoned = abandoned  # type: ignore[attr-defined]  # detached when rescheduled
        return request

    def _convert(self, response: Any, item: BatchItem) -> Result:
        model = self._config.name
        if isinstance(response, pb_utils.InferenceResponse):
            error = response.error()
            if error is not None:
                return model_error(model, error)
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
            if array.dtype.kind in "OSU":  # strings leave as an object array of bytes; others str()
                try:
                    where = f"model {model!r} output {name!r}"
                    array = dtypes.as_bytes_array(array, where=where, stringify=True)
                except InvalidArgument as exc:
                    return ModelExecutionError(exc.message)
            elif array.dtype != self._out_dtypes[name]:
                self._warn_dtype(name, array.dtype)
            result[name] = array
        if isinstance(response, pb_utils.InferenceResponse):
            parameters = response.parameters()
            if parameters != "{}":  # Triton's response parameters go back to the client
                return Outputs(result, json.loads(parameters))
        return result

    def _warn_dtype(self, name: str, dtype: np.dtype) -> None:
        """Once per output: it leaves with the type the model gave it, as Triton sends it (no cast)."""
        if name in self._dtype_warned:
            return
        self._dtype_warned.add(name)
        log.warning(
            "%s: output %r is %s but the config says %s; it is sent as %s, as Triton does",
            self._name,
            name,
            dtype,
            self._out_dtypes[name],
            dtype,
        )

    def _async_done(self, batch: Sequence[BatchItem], future: Future[Any]) -> None:
        """A decoupled model's ``async def execute`` ended (in the background): report what went wrong."""
        if future.cancelled():
            error: EdgeServerError | None = Cancelled(f"model {self._config.name!r}: execute() was cancelled")
        elif future.exception() is not None:
            exc = future.exception()
            trace = "".join(traceback.format_exception(exc))  # as the synchronous path logs it
            log.warning("%s: execute() raised:\n%s", self._name, trace)
            error = model_error(self._name, exc)
        elif future.result() is not None:
            error = self._must_return_none()
        else:
            return
        for item in batch:  # ends every stream the model left open; finished ones refuse it
            _stream(item).put(None, error, final=True)

    def _must_return_none(self) -> EdgeServerError:
        return ModelExecutionError(
            f"Python model '{self._name}' is using the decoupled mode and the execute function "
            "must return None."
        )

    def close(self) -> None:
        finalize = getattr(self._model, "finalize", None)
        if finalize is not None:
            try:
                with pb_context.running(self._context):
                    finalize()
            except Exception:
                log.exception("%s: finalize() raised", self._name)
        self._model = None
        pb_context.unregister_module(self._scope.package)
        self._scope.close()
        self._loop.close()


def _abandoned(stream: ResponseSink, model: str) -> None:
    """A decoupled model let a request go (its sender collected) without the final flag.

    The stream ends with an error instead of leaving its client waiting, and what the request held
    is given back; refused, and so harmless, where the final response was sent.
    """
    stream.put(
        None,
        ModelExecutionError(
            f"model {model!r} released a request without sending its final response "
            "(send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL) ends a decoupled request)"
        ),
        final=True,
    )
