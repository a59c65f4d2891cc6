"""``GET /metrics``: the Prometheus text format on its own port (Triton's 8002), loopback by default.

Each connection is counted in the daemon's budget (:class:`~edge_server.limits.Limits`) and served by a
thread of its own, at most :data:`~edge_server.limits.METRICS_CONNECTIONS` at once (more are closed at
accept), and one that has not sent its request within the header timeout is closed: idle connections
cannot pile up threads or descriptors.

prometheus-client writes the text; this module only serves it.  Its writer names a counter's HELP and
TYPE lines ``<name>_total``; Triton's counters have no ``_total`` in their samples, so those two lines
are renamed to the sample name and the output reads exactly like Triton's.
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from edge_server.backends.python_metrics import REGISTRY as MODEL_METRICS
from edge_server.errors import AddressInUse
from edge_server.kserve.shm import Peer, peer_uid
from edge_server.limits import METRICS_CONNECTIONS, Connection, Limits
from edge_server.metrics.collector import FAILURE, REQUEST_DURATION, TRITON_COUNTERS
from edge_server.metrics.device import DeviceCollector

log = logging.getLogger(__name__)

_RENAMES = [
    (f"# {kind} {name}_total ".encode(), f"# {kind} {name} ".encode())
    for name in (*TRITON_COUNTERS, FAILURE, REQUEST_DURATION)
    for kind in ("HELP", "TYPE")
]


def registry_with(*collectors: Any, device_root: str = "/") -> CollectorRegistry:
    """A registry of ``collectors`` plus the process (CPU, memory), the device, and Python models' metrics."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    ProcessCollector(registry=registry)
    registry.register(DeviceCollector(device_root))
    registry.register(MODEL_METRICS)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text, with Triton's counter names: no ``_total`` on Triton's own or Python models' counters."""
    text = generate_latest(registry)
    for old, new in _RENAMES:
        text = text.replace(old, new)
    for name in MODEL_METRICS.counter_names():
        for kind in ("HELP", "TYPE"):
            text = text.replace(f"# {kind} {name}_total ".encode(), f"# {kind} {name} ".encode())
    return text


class _BoundedServer(ThreadingHTTPServer):
    """One thread per connection, as many as the budget and :data:`METRICS_CONNECTIONS` allow."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, limits: Limits) -> None:
        super().__init__(address, handler)
        self.limits = limits
        self._busy = 0
        self._busy_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        host, port = client_address[0], int(client_address[1])
        peer = Peer(host, port, int(self.server_address[1]), str(self.server_address[0]))
        connection = self.limits.connect(peer_uid(peer))
        with self._busy_lock:
            refusal = connection.refusal
            if refusal is None and self._busy >= METRICS_CONNECTIONS:
                refusal = f"{self._busy} connections are being served, the endpoint's limit"
            if refusal is None:
                self._busy += 1
        if refusal is not None:
            self.limits.disconnect(connection)
            log.info("metrics: connection refused: %s", refusal)
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self._serve_counted, args=(request, client_address, connection), daemon=True
        )
        thread.start()

    def _serve_counted(self, request: socket.socket, client_address: Any, connection: Connection) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._busy_lock:
                self._busy -= 1
            self.limits.disconnect(connection)


class MetricsEndpoint:
    """An HTTP server thread answering ``/metrics``; ``port`` 0 picks a free one (see :attr:`port`)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        address: str = "127.0.0.1",
        port: int = 8002,
        limits: Limits | None = None,
    ) -> None:
        self.registry = registry
        budget = limits or Limits()

        class Handler(BaseHTTPRequestHandler):
            timeout = budget.header_timeout_s  # the socket's: a connection that sends nothing is closed

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                try:
                    body = exposition(registry)
                except Exception:  # a broken collector answers 500; the daemon goes on
                    log.exception("collecting metrics failed")
                    self.send_error(500, "collecting metrics failed")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("metrics: " + format, *args)

        self._httpd = _BoundedServer((address, port), Handler, budget)
        self.address = address
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="edge-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", self.address, self.port)

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()


def serve_metrics(
    collector: Any, *, address: str, port: int, limits: Limits | None = None
) -> MetricsEndpoint:
    """The daemon's endpoint over ``collector``; a port that cannot be bound is a start-up error."""
    try:
        endpoint = MetricsEndpoint(registry_with(collector), address, port, limits)
    except OSError as exc:
        raise AddressInUse(
            f"cannot serve metrics on {address}:{port}: {exc.strerror}; pass --metrics-port PORT or "
            "--allow-metrics false"
        ) from exc
    endpoint.start()
    return endpoint
