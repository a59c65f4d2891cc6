"""Which model is calling: the module-level parts of ``pb_utils`` that depend on it.

In Triton every model instance runs in its own stub process, so ``pb_utils.get_model_dir()`` and
``pb_utils.Logger`` know their model from the process.  Here every Python model shares one
``triton_python_backend_utils`` module, so the Python backend marks the thread that is running a
model's ``auto_complete_config``/``initialize``/``execute``/``finalize`` with that model, and these
helpers read the mark.  From a thread the model started itself, ``get_model_dir()`` falls back to
the directory of the calling file, which is the version directory when the caller is ``model.py``,
and BLS calls find their model by the module of the calling code (each instance imports ``model.py``
and its sibling modules into a package of its own, registered here while the instance is loaded).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edge_server.request import ClientKey, ModelAccess

_log = logging.getLogger("edge_server.models")


@dataclass(frozen=True)
class ModelContext:
    instance_name: str  # "<model>_<group>_<index>", or the model name during auto-complete
    model_dir: Path  # the version directory, where model.py is
    models: ModelAccess | None = None  # other models, for BLS calls
    model_name: str = ""
    model_version: int = 0
    instances: int = 1  # instances of this model version (a self-call from the only one never runs)
    executing: bool = False  # set while the instance's worker runs ``execute`` (not initialize)


_current = threading.local()
# package of an instance's modules (pb_imports) -> its context, for code on the model's own threads
_by_module: dict[str, ModelContext] = {}
_by_module_lock = threading.Lock()


def register_module(package: str, context: ModelContext) -> None:
    """Code of any module inside ``package`` (``model.py`` and its siblings) is ``context``'s model."""
    with _by_module_lock:
        _by_module[package] = context


def unregister_module(package: str) -> None:
    with _by_module_lock:
        _by_module.pop(package, None)


def calling_model() -> ModelContext | None:
    """The model whose code is calling: this thread's mark, else the nearest model module on the stack."""
    context = current()
    if context is not None:
        return context
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        found = _by_module.get(str(frame.f_globals.get("__name__", "")).partition(".")[0])
        if found is not None:
            return found
        frame = frame.f_back
    return None


@contextlib.contextmanager
def running(context: ModelContext) -> Iterator[None]:
    """Mark this thread as running ``context``'s model code for the duration of the block."""
    previous = getattr(_current, "context", None)
    _current.context = context
    try:
        yield
    finally:
        _current.context = previous


def mark(context: ModelContext | None) -> ModelContext | None:
    """Set this thread's mark and return the previous one: :func:`running` without a generator.

    The Python backend's execute() pays this on every request (a generator-based context manager
    costs several times more); restore with ``mark(previous)`` in a ``finally``.
    """
    previous = getattr(_current, "context", None)
    _current.context = context
    return previous


def current() -> ModelContext | None:
    return getattr(_current, "context", None)


# The client whose request the model's code works on now (a context variable: each thread, and each
# task of an ``async def execute``, has its own; a task started in ``execute`` inherits it).
_acting_for: contextvars.ContextVar[ClientKey | None] = contextvars.ContextVar(
    "edge_acting_for", default=None
)


def act_for(client: ClientKey | None) -> contextvars.Token[ClientKey | None]:
    """From now on this thread (or task) works for ``client``; ``stop_acting(token)`` undoes it.

    Set to the batch's first request's client for ``execute``, and to a request's client each time the
    model reads that request's inputs, so that a BLS call built then waits its turn as that client's
    (``scheduler.queue``) instead of as an anonymous one beside every other user's calls.
    """
    return _acting_for.set(client)


def stop_acting(token: contextvars.Token[ClientKey | None]) -> None:
    _acting_for.reset(token)


def acting_for() -> ClientKey | None:
    return _acting_for.get()


def get_model_dir() -> str:
    """The version directory of the calling model (Triton: the directory holding ``model.py``)."""
    context = current()
    if context is not None:
        return str(context.model_dir)
    caller = sys._getframe(1).f_globals.get("__file__")  # the calling model file
    if caller:
        return str(Path(caller).resolve().parent)
    raise RuntimeError("get_model_dir() is only available to model code")


class LogLevel(enum.IntEnum):
    """``pb_utils.Logger.LogLevel``; VERBOSE goes to the DEBUG level of our logging."""

    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_LEVELS = {
    LogLevel.INFO: logging.INFO,
    LogLevel.WARNING: logging.WARNING,
    LogLevel.ERROR: logging.ERROR,
    LogLevel.VERBOSE: logging.DEBUG,
}


class Logger:
    """``pb_utils.Logger``: a model's messages go to the ``edge_server.models`` logger.

    Each message is prefixed with the instance that logged it, and the record carries the model
    file's name and line (as Triton's log lines do).
    """

    LogLevel = LogLevel
    # Triton exports the levels onto the class too: ``Logger.log(msg, pb_utils.Logger.INFO)``
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: int = 0) -> None:  # 0: LogLevel.INFO
        Logger._emit(str(message), _LEVELS.get(LogLevel(level), logging.INFO))

    @staticmethod
    def log_info(message: str) -> None:
        Logger._emit(str(message), logging.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger._emit(str(message), logging.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger._emit(str(message), logging.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger._emit(str(message), logging.DEBUG)

    @staticmethod
    def _emit(message: str, level: int) -> None:
        context = current()
        who = context.instance_name if context is not None else "python model"
        # stacklevel 3: the model's call to log_*, above _emit and the log_* method
        _log.log(level, "%s: %s", who, message, stacklevel=3)
