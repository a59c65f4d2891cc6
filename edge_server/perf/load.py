"""Load generators: N requests always in flight (concurrency), or requests sent on a schedule (rate).

Both record, for every request, when it was sent and when its last response arrived
(``time.perf_counter_ns``), into one append-only list that the measurement windows read.  A request
that fails stops the load: perf_analyzer stops too, since figures mixed with errors mean nothing.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from edge_server.perf.targets import Sequence, Target, Worker

log = logging.getLogger(__name__)


class Lane:
    """One sender's records: (sent ns, done ns, responses) per answered request, flat in an array.

    Each sender writes only its own lane, so recording takes no lock, and an ``array`` of integers
    holds no Python objects that the garbage collector would scan again and again as a run grows.
    """

    def __init__(self) -> None:
        self.data = array("q")
        self.sent = 0

    def snapshot(self) -> np.ndarray:
        data = self.data[:]  # a copy, taken at once under the GIL while the sender appends
        return np.frombuffer(data, dtype=np.int64)[: len(data) // 3 * 3].reshape(-1, 3)


@dataclass
class Recorder:
    """What a load level did, lane by lane, and the first error that stopped it."""

    lanes: list[Lane] = field(default_factory=list)
    failed: threading.Event = field(default_factory=threading.Event)
    error: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def lane(self) -> Lane:
        lane = Lane()
        self.lanes.append(lane)
        return lane

    def records(self) -> np.ndarray:
        """Every answered request so far, one (sent ns, done ns, responses) row each."""
        return np.concatenate([lane.snapshot() for lane in self.lanes] or [np.zeros((0, 3), np.int64)])

    @property
    def sent(self) -> int:
        return sum(lane.sent for lane in self.lanes)

    @property
    def answered(self) -> int:
        return sum(len(lane.data) // 3 for lane in self.lanes)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if not self.error:
                message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
                self.error = f"{type(exc).__name__}: {str(message).splitlines()[0]}"
        self.failed.set()


class _Stepper:
    """Which data step and which sequence fields the next request of one thread gets."""

    def __init__(self, steps: int, sequence_length: int | None, ids: Iterator[int]) -> None:
        self._steps = steps
        self._length = sequence_length
        self._ids = ids
        self._count = 0
        self._position = 0
        self._correlation_id = 0

    def next(self) -> tuple[int, Sequence | None]:
        step = self._count % self._steps
        self._count += 1
        if self._length is None:
            return step, None
        if self._position == 0:
            self._correlation_id = next(self._ids)
        self._position += 1
        end = self._position == self._length
        sequence = Sequence(self._correlation_id, self._position == 1, end)
        if end:
            self._position = 0
        return step, sequence

    def closing(self) -> tuple[int, Sequence] | None:
        """The request that ends a sequence left open when the load stops (the daemon frees its slot)."""
        if self._length is None or self._position == 0:
            return None
        self._position = self._length - 1
        step, sequence = self.next()
        assert sequence is not None
        return step, sequence


def _send(worker: Worker, lane: Lane, recorder: Recorder, step: int, sequence: Sequence | None) -> bool:
    start = time.perf_counter_ns()
    lane.sent += 1
    try:
        responses = worker.send(step, sequence)
    except Exception as exc:  # any failure ends the level; the report names it
        recorder.fail(exc)
        return False
    lane.data.extend((start, time.perf_counter_ns(), responses))
    return True


class ConcurrencyLoad:
    """``concurrency`` threads, each sending its next request as soon as the last one is answered."""

    def __init__(
        self, target: Target, concurrency: int, *, steps: int, sequence_length: int | None, ids: Iterator[int]
    ) -> None:
        self.recorder = Recorder()
        self._stop = threading.Event()
        self._workers = [target.worker() for _ in range(concurrency)]
        self._threads = [
            threading.Thread(
                target=self._loop,
                args=(worker, self.recorder.lane(), _Stepper(steps, sequence_length, ids)),
                name=f"perf-load-{i}",
                daemon=True,
            )
            for i, worker in enumerate(self._workers)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _loop(self, worker: Worker, lane: Lane, stepper: _Stepper) -> None:
        while not self._stop.is_set() and not self.recorder.failed.is_set():
            step, sequence = stepper.next()
            if not _send(worker, lane, self.recorder, step, sequence):
                return
        closing = stepper.closing()
        if closing is not None and not self.recorder.failed.is_set():
            _send(worker, lane, self.recorder, *closing)

    def stop(self) -> None:
        """Stop sending, wait for what is in flight, close the connections."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        for worker in self._workers:
            worker.close()


class RateLoad:
    """Requests sent at ``rate`` per second on a fixed schedule by up to ``threads`` senders.

    A request whose turn comes while every sender is busy waits for one (it is sent late, and its
    latency is counted from when it was really sent, as perf_analyzer does); ``late`` counts them.
    """

    def __init__(self, target: Target, rate: float, *, steps: int, threads: int) -> None:
        self.recorder = Recorder()
        self.late = 0
        self._rate = rate
        self._steps = steps
        self._stop = threading.Event()
        self._free: queue.SimpleQueue[tuple[Worker, Lane]] = queue.SimpleQueue()
        self._workers = [target.worker() for _ in range(threads)]
        for worker in self._workers:
            self._free.put((worker, self.recorder.lane()))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="perf-rate")
        self._scheduler = threading.Thread(target=self._schedule, name="perf-schedule", daemon=True)

    def start(self) -> None:
        self._scheduler.start()

    def _schedule(self) -> None:
        begin = time.perf_counter()
        for i in itertools.count():
            due = begin + i / self._rate
            delay = due - time.perf_counter()
            if self._stop.wait(delay) if delay > 0 else self._stop.is_set():
                return
            if self.recorder.failed.is_set():
                return
            self._pool.submit(self._one, i % self._steps, due)

    def _one(self, step: int, due: float) -> None:
        worker, lane = self._free.get()
        try:
            if time.perf_counter() - due > 0.001:
                with self.recorder._lock:
                    self.late += 1
            _send(worker, lane, self.recorder, step, None)
        finally:
            self._free.put((worker, lane))

    def stop(self) -> None:
        self._stop.set()
        self._scheduler.join()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for worker in self._workers:
            worker.close()
