"""One isolated Python model's stub process, as the daemon holds it: started, watched, killed.

The stub (``python_stub.py``) is started with ``subprocess`` (fork and exec: nothing of the daemon's
threads or sockets is inherited) in a process group and session of its own, and talks over a private
socket pair.  Its exit is watched by its pid, not by the end of its pipe: a model that forks
(``multiprocessing``) and then dies leaves a child holding the pipe open, so EOF would never come.
When the stub exits, the watcher kills what is left of its group and ends the pipe from the daemon's
side (a call waiting for a reply gets ChannelClosed at once); :meth:`StubProcess.kill` kills the whole
group, so no forked worker or stopped stub outlives a failure, an unload or the daemon's stop.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import edge_server
from edge_server.backends.python_wire import Arena, Channel, ChannelClosed

log = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(edge_server.__file__).resolve().parent.parent)


def exit_reason(returncode: int | None) -> str:
    """How a process ended, in words: 'exited with status 1', 'was killed by SIGSEGV'."""
    if returncode is None:
        return "stopped answering"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class StubProcess:
    """One stub process and the daemon's end of its pipe."""

    def __init__(self, label: str, arenas: Sequence[Arena]) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # The child imports edge_server from where this daemon did, installed or not.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        # Modules that user code imports from the repository leave no bytecode there (see repository.py).
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        fds = [theirs.fileno(), *(arena.fd for arena in arenas)]
        command = [sys.executable, "-m", "edge_server.backends.python_stub", label, str(os.getpid())]
        try:
            self.proc = subprocess.Popen(
                [*command, *(str(fd) for fd in fds)],
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: see kill()
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.channel = Channel(mine)
        self._replies: queue.SimpleQueue[dict[str, Any] | None] | None = None
        #: the model's BLS calls (``bls`` messages), read by :meth:`call` or by the reader thread
        self.on_bls: Callable[[dict[str, Any]], None] | None = None
        #: the model's ``is_ready()`` answers (``readyr`` messages), read by the reader thread
        self.on_ready: Callable[[dict[str, Any]], None] | None = None
        self._exit_lock = threading.Lock()
        self._on_exit: Callable[[int], None] | None = None
        self.returncode: int | None = None  # set by the exit watcher, once the stub has exited
        self._group_dead = False  # the watcher killed the group after the stub exited: never again
        self._watcher = threading.Thread(target=self._watch_exit, name=f"edge-{label}-exit", daemon=True)
        self._watcher.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _watch_exit(self) -> None:
        """Wait for the stub's pid; then kill what is left of its group and end the pipe here.

        The stub's exit, not EOF, is the signal: a process the model forked holds the pipe open.
        """
        returncode = self.proc.wait()
        self._kill_group()
        with self._exit_lock:
            self._group_dead = True  # its id may be reused from now on
        self.channel.shutdown()  # a call waiting for a reply gets ChannelClosed now
        with self._exit_lock:
            self.returncode = returncode
            callback = self._on_exit
        if callback is not None:
            callback(returncode)

    def on_exit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(returncode)`` (once, in the watcher thread, or now if it already exited)."""
        with self._exit_lock:
            returncode = self.returncode
            if returncode is None:
                self._on_exit = callback
                return
        callback(returncode)

    def _kill_group(self) -> None:
        # The group's id is the stub's pid, which the kernel does not reuse while the group has members.
        with self._exit_lock:
            if self._group_dead:
                return
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def start_reader(
        self, name: str, on_send: Callable[[dict[str, Any]], None], on_gone: Callable[[], None]
    ) -> None:
        """Read the pipe in a thread of its own from now on (decoupled models send at any time).

        ``send`` messages go to ``on_send``; replies to :meth:`call`; ``on_gone`` runs once the pipe is
        closed (the process died or was stopped).
        """
        replies: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()

        def read() -> None:
            try:
                while True:
                    message = self.channel.recv()
                    op = message.get("op")
                    if op == "send":
                        on_send(message)
                    elif op in ("bls", "blsc") and self.on_bls is not None:  # calls, and cancels of streams
                        self.on_bls(message)
                    elif op == "readyr" and self.on_ready is not None:  # the model's is_ready() answer
                        self.on_ready(message)
                    else:
                        replies.put(message)
            except (ChannelClosed, OSError):
                pass
            except Exception:
                log.exception("%s: reading the model's process failed", name)
                self.kill()
            replies.put(None)
            on_gone()

        self._replies = replies
        threading.Thread(target=read, name=f"edge-{name}-stream", daemon=True).start()

    def call(self, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        self.channel.send(message)
        if self._replies is None:
            # The model's BLS calls arrive here while it executes: serve them, wait on for the reply.
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("no reply within the timeout")
                message = self.channel.recv(left)  # TimeoutError once ``left`` has passed
                if message.get("op") in ("bls", "blsc") and self.on_bls is not None:
                    self.on_bls(message)
                    continue
                return message
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("no reply within the timeout") from None
        if reply is None:
            self._replies.put(None)  # for any later call
            raise ChannelClosed("the model's process is gone")
        return reply

    def reap(self) -> int | None:
        """Wait briefly for the process to end (its pipe closed), kill it if it does not; its status."""
        try:
            return self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode
        finally:
            self._kill_group()  # what it forked goes with it

    def kill(self) -> None:
        """Kill the stub and everything in its process group (forked workers, a stopped stub)."""
        self._kill_group()
        self.proc.wait()
        if threading.current_thread() is not self._watcher:
            # It has seen the exit and only finishes its callback (bounded: never wait on a lock cycle).
            self._watcher.join(1.0)

    def stop(self, timeout: float) -> None:
        """Ask the child to finalize and exit; kill it when it does not within ``timeout``."""
        if self.proc.poll() is None:
            try:
                reply = self.call({"op": "fini"}, timeout)
                if "err" in reply:
                    log.error("pid %d: finalize() failed: %s", self.pid, reply["err"][1])
                self.proc.wait(timeout)
            except (ChannelClosed, TimeoutError, subprocess.TimeoutExpired):
                log.warning("pid %d did not finish finalize() within %.0f s; killed", self.pid, timeout)
        self.kill()
        if self._replies is None:  # else the reader closes it when it sees the end
            self.channel.close()
