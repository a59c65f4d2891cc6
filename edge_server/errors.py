"""One error hierarchy for the whole server.

Every error carries a stable ``code`` (sent on the IPC wire and mapped once to an HTTP status by the
HTTP frontend) and a message that says what was expected and what came.  Errors that concern a single
request never take down a batch, an instance or the daemon.
"""

from __future__ import annotations

import reprlib

#: How much of a client's text an error message quotes (the repr's characters).
ECHO_LIMIT = 80
#: No error message is longer, whatever it quotes: the backstop for a quote not cut where it is made.
MAX_MESSAGE = 8192

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = ECHO_LIMIT
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 8
_REPR.maxlevel = 3


def shorten(text: object, limit: int = ECHO_LIMIT) -> str:
    """``repr(text)`` cut to about ``limit`` characters: the one way every frontend quotes a client.

    Strings and bytes keep their head and say their length (``'mmmm...' (60000 chars)``); anything
    else is cut by :mod:`reprlib`, which never builds the whole repr of a large container first.
    """
    if isinstance(text, (str, bytes)):
        if len(text) <= limit:
            return repr(text)
        unit = "chars" if isinstance(text, str) else "bytes"
        return repr(text[: max(8, limit - 20)]) + f"... ({len(text)} {unit})"
    return _REPR.repr(text)


class EdgeServerError(Exception):
    """Root of every error edge-server raises on purpose.

    A message over :data:`MAX_MESSAGE` characters is cut there, so that no reply on any frontend ever
    carries a client's text back whole, even where a message forgot to :func:`shorten` it.
    """

    code: str = "INTERNAL"
    http_status: int = 500
    #: the gRPC status name where it is not the one the HTTP status maps to (kserve/service.py)
    grpc_status: str | None = None

    def __init__(self, message: str) -> None:
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 40] + f"... (message cut, {len(message)} chars)"
        super().__init__(message)
        self.message = message

    def restated(self, message: str) -> EdgeServerError:
        """The same error (class, code, attributes) with ``message``; subclasses' constructors differ."""
        error = type(self).__new__(type(self))
        error.__dict__.update(self.__dict__)
        EdgeServerError.__init__(error, message)
        return error


class InvalidArgument(EdgeServerError):
    """The request is malformed: wrong tensor name, dtype, shape, batch size or option."""

    code = "INVALID_ARGUMENT"
    http_status = 400


class ModelNotFound(EdgeServerError):
    """No such model or version is known to the repository."""

    code = "MODEL_NOT_FOUND"
    http_status = 404


class UnknownModel(ModelNotFound):
    """No model of that name at all (Triton: "Request for unknown model: 'X' is not found").

    The same stable code as :class:`ModelNotFound` (IPC clients see no difference); over HTTP and gRPC
    Triton's statuses for it, 400 and INVALID_ARGUMENT, which its clients and tools expect.
    """

    http_status = 400
    grpc_status = "INVALID_ARGUMENT"


def unknown_model(name: object, detail: str = "is not found") -> str:
    """Triton's text for a request naming a model (or version) it cannot serve; its tools match it."""
    return f"Request for unknown model: {shorten(name)} {detail}"


def failed_to_poll(name: object, detail: str) -> str:
    """Triton's text for a load refused before any version was tried (its clients match the head)."""
    return f"failed to load {shorten(name)}, failed to poll from model repository ({detail})"


class ModelNotReady(EdgeServerError):
    """The model exists but cannot take requests now (loading, unloading, failed)."""

    code = "MODEL_NOT_READY"
    http_status = 503


class QueueFull(EdgeServerError):
    """The model's queue is at ``max_queue_size``; the request was rejected, not queued."""

    code = "QUEUE_FULL"
    http_status = 503


class TooManyRequests(EdgeServerError):
    """A client, or all clients together, already have as many requests in flight as allowed."""

    code = "TOO_MANY_REQUESTS"
    http_status = 429


class RequestTimeout(EdgeServerError):
    """The request waited in the queue past its timeout."""

    code = "TIMEOUT"
    http_status = 504


class ModelExecutionError(EdgeServerError):
    """The backend or user model code failed while executing this request."""

    code = "EXECUTION_FAILED"
    http_status = 500


class ModelUnknownError(ModelExecutionError):
    """A model failed with Triton's UNKNOWN code (``pb_utils.TritonError.UNKNOWN``).

    Triton's statuses for it: HTTP 400, gRPC UNKNOWN; its clients and tests tell it from INTERNAL.
    """

    code = "UNKNOWN"
    http_status = 400
    grpc_status = "UNKNOWN"


class InstanceFailed(ModelExecutionError):
    """The model instance that ran this request failed in a way it cannot recover from.

    A crashed isolated Python model process (``os._exit``, a segfault in native code, an OOM kill), or
    a lost CUDA context (a sticky CUDA error).  A kind of execution failure, with a code of its own:
    where a plain :class:`ModelExecutionError` says "this request failed", a backend raises this to
    say "this instance can never serve again", and the scheduler takes the instance out of service and
    restarts it while the version's other instances keep serving.
    Requests that were in flight on the instance fail with this error; the same request sent again
    may succeed on a restarted or another instance (unless the request itself crashes the model).
    """

    code = "INSTANCE_FAILED"
    http_status = 500


class ConfigError(EdgeServerError):
    """A model's configuration or files are invalid; that model (version) does not load."""

    code = "INVALID_CONFIG"
    http_status = 400


