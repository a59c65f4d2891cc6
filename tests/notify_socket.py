"""The service manager's end of systemd's notify protocol: a real AF_UNIX datagram socket."""

from __future__ import annotations

import socket
import time
from pathlib import Path


class NotifySocket:
    """Bound at ``path``; collects every message (a dict of its ``KEY=VALUE`` lines) with its arrival time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._cursor = 0  # wait_for looks at messages from here on

    def poll(self, timeout: float) -> list[dict[str, str]]:
        """Every message that arrives within the next ``timeout`` s."""
        got: list[dict[str, str]] = []
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return got
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if line)
            self.messages.append((time.monotonic(), fields))
            got.append(fields)
        return got

    def wait_for(self, key: str, value: str | None = None, timeout: float = 30.0) -> dict[str, str]:
        """The next message (after the last one ``wait_for`` returned) carrying ``key`` (= ``value``)."""
        deadline = time.monotonic() + timeout
        while True:
            while self._cursor < len(self.messages):
                fields = self.messages[self._cursor][1]
                self._cursor += 1
                if key in fields and (value is None or fields[key] == value):
                    return fields
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {key}={value or '*'} within {timeout} s; got {self.messages[-5:]}")
            self.poll(min(remaining, 0.2))

    def since(self, t: float, key: str) -> list[dict[str, str]]:
        return [m for at, m in self.messages if at >= t and key in m]

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)
