"""The process an isolated Python model instance runs in: ``python -m edge_server.backends.python_stub``.

Started by ``python_process.py`` with ``LABEL PARENT_PID PIPE_FD [REQUESTS_FD RESPONSES_FD]``.  It
runs the in-thread :class:`~edge_server.backends.python.PythonBackend` (so a model behaves exactly as
in the thread mode, errors included) and answers the daemon's messages one at a time:

* ``init``: the pickled :class:`LoadContext` (from the daemon that started us); load the instance.
* ``complete``: run ``auto_complete_config`` and send back the config it made (a dict).
* ``exec``: a batch: inputs are read-only views of the requests arena; outputs are written to the
  responses arena (grown when needed), errors sent as ``[code, message]``.
* ``fini``: ``finalize()``, answer, exit.

BLS calls of the model (``InferenceRequest(...).exec()``) go to the daemon as ``bls`` messages and
come back as ``blsr`` (see ``python_bls.py``); a reader thread takes them (and ``cancel``) off the
pipe while ``execute`` runs, and queues everything else for the main loop.

A decoupled model's responses leave as ``send`` messages (``k``: the request's token, ``o``: tensors
inline, ``e``: an error, ``f``: final), from whichever thread the model sends on.  The daemon sends
``cancel`` when the client cancels a request, after which ``request.is_cancelled()`` is true and
later responses are dropped here, all but the final one (its end ends the daemon's stream too).  A
rescheduled request comes back with the token it had; ``exec`` lists in ``d`` the tokens whose
streams the daemon ended otherwise (cancelled while rescheduled), to be forgotten here.

The stub ignores SIGINT and SIGTERM (a terminal's Ctrl-C or systemd's stop reach the whole group; the
daemon decides when its models finalize) and exits within a second when its daemon is gone (its
parent changes), so that no stub outlives the daemon that owns it.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_server.backends import python as python_backend
from edge_server.backends.base import BatchItem, Timing
from edge_server.backends.python_bls import PipeModels, position
from edge_server.backends.python_wire import Arena, Channel, ChannelClosed, pack_inline, put, read
from edge_server.errors import EdgeServerError, ServerShuttingDown
from edge_server.request import Rescheduled, ResponseSink

log = logging.getLogger("edge_server.backends.python_stub")

_ORPHAN_CHECK_S = 1.0


def _detach_signals(parent_pid: int) -> None:
    """Ignore the group's stop signals, and exit when the daemon is gone (even while a model hangs).

    Not ``PR_SET_PDEATHSIG``: it fires when the daemon *thread* that started us exits, and instances
    are started (and restarted) by threads that come and go.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_ORPHAN_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="orphan-check", daemon=True).start()


class _PipeSink(ResponseSink):
    """A streamed request's responses, sent to the daemon as they come (any thread).

    Once the request is cancelled, its responses stay here, but its end still crosses (it
    :attr:`relays`): the daemon's stream (and the body its client holds in the budget) ends with it.
    """

    relays = True

    def __init__(self, channel: Channel, token: int) -> None:
        super().__init__()
        self._channel = channel
        self.token = token

    def deliver(
        self, outputs: dict[str, np.ndarray] | None, error: EdgeServerError | None, final: bool
    ) -> None:
        self._channel.send(
            {
                "op": "send",
                "k": self.token,
                "o": pack_inline(outputs.items()) if outputs is not None else None,
                "e": [error.code, error.message] if error is not None else None,
                "f": final,
            }
        )