class Unavailable(EdgeServerError):
    """Something the request needs is not available now; trying again later may succeed.

    Also what a Python model's ``TritonError(..., TritonError.UNAVAILABLE)`` becomes.
    """

    code = "UNAVAILABLE"
    http_status = 503


class PermissionDenied(EdgeServerError):
    """The caller may not do this: control operations are for the daemon's user, group or operators."""

    code = "PERMISSION_DENIED"
    http_status = 403


class ServerShuttingDown(Unavailable):
    """The server is draining or stopped and takes no new requests."""


class NotFound(EdgeServerError):
    """A model said that something the request names does not exist (``TritonError.NOT_FOUND``).

    Not MODEL_NOT_FOUND: the model was found and ran; what it looked up was not.
    """

    code = "NOT_FOUND"
    http_status = 404


class Unsupported(EdgeServerError):
    """Something asked for is not supported: a protocol feature, or what a model refuses.

    CUDA shared memory over KServe, or ``TritonError.UNSUPPORTED`` from a model.
    """

    code = "UNSUPPORTED"
    http_status = 501


class AlreadyExists(EdgeServerError):
    """A model said that what the request would create exists already (``TritonError.ALREADY_EXISTS``)."""

    code = "ALREADY_EXISTS"
    http_status = 409


class Cancelled(EdgeServerError):
    """The request was cancelled by its caller before it ran."""

    code = "CANCELLED"
    http_status = 499


class UnsupportedBackend(ConfigError):
    """The config names a backend (or platform) edge-server does not have at all: pytorch, openvino, ...

    Different from :class:`BackendUnavailable`, which is a backend edge-server has but this machine
    cannot run.
    """

    code = "UNSUPPORTED_BACKEND"


class BackendUnavailable(EdgeServerError):
    """The backend named by the config needs software or hardware this machine lacks."""

    code = "BACKEND_UNAVAILABLE"
    http_status = 400


# -- IPC protocol and shared memory (edge_server.ipc, edge_server.client) --------------------------


class ProtocolError(EdgeServerError):
    """A message on the IPC socket does not follow the wire protocol (docs/protocol.md)."""

    code = "PROTOCOL_ERROR"
    http_status = 400


class MalformedMessage(ProtocolError):
    """Garbage or truncated frames, a header that is not msgpack, a missing or mistyped field."""

    code = "MALFORMED_MESSAGE"


class UnsupportedProtocolVersion(ProtocolError):
    """The message carries a protocol version this server does not speak."""

    code = "UNSUPPORTED_VERSION"


class UnknownOperation(ProtocolError):
    """The header's ``op`` names no operation of this protocol version."""

    code = "UNKNOWN_OP"


class TensorSizeMismatch(ProtocolError):
    """A tensor's bytes (inline frame or shared-memory reference) disagree with its datatype and shape."""

    code = "TENSOR_SIZE_MISMATCH"


class MessageTooLarge(ProtocolError):
    """The message is larger than the configured limit; send big tensors through shared memory."""

    code = "MESSAGE_TOO_LARGE"
    http_status = 413


class SharedMemoryError(EdgeServerError):
    """A shared-memory registration or reference cannot be honoured."""

    code = "SHM_ERROR"
    http_status = 400


class ShmNotRegistered(SharedMemoryError):
    """The reference names a region this client has not registered (or has unregistered)."""

    code = "SHM_NOT_REGISTERED"


class ShmOutOfBounds(SharedMemoryError):
    """offset + byte_size reaches past the end of the registered region, or an output does not fit."""

    code = "SHM_OUT_OF_BOUNDS"


class ShmNameRejected(SharedMemoryError):
    """The segment name is outside the configured prefix or contains characters a name may not have."""

    code = "SHM_NAME_REJECTED"


class ShmUnavailable(SharedMemoryError):
    """The segment does not exist, is not a regular shared-memory file, or cannot be mapped."""

    code = "SHM_UNAVAILABLE"


class ShmCannotOpen(ShmUnavailable):
    """The segment a key names cannot be opened (there is none, or no permission).

    gRPC INTERNAL, as Triton answers ("Unable to open shared memory region"); its QA checks the status.
    """

    grpc_status = "INTERNAL"


class ShmAlreadyRegistered(SharedMemoryError):
    """The client already registered a region under that name."""

    code = "SHM_ALREADY_REGISTERED"


class DaemonNotRunning(EdgeServerError):
    """No daemon answers at any address a client tried."""

    code = "DAEMON_NOT_RUNNING"
    http_status = 503


class AddressInUse(EdgeServerError):
    """Another live daemon already listens on the IPC address."""

    code = "ADDRESS_IN_USE"
    http_status = 500


class ConnectionLost(EdgeServerError):
    """Client side: the daemon went away while the request was in flight; its reply will never come.

    The client reconnects by itself; the same request sent again after the daemon is back succeeds.
    """

    code = "CONNECTION_LOST"
    http_status = 503


class ReplyTimeout(RequestTimeout):
    """Client side: no reply within the caller's timeout (the daemon may be down or overloaded)."""

    code = "TIMEOUT"


# -- tools (edge_server.tools, edge_server.dla) ------------------------------------------------------


class MissingDependency(EdgeServerError):
    """An optional package a tool needs is not installed; the message names the package and the extra."""

    code = "MISSING_DEPENDENCY"
    http_status = 500
