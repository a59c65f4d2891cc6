"""One error hierarchy for the whole server.

Every error carries a stable ``code`` (sent on the IPC wire and mapped once to an HTTP status by the
HTTP frontend) and a message that says what was expected and what came.  Errors that concern a single
request never take down a batch, an instance or the daemon.
"""

from __future__ import annotations


class EdgeServerError(Exception):
    """Root of every error edge-server raises on purpose."""

    code: str = "INTERNAL"
    http_status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(EdgeServerError):
    """The request is malformed: wrong tensor name, dtype, shape, batch size or option."""

    code = "INVALID_ARGUMENT"
    http_status = 400


class ModelNotFound(EdgeServerError):
    """No such model or version is known to the repository."""

    code = "MODEL_NOT_FOUND"
    http_status = 404


class ModelNotReady(EdgeServerError):
    """The model exists but cannot take requests now (loading, unloading, failed)."""

    code = "MODEL_NOT_READY"
    http_status = 503


class QueueFull(EdgeServerError):
    """The model's queue is at ``max_queue_size``; the request was rejected, not queued."""

    code = "QUEUE_FULL"
    http_status = 503


class RequestTimeout(EdgeServerError):
    """The request waited in the queue past its timeout."""

    code = "TIMEOUT"
    http_status = 504


class ModelExecutionError(EdgeServerError):
    """The backend or user model code failed while executing this request."""

    code = "EXECUTION_FAILED"
    http_status = 500


class ConfigError(EdgeServerError):
    """A model's configuration or files are invalid; that model (version) does not load."""

    code = "INVALID_CONFIG"
    http_status = 400


class ServerShuttingDown(EdgeServerError):
    """The server is draining or stopped and takes no new requests."""

    code = "UNAVAILABLE"
    http_status = 503


class Cancelled(EdgeServerError):
    """The request was cancelled by its caller before it ran."""

    code = "CANCELLED"
    http_status = 499


class BackendUnavailable(EdgeServerError):
    """The backend named by the config needs software or hardware this machine lacks."""

    code = "BACKEND_UNAVAILABLE"
    http_status = 400
