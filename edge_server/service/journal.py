"""Log records to journald with structured fields, through its native datagram protocol.

Under systemd the daemon's output already reaches the journal, one line per record with a ``<N>``
priority prefix; this handler adds what a line cannot carry: ``MODEL=``, ``VERSION=`` and
``REQUEST_ID=`` (from a record's ``extra``), the logger, thread and code location, so that
``journalctl -u edge-server MODEL=detector`` finds one model's lines.  It is used only when stderr is
the journal stream systemd set up (``$JOURNAL_STREAM``) and the journal socket exists; a record the
socket refuses (too large) goes to stderr instead.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys

JOURNAL_SOCKET = "/run/systemd/journal/socket"
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}
# LogRecord attributes (given with extra=...) that become journal fields.
EXTRA_FIELDS = {"model": "MODEL", "version": "VERSION", "request_id": "REQUEST_ID"}


def stderr_is_journal() -> bool:
    """``$JOURNAL_STREAM`` is ``device:inode`` of the journal stream; it must be our stderr's."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        device, inode = (int(part) for part in value.split(":"))
        info = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (info.st_dev, info.st_ino) == (device, inode)


def _field(name: str, value: object) -> bytes:
    data = str(value).encode("utf-8", "replace")
    if b"\n" in data:  # the binary form: name, newline, 64-bit little-endian length, data
        return name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return name.encode() + b"=" + data + b"\n"


class JournalHandler(logging.Handler):
    def __init__(self, path: str = JOURNAL_SOCKET, identifier: str = "edge-server") -> None:
        super().__init__()
        self.path = path
        self.identifier = identifier
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            fields = [
                _field("MESSAGE", message),
                _field("PRIORITY", _PRIORITY.get(record.levelno, 6)),
                _field("SYSLOG_IDENTIFIER", self.identifier),
                _field("LOGGER", record.name),
                _field("THREAD_NAME", record.threadName),
                _field("CODE_FILE", record.pathname),
                _field("CODE_LINE", record.lineno),
                _field("CODE_FUNC", record.funcName),
            ]
            for attribute, name in EXTRA_FIELDS.items():
                value = getattr(record, attribute, None)
                if value is not None:
                    fields.append(_field(name, value))
            try:
                self._sock.sendto(b"".join(fields), self.path)
            except OSError:  # too large for one datagram, or the journal is gone: the line still goes out
                sys.stderr.write(f"<{_PRIORITY.get(record.levelno, 6)}>{message}\n")
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self._sock.close()
        super().close()
