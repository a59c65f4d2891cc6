"""The KServe v2 HTTP frontend's server: :class:`~edge_server.kserve.http.KServeHttpApp` under uvicorn.

uvicorn runs with httptools (our protocol class: :mod:`edge_server.kserve.http_protocol`, which counts
connections and bodies in the daemon's budget), and uvloop when present, on a thread and event loop of
its own.  The listening socket is bound here, so that a port in use is an error at start.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from edge_server.errors import AddressInUse
from edge_server.kserve.http import DEFAULT_MAX_BODY_BYTES, KServeHttpApp
from edge_server.kserve.http_protocol import http_protocol
from edge_server.kserve.service import KServeService
from edge_server.limits import Limits

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)


class HttpFrontend:
    """Runs :class:`KServeHttpApp` under uvicorn on a thread of its own; ``port`` 0 picks a free one."""

    def __init__(
        self,
        service: KServeService,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        drain_timeout: float = 5.0,
        limits: Limits | None = None,
    ) -> None:
        self.app = KServeHttpApp(service, max_body_bytes=max_body_bytes)
        self.limits = limits or Limits()  # the daemon's; alone, one of the frontend's own
        self.host = host
        self.port = port
        self.drain_timeout = drain_timeout
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Bind (errors raise here) and serve; returns once connections are accepted."""
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(1024)
        except OSError as exc:
            sock.close()
            raise AddressInUse(
                f"the HTTP frontend cannot bind {self.host}:{self.port}: {exc.strerror}"
            ) from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            http=http_protocol(self.limits, self.app.max_body_bytes, self.app),
            loop=_loop_impl(),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=max(1, int(self.drain_timeout)),
            server_header=False,
            date_header=False,
            # The client is the socket's peer, never what a header says (and the middleware costs time).
            proxy_headers=False,
            timeout_keep_alive=self.limits.idle_timeout_s,  # type: ignore[arg-type]
        )
        server = uvicorn.Server(config)
        self._server = server
        started = threading.Event()

        def run() -> None:
            try:
                server.run(sockets=[sock])
            except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
                self._failed = exc
                log.exception("the HTTP frontend stopped")
            finally:
                sock.close()
                started.set()

        self._thread = threading.Thread(target=run, name="edge-http-frontend", daemon=True)
        self._thread.start()
        while not started.wait(0.01):
            if server.started:
                break
        if self._failed is not None:
            raise RuntimeError(f"the HTTP frontend did not start: {self._failed}")
        self._loop = server.servers[0].get_loop()
        log.info("HTTP frontend (KServe v2) listening on %s:%d", self.host, self.port)

    def call_soon(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` on the frontend's event loop (the watchdog's probe); False if the loop is gone."""
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # closed
            return False
        return True

    def refuse_new(self) -> None:
        """Close the listening socket; open requests go on (uvicorn's graceful shutdown begins)."""
        if self._server is not None:
            self._server.should_exit = True

    def close(self) -> None:
        """Stop accepting, let open requests finish (up to the drain timeout), stop the loop."""
        if self._server is None or self._thread is None:
            return
        self.refuse_new()
        self._thread.join(self.drain_timeout + 5)
        self._server = None


def _loop_impl() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"
