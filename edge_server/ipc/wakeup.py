"""Wake a thread blocked in ``zmq_poll`` without letting go of the GIL.

A scheduler worker that finishes a request wakes the IPC frontend through an eventfd.  ``os.eventfd_write``
releases the GIL around its ``write``; the frontend thread, woken by that very write, takes the GIL
and keeps it until it blocks in ``zmq_poll`` again, so the worker waits for the frontend's whole turn
(sending the reply, receiving the next request) before it can start its next execution, and the cores
idle meanwhile.  With the GIL held over the write (the call takes a microsecond and never blocks on a
non-blocking eventfd), the worker goes straight on to its next execution, which releases the GIL, and the
frontend's turn overlaps it: with 8 clients on a 4 ms CNN this won 1.5-4.5% of a one-thread server's
throughput in two A/B runs (docs/benchmarks.md, "Minimal zmq + ONNX Runtime server").
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable


def _gil_holding_write() -> Callable[[int], None] | None:
    """The C library's ``write`` through ``ctypes.PyDLL``, which keeps the GIL (None where it is missing)."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):
        return None
    write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    write.restype = ctypes.c_ssize_t
    one = ctypes.c_uint64(1)  # written, never changed: one buffer serves every call and thread
    address = ctypes.addressof(one)

    def signal(fd: int) -> None:
        # Failures are ignored: EAGAIN (the counter is full) means the reader is awake already, EBADF
        # that its owner closed it meanwhile, and the waiter has nothing to wake then.
        write(fd, address, 8)

    signal.buffer = one  # type: ignore[attr-defined]  # keeps the buffer alive with the function
    return signal


def _os_write(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except OSError:  # as in signal above: full, or closed meanwhile
        pass


#: ``signal_eventfd(fd)``: add 1 to a non-blocking eventfd (failures ignored), keeping the GIL where the
#: platform allows.  The IPC frontend's workers and the client's callers both wake a poller with it.
signal_eventfd: Callable[[int], None] = _gil_holding_write() or _os_write
