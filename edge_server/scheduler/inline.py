"""Whether a request may run in the caller's own thread: the caller's budget, and one policy per version.

Every caller of the data plane gets a future.  :meth:`DataPlane.submit` only queues;
:meth:`DataPlane.run_here` may run the request in the caller's thread first, within a
:class:`Budget` the caller states, and the future is then done when it returns.  The budgets:

* :data:`QUEUE_ONLY`: nothing runs here (``submit``).
* :data:`FRONTEND`: a frontend's thread (the IPC thread, KServe's event loop, gRPC's server thread, the
  in-process ``Server.infer``), and any thread whose owner stated nothing: a model without dynamic
  batching whose executions are cheap (a moving average under ``INLINE_BUDGET_NS``) runs here when an
  instance is idle and nothing is queued: a thread hand-off costs more than such a model, and the
  caller would only wait for it anyway.  The daemon's only model, when it has one instance, does so up
  to ``SOLE_VERSION_INLINE_BUDGET_NS``: no other model's requests can wait behind it on a frontend thread,
  and its own would wait for the instance anyway, so it serves as a hand-written receive-run-reply
  loop does, without the two thread wake-ups (a tenth of a millisecond each on a loaded 2-core box)
  that a worker costs every request.  A model whose executions mostly wait rather than compute (its
  thread on a CPU for less than ``SOLE_VERSION_CPU_SHARE`` of the time: a ``model.py`` driving a GPU
  or DLA, or waiting for another process; a process-isolated model never opts in) does so only for a
  request from the same client (``BatchItem.client``: one connection) as the one before:
  with several clients it runs on its worker, so that the frontend reads the next clients' requests
  while it waits, instead of after (8 gRPC clients on a 4 ms wait: 192 against 233 inferences/s),
  and one client's stream still saves its two wake-ups.
* :data:`IN_EXECUTE`: an instance's worker inside its own ``execute`` (a BLS call): any request, whatever
  its cost and with dynamic batching too: its instance is busy anyway, so blocking the thread stalls no
  frontend, and handing the request to another thread would only make it wait for the answer.
* :func:`delivering`: an instance's worker delivering a finished batch (an ensemble's next step,
  submitted from the done-callback of the step before it): the same, but only while its own queue is
  empty (it holds no one up) and for callees that cannot call models (a BLS model could need the very
  instance this worker would hold while running it: a deadlock no thread hand-off would have had).

A detect-then-classify frame, whose steps all run inside the BLS model's ``execute``, thus walks them in
one thread while their instances are free, and hands off only where a step is busy: there it queues,
and batches with what else is queued.

A call made while a request runs here (a BLS call inside the lent instance's ``execute``, the steps of
an ensemble walked from this thread) is made with the budget stated for this thread: the data plane
states the caller's for the time of a ``run_here`` (:func:`state`), an instance's worker states
:func:`delivering` for its life and :data:`IN_EXECUTE` around each execute, and the access that
pipelines and BLS calls receive reads it (:func:`current`).  It is kept per thread, never copied to
another thread (a Python model's asyncio loop states nothing: FRONTEND).

The :class:`InlinePolicy` of a model version keeps the cost estimate (a moving average of one request's
execution and of its input bytes), the model's budget (``INLINE_BUDGET_NS``, or
``SOLE_VERSION_INLINE_BUDGET_NS`` for the daemon's only model with one instance) and answers, for a caller's
budget, whether the request may run there; the scheduler lends it an idle instance when it says yes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Sequence

from edge_server.backends.base import Backend, BatchItem, Result

# A request runs in the caller's thread only for models whose executions average less than this:
# about what the two thread wake-ups of a hand-off cost on a loaded 2-core box, and short enough not to
# stall a frontend.  It was 100 µs: on a slower 2-core VM bench/triton_models.py's tiny ``model.py``
# measured 90 µs on its worker, crossed it, and then paid 164 µs of queue per request for the hand-off.
INLINE_BUDGET_NS = 200_000
# The daemon's only model (one instance) may hold the caller's thread longer: a frame period at 50 fps,
# the longest that control requests (status, health over IPC, shared-memory registration) wait
# behind it; beyond it the two wake-ups saved are under 2% of the run.
SOLE_VERSION_INLINE_BUDGET_NS = 20_000_000
# ... if its executions keep the thread on a CPU for at least this share of their time, measured on its
# thread (short computing runs read 0.4-1.0 here on a 2-core box shared with spinning threads; sleeping
# ones under 0.05; a run-long spin among six spinners on two cores fell to 0.25).  One that waits
# holds the frontend's thread through the wait, when the thread's other clients could be read: it gets
# the longer budget only for a request from the client of the request before.
SOLE_VERSION_CPU_SHARE = 0.25
# ... and only for requests not much larger than those the average was measured on: a request far
# larger than usual (a 4K frame to a model measured on thumbnails) could hold a frontend thread, and
# every other client and model behind it, for its whole execution.  It goes to a worker instead.
INLINE_SIZE_FACTOR = 2.0
INLINE_SIZE_SLACK = 16 * 1024
_EMA_WEIGHT = 0.2


def _input_bytes(item: BatchItem) -> int:
    total = 0
    for array in item.inputs.values():
        total += array.nbytes
    return total


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Budget:
    """What a caller lets a request cost in its own thread (see the module doc)."""

    name: str
    #: the thread is an instance's worker (IN_EXECUTE, delivering): a pipeline's own thread
    on_worker: bool = False
    #: delivering: how many requests wait for the worker's own instance (it lends itself only when none)
    own_queue: Callable[[], int] | None = None


#: Nothing runs in the caller's thread: :meth:`DataPlane.submit`.
QUEUE_ONLY = Budget("queue only")
#: A frontend's thread: cheap models only, up to the model's budget.
FRONTEND = Budget("frontend")
#: An instance's worker inside its own execute: any model that allows inline execution.
IN_EXECUTE = Budget("inside an execute", on_worker=True)


def delivering(own_queue: Callable[[], int]) -> Budget:
    """The budget of a worker delivering a finished batch; ``own_queue``: its batcher's waiting count."""
    return Budget("delivering a batch", on_worker=True, own_queue=own_queue)


