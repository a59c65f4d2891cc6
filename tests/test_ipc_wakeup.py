"""The frontend's wake-up: an eventfd signalled without releasing the GIL (edge_server/ipc/wakeup.py)."""

from __future__ import annotations

import os
import select
import sys
import threading
import time

import pytest

from edge_server.ipc import wakeup


@pytest.fixture
def eventfd():
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    yield fd
    os.close(fd)


def test_signal_adds_one_per_call(eventfd: int) -> None:
    for _ in range(3):
        wakeup.signal_eventfd(eventfd)
    assert os.eventfd_read(eventfd) == 3
    with pytest.raises(BlockingIOError):
        os.eventfd_read(eventfd)  # read back to zero: nothing left behind


def test_signal_wakes_a_thread_blocked_in_poll(eventfd: int) -> None:
    woke = threading.Event()

    def wait() -> None:
        poller = select.poll()
        poller.register(eventfd, select.POLLIN)
        if poller.poll(10_000):
            woke.set()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.05)
    wakeup.signal_eventfd(eventfd)
    thread.join(10)
    assert woke.is_set()


def test_signal_keeps_the_gil(eventfd: int) -> None:
    """A thread waiting for the GIL does not run during the signal: the caller goes straight on.

    With a 1 s switch interval, another thread can only run when this one releases the GIL; a write
    through ``os.eventfd_write`` would release it, and the spinning thread would then count.
    """
    if wakeup.signal_eventfd is wakeup._os_write:
        pytest.skip("libc's write cannot be called through ctypes.PyDLL here; the os fallback is in use")
    ran = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ran.append(1)
            time.sleep(0)  # releases the GIL between counts, so the main thread gets it back

    old = sys.getswitchinterval()
    # Set before the spinner exists: a wait for the GIL it began under the old 5 ms interval could
    # still time out during the loop and make this thread drop the GIL (3 counts, once in CI).
    sys.setswitchinterval(1.0)
    thread = threading.Thread(target=spin)
    thread.start()
    try:
        time.sleep(0.05)
        before = len(ran)
        for _ in range(1000):
            wakeup.signal_eventfd(eventfd)
        assert len(ran) == before
    finally:
        sys.setswitchinterval(old)
        stop.set()
        thread.join()
    assert os.eventfd_read(eventfd) == 1000


def test_os_fallback_adds_one(eventfd: int) -> None:
    wakeup._os_write(eventfd)
    assert os.eventfd_read(eventfd) == 1


@pytest.mark.parametrize("signal", [wakeup.signal_eventfd, wakeup._os_write], ids=["chosen", "os"])
def test_signal_on_a_closed_fd_is_ignored(signal) -> None:
    """A client's close() may close the fd while another thread pokes it: nothing to wake, no error."""
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    os.close(fd)
    signal(fd)
