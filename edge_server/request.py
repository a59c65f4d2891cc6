"""The request types every layer shares: what a frontend hands in, what a backend receives, what comes back.

This module imports nothing of edge_server but errors and dtypes, so that the data plane, validation,
the scheduler, backends and pipelines can all use it without an import cycle.

* :class:`InferRequest`: one request as a frontend builds it (keyword arguments only, so that a new
  field can never shift the meaning of a positional one).
* :class:`BatchItem`: a validated request as it waits in a batch and reaches a backend.
* :class:`Timing`, :data:`Result`: what a backend reports for a batch and returns per request.
* :class:`ResponseSink`: where the responses of a streamed request go (decoupled models answer one
  request with zero, one or many responses; every stream ends with exactly one ``final``).
* :class:`ModelAccess`: what pipelines (ensembles) and Python models' BLS calls receive at load to
  reach other models: the data plane's submit and stream, and model control.  Handed down, so that
  nothing below the server imports it.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict

import numpy as np

from edge_server.errors import EdgeServerError

if TYPE_CHECKING:
    from edge_server.config.model import ModelConfig

#: A request parameter's value, as KServe v2 allows: bool, int or string.
ParamValue = bool | int | str
Parameters = Mapping[str, ParamValue]


class _NoParameters(Mapping[str, ParamValue]):
    """The shared empty parameter map: immutable and hashable, so it can be a dataclass default."""

    __slots__ = ()

    def __getitem__(self, key: str) -> ParamValue:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __hash__(self) -> int:
        return 0


NO_PARAMETERS: Parameters = _NoParameters()

#: Who sent a request, for the dynamic batcher's turns (:mod:`edge_server.scheduler.queue`): (user,
#: connection).  Requests of one connection keep their order; users take turns, and so do one user's
#: connections.  None: the in-process API (one client).
ClientKey = tuple[Hashable, Hashable]


def client_key(uid: int | None, connection: Hashable) -> ClientKey:
    """The key of a frontend's client: its uid from the kernel where known, else the connection alone.

    A connection whose uid is unknown (a remote TCP client, a gRPC call) is a user of its own.
    """
    return (uid if uid is not None and uid >= 0 else connection, connection)


@dataclass(slots=True, kw_only=True)
class InferRequest:
    """One inference request as every frontend hands it to the data plane; not changed afterwards.

    ``correlation_id`` (0: none), ``sequence_start`` and ``sequence_end`` are Triton's sequence
    fields; ``parameters`` reach the model (``request.parameters()`` in a Python model).
    The data plane writes one field, ``routed_version``, when it hands the request to a version.
    (Not frozen: a frozen dataclass costs three times as much to build, and every request builds one.)
    """

    model: str
    inputs: Mapping[str, np.ndarray]
    version: int | None = None
    outputs: Sequence[str] | None = None  # None: every output
    priority: int = 0
    timeout_us: int | None = None
    request_id: str = ""
    parameters: Parameters = NO_PARAMETERS
    correlation_id: int | str = 0
    sequence_start: bool = False
    sequence_end: bool = False
    #: set by frontends, not by applications: where the client asked each named output to be written
    #: (a span of its own mapped shared memory, bounds already checked); see :class:`OutputBuffer`
    output_buffers: Mapping[str, OutputBuffer] | None = None
    #: set by frontends: the uid of the client, from the kernel (-1: not known, e.g. not on this host;
    #: None: the in-process API).  A sequence belongs to the owner of its start (see scheduler.sequence)
    owner: int | None = None
    #: set by frontends: who sent it (:func:`client_key`), so that one client's burst cannot make the
    #: others wait for all of it (the dynamic batcher serves clients in turns)
    client: ClientKey | None = None
    #: set by the data plane: the version that took the request (a response names it, even when a
    #: reload swapped the serving version while it ran)
    routed_version: int | None = None
    #: Triton's classification extension: output name -> how many top classes to return instead of
    #: its values (see :mod:`edge_server.classification`); each must be among ``outputs``
    classification: Mapping[str, int] | None = None


class RequestOptions(TypedDict, total=False):
    """:class:`InferRequest`'s optional fields, for APIs that take them as keyword arguments."""

    version: int | None
    outputs: Sequence[str] | None
    priority: int
    timeout_us: int | None
    request_id: str
    parameters: Parameters
    correlation_id: int | str
    sequence_start: bool
    sequence_end: bool
    classification: Mapping[str, int] | None


