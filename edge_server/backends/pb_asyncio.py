"""The event loop of a Python model whose ``execute`` is ``async def``: one per instance, always running.

Triton's stub runs such a model's coroutines on an event loop that keeps running between executions,
so a task the model starts with ``asyncio.create_task`` (a response sent 0.5 s after ``execute``
returned, a timer) goes on in the background; and it does not wait for a *decoupled* model's
``execute`` coroutine at all (its responses go through the senders).  Here the loop runs in a thread
of its own, marked with the model's context (so ``pb_utils.Logger``, ``get_model_dir`` and BLS calls
know their model there), and the instance's worker hands each ``execute`` coroutine to it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from edge_server.backends import pb_context

log = logging.getLogger(__name__)

#: how long closing waits for the loop thread to stop (a task stuck in blocking code keeps it)
_STOP_WAIT_S = 5.0


class ModelLoop:
    """A running event loop in its own thread for one instance's coroutines (made on first use)."""

    def __init__(self, name: str, context: pb_context.ModelContext) -> None:
        self._name = name
        self._context = context
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the loop now (a model with ``async def execute``), not at its first coroutine."""
        self._running()

    def run(self, coroutine: Coroutine[Any, Any, Any], marked: pb_context.ModelContext) -> Any:
        """Run ``coroutine`` on the loop and wait for its result (the loop goes on afterwards)."""
        return self.spawn(coroutine, marked).result()

    def spawn(self, coroutine: Coroutine[Any, Any, Any], marked: pb_context.ModelContext) -> Future[Any]:
        """Start ``coroutine`` on the loop; its future (``marked``: the context while it runs)."""
        return asyncio.run_coroutine_threadsafe(_marked(coroutine, marked), self._running())

    def spawn_then(
        self,
        coroutine: Coroutine[Any, Any, Any],
        marked: pb_context.ModelContext,
        done: Callable[[Future[Any]], None],
    ) -> None:
        """:meth:`spawn`, and ``done(future)`` once it ends (on the loop's thread)."""
        self.spawn(coroutine, marked).add_done_callback(done)

    def close(self) -> None:
        """Cancel what still runs, stop the loop and its thread."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return

        def stop() -> None:
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.call_soon(loop.stop)

        loop.call_soon_threadsafe(stop)
        thread.join(_STOP_WAIT_S)
        if thread.is_alive():
            log.warning("%s: the model's event loop did not stop within %.0f s", self._name, _STOP_WAIT_S)
            return
        loop.close()

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=self._serve, args=(loop,), name=f"edge-{self._name}-asyncio", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        pb_context.mark(self._context)  # background tasks belong to the model too
        asyncio.set_event_loop(loop)
        loop.run_forever()


async def _marked(coroutine: Coroutine[Any, Any, Any], context: pb_context.ModelContext) -> Any:
    previous = pb_context.mark(context)
    try:
        return await coroutine
    finally:
        pb_context.mark(previous)
