"""A version's load on a thread of its own, abandoned after its timeout or at shutdown.

Python cannot stop a thread, so a load that does not finish in time (user code stuck in
``initialize()``) is abandoned: the lifecycle goes on (the version is UNAVAILABLE with the reason, the
last good one serving), its thread runs on, and it closes what it loaded if it ever ends.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from edge_server.config import ModelConfig
from edge_server.errors import ModelNotReady, ServerShuttingDown
from edge_server.loader import LoadedVersion, LoadEnvironment, load_version
from edge_server.repository import ModelSource

log = logging.getLogger(__name__)


def load_abandonable(
    source: ModelSource,
    version: int,
    config: ModelConfig,
    *,
    timeout: float,
    closing: threading.Event,
    content_hash: str,
    env: LoadEnvironment,
    sharing: int = 0,
) -> LoadedVersion:
    """``load_version`` on a thread of its own, given up after ``timeout`` seconds or once ``closing``."""
    future: Future[LoadedVersion] = Future()

    def run() -> None:
        try:
            future.set_result(
                load_version(source, version, config, content_hash=content_hash, env=env, sharing=sharing)
            )
        except BaseException as exc:
            future.set_exception(exc)

    # Woken by the load's end (not a poll: every load would last a whole poll period), and at least
    # every 0.25 s to look at ``closing`` and the deadline.
    finished = threading.Event()
    future.add_done_callback(lambda _: finished.set())
    thread = threading.Thread(target=run, name=f"edge-load-{source.name}-{version}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not future.done():
        finished.wait(min(0.25, max(0.0, deadline - time.monotonic())))
        if future.done():
            break
        if closing.is_set():
            future.add_done_callback(_close_abandoned)
            raise ServerShuttingDown("the server is shutting down")
        if time.monotonic() >= deadline and not future.done():
            future.add_done_callback(_close_abandoned)
            log.error(
                "%s v%d did not finish loading within %g s (--model-load-timeout-secs); its load "
                "thread %s is abandoned (a Python model's initialize() may be stuck)",
                source.name,
                version,
                timeout,
                thread.name,
            )
            raise ModelNotReady(
                f"{source.name} v{version} did not finish loading within {timeout:g} s "
                "(--model-load-timeout-secs); its initialize() may be stuck, and its thread was "
                "abandoned"
            )
    return future.result()


def _close_abandoned(future: Future[LoadedVersion]) -> None:
    """An abandoned load that ended after all: free what it brought up (it never took traffic)."""
    if future.cancelled() or future.exception() is not None:
        return
    loaded = future.result()
    log.warning("%s v%d: an abandoned load finished late; closing it", loaded.name, loaded.version)
    loaded.retire(time.monotonic())
