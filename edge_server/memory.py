"""The process heap: what a long-running daemon that loads and unloads models must do about it.

What the daemon does about glibc (on any other C library these do nothing):

* :func:`settle_heap` after versions come or go: collect, hand freed pages back (``malloc_trim``),
  and freeze the survivors for the garbage collector.
* :func:`keep_large_buffers` once, at daemon start-up: frames reuse the heap's pages from request to
  request, and :class:`DeferredTrim` gives them back once such traffic pauses.
* :func:`limit_malloc_arenas` once, at daemon start-up: glibc gives threads up to 8 arenas per core,
  and a model loaded on one thread and freed after running on others leaves its pages scattered over
  several of them, where ``malloc_trim`` cannot always return them.  Over 150 reloads
  (``bench/bench_reload.py --reloads 150``) the median RSS grew 32% with glibc's default and 17-22%
  with two arenas; 50 reloads stay under 10%.  What remains of the drift is not explained yet.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import threading
import time

log = logging.getLogger(__name__)

_M_ARENA_MAX = -8  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_M_TRIM_THRESHOLD = -1
DAEMON_MALLOC_ARENAS = 2
DAEMON_MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (half its 64 MiB heap)
#: glibc's malloc_trim gives back the free top of its main heap but not of the other arena's: up to this
#: much may stay there.  A stream of 1080p frames keeps its pages below it (16 MiB: gRPC faulted 1,830
#: pages a frame in one run); 32 MiB left +29 MiB after an IPC burst, 64 MiB +35 MiB.
DAEMON_TRIM_THRESHOLD = 24 << 20
#: A request or body at least this large asks for a heap trim once the traffic pauses (:class:`DeferredTrim`).
TRIM_AFTER_BYTES = 1 << 20
#: The daemon's trims after large buffers went: an HTTP body is freed when its response is sent (the
#: first), an IPC client's replies by ZeroMQ's I/O thread and pyzmq's collector over the next seconds
#: (the later ones).
DAEMON_TRIM_DELAYS = (0.25, 1.0, 5.0)


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _load_libc()  # a handle to the C library, not state: loading it again gives the same


def settle_heap() -> None:
    """After versions were loaded or unloaded: collect, hand freed pages back, freeze what is left.

    glibc keeps the pages of freed arenas (a closed session's weights), so RSS would only grow across
    reloads; ``malloc_trim`` returns them.  ``gc.freeze`` then moves every object alive now (configs,
    sessions, threads: tens of thousands) out of the collector's generations, so the collections that
    the garbage of requests triggers no longer walk them: about 3 us a request on a 2-core machine.
    Unfreezing first lets this collection find what an unload left in reference cycles.
    """
    gc.unfreeze()
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    gc.freeze()


def trim_heap() -> None:
    """Hand freed heap pages back to the system (``malloc_trim``), without a garbage collection.

    For large buffers freed outside a model change, e.g. the replies of a client that was
    disconnected for not reading them: glibc keeps them in its arenas otherwise.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class DeferredTrim:
    """Trims the heap ``delays`` seconds after the last :meth:`request` (each delay once), on a timer.

    For memory that is freed a while after the event that dooms it: the replies and queued requests of
    a client that went away are freed by ZeroMQ's I/O thread, pyzmq's collector and the schedulers
    over the following seconds, and a burst of such events must end with a trim after the last one.
    A request starts the delays over: one that came while the timer waited for a later stage (a client
    that left 2 s after the previous one) is trimmed after the first delay, not the last.  At most one
    timer thread is alive.
    """

    def __init__(self, delays: tuple[float, ...] = (1.0, 5.0)) -> None:
        self._delays = delays
        self._lock = threading.Lock()
        self._last = 0.0
        self._timer: threading.Timer | None = None
        self._stage = 0  # the stage the timer waits for

    def request(self) -> None:
        with self._lock:
            self._last = time.monotonic()
            if self._timer is not None and self._stage > 0:
                self._timer.cancel()
                self._timer = None
            if self._timer is None:
                self._arm(self._delays[0], 0)

    def cancel(self) -> None:
        """Drop the pending trims (the frontend that asked for them is closing)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _arm(self, delay: float, stage: int) -> None:
        timer = threading.Timer(max(0.0, delay), self._fire, args=(stage,))
        timer.name = "edge-heap-trim"
        timer.daemon = True
        self._timer = timer
        self._stage = stage
        timer.start()

    def _fire(self, stage: int) -> None:
        with self._lock:
            if threading.current_thread() is not self._timer:
                return  # cancelled, or started over by a request, after this timer was due
            now = time.monotonic()
            due = self._last + self._delays[stage]
            if now < due:  # requested again meanwhile: wait until that is as old
                self._arm(due - now, stage)
                return
            trim_heap()
            if stage + 1 < len(self._delays):
                self._arm(self._last + self._delays[stage + 1] - now, stage + 1)
            else:
                self._timer = None


def limit_malloc_arenas(arenas: int = DAEMON_MALLOC_ARENAS) -> None:
    """Cap glibc's malloc arenas for this process, unless ``MALLOC_ARENA_MAX`` already says how many.

    Call it before threads start: arenas already handed to threads stay.  The daemon calls it; a
    library user's process is left as its owner set it up.
    """
    _mallopt(_M_ARENA_MAX, arenas, "MALLOC_ARENA_MAX")


def keep_large_buffers(
    mmap_threshold: int = DAEMON_MMAP_THRESHOLD, trim_threshold: int = DAEMON_TRIM_THRESHOLD
) -> None:
    """Let glibc reuse the pages of large buffers (request bodies, frames, outputs) across requests.

    By default glibc maps each allocation over its (moving) mmap threshold afresh and unmaps it when
    freed, and returns the heap's top to the system as soon as 2x that threshold is free: every request
    of a 6 MB frame faulted in 12 MB of new zeroed pages (3,000 page faults), 8 of its 11 ms of daemon
    CPU over HTTP.  Here buffers up to ``mmap_threshold`` come from the heap and ``trim_threshold`` of
    free heap may stay: a stream of frames reuses its pages.  What a burst leaves goes back when the
    traffic pauses (:class:`DeferredTrim`, asked for by every large request).  ``MALLOC_MMAP_THRESHOLD_``
    and ``MALLOC_TRIM_THRESHOLD_`` in the environment win, each for its own setting.
    """
    _mallopt(_M_MMAP_THRESHOLD, mmap_threshold, "MALLOC_MMAP_THRESHOLD_")
    _mallopt(_M_TRIM_THRESHOLD, trim_threshold, "MALLOC_TRIM_THRESHOLD_")


def _mallopt(param: int, value: int, variable: str) -> None:
    if _LIBC is None or variable in os.environ:
        return
    if not _LIBC.mallopt(param, value):
        log.warning("mallopt(%s, %d) was refused; glibc's default stays", variable.rstrip("_"), value)
