"""The in-process API: the whole server as an object, no IPC (Triton's C API, in Python).

Applications import it directly; the daemon's frontends (IPC now, HTTP later) are thin layers over the
same object.  Construction loads the repository (in ``none`` and ``poll`` mode every model, in
``explicit`` mode the ``load_models``); a model that fails to load is reported in :meth:`models` and
the others serve.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from edge_server.access import LocalAccess, control_refused
from edge_server.backends.base import ONNXRUNTIME_THREAD_POLICIES
from edge_server.backends.tensorrt.rebuild import ENGINE_BUILD_MODES, EngineRebuilder
from edge_server.config.model import ModelConfig
from edge_server.dataplane import DataPlane
from edge_server.errors import EdgeServerError, InvalidArgument, ServerShuttingDown
from edge_server.lifecycle import DEFAULT_LOAD_TIMEOUT_S, ModelManager
from edge_server.loader import LoadEnvironment
from edge_server.memory import DeferredTrim
from edge_server.model_readiness import answered, version_ready
from edge_server.repository import Repositories
from edge_server.request import InferRequest, RequestOptions
from edge_server.routing import Routing, RoutingView
from edge_server.scheduler import inline
from edge_server.scheduler.summaries import SummaryOptions
from edge_server.status_index import Listener, NotLoaded, StatusIndex, VersionStatus
from edge_server.streaming import AsyncResponseIterator, ResponseIterator
from edge_server.versions import parse_version
from edge_server.watcher import RepositoryWatcher

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)


class ServiceView(Protocol):
    """What the daemon's service layer tells the server: readiness, and its part of :meth:`Server.status`."""

    def is_ready(self) -> bool: ...

    def describe(self) -> dict[str, Any]: ...


ControlMode = Literal["none", "explicit", "poll"]
CONTROL_MODES: tuple[str, ...] = ("none", "explicit", "poll")


def default_repository() -> Path:
    """The bundled example repository (``models/`` beside the package in a source checkout)."""
    return Path(__file__).resolve().parent.parent / "models"