class _Stated(threading.local):
    budget: Budget = FRONTEND  # a thread whose owner stated nothing: a frontend's rule


_STATED = _Stated()


def current() -> Budget:
    """The budget stated for this thread (FRONTEND where nothing was stated)."""
    return _STATED.budget


def state(budget: Budget) -> Budget:
    """State ``budget`` for this thread (calls made from it inherit it); returns the one to restore."""
    outer = _STATED.budget
    _STATED.budget = budget
    return outer


class InlinePolicy:
    """The inline decision of one model version (see the module doc)."""

    def __init__(self, backends: Sequence[Backend], *, batching: bool, preserve_ordering: bool) -> None:
        # Inline execution is an explicit opt-in of each backend (TensorRT opts out: never on a
        # frontend).
        self._capable = not batching and all(backend.allows_inline for backend in backends)
        # Any instance may be lent to a pipeline's worker thread, TensorRT's not.  Not with
        # preserve_ordering: an inline answer could overtake a batch running on another instance.
        self._pipeline = not preserve_ordering and all(backend.allows_inline for backend in backends)
        self._calls_models = any(backend.calls_models for backend in backends)
        self._sole = False  # the daemon's only model version, with one instance
        self._compute_ema_ns = float("inf")  # moving average of one request's execution
        self._bytes_ema = 0.0  # moving average of the input bytes of the requests measured
        #: moving average of the executions' share on a CPU (measured when sole; None: not yet, as if busy)
        self._cpu_share_ema: float | None = None
        self._last_client: Hashable = None  # the client of the last request asked about (a hint)

    def pays(self, budget: Budget, item: BatchItem) -> bool:
        """Whether ``item`` may run in a thread with ``budget``, if an instance is idle and none queued.

        Lock-free: the estimates it reads are hints (a benign race).
        """
        if budget is FRONTEND:
            same_client, self._last_client = item.client == self._last_client, item.client
            ema = self._compute_ema_ns  # under INLINE_BUDGET_NS, within every budget (no call to ask)
            if not self._capable or (ema >= INLINE_BUDGET_NS and ema >= self._budget_ns(same_client)):
                return False
            # Out of line with what was measured: a worker runs it (and measures it).
            return _input_bytes(item) <= INLINE_SIZE_FACTOR * self._bytes_ema + INLINE_SIZE_SLACK
        if not budget.on_worker or not self._pipeline:
            return False
        if budget.own_queue is None:  # inside an execute: its instance is busy anyway
            return True
        # Delivering a finished batch: its instance is free, but would stay held while the callee runs
        # here.  A callee that may call models (a BLS model) could need that very instance (A's step
        # done -> B here -> B calls A) and wait for it forever: it goes to its own worker instead.
        return not self._calls_models and not budget.own_queue()

    def set_sole_version(self, sole: bool) -> None:
        """Whether this is the daemon's only model version, with one instance (the longer budget)."""
        self._sole = sole

    def _budget_ns(self, same_client: bool) -> int:
        share = self._cpu_share_ema
        if self._sole and (same_client or share is None or share >= SOLE_VERSION_CPU_SHARE):
            return SOLE_VERSION_INLINE_BUDGET_NS
        return INLINE_BUDGET_NS

    def cpu_mark(self) -> int | None:
        """The executing thread's CPU time before a single-request run, where it decides anything.

        None otherwise: reading it costs a system call, and only the daemon's only model, measured over
        the shared budget, uses it.  Pass it to :meth:`observe`, from the same thread, after the run.
        """
        if self._capable and self._sole and self._compute_ema_ns >= INLINE_BUDGET_NS:
            return time.thread_time_ns()
        return None

    def observe(self, spent_ns: int, item: BatchItem, result: Result, cpu_mark: int | None = None) -> None:
        """Fold one single-request execution into the estimates that decide inline execution.

        ``cpu_mark``: :meth:`cpu_mark` taken before the run on this thread (the run's CPU share).
        A failed execution is left out: it is no measure of the model's (refused at once, a client's
        burst of bad requests would teach a slow model cheap, or a waiting one computing, and the next
        clients' requests would hold a frontend's thread).
        """
        if not self._capable or isinstance(result, Exception):
            return
        ema = self._compute_ema_ns  # a benign race: only these estimates are at stake
        nbytes = _input_bytes(item)
        if ema == float("inf"):
            self._compute_ema_ns, self._bytes_ema = spent_ns, float(nbytes)
        else:
            self._compute_ema_ns = ema + _EMA_WEIGHT * (spent_ns - ema)
            self._bytes_ema += _EMA_WEIGHT * (nbytes - self._bytes_ema)
        if cpu_mark is not None and spent_ns > 0:
            measured = min((time.thread_time_ns() - cpu_mark) / spent_ns, 1.0)
            share = self._cpu_share_ema
            self._cpu_share_ema = measured if share is None else share + _EMA_WEIGHT * (measured - share)
