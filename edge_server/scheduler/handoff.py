"""Deliveries a worker hands off so that its instance takes the next batch at once.

Delivering a batch (completing its futures) runs the frontends' callbacks in the thread that completes
them: a gRPC answer is encoded and started on its call there, an HTTP answer handed to the event loop,
an IPC answer queued for its socket.  With 7 gRPC requests queued, that held a worker 0.4-1.2 ms per
request on a 2-core box while its instance sat idle: for a model whose work is off the CPU (a GPU or
DLA engine) that is lost throughput (``bench/bench_busy_instance.py``: 0.87 of the ceiling over gRPC,
0.96 handed off; ``docs/batching.md``, "Delivering").

So a worker whose instance has requests waiting hands its delivery to this one thread per model version
and goes back to its instance; a worker with nothing waiting delivers itself, which costs a single
stream no thread hand-off.  Deliveries keep the order in which the batches finished on a worker: once
one is handed off, the next ones follow it through this thread until it has caught up.  At most
``MAX_PENDING`` wait here; a worker with more waits for the thread to catch up (back-pressure, not
an unbounded list of finished results).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from edge_server.scheduler import inline
from edge_server.scheduler.drain import wait_until_idle

log = logging.getLogger(__name__)

#: Finished batches that may wait for the delivering thread before a worker waits for it instead.
MAX_PENDING = 4
#: The delivering thread ends after this long without a delivery (a burst's thread does not stay).
IDLE_EXIT_S = 1.0


class Handoff:
    """One model version's delivering thread, started when a worker hands a delivery off."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._pending: collections.deque[Callable[[], None]] = collections.deque()
        self._running = False  # the thread is inside a delivery taken off _pending
        self._closed = False
        self._thread: threading.Thread | None = None
        self._no_thread_logged = False

    def deliver(self, deliver: Callable[[], None], *, others_wait: bool) -> None:
        """Run ``deliver`` here, or hand it to the delivering thread.

        It goes there when ``others_wait`` (requests wait for the caller's instance), or when earlier
        deliveries are still with that thread.

        ``deliver`` must not raise: it completes futures and logs its own failures.
        """
        with self._cond:
            if not self._closed and (others_wait or self._holding()):
                while len(self._pending) >= MAX_PENDING and not self._closed:
                    self._cond.wait()
                if not self._closed and self._started():
                    self._pending.append(deliver)
                    self._cond.notify_all()
                    return
        deliver()  # here, in the caller's thread

    def _started(self) -> bool:
        """Whether the delivering thread runs, started now if needed (lock held).

        False where no thread can be had (a pids limit, memory): the worker delivers itself, as it did
        before the hand-off, rather than leave the batch with a thread that never runs.
        """
        if self._thread is not None:
            return True
        thread = threading.Thread(target=self._loop, name=f"edge-{self._name}-deliver", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            if not self._no_thread_logged:  # once: a pids limit would otherwise log every batch
                self._no_thread_logged = True
                log.warning("%r: no delivering thread (%s); its workers deliver themselves", self._name, exc)
            return False
        self._thread = thread
        return True

    def _loop(self) -> None:
        # No request runs in this thread: a step it ran could wait (BLS) for a delivery queued behind it.
        inline.state(inline.QUEUE_ONLY)
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    self._cond.wait(IDLE_EXIT_S)
                if not self._pending:  # closed, or idle: the next hand-off starts a new thread
                    self._thread = None
                    return
                deliver = self._pending.popleft()
                self._running = True
                self._cond.notify_all()  # a worker waiting for room
            try:
                deliver()
            except Exception:  # a bug of ours: the thread must go on delivering the others
                log.exception("delivering a batch of %r failed", self._name)
            finally:
                # Dropped now, not when the next one comes: the batch's inputs may be views of a
                # client's shared memory, to be unmapped as soon as the client unregisters it.
                del deliver
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    def busy(self) -> bool:
        """Whether deliveries are with the delivering thread.

        Under its lock: read without it, ``_running`` (False) then ``_pending`` (emptied meanwhile by
        the thread taking the last one) could both say idle while that one is being delivered, and
        :meth:`InstancePool.lend` let an inline answer overtake it.
        """
        with self._cond:
            return self._holding()

    def _holding(self) -> bool:
        """Whether deliveries are with the delivering thread (lock held)."""
        return self._running or bool(self._pending)

    def wait_idle(self, deadline: float) -> bool:
        """Wait until everything handed off was delivered, or ``deadline`` (monotonic) passes (False)."""
        return wait_until_idle(self._cond, self._holding, deadline)

    def close(self, timeout: float) -> bool:
        """Deliver what was handed off, then end the thread; False if it did not within ``timeout`` s.

        Deliveries handed to a closed handoff run in their caller's thread.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()
