"""systemd's notify protocol (``sd_notify(3)``): newline-separated ``KEY=VALUE`` lines in one datagram.

A dozen lines of socket code instead of a dependency.  With no ``NOTIFY_SOCKET`` (not started by
systemd with ``Type=notify``) every call does nothing, so the daemon never has to ask.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends state lines to the service manager named by ``NOTIFY_SOCKET``.

    The variables are read once and, by default, removed from ``environ`` (``sd_notify``'s
    ``unset_environment``) so that processes the daemon starts (model stubs, tools) cannot notify in
    its name.
    """

    def __init__(self, environ: MutableMapping[str, str] | None = None, *, unset: bool = True) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        self.watchdog_s = watchdog_interval(env)
        if unset:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                env.pop(key, None)
        self._address: str | None = None
        self._sock: socket.socket | None = None
        if address.startswith("@"):  # the abstract namespace: a leading NUL byte instead of '@'
            self._address = "\0" + address[1:]
        elif address.startswith("/"):
            self._address = address
        elif address:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket path; systemd notifications are off", address)
        if self._address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *lines: str) -> bool:
        """Send ``lines`` (``"READY=1"``, ``"STATUS=..."``) as one message; False if it could not go."""
        if self._sock is None or self._address is None or not lines:
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError as exc:  # the manager went away or its queue is full: never fatal
            log.debug("systemd notification %r not sent: %s", lines, exc)
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``WatchdogSec=``), or None when not asked for.

    ``WATCHDOG_PID``, when set, must be this process: a child that inherited the variables is not
    the one systemd watches (``sd_watchdog_enabled(3)``).
    """
    try:
        usec = int(environ.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    pid = environ.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2e6
