"""A model's own say in its readiness (a Python model's ``is_ready``), asked without ever waiting long.

Triton's python_backend lets ``model.py`` define ``is_ready()``; the model-ready probes of every
frontend (HTTP ``/v2/models/X/ready``, gRPC ``ModelReady``, IPC ``ready``, a model's own
``pb_utils.is_model_ready``) ask it through :func:`version_ready`, the one place they all go.  The
rules, Triton's: False, an exception or a non-boolean answer mean not ready; each probe waits at most
:data:`READY_TIMEOUT_S` and then says not ready; one call per instance is in flight at a time, and a
probe that comes meanwhile waits for that call's answer instead of starting another.

The call runs in a thread of its own, never on a scheduler's worker, so a probe does not queue behind
inference (nor inference behind a probe).  A frontend gets a future that is done by the deadline at
the latest (a watchdog thread per instance resolves the probes that waited too long), so an event
loop awaits it and no thread is held per probe.  Each kind of misbehaviour is logged once per
instance, not per probe (load balancers probe every second).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING

from edge_server.errors import EdgeServerError

if TYPE_CHECKING:  # the routing table's modules load backends, which use the probe
    from edge_server.routing import RoutingView

log = logging.getLogger(__name__)

#: how long one probe waits for the model's answer (Triton's python_backend: five seconds)
READY_TIMEOUT_S = 5.0


class NotReady(Exception):
    """The readiness function misbehaved (raised, answered a non-boolean): not ready, and why."""


class ReadinessProbe:
    """One instance's readiness function: at most one call in flight, every probe bounded in time.

    ``check()`` blocks until the model answers: True or False, or :class:`NotReady` (or any
    exception) for not ready.
    """

    def __init__(self, label: str, check: Callable[[], bool], timeout_s: float = READY_TIMEOUT_S) -> None:
        self._label = label
        self._check = check
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: list[tuple[float, int, Future[bool]]] = []  # a heap by deadline
        self._order = itertools.count()
        self._calling = False
        self._warned: set[str] = set()  # the kinds of misbehaviour already logged

    def ask(self) -> Future[bool]:
        """A future that gets the model's answer, or False by the deadline."""
        future: Future[bool] = Future()
        with self._lock:
            heapq.heappush(self._waiting, (time.monotonic() + self._timeout_s, next(self._order), future))
            if not self._calling:
                self._calling = True
                for target, role in ((self._call, "call"), (self._watch, "watch")):
                    name = f"edge-{self._label}-ready-{role}"
                    threading.Thread(target=target, name=name, daemon=True).start()
            self._wake.notify()
        return future

    def _call(self) -> None:
        answer = False
        try:
            answer = self._check() is True
        except BaseException as exc:  # noqa: BLE001 - the model's misbehaviour (sys.exit() too) is its not being ready
            self._warn(type(exc).__name__, f"{self._label}: not ready: {exc!r}")
        finally:  # whatever happened, the next probe may call again
            with self._lock:
                waiting, self._waiting = self._waiting, []
                self._calling = False
                self._wake.notify()
            for _, _, future in waiting:
                _settle(future, answer)

    def _watch(self) -> None:
        """Answer False to the probes whose deadline passed while the call is still in flight."""
        with self._lock:
            while self._calling:
                now = time.monotonic()
                expired = []
                while self._waiting and self._waiting[0][0] <= now:
                    expired.append(heapq.heappop(self._waiting)[2])
                for future in expired:
                    _settle(future, False)
                if expired:
                    self._warn(
                        "timeout",
                        f"{self._label}: not ready: is_ready() did not answer within "
                        f"{self._timeout_s:g} s (it still runs; the next probes wait for it)",
                    )
                self._wake.wait(self._waiting[0][0] - now if self._waiting else None)

    def _warn(self, kind: str, message: str) -> None:
        first = kind not in self._warned
        self._warned.add(kind)
        log.log(logging.WARNING if first else logging.DEBUG, "%s", message)


def _settle(future: Future[bool], answer: bool) -> None:
    try:
        future.set_result(answer)
    except InvalidStateError:  # the watchdog or the call got there first
        pass


def all_ready(futures: Sequence[Future[bool]]) -> Future[bool]:
    """True once every future says True; False as soon as one says False."""
    combined: Future[bool] = Future()
    if not futures:
        return answered(True)
    left = [len(futures)]
    lock = threading.Lock()

    def one(future: Future[bool]) -> None:
        if not future.result():
            _settle(combined, False)
            return
        with lock:
            left[0] -= 1
            done = left[0] == 0
        if done:
            _settle(combined, True)

    for future in futures:
        future.add_done_callback(one)
    return combined


def version_ready(routing: RoutingView, name: str, version: int | None = None) -> Future[bool]:
    """Whether ``name`` (``version``, or the latest) is served and its instances say they are ready.

    Done by :data:`READY_TIMEOUT_S` at the latest; at once for a model without a readiness function.
    """
    try:
        found = routing.resolve(name, version)
    except EdgeServerError:
        return answered(False)
    return all_ready(found.scheduler.readiness())


def answered(answer: bool) -> Future[bool]:
    """A future that has ``answer`` already."""
    future: Future[bool] = Future()
    future.set_result(answer)
    return future
