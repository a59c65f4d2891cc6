"""Whether a request may run in the caller's own thread: one policy object per model version.

A model without dynamic batching whose executions are cheap (a moving average under
``INLINE_BUDGET_NS``) runs a request in the caller's own thread when an instance is idle and nothing is
queued: a thread hand-off costs more than such a model, and the caller would only wait for it anyway.
The idle instance is lent for that one request; its worker does not touch it meanwhile.  The
daemon's only model, when it has one instance, does so up to ``ALONE_INLINE_BUDGET_NS``: no other
model's requests can wait behind it on a frontend thread, and its own would wait for the instance
anyway, so it serves as a hand-written receive-run-reply loop does, without the two thread wake-ups
(a tenth of a millisecond each on a loaded 2-core box) that a worker costs every request.

A request submitted from another scheduler's worker thread (a pipeline: an ensemble's next step,
submitted from the done-callback of the step before it, or a BLS call from inside a Python model's
``execute``) runs inline whenever an instance is idle and nothing is queued, whatever its cost, and
with dynamic batching too: that thread is a pipeline's own, so blocking it stalls no frontend (the
IPC frontend's thread is never a worker and keeps the budget), and handing the request to another
thread would only make it wait for the answer.  A worker does this only while it is inside its own
``execute`` (its instance is busy anyway), or, while it delivers a finished batch, when its own queue
is empty (it holds no one up) and the callee cannot call models (a BLS model could need the very
instance this worker would hold while running it: a deadlock no thread hand-off would have had).
A detect-then-classify frame, whose steps all run inside the BLS model's ``execute``, thus walks
them in one thread while their instances are free, and hands off only where a step is busy: there
it queues, and batches with what else is queued.

The policy keeps the cost estimate (a moving average of one request's execution and of its input
bytes), the budget (``INLINE_BUDGET_NS``, or ``ALONE_INLINE_BUDGET_NS`` for the daemon's only model
with one instance) and which callers qualify; the scheduler asks it, and lends an idle instance from
its pool when it says yes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from edge_server.backends.base import Backend, BatchItem
from edge_server.scheduler.pool import Worker

# A request runs in the caller's thread only for models whose executions average less than this:
# about what two thread hand-offs cost in CPython, and short enough not to stall an IPC frontend.
INLINE_BUDGET_NS = 100_000
# The daemon's only model (one instance) may hold the caller's thread longer: a frame period at 50 fps,
# the longest that control requests (status, health over IPC, shared-memory registration) wait
# behind it; beyond it the two wake-ups saved are under 2% of the run.
ALONE_INLINE_BUDGET_NS = 20_000_000
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


def _pipeline_caller(callee_calls_models: bool) -> bool:
    """Whether this thread is a worker free to run another model's request (see the module doc)."""
    caller = threading.current_thread()
    if type(caller) is not Worker:
        return False
    if caller.executing:  # its instance is busy anyway: running the callee here holds nothing more
        return True
    # Delivering a finished batch: its instance is free, but would stay held while the callee runs
    # here.  A callee that may call models (a BLS model) could need that very instance (A's step
    # done -> B inline -> B calls A) and wait for it forever: it goes to its own worker instead.
    return not callee_calls_models and not caller.pool.waiting()  # a benign race: a hint only


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
        self._budget_ns = INLINE_BUDGET_NS  # ALONE_INLINE_BUDGET_NS while the daemon's only model
        self._compute_ema_ns = float("inf")  # moving average of one request's execution
        self._bytes_ema = 0.0  # moving average of the input bytes of the requests measured

    def caller(self, item: BatchItem) -> tuple[bool, int]:
        """(whether the calling thread is a pipeline's worker, the request's input bytes), lock-free."""
        pipeline = self._pipeline and _pipeline_caller(self._calls_models)
        return pipeline, (_input_bytes(item) if self._capable and not pipeline else 0)

    def pays(self, nbytes: int, pipeline: bool) -> bool:
        """Whether the request may run in the caller's thread, if an instance is idle and none queued.

        ``pipeline``: the caller is another scheduler's worker, which may run any request inline.
        """
        if pipeline:
            return self._pipeline
        if not self._capable or self._compute_ema_ns >= self._budget_ns:
            return False
        # Out of line with what was measured: a worker runs it (and measures it).
        return nbytes <= INLINE_SIZE_FACTOR * self._bytes_ema + INLINE_SIZE_SLACK

    def set_sole_version(self, sole: bool) -> None:
        """Whether this is the daemon's only model version, with one instance (the longer budget)."""
        self._budget_ns = ALONE_INLINE_BUDGET_NS if sole else INLINE_BUDGET_NS

    def observe(self, spent_ns: int, item: BatchItem) -> None:
        """Fold one single-request execution into the estimates that decide inline execution."""
        if not self._capable:
            return
        ema = self._compute_ema_ns  # a benign race: only these estimates are at stake
        nbytes = _input_bytes(item)
        if ema == float("inf"):
            self._compute_ema_ns, self._bytes_ema = spent_ns, float(nbytes)
        else:
            self._compute_ema_ns = ema + _EMA_WEIGHT * (spent_ns - ema)
            self._bytes_ema += _EMA_WEIGHT * (nbytes - self._bytes_ema)
