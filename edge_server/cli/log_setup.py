"""Logging for every command: one set-up per process, structured fields for journald under systemd."""

from __future__ import annotations

import json
import logging
import os

from edge_server.service.journal import JOURNAL_SOCKET, JournalHandler, stderr_is_journal


def configure_logging(verbose: int, fmt: str) -> None:
    """One logging set-up for the process; under journald (JOURNAL_STREAM set) timestamps are left out."""
    level = logging.DEBUG if verbose > 0 else logging.INFO
    if fmt == "json":
        formatter: logging.Formatter = _JsonFormatter()
    elif os.environ.get("JOURNAL_STREAM") and fmt == "default":
        formatter = _JournalFormatter("%(name)s: %(message)s")
    else:
        datefmt = "%Y-%m-%dT%H:%M:%S" if fmt == "ISO8601" else None
        formatter = logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt)
    handler: logging.Handler = logging.StreamHandler()
    if fmt == "default" and os.path.exists(JOURNAL_SOCKET) and stderr_is_journal():
        handler = JournalHandler()  # structured fields (MODEL=, VERSION=) besides the message
        formatter = logging.Formatter("%(name)s: %(message)s")
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class _JournalFormatter(logging.Formatter):
    """journald reads a syslog priority from a ``<N>`` prefix on each stdout line and adds the time."""

    _PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self._PRIORITY.get(record.levelno, 6)}>{super().format(record)}"


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "ts": record.created,
                "level": record.levelname,
                "logger": record.name,
                "msg": record.getMessage(),
            }
        )