class Server:
    """An edge-server instance in this process.

    ``model_control_mode`` follows Triton: ``none`` loads everything and refuses load/unload calls,
    ``explicit`` loads ``load_models`` (``"*"`` for all) and obeys load/unload, ``poll`` loads
    everything and follows changes in the repository.
    """

    def __init__(
        self,
        model_repository: str | Path | Sequence[str | Path] | None = None,
        *,
        model_control_mode: ControlMode = "none",
        load_models: Iterable[str] = (),
        drain_timeout: float = 30.0,
        cpu_count: int | None = None,
        watch_quiet_s: float = 0.5,
        listeners: Iterable[Listener] = (),
        engine_build: str = "none",
        load_timeout: float = DEFAULT_LOAD_TIMEOUT_S,
        latency_summaries: SummaryOptions | None = None,
        onnxruntime_thread_policy: str = "auto",
        service: ServiceView | None = None,
        heap_trim: DeferredTrim | None = None,
    ) -> None:
        """``model_repository``: a folder, or several (Triton's repeated flag); default: ``models/``.

        Model names must be unique across several repositories (a name in two is refused, as in Triton).

        ``watch_quiet_s`` (poll mode): how long a model's files must see no change before it loads.

        ``listeners`` hear every model state change from the first load on (see ``add_listener``).
        ``engine_build="on-load"`` rebuilds TensorRT plans that cannot serve here (another TensorRT
        version or device, or missing) from the ONNX beside them, in the background, while the ONNX serves.
        ``latency_summaries``: every version keeps latency quantiles for Triton's summary metrics.
        ``onnxruntime_thread_policy``: auto, default or split (docs/batching.md, "ONNX Runtime threads").
        ``service``: the daemon's service layer (readiness, its part of :meth:`status`); None in-process.
        ``heap_trim``: the daemon's heap trim, asked for by every request with large inputs; None in-process.
        """
        if model_control_mode not in CONTROL_MODES:
            raise InvalidArgument(
                f"model_control_mode must be one of {list(CONTROL_MODES)}, got {model_control_mode!r}"
            )
        if onnxruntime_thread_policy not in ONNXRUNTIME_THREAD_POLICIES:
            raise InvalidArgument(
                f"onnxruntime_thread_policy must be one of {list(ONNXRUNTIME_THREAD_POLICIES)}, "
                f"got {onnxruntime_thread_policy!r}"
            )
        if model_repository is None:
            model_repository = default_repository()
        self.repositories = Repositories(
            [model_repository] if isinstance(model_repository, (str, Path)) else model_repository
        )
        self.control_mode = model_control_mode
        # The composition root: each part gets what it needs at construction.  The routing table and
        # the index are what the request path and the observers read; the data plane routes through
        # the routing view; pipelines and Python models reach other models through the data plane
        # (and the control, late-bound here, where the control mode allows); the lifecycle's control
        # writes the table and the index and loads with one frozen environment.
        self._index = StatusIndex(listeners)
        self._routing = Routing(self._index)
        self._dataplane = DataPlane(self._routing, heap_trim)
        access = LocalAccess(
            self._dataplane,
            self._routing,
            control_mode=model_control_mode,
            load=lambda name: self._manager.load(name),
            unload=lambda name: self._manager.unload(name),
        )
        self._rebuilder = self._engine_rebuilder(engine_build)
        env = LoadEnvironment(
            access=access,
            rebuilder=self._rebuilder,
            thread_policy=onnxruntime_thread_policy,
            summaries=latency_summaries,
            cpu_count=cpu_count,
        )
        # load_timeout: a load (a Python model's initialize() included) running longer is abandoned.
        self._manager = ModelManager(
            self.repositories,
            routing=self._routing,
            index=self._index,
            env=env,
            drain_timeout=drain_timeout,
            load_timeout=load_timeout,
        )
        # The daemon's service (edge_server.service.supervisor): readiness from its state (starting,
        # draining, strict readiness) and the daemon's part of status().  None in-process.
        self.service = service
        self._drain_timeout = drain_timeout
        self._closed = threading.Event()
        self._close_lock = threading.Lock()
        self.watcher: RepositoryWatcher | None = None
        if model_control_mode == "poll":
            # Watch before the first scan: a file that lands while the repository loads is not missed.
            self.watcher = RepositoryWatcher(
                self.repositories.roots,
                lambda names: self._manager.rescan(names, retry_failed=False),
                quiet_s=watch_quiet_s,
            )
            self.watcher.start()
        names = list(load_models)
        try:
            if model_control_mode == "explicit" and "*" not in names:
                for name in names:
                    try:
                        self._manager.load(name)
                    except EdgeServerError as exc:
                        log.error("model %s failed to load: %s", name, exc.message)
            else:
                self._manager.rescan()
        except BaseException:
            self.close()
            raise

    # -- inference ------------------------------------------------------------------------------

    def submit(
        self, model: str, inputs: Mapping[str, np.ndarray], **options: Unpack[RequestOptions]
    ) -> Future[dict[str, np.ndarray]]:
        """Queue a request and return at once; for many requests in flight from one thread.

        ``options`` are :class:`~edge_server.request.InferRequest`'s fields: ``version``, ``outputs``,
        ``priority``, ``timeout_us``, ``request_id``, ``parameters``, ``correlation_id``,
        ``sequence_start``, ``sequence_end``.

        The future's done-callbacks run on the model's threads: they must not wait for another request
        to the same model version, whose answer may be queued behind them (docs/batching.md,
        "Delivering"); chain a callback instead.
        """
        self._check_open()
        return self._dataplane.submit(_request(model, inputs, options))

    def infer(
        self, model: str, inputs: Mapping[str, np.ndarray], **options: Unpack[RequestOptions]
    ) -> dict[str, np.ndarray]:
        """Run one request and wait for its outputs; failures raise an :class:`EdgeServerError`."""
        self._check_open()
        # This thread waits for the outputs anyway: a cheap model runs here (a frontend's budget).
        return self._dataplane.run_here(_request(model, inputs, options), inline.FRONTEND).result()

    async def infer_async(
        self, model: str, inputs: Mapping[str, np.ndarray], **options: Unpack[RequestOptions]
    ) -> dict[str, np.ndarray]:
        """The asyncio form of :meth:`infer`; many may be awaited at once."""
        return await asyncio.wrap_future(self.submit(model, inputs, **options))

    def stream(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> ResponseIterator:
        """Run a request whose responses are streamed (a decoupled model: zero, one or many).

        Iterate the result for each response's outputs; an error response raises from ``next()``;
        the final response ends the iteration; ``close()`` stops early.  ``timeout`` bounds the wait
        for each response.  Any model may be streamed: an ordinary one answers once.
        """
        self._check_open()
        responses = ResponseIterator(timeout)
        self._dataplane.stream(_request(model, inputs, options), responses)
        return responses

    async def stream_async(
        self,
        model: str,
        inputs: Mapping[str, np.ndarray],
        *,
        timeout: float | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncResponseIterator:
        """:meth:`stream` for asyncio: ``async for outputs in await server.stream_async(...)``."""
        self._check_open()
        responses = AsyncResponseIterator(timeout)
        self._dataplane.stream(_request(model, inputs, options), responses)
        return responses

    @property
    def dataplane(self) -> DataPlane:
        """What frontends call; the same object this API uses."""
        return self._dataplane

    # -- repository and models ------------------------------------------------------------------

    def models(self) -> list[VersionStatus]:
        """Every model version the server knows, with its state and, when not ready, why."""
        return self._routing.index()

    def repository_index(self) -> list[VersionStatus | NotLoaded]:
        """The index every frontend answers with: :meth:`models`, and the repositories' other models.

        As in Triton, a model never loaded (explicit mode) is listed by name alone; sorted by name,
        a model's versions in :meth:`models`' order.
        """
        rows: list[VersionStatus | NotLoaded] = list(self.models())
        known = {row.name for row in rows}
        rows += [NotLoaded(name) for name in self.repositories.scan() if name not in known]
        rows.sort(key=lambda row: row.name)  # stable
        return rows

    def model_config(self, model: str, version: int | None = None) -> ModelConfig:
        return self._dataplane.config(model, parse_version(version))

    def model_metadata(self, model: str, version: int | None = None) -> dict[str, Any]:
        return self._dataplane.metadata(model, parse_version(version))

    def statistics(self, model: str | None = None, version: int | None = None) -> list[dict[str, Any]]:
        return self._dataplane.statistics(model, parse_version(version))

    def is_ready(self, model: str | None = None, version: int | None = None) -> bool:
        """The server's readiness, or a model's (which may wait up to ``READY_TIMEOUT_S`` for its answer)."""
        if model is None:
            return not self._closed.is_set() and (self.service is None or self.service.is_ready())
        return self.model_ready(model, version).result()

    def model_ready(self, model: str, version: int | None = None) -> Future[bool]:
        """Whether ``model`` serves and says it is ready; done within ``READY_TIMEOUT_S`` (awaitable)."""
        if self._closed.is_set():
            return answered(False)
        return version_ready(self._routing, model, parse_version(version))

    def status(self) -> dict[str, Any]:
        """What ``edge-server status`` shows: the daemon's state and uptime, and every model's figures."""
        from edge_server.model_report import model_report, thread_rule

        if self.service is not None:
            info = self.service.describe()
        else:
            info = {"state": "stopped" if self._closed.is_set() else "serving"}
        return {
            **info,
            "repositories": [str(root) for root in self.repositories.roots],
            "onnxruntime_threads": thread_rule(*self._manager.thread_rule_now()),
            "models": model_report(self._routing),
        }

    def load_model(
        self,
        model: str,
        *,
        config_override: str | None = None,
        files: Mapping[PurePosixPath, bytes] | None = None,
    ) -> list[VersionStatus]:
        """Load or reload ``model`` from the repositories (explicit and poll modes).

        ``config_override``: the model's config as JSON (Triton's load-time ``config``), used instead of
        its config.pbtxt until it is loaded again without one; ``files`` (with a config): the model's
        files, instead of its directory (Triton's ``file:`` overrides; see edge_server.load_files).
        """
        self._check_control()
        return self._manager.load(model, config_override=config_override, files=files)

    def unload_model(self, model: str) -> None:
        """Drain and unload every version of ``model`` (explicit and poll modes)."""
        self._check_control()
        self._manager.unload(model)

    def rescan(self) -> None:
        """Reload what changed on disk (SIGHUP); in explicit mode only the models already loaded."""
        self._check_open()
        if self.control_mode == "explicit":
            self._manager.rescan(self._routing.serving().keys())
        else:
            self._manager.rescan()

    @property
    def manager(self) -> ModelManager:
        """The lifecycle's control (load, unload, rescan)."""
        return self._manager

    @property
    def routing(self) -> RoutingView:
        """What serves now, read-only: for metrics, the supervisor and status."""
        return self._routing

    def add_listener(self, listener: Listener) -> None:
        """Hear every model state change from now on (metrics, STATUS lines, logs); must not block."""
        self._index.add_listener(listener)

    def _engine_rebuilder(self, mode: str) -> EngineRebuilder | None:
        if mode not in ENGINE_BUILD_MODES:
            raise InvalidArgument(f"engine_build must be one of {list(ENGINE_BUILD_MODES)}, got {mode!r}")
        if mode == "none":
            return None

        def reload(name: str) -> None:  # on the builder's thread, once a plan is written
            try:
                self._manager.rescan([name])
            except EdgeServerError as exc:
                log.warning("model %s: reload after the engine build failed: %s", name, exc.message)

        return EngineRebuilder(reload)

    # -- shutdown -------------------------------------------------------------------------------

    def close(self, deadline: float | None = None) -> None:
        """Drain, then unload every model; idempotent.

        Requests get until ``deadline`` (monotonic; default: now + the drain timeout); what is still
        queued then fails with UNAVAILABLE.
        """
        with self._close_lock:  # two threads closing at once must not both stop the watcher
            if self._closed.is_set():
                return
            self._closed.set()
        if self._rebuilder is not None:
            self._rebuilder.close()
        if deadline is None:
            deadline = time.monotonic() + self._drain_timeout
        # The watcher first, so that no rescan starts while the models are unloaded.  A rescan in
        # progress (a hot-dropped model loading) is not waited for before the drain: the manager's
        # close abandons its load, and the watcher's thread ends within the same deadline.
        watcher_done = self.watcher is None or self.watcher.stop(time.monotonic())
        self._manager.close(deadline)
        if self.watcher is not None and not watcher_done and not self.watcher.stop(deadline):
            log.warning("the repository watcher's rescan did not end by the shutdown deadline")

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise ServerShuttingDown("the server is shut down")

    def _check_control(self) -> None:
        self._check_open()
        if self.control_mode == "none":
            raise control_refused("load or unload")


def _request(model: str, inputs: Mapping[str, np.ndarray], options: RequestOptions) -> InferRequest:
    """The in-process API's request; its version goes through the parser every frontend uses."""
    if options.get("version") is not None:
        options["version"] = parse_version(options["version"])
    return InferRequest(model=model, inputs=inputs, **options)
