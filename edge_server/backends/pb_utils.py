"""Triton's ``triton_python_backend_utils`` for models that run inside edge-server.

A ``model.py`` written for Triton's Python backend does ``import triton_python_backend_utils as
pb_utils``; the Python backend makes that name resolve to this module.  BLS calls
(``InferenceRequest(...).exec()``) go through the data plane (see ``backends/pb_bls.py``).
``TritonError`` codes reach the client as our stable error codes (see ``backends/python.py``).
Tensors and data types are in ``backends/pb_tensor.py``, custom metrics in ``backends/python_metrics.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from edge_server.backends import pb_bls, pb_context
from edge_server.backends.pb_autocomplete import ModelConfig as ModelConfig
from edge_server.backends.pb_context import Logger as Logger
from edge_server.backends.pb_context import LogLevel as LogLevel
from edge_server.backends.pb_context import get_model_dir as get_model_dir
from edge_server.backends.pb_tensor import Tensor as Tensor
from edge_server.backends.pb_tensor import TritonError as TritonError
from edge_server.backends.pb_tensor import TritonModelException as TritonModelException
from edge_server.backends.pb_tensor import deserialize_bytes_tensor as deserialize_bytes_tensor
from edge_server.backends.pb_tensor import numpy_to_triton_string as numpy_to_triton_string
from edge_server.backends.pb_tensor import numpy_to_triton_type as numpy_to_triton_type
from edge_server.backends.pb_tensor import serialize_byte_tensor as serialize_byte_tensor
from edge_server.backends.pb_tensor import triton_string_to_numpy as triton_string_to_numpy
from edge_server.backends.pb_tensor import triton_to_numpy_type as triton_to_numpy_type
from edge_server.errors import EdgeServerError
from edge_server.request import ClientKey, InferRequest, ModelAccess, response_parameters

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


class InferenceResponseSender:
    """A decoupled model's way to answer: any number of ``send(response)``, then one FINAL flag.

    It may be used from any thread, also after ``execute`` returned.  ``emit`` is the backend's: it
    checks and converts the response and hands it to the request's stream.
    """

    def __init__(self, emit: Callable[[InferenceResponse | None, bool], bool], cancelled: Callable[[], bool]):
        self._emit = emit
        self._cancelled = cancelled

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException(
                f"send(): unknown flags {flags!r}; use 0 or TRITONSERVER_RESPONSE_COMPLETE_FINAL"
            )
        final = flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if response is None and not final:
            raise TritonModelException(
                "send(): give a response, or flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL"
            )
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send(): expected an InferenceResponse, got {type(response).__name__}"
            )
        if not self._emit(response, final):
            raise TritonModelException(
                "send(): the response sender is closed (the final flag was already sent)"
            )

    def is_cancelled(self) -> bool:
        return self._cancelled()


def _text(value: Any) -> Any:
    """``bytes`` as UTF-8 text (Triton's C++ binding accepts either for a string argument)."""
    if isinstance(value, bytes | np.bytes_):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise TritonModelException(f"expected UTF-8 text, got {value!r}") from None
    return value


class ResponseIterator:
    """What ``exec(decoupled=True)`` returns: the called model's responses as they come.

    Ends after the final response (an empty one when the final flag came alone, as in Triton);
    ``cancel()`` asks the called model to stop (it sees ``request.is_cancelled()``) and the iteration
    goes on with what it still sends: typically a CANCELLED error, or, from a model that ignores
    cancellation, its remaining responses.
    """

    def __init__(self, stream: pb_bls.Stream) -> None:
        self._stream = stream

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        outputs, error = next(self._stream)
        return _response(outputs, error)

    def cancel(self) -> None:
        self._stream.cancel()


class InferenceRequest:
    """A request: handed to ``TritonPythonModel.execute``, or built by a model to call another (BLS).

    The constructor is Triton's BLS form (keywords, as Triton's examples call it)::

        request = pb_utils.InferenceRequest(
            model_name="classifier", requested_output_names=["probabilities"], inputs=[tensor])
        response = request.exec()                  # or: await request.async_exec()
        for response in request.exec(decoupled=True): ...   # a decoupled model's responses

    ``flags`` holds ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START``/``_END``; ``timeout`` is in
    microseconds (0: none), as in Triton; for a BLS call it bounds the whole wait for the answer.
    """

    def __init__(
        self,
        *,
        model_name: str,
        inputs: Iterable[Tensor] = (),
        requested_output_names: Iterable[str] = (),
        request_id: str = "",
        correlation_id: int | str = 0,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        parameters: Mapping[str, Any] | str | None = None,
        preferred_memory: Any = None,
        trace: Any = None,
    ) -> None:
        model_name = _text(model_name)  # bytes too, as Triton's binding takes them (as_numpy()[0])
        if not isinstance(model_name, str) or not model_name:
            raise TritonModelException("InferenceRequest: model_name must be a non-empty string")
        tensors = list(inputs)
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                raise TritonModelException(
                    f"InferenceRequest: inputs must be pb_utils.Tensor objects, got {type(tensor).__name__}"
                )
        if isinstance(requested_output_names, str):
            raise TritonModelException("InferenceRequest: requested_output_names must be a list of names")
        if not isinstance(timeout, int) or timeout < 0:
            raise TritonModelException(
                f"InferenceRequest: timeout must be microseconds >= 0, got {timeout!r}"
            )
        self._model_name = model_name
        self._model_version = int(model_version)
        self._inputs = tensors
        self._requested = [str(_text(name)) for name in requested_output_names]
        self._request_id = str(request_id)
        self._parameters = json.loads(_parameters_json(parameters))
        self._correlation_id = correlation_id
        self._flags = int(flags)
        self._timeout = timeout
        self._sender: InferenceResponseSender | None = None
        self._sender_factory: Callable[[InferenceRequest], InferenceResponseSender] | None = None
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        # a BLS call waits its turn as the client the model works for now (pb_context.act_for)
        self._client = pb_context.acting_for()
        self._from_client = False

    @classmethod
    def _incoming(
        cls,
        model_name: str,
        inputs: Mapping[str, np.ndarray],
        requested_outputs: Iterable[str],
        *,
        request_id: str = "",
        parameters: Mapping[str, Any] | None = None,
        correlation_id: int | str = 0,
        flags: int = 0,
        timeout: int = 0,
        sender: InferenceResponseSender | None = None,
        sender_factory: Callable[[InferenceRequest], InferenceResponseSender] | None = None,
        client: ClientKey | None = None,
    ) -> InferenceRequest:
        """A request the backend hands to ``execute`` (no checks: the data plane validated it).

        ``sender_factory``: makes the response sender of a non-decoupled model's request, only when
        the model asks for one (most never do).  ``client``: who sent it; reading its inputs makes
        the model's code work for that client (BLS calls built afterwards take its turns).
        """
        request = cls.__new__(cls)
        request._model_name = model_name
        request._model_version = -1
        request._inputs = [Tensor(name, array) for name, array in inputs.items()]
        request._requested = list(requested_outputs)
        request._request_id = request_id
        request._parameters = dict(parameters or {})
        request._correlation_id = correlation_id
        request._flags = flags
        request._timeout = timeout
        request._sender = sender
        request._sender_factory = sender_factory
        request._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        request._client = client
        request._from_client = True
        return request

    def inputs(self) -> list[Tensor]:
        if self._from_client:  # the model works on this request now (until it reads another's)
            pb_context.act_for(self._client)
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def request_id(self) -> str:
        return self._request_id

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def parameters(self) -> str:
        """The request's parameters as a JSON object string, as Triton hands them to a model."""
        return json.dumps(self._parameters)

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        """The request's timeout in microseconds (0: none)."""
        return self._timeout

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None and self._sender_factory is not None:
            self._sender = self._sender_factory(self)
        if self._sender is None:
            raise TritonModelException(
                "get_response_sender() is only available to decoupled models "
                "(model_transaction_policy { decoupled: true })"
            )
        return self._sender

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled() if self._sender is not None else False

    def set_release_flags(self, flags: int) -> None:
        """``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``: run this same request again in a later batch.

        Request rescheduling, as in Triton: the model config needs ``sequence_batching {
        iterative_sequence: true }``; a non-decoupled model returns ``None`` for the request in
        ``execute``'s list, a decoupled one sets the flag before ``execute`` returns.  The request
        keeps its id, correlation id and sequence slot; the backend reads the flag after ``execute``.
        """
        if flags not in (TRITONSERVER_REQUEST_RELEASE_ALL, TRITONSERVER_REQUEST_RELEASE_RESCHEDULE):
            raise TritonModelException(
                f"set_release_flags(): unknown flags {flags!r}; use TRITONSERVER_REQUEST_RELEASE_ALL "
                "or TRITONSERVER_REQUEST_RELEASE_RESCHEDULE"
            )
        self._release_flags = flags

    def release_flags(self) -> int:
        return self._release_flags

    # -- BLS ------------------------------------------------------------------------------------

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on ``model_name`` and wait: an InferenceResponse (errors inside it).

        ``decoupled=True``: an iterator over the model's responses, ending with an empty response
        when the final flag came alone (as in Triton).
        """
        models = self._models()
        request, wait_s = self._outgoing()
        if decoupled:
            return ResponseIterator(pb_bls.Stream(models, request, wait_s))
        return _response_of(pb_bls.call(models, request, wait_s))

    async def async_exec(self, decoupled: bool = False) -> Any:
        """:meth:`exec` for ``async def execute``: ``await`` it; many may be in flight at once."""
        models = self._models()
        request, wait_s = self._outgoing()
        if decoupled:  # as in Triton: the iterator at once, iterated (and cancelled) as exec's
            return ResponseIterator(pb_bls.Stream(models, request, wait_s))
        return _response_of(await pb_bls.call_async(models, request, wait_s))

    def _models(self) -> ModelAccess:
        try:
            return pb_bls.models()
        except EdgeServerError as exc:
            raise TritonModelException(exc.message) from None

    def _outgoing(self) -> tuple[InferRequest, float | None]:
        request = InferRequest(
            model=self._model_name,
            inputs={t.name(): t.as_numpy() for t in self._inputs},
            version=self._model_version if self._model_version >= 0 else None,
            outputs=self._requested or None,
            timeout_us=self._timeout or None,
            request_id=self._request_id,
            parameters=self._parameters,
            correlation_id=self._correlation_id,
            sequence_start=bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_START),
            sequence_end=bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_END),
            client=self._client,
        )
        return request, (self._timeout / 1e6 if self._timeout else None)


# Our error codes -> TritonError codes, for errors of BLS calls that reach model code.
_TRITON_CODES = {
    "INVALID_ARGUMENT": TritonError.INVALID_ARG,
    "MODEL_NOT_FOUND": TritonError.NOT_FOUND,
    "NOT_FOUND": TritonError.NOT_FOUND,
    "MODEL_NOT_READY": TritonError.UNAVAILABLE,
    "UNAVAILABLE": TritonError.UNAVAILABLE,
    "QUEUE_FULL": TritonError.UNAVAILABLE,
    "TIMEOUT": TritonError.UNAVAILABLE,
    "UNSUPPORTED": TritonError.UNSUPPORTED,
    "CANCELLED": TritonError.CANCELLED,
    "UNKNOWN": TritonError.UNKNOWN,
    "ALREADY_EXISTS": TritonError.ALREADY_EXISTS,
}


def _response(outputs: Mapping[str, np.ndarray], error: EdgeServerError | None) -> InferenceResponse:
    if error is not None:
        code = _TRITON_CODES.get(error.code, TritonError.INTERNAL)
        return InferenceResponse(error=TritonError(f"[{error.code}] {error.message}", code))
    tensors = [Tensor(name, array) for name, array in outputs.items()]
    parameters = response_parameters(outputs)  # the called model's response parameters, as in Triton
    return InferenceResponse(output_tensors=tensors, parameters=dict(parameters) if parameters else None)


def _response_of(outcome: pb_bls.Outcome) -> InferenceResponse:
    if isinstance(outcome, EdgeServerError):
        return _response({}, outcome)
    return _response(outcome, None)


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether ``model_name`` (and ``model_version``, "" for the latest) can take requests now."""
    models = _calling_models()
    version = _text(model_version)
    return models.is_ready(_text(model_name), int(version) if version else None)


def load_model(model_name: str, config: str = "", files: Mapping[str, bytes] | None = None) -> None:
    """Load or reload ``model_name`` from the repository (explicit and poll control modes only)."""
    if config or files:
        raise TritonModelException(
            "load_model(): config and files overrides are not supported; write them to the repository"
        )
    try:
        _calling_models().load(_text(model_name))
    except EdgeServerError as exc:
        raise TritonModelException(exc.message) from None


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload every version of ``model_name`` (explicit and poll control modes only)."""
    try:
        _calling_models().unload(_text(model_name))
    except EdgeServerError as exc:
        raise TritonModelException(exc.message) from None


def _calling_models() -> ModelAccess:
    try:
        return pb_bls.models()
    except EdgeServerError as exc:
        raise TritonModelException(exc.message) from None


def _parameters_json(parameters: Any) -> str:
    """Triton's rule for response parameters: string keys, bool/int/str values, kept as JSON text.

    The error texts are Triton's (its QA matches them).
    """
    if parameters is None:
        return "{}"
    if isinstance(parameters, str):
        parameters = json.loads(parameters)
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect parameters to be a dict, got {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)}")
        if not isinstance(value, bool | int | str):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)}"
            )
    return json.dumps(parameters)


class InferenceResponse:
    """One response: output tensors, or an error for its request; ``parameters()`` is JSON text."""

    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, bool | int | str] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = _parameters_json(parameters)

    def parameters(self) -> str:
        return self._parameters

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", []) if t["name"] == name), None)


def serialize_config(config: dict[str, Any]) -> str:
    """``args["model_config"]``: the model config as JSON, as Triton passes it."""
    return json.dumps(config)


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    """Whether the config (``json.loads(args["model_config"])``) makes the model decoupled."""
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


# Custom metrics (Triton's pb_utils.MetricFamily / Metric): see python_metrics.py.
from edge_server.backends.python_metrics import Metric as Metric  # noqa: E402
from edge_server.backends.python_metrics import MetricFamily as MetricFamily  # noqa: E402