class _Stub:
    def __init__(self, channel: Channel, requests: Arena | None, responses: Arena | None) -> None:
        self._channel = channel
        self._requests = requests
        self._responses = responses
        self._backend: python_backend.PythonBackend | None = None
        self._streams: dict[int, _PipeSink] = {}  # decoupled: requests that may still send
        # A cancellation can overtake its request (the daemon sends it from the client's thread): one
        # for a token newer than any request seen yet waits in _early for its request.
        self._streams_lock = threading.Lock()
        self._newest = 0
        self._early: set[int] = set()
        self._models = PipeModels(channel)  # BLS calls, answered by the daemon over the pipe
        self._inbox: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()

    def _read(self) -> None:
        """The pipe's only reader: answers to BLS calls and cancellations at once, the rest in order.

        A thread of its own, because a model waiting for a BLS answer inside ``execute`` holds the
        main loop (and a cancellation reaches ``is_cancelled()`` while ``execute`` still runs).
        """
        try:
            while True:
                message = self._channel.recv()
                op = message.get("op")
                if op == "blsr":
                    self._models.answer(message)
                elif op == "ready":  # beside a running execute(), as Triton's stub answers it
                    threading.Thread(target=self._ready, name="is-ready", daemon=True).start()
                elif op == "cancel":
                    self._cancel(int(message["k"]))
                else:
                    self._inbox.put(message)
        except ChannelClosed:  # the daemon closed our pipe (or died): nothing left to do
            pass
        except Exception:
            log.error("%s", traceback.format_exc())
        self._models.fail_all(ServerShuttingDown("the daemon closed this model's pipe"))
        self._inbox.put(None)

    def serve(self) -> None:
        threading.Thread(target=self._read, name="pipe-reader", daemon=True).start()
        while True:
            message = self._inbox.get()
            if message is None:
                return
            op = message.get("op")
            if op == "fini":
                self._finalize()
                return
            try:
                if op == "exec":
                    reply = self._execute(message["r"], message["n"], message.get("d", ()))
                elif op == "init":
                    reply = self._init(message)
                elif op == "complete":
                    reply = self._complete(message)
                else:
                    reply = {"err": ["INTERNAL", f"unknown operation {op!r}"]}
            except EdgeServerError as exc:
                reply = {"err": [exc.code, exc.message]}
            except Exception as exc:  # the stub must answer whatever broke
                log.error("%s", traceback.format_exc())
                reply = {"err": ["EXECUTION_FAILED", f"the model's process failed: {exc!r}"]}
            self._channel.send(reply)

    def _init(self, message: dict[str, Any]) -> dict[str, Any]:
        logging.getLogger().setLevel(int(message.get("log_level") or logging.INFO))
        ctx = pickle.loads(message["context"])  # from the daemon that started this process
        self._backend = python_backend.PythonBackend(dataclasses.replace(ctx, models=self._models))
        return {"ok": True, "ready_fn": self._backend.has_readiness}

    def _ready(self) -> None:
        """Answer a readiness probe with the model's ``is_ready()`` (the daemon bounds the wait)."""
        try:
            assert self._backend is not None
            reply: dict[str, Any] = {"op": "readyr", "v": self._backend.model_ready()}
        except BaseException as exc:  # noqa: BLE001 - NotReady, or anything else: not ready, and why
            reply = {"op": "readyr", "v": False, "why": str(exc)}
        try:
            self._channel.send(reply)
        except ChannelClosed:
            pass

    def _complete(self, message: dict[str, Any]) -> dict[str, Any]:
        config = pickle.loads(message["config"])  # from the daemon that started this process
        return {"ok": True, "config": python_backend.complete_in_thread(config, Path(message["path"]))}

    def _execute(self, requests: list[dict[str, Any]], size: int, forgotten: Sequence[int]) -> dict[str, Any]:
        assert self._backend is not None and self._requests is not None and self._responses is not None
        self._requests.follow(size)  # the daemon may have grown it
        for token in [t for t, sink in self._streams.items() if sink.finished]:
            del self._streams[token]
        for token in forgotten:  # ended in the daemon (a rescheduled request cancelled in its queue)
            sink = self._streams.pop(token, None)
            if sink is not None:
                sink.cancel()  # the model's is_cancelled() says so; what it still sends stays here
        items = [
            BatchItem(
                inputs=dict(read(desc, self._requests, copy=False) for desc in r["i"]),
                batch_size=r["b"],
                requested_outputs=tuple(r["o"]),
                request_id=r["id"],
                parameters=r["p"],
                correlation_id=r["c"],
                flags=r["f"],
                timeout_us=r["t"],
                stream=self._sink(r["k"], r["x"]) if "k" in r else None,
                client=position(index),  # BLS calls name it; the daemon knows who sent it
            )
            for index, r in enumerate(requests)
        ]
        timing = Timing()
        results = self._backend.execute(items, timing)
        del items  # the model's views of the requests arena go before the next batch is written
        named: list[tuple[str, np.ndarray]] = []
        for result in results:
            if not isinstance(result, Exception):
                named.extend(result.items())
        descs = iter(put(named, self._responses))
        encoded: list[Any] = []
        for result in results:
            if isinstance(result, EdgeServerError):
                encoded.append([result.code, result.message])
            elif isinstance(result, Exception):
                encoded.append(["EXECUTION_FAILED", repr(result)])
            elif isinstance(result, Rescheduled):  # released with RESCHEDULE: runs again, no outputs
                encoded.append({"o": [], "r": 1})
            else:
                encoded.append({"o": [next(descs) for _ in result]})
        # A request's outputs are {"o": [descriptor, ...]}, its error a [code, message] list.
        return {"r": encoded, "t": timing.compute_infer_ns, "n": self._responses.size}

    def _sink(self, token: int, cancelled: bool) -> _PipeSink:
        """A new sink for the request's token (a rescheduled request's replaces the one it had)."""
        sink = _PipeSink(self._channel, token)
        sink.model_sends = True
        with self._streams_lock:
            self._streams[token] = sink
            self._newest = max(self._newest, token)
            if token in self._early:
                self._early.discard(token)
                cancelled = True
        if cancelled:
            sink.cancel()
        return sink

    def _cancel(self, token: int) -> None:
        """The daemon's client cancelled the request (reader thread): the model sees ``is_cancelled()``."""
        with self._streams_lock:
            sink = self._streams.get(token)
            if sink is None and token > self._newest:  # before its request: see __init__
                self._early.add(token)
        if sink is not None:
            sink.cancel()

    def _finalize(self) -> None:
        reply: dict[str, Any] = {"ok": True}
        if self._backend is not None:
            try:
                self._backend.close()
            except Exception as exc:
                reply = {"err": ["INTERNAL", repr(exc)]}
        self._channel.send(reply)


def main(argv: list[str]) -> int:
    label, parent_pid, pipe_fd, *arena_fds = argv
    sys.argv[1:] = []  # the model sees the program alone, as in the daemon (cli/serve.py)
    _detach_signals(int(parent_pid))
    faulthandler.enable()  # a native crash leaves its Python traceback in the daemon's log
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s %(levelname).1s %(name)s [{label} pid %(process)d]: %(message)s",
        stream=sys.stderr,
    )
    channel = Channel(socket.socket(fileno=int(pipe_fd)))
    arenas = [Arena(int(fd)) for fd in arena_fds]
    requests, responses = (arenas[0], arenas[1]) if arenas else (None, None)
    _Stub(channel, requests, responses).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