@dataclass(slots=True)
class BatchItem:
    """One validated request in a batch; ``inputs`` carry the batch axis where the model has one.

    ``stream`` is set for requests whose responses are streamed (decoupled models): the backend sends
    through it instead of returning outputs.
    """

    inputs: dict[str, np.ndarray]
    batch_size: int
    requested_outputs: tuple[str, ...]
    request_id: str = ""
    parameters: Parameters = NO_PARAMETERS
    correlation_id: int | str = 0
    flags: int = 0  # REQUEST_FLAG_SEQUENCE_START | REQUEST_FLAG_SEQUENCE_END
    timeout_us: int = 0
    stream: ResponseSink | None = None
    #: outputs the client wants in its shared memory (from ``InferRequest.output_buffers``)
    destinations: Mapping[str, OutputBuffer] | None = None
    owner: int | None = None  # InferRequest.owner, for a sequence's requests
    client: ClientKey | None = None  # InferRequest.client: whose turn it waits for in the queue


class OutputBuffer:
    """A writable span of one client's mapped shared memory where one output of its request goes.

    Built by a frontend from a reference it has bounds-checked against that client's own registration,
    so a backend that writes here can only reach memory of the client that sent the request.  ``array``
    is a flat ``uint8`` view of the whole span (the output's shape may be known only after the run).
    ``filled`` says who put the output there, for the frontend (which then skips its copy) and for
    ``shm_status``: ``DIRECT`` (the runtime wrote it during the run), ``COPIED`` (the instance copied it
    after the run), or ``""`` (not filled: the frontend copies it).
    """

    __slots__ = ("array", "filled")

    DIRECT = "direct"
    COPIED = "copied"

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.filled = ""

    def view(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
        """The span's first bytes as ``dtype``/``shape``, or None where that does not fit in it."""
        nbytes = dtype.itemsize
        for dim in shape:
            nbytes *= dim
        if dtype.hasobject or nbytes > self.array.nbytes:
            return None
        return self.array[:nbytes].view(dtype).reshape(shape)

    def holds(self, array: np.ndarray) -> bool:
        """Whether ``array`` lies at the start of this span (the runtime wrote it here)."""
        return (
            array.flags.c_contiguous
            and array.nbytes <= self.array.nbytes
            and array.__array_interface__["data"][0] == self.array.__array_interface__["data"][0]
        )


#: Triton's request flags (``pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_*``).
REQUEST_FLAG_SEQUENCE_START = 1
REQUEST_FLAG_SEQUENCE_END = 2


@dataclass(slots=True)
class Timing:
    """Nanoseconds a backend spent on one batch, split as Triton's compute input/infer/output."""

    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0


class Outputs(dict[str, np.ndarray]):
    """A response's outputs and the response parameters its model gave (KServe v2; empty: none).

    A dict, so that everything that handles outputs handles these unchanged; frontends put
    ``parameters`` into their replies (IPC header, KServe JSON and gRPC), and clients hand them back the
    same way.
    """

    __slots__ = ("parameters",)

    def __init__(self, outputs: Mapping[str, np.ndarray], parameters: Parameters = NO_PARAMETERS) -> None:
        super().__init__(outputs)
        self.parameters: Parameters = parameters


def response_parameters(outputs: Mapping[str, np.ndarray]) -> Parameters:
    """The response parameters ``outputs`` carry (none for a plain dict)."""
    return outputs.parameters if isinstance(outputs, Outputs) else NO_PARAMETERS


Result = dict[str, np.ndarray] | EdgeServerError


class Rescheduled(dict):  # type: ignore[type-arg]
    """The result of a request a Python model released with RESCHEDULE: it runs again, no answer yet.

    Only the sequence batcher of an ``iterative_sequence`` model receives it (it puts the request
    back in its queue); an empty dict, so that it is a :data:`Result` everywhere else.
    """

    __slots__ = ()


class ResponseSink(abc.ABC):
    """The receiving end of a streamed request: responses in order, then exactly one final.

    Producers (a decoupled model's response sender, the data plane for an ordinary model) call
    :meth:`put`; a response after the final one is refused with ``False``.  Consumers (the IPC
    frontend, the in-process iterators, the gRPC stream) implement :meth:`deliver`, which may run on
    any thread and must not block.  :meth:`cancel` is the consumer going away: later responses are
    dropped and the model can see it (``request.is_cancelled()``), unless the consumer
    :attr:`keeps_reading` (a BLS response iterator's ``cancel()``: the model is told, and what it
    still sends, its final response included, is delivered).  :attr:`on_final` runs once the final
    response is put, delivered or dropped: the request is over (a frontend gives its body back then).
    A sink that only passes responses on to another sink :attr:`relays` (one that classifies them,
    or a model's process sending them to the daemon): its final response is delivered even when
    cancelled, so that the request also ends at the far sink, which drops it there.
    """

    keeps_reading = False
    relays = False
    on_cancel: Callable[[], None] | None = None
    on_final: Callable[[], None] | None = None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finished = False
        self.cancelled = False
        self.responses = 0  # responses delivered, the final one included when it carried outputs
        self.model_sends = False  # a decoupled model sends the responses (and the final) itself

    def put(
        self, outputs: Mapping[str, np.ndarray] | None, error: EdgeServerError | None, *, final: bool
    ) -> bool:
        """Deliver one response (outputs, an error, or neither: a bare final); False once finished."""
        with self._lock:
            if self.finished:
                return False
            if final:
                self.finished = True
            dropped = self.cancelled and not self.keeps_reading and not (final and self.relays)
            if not dropped and (outputs is not None or error is not None):
                self.responses += 1
        if not dropped:
            if outputs is not None and type(outputs) is not Outputs:
                outputs = dict(outputs)
            self.deliver(outputs, error, final)  # type: ignore[arg-type]
        if final and self.on_final is not None:
            self.on_final()
        return True

    def cancel(self) -> None:
        self.cancelled = True
        if self.on_cancel is not None:  # the producer is elsewhere (a model's own process): tell it
            self.on_cancel()

    @abc.abstractmethod
    def deliver(
        self, outputs: dict[str, np.ndarray] | None, error: EdgeServerError | None, final: bool
    ) -> None:
        """Hand one response to the consumer; must not block (called on the model's threads)."""


class ModelAccess(Protocol):
    """Other models, as a pipeline or a Python model's BLS call reaches them: through the data plane.

    A request submitted here is validated, queued, batched with every other request for that model and
    counted in its statistics, exactly like a client's.  Pipelines call :meth:`submit` from
    done-callbacks on model worker threads, and BLS calls from inside a model's ``execute``.
    """

    def submit(self, request: InferRequest) -> Future[dict[str, np.ndarray]]:
        """Queue ``request``, or run it here where this thread's stated budget allows it.

        (``edge_server.scheduler.inline``: a worker inside its execute, say.)  Validation errors raise
        here, everything later arrives in the future.
        """
        ...

    def stream(self, request: InferRequest, sink: ResponseSink) -> None:
        """Run ``request`` and send its responses to ``sink`` (decoupled models: zero or many)."""
        ...

    def model_config(self, name: str, version: int | None = None) -> ModelConfig:
        """The config of the version a request for ``name`` would go to; raises if none serves."""
        ...

    def labels(self, name: str, version: int | None = None) -> Mapping[str, tuple[str, ...]]:
        """The class names of that version's outputs, by output name (its ``label_filename``s)."""
        ...

    def is_ready(self, name: str, version: int | None = None) -> bool: ...

    def load(self, name: str) -> None:
        """Load or reload ``name``; refused (``InvalidArgument``) where the control mode forbids it."""
        ...

    def unload(self, name: str) -> None: ...
