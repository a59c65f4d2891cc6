"""Triton's log and trace settings: one object behind HTTP and gRPC, so that both answer the same.

HTTP's ``/v2/logging`` and ``/v2/trace/setting`` and gRPC's ``LogSettings`` and ``TraceSetting`` all
call it.

What the daemon can change while it runs is applied: ``log_verbose_level`` sets the process's log
level (0: info, 1 or more: debug, as ``--log-verbose``), and ``log_info``/``log_warning``/``log_error``
drop or keep records of that severity at the process's log handlers.  What it cannot change is refused,
naming the setting: another ``log_format`` or ``log_file`` (``--log-format`` and the service's output
choose them at start), and any trace setting but the current one (edge-server does not trace
requests; a setting equal to the current value, or a null that clears a model's setting, is accepted
and changes nothing).  A GET reports what is in force.

Python models running in their own process (``EXECUTION_ENV_PATH``) take the log level once, when
they start; a change reaches them at their next load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from edge_server.errors import InvalidArgument, shorten

_TOGGLES: dict[str, tuple[int, ...]] = {
    "log_info": (logging.INFO,),
    "log_warning": (logging.WARNING,),
    "log_error": (logging.ERROR, logging.CRITICAL),
}

# Triton's trace settings as an edge-server that never traces reports them (strings, as Triton's).
TRACE_SETTINGS: dict[str, Any] = {
    "trace_level": ["OFF"],
    "trace_rate": "1000",
    "trace_count": "-1",
    "log_frequency": "0",
    "trace_file": "",
    "trace_mode": "triton",
}


class _SeverityFilter(logging.Filter):
    """Drops the records of the severities a client turned off (``log_info: false`` and so on)."""

    def __init__(self) -> None:
        super().__init__("edge-server-log-settings")
        self.dropped: frozenset[int] = frozenset()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno not in self.dropped


class RuntimeSettings:
    """The daemon's log settings as Triton names them, applied to the process's logging."""

    def __init__(self, *, log_verbose: int | None = None, log_format: str = "default") -> None:
        root = logging.getLogger()
        if log_verbose is None:  # started without the flag's value: what the root logger says
            log_verbose = 1 if root.getEffectiveLevel() <= logging.DEBUG else 0
        self._verbose = max(0, int(log_verbose))
        self._format = log_format
        self._enabled = dict.fromkeys(_TOGGLES, True)
        self._filter = _SeverityFilter()
        self._lock = threading.Lock()

    def log_settings(self) -> dict[str, Any]:
        with self._lock:
            return {
                "log_file": "",
                **self._enabled,
                "log_verbose_level": self._verbose,
                "log_format": self._format,
            }

    def update_log(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Check every change first, then apply them all (or none), and return the settings."""
        verbose: int | None = None
        toggles: dict[str, bool] = {}
        for key, value in changes.items():
            if value is None:  # tritonclient's "no value": nothing to change
                continue
            if key == "log_verbose_level":
                if type(value) is not int or not 0 <= value < 1 << 32:
                    raise InvalidArgument(
                        f"log setting log_verbose_level must be an unsigned integer, got {shorten(value)}"
                    )
                verbose = value
            elif key in _TOGGLES:
                if type(value) is not bool:
                    raise InvalidArgument(f"log setting {key} must be a boolean, got {shorten(value)}")
                toggles[key] = value
            elif key == "log_format":
                if value != self._format:
                    raise InvalidArgument(
                        f"log setting log_format cannot change while the daemon runs ({self._format!r} "
                        f"now, {shorten(value)} asked): restart it with --log-format"
                    )
            elif key == "log_file":
                if value != "":
                    raise InvalidArgument(
                        "log setting log_file is not supported: edge-server logs to stderr (the journal "
                        "under systemd); redirect it there"
                    )
            else:
                raise InvalidArgument(f"unknown log setting {shorten(key)}")
        with self._lock:
            if verbose is not None:
                self._verbose = verbose
                logging.getLogger().setLevel(logging.DEBUG if verbose > 0 else logging.INFO)
            if toggles:
                self._enabled.update(toggles)
                self._filter.dropped = frozenset(
                    level for key, on in self._enabled.items() if not on for level in _TOGGLES[key]
                )
                for handler in logging.getLogger().handlers:
                    if self._filter not in handler.filters:
                        handler.addFilter(self._filter)
        if verbose is not None or toggles:
            logging.getLogger(__name__).info("log settings changed by a client: %s", self.log_settings())
        return self.log_settings()

    @staticmethod
    def trace_settings() -> dict[str, Any]:
        return {
            key: list(value) if isinstance(value, list) else value for key, value in TRACE_SETTINGS.items()
        }

    def update_trace(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """Accept what leaves tracing as it is (off); refuse, naming it, any setting that would not."""
        for key, value in changes.items():
            if key not in TRACE_SETTINGS:
                raise InvalidArgument(f"unknown trace setting {shorten(key)}")
            if value is None or value == []:  # clear a model's setting: it has none of its own
                continue
            current = TRACE_SETTINGS[key]
            values = value if isinstance(value, list) else [value]
            asked = [str(v) for v in values]
            if asked != (current if isinstance(current, list) else [current]):
                raise InvalidArgument(
                    f"trace setting {key} {shorten(value)} is not supported: edge-server does not trace "
                    f"requests (trace settings stay {self.trace_settings()})"
                )
        return self.trace_settings()
