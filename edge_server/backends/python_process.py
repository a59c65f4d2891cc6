"""A Python model instance in a process of its own (``isolation: process``): the daemon's side.

Each instance is one stub process (``python_stub.py``, started with ``subprocess``: fork and exec, so
nothing of the daemon's threads or sockets is inherited) that imports ``model.py`` with the same
``triton_python_backend_utils`` and runs the in-thread :class:`PythonBackend` on its side of a
private pipe.  Requests and responses cross as described in ``python_wire.py``: fields in small
msgpack messages, tensors through two ``memfd`` arenas owned by this instance.

The stub process itself (``python_child.py``) runs in a process group of its own and is watched by
its pid, not by the end of its pipe (a model that forks and dies leaves a child holding the pipe
open); killing an instance (a failure, an unload, the daemon's stop) kills the whole group.

When the process dies (``os._exit``, a segfault in native code, an OOM kill) or its pipe breaks,
the batch it was running fails with :class:`~edge_server.errors.InstanceFailed` and the instance
refuses all further work; the scheduler then replaces it (restart with back-off).  A failure in the
model's own Python code is no such fault: the child reports it, and only its requests fail, exactly
as in the thread mode.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import pickle
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from edge_server.backends.base import Backend, BatchItem, LoadContext, Result, Timing
from edge_server.backends.python_bls import serve_call
from edge_server.backends.python_child import StubProcess, exit_reason
from edge_server.backends.python_wire import Arena, ChannelClosed, put, read, unpack_inline
from edge_server.config.model import ModelConfig, seconds_parameter
from edge_server.errors import (
    AlreadyExists,
    Cancelled,
    ConfigError,
    EdgeServerError,
    InstanceFailed,
    InvalidArgument,
    ModelExecutionError,
    NotFound,
    ServerShuttingDown,
    Unavailable,
    Unsupported,
)
from edge_server.model_readiness import NotReady, ReadinessProbe
from edge_server.request import ClientKey, Rescheduled, ResponseSink

log = logging.getLogger(__name__)

#: config.pbtxt ``parameters`` key: seconds the child may spend importing the model and in
#: ``initialize()`` (or ``auto_complete_config``) before it is killed and the load fails.
INIT_TIMEOUT_KEY = "isolation_init_timeout_s"
DEFAULT_INIT_TIMEOUT_S = 120.0
#: config.pbtxt ``parameters`` key: seconds one ``execute()`` may run before the process is killed and
#: the instance replaced (its requests fail with INSTANCE_FAILED); unset: no limit.  A thread cannot be
#: stopped; a process can.
EXECUTE_TIMEOUT_KEY = "isolation_execute_timeout_s"
#: how long ``finalize()`` may take at unload before the child is killed
FINALIZE_TIMEOUT_S = 5.0

# The errors a child can report for a request or a batch, by wire code; anything else is EXECUTION_FAILED.
_ERRORS: dict[str, type[EdgeServerError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        Unavailable,
        Unsupported,
        AlreadyExists,
        Cancelled,
        ModelExecutionError,
        ConfigError,
    )
}


def init_timeout(config: ModelConfig) -> float:
    return seconds_parameter(config, INIT_TIMEOUT_KEY, DEFAULT_INIT_TIMEOUT_S) or DEFAULT_INIT_TIMEOUT_S


def _error(entry: Any) -> EdgeServerError:
    code, message = str(entry[0]), str(entry[1])
    return _ERRORS.get(code, ModelExecutionError)(message)


def complete_in_process(config: ModelConfig, model_path: Path) -> dict[str, Any] | None:
    """``auto_complete_config`` run by a short-lived child, so that the daemon never imports model.py."""
    child = StubProcess(f"{config.name}-autocomplete", ())
    timeout = init_timeout(config)
    try:
        message = {"op": "complete", "config": pickle.dumps(config), "path": str(model_path)}
        reply = child.call(message, timeout)
    except TimeoutError:
        child.kill()
        raise ConfigError(
            f"{model_path}: importing the model in its own process took more than {timeout:g} s "
            f"({INIT_TIMEOUT_KEY}); the process was killed"
        ) from None
    except ChannelClosed:
        raise ConfigError(
            f"{model_path}: the model's process {exit_reason(child.reap())} while importing model.py"
        ) from None
    finally:
        child.stop(FINALIZE_TIMEOUT_S)
    if "err" in reply:
        raise ConfigError(str(reply["err"][1]))
    completed = reply.get("config")
    return completed if isinstance(completed, dict) else None


class IsolatedPythonBackend(Backend):
    """One Python model instance in its own process; see the module docstring.

    Made by ``PythonBackend.create``, which also completes the config (in a child as well).
    """

    @classmethod
    def complete_config(cls, config: ModelConfig, model_path: Path) -> ModelConfig:
        from edge_server.backends.python import PythonBackend

        return PythonBackend.complete_config(config, model_path)

    def __init__(self, ctx: LoadContext) -> None:
        self._model = ctx.config.name
        self._name = ctx.instance.name
        self._execute_timeout = seconds_parameter(ctx.config, EXECUTE_TIMEOUT_KEY, None)
        self._failure: InstanceFailed | None = None
        self._report: Callable[[InstanceFailed], None] | None = None  # the pool's, given to watch()
        self._busy = False  # in execute(), which reports a death itself (the watcher stays quiet)
        # decoupled: the open streams by token (requests whose final response has not come yet); a
        # rescheduled request keeps its token for its next run (see _tokens_for)
        self._streams: dict[int, ResponseSink] = {}
        # streams that ended here, not in the process (a rescheduled request cancelled or timed out in
        # the queue): forgotten at once, and by the process at the next batch
        self._ended_here: collections.deque[int] = collections.deque()
        self._bls_streams: dict[int, ResponseSink] = {}  # the model's open streamed BLS calls, by id
        # the clients of the batch sent last, by position: whose turns the model's BLS calls take
        self._bls_clients: list[ClientKey | None] = []
        self._tokens = itertools.count(1)
        self._closing = False
        self._requests = Arena.create(f"edge-{self._name}-requests")
        self._responses = Arena.create(f"edge-{self._name}-responses")
        self._child: StubProcess | None = None
        self._ready_answer: Future[dict[str, Any]] | None = None  # the readiness probe in flight
        self._child_gone = False  # the pipe's reader has ended
        self._models = ctx.models  # the data plane, for the model's BLS calls (see python_bls)
        try:
            self._child = StubProcess(self._name, (self._requests, self._responses))
            self._child.on_bls = self._on_bls
            ready_fn = self._initialize(ctx)
            if ready_fn:  # probes come at any time, also while execute() runs: answers need the reader
                self._child.on_ready = self._on_ready
                self.readiness_probe = ReadinessProbe(self._name, self._ask_ready)
            if ctx.config.decoupled or ready_fn:
                self._child.start_reader(self._name, self._on_send, self._on_gone)
        except BaseException:
            self.close()
            raise
        log.info("%s: running in process %d", self._name, self._child.pid)

    def _initialize(self, ctx: LoadContext) -> bool:
        """Load the model in the child; whether it defines ``is_ready``."""
        assert self._child is not None
        timeout = init_timeout(ctx.config)
        # Without the daemon's model access (live objects): the child's BLS calls come over the pipe.
        context = dataclasses.replace(ctx, models=None)
        message = {"op": "init", "context": pickle.dumps(context), "log_level": logging.getLogger().level}
        try:
            reply = self._child.call(message, timeout)
        except TimeoutError:
            self._child.kill()
            raise ConfigError(
                f"{ctx.model_path}: loading the model in its own process took more than {timeout:g} s "
                f"({INIT_TIMEOUT_KEY}); the process was killed"
            ) from None
        except ChannelClosed:
            raise ConfigError(
                f"{ctx.model_path}: the model's process {exit_reason(self._child.reap())} while loading "
                "(importing model.py or in initialize())"
            ) from None
        if "err" in reply:
            raise ConfigError(str(reply["err"][1]))
        return bool(reply.get("ready_fn"))

    def _ask_ready(self) -> bool:
        """The model's ``is_ready()`` answer from its process (one at a time: the probe's rule)."""
        child = self._child
        if child is None or self._failure is not None:
            raise NotReady(f"instance {self._name} is not serving")
        answer: Future[dict[str, Any]] = Future()
        self._ready_answer = answer
        if self._child_gone:  # the reader has ended (the process died): no answer will come
            raise NotReady(f"the process of instance {self._name} is gone")
        try:
            child.channel.send({"op": "ready"})
        except (ChannelClosed, OSError):
            raise NotReady(f"the process of instance {self._name} is gone") from None
        reply = answer.result()
        if reply.get("why"):
            raise NotReady(str(reply["why"]))
        return reply.get("v") is True

    def _on_ready(self, message: dict[str, Any]) -> None:
        answer = self._ready_answer
        if answer is not None and not answer.done():
            answer.set_result(message)

    def _on_bls(self, message: dict[str, Any]) -> None:
        """A BLS call from the model's process: through the data plane; the answer goes back later."""
        if self._child is not None:
            serve_call(message, self._models, self._child.channel, self._bls_streams, self._bls_clients)

    def _on_send(self, message: dict[str, Any]) -> None:
        """A streamed response from the model (reader thread): hand it to its request's stream."""
        token = message["k"]
        final = bool(message["f"])
        sink = self._streams.pop(token, None) if final else self._streams.get(token)
        if sink is None:
            return
        error = _error(message["e"]) if message.get("e") else None
        outputs = unpack_inline(message["o"]) if message.get("o") is not None else None
        sink.put(outputs, error, final=final)

    def _cancel(self, token: int) -> None:
        """The client cancelled a streamed request: tell the process (the model sees ``is_cancelled()``)."""
        child = self._child
        if child is None or self._child_gone:
            return
        try:
            child.channel.send({"op": "cancel", "k": token})
        except (ChannelClosed, OSError):
            pass  # the process is gone: its streams end with it

    def _on_gone(self) -> None:
        """The pipe closed: end every open stream (the process died, or the instance was unloaded)."""
        self._child_gone = True
        self._on_ready({"v": False, "why": f"the process of instance {self._name} is gone"})
        error: EdgeServerError
        if self._failure is not None:  # its death was seen first, and the instance may be closing for it
            error = self._failure
        elif self._closing:
            error = ServerShuttingDown(
                f"model {self._model!r} was unloaded before it sent the final response"
            )
        else:
            assert self._child is not None
            error = InstanceFailed(
                f"model {self._model!r}: instance {self._name} failed: its process {self._child.pid} "
                f"{exit_reason(self._child.reap())} before it sent the final response"
            )
            # Out of service before its streams hear of it: a client that sends its next request as
            # soon as its stream fails must find the instance being replaced, not the dead process
            # (the exit watcher may see the death only after this reader did).
            self._failure = error
            if self._report is not None:
                self._report(error)
        while self._streams:
            _, sink = self._streams.popitem()
            sink.put(None, error, final=True)

    def watch(self, report: Callable[[InstanceFailed], None]) -> None:
        """Wait for the process in a thread of its own.

        A death between batches (an OOM kill, a model's own thread) is reported at once, so that no
        request is sent to a dead instance.
        """
        child = self._child
        assert child is not None
        self._report = report

        def exited(returncode: int) -> None:
            # While busy, execute() sees the pipe end (the exit watcher ended it) and reports itself.
            if self._closing or self._busy or self._failure is not None:
                return
            self._failure = InstanceFailed(
                f"model {self._model!r}: instance {self._name} failed: its process {child.pid} "
                f"{exit_reason(returncode)} while idle"
            )
            log.error("%s", self._failure.message)
            report(self._failure)

        child.on_exit(exited)

    @property
    def pid(self) -> int | None:
        """The instance's process (for logs and tests)."""
        return self._child.pid if self._child is not None else None

    def execute(self, batch: Sequence[BatchItem], timing: Timing) -> list[Result]:
        if self._failure is not None or self._child is None:
            raise self._failure or InstanceFailed(f"model {self._model!r}: instance {self._name} is closed")
        if self._child.proc.poll() is not None:  # died while idle (an OOM kill, a model's own thread)
            self._fail("before this request reached it")
        self._busy = True
        try:
            return self._execute(batch, timing)
        finally:
            self._busy = False

    def _execute(self, batch: Sequence[BatchItem], timing: Timing) -> list[Result]:
        assert self._child is not None
        named = [pair for item in batch for pair in item.inputs.items()]
        descs = iter(put(named, self._requests))
        self._bls_clients = [item.client for item in batch]
        tokens, forgotten = self._tokens_for(batch)
        requests = []
        for item, token in zip(batch, tokens, strict=True):
            request = {
                "i": [next(descs) for _ in item.inputs],
                "b": item.batch_size,
                "o": list(item.requested_outputs),
                "id": item.request_id,
                "p": dict(item.parameters),
                "c": item.correlation_id,
                "f": item.flags,
                "t": item.timeout_us,
            }
            if item.stream is not None:  # a decoupled model's request: its responses are streamed
                request["k"] = token
                request["x"] = item.stream.cancelled
            requests.append(request)
        message = {"op": "exec", "n": self._requests.size, "r": requests, "d": forgotten}
        try:
            reply = self._child.call(message, self._execute_timeout)
        except ChannelClosed:
            self._fail("while running this request")
        except TimeoutError:
            self._child.kill()
            self._fail(f"after execute() ran past {self._execute_timeout:g} s ({EXECUTE_TIMEOUT_KEY})")
        timing.compute_infer_ns += int(reply.get("t", 0))
        if "err" in reply:  # the model failed the whole batch (execute() raised); the process is fine
            raise _error(reply["err"])
        try:
            self._responses.follow(int(reply.get("n", 0)))
            results: list[Result] = []
            for entry in reply["r"]:
                if isinstance(entry, list):
                    results.append(_error(entry))
                elif entry.get("r"):  # the model rescheduled the request
                    results.append(Rescheduled())
                else:
                    results.append(dict(read(desc, self._responses, copy=True) for desc in entry["o"]))
            return results
        except (KeyError, TypeError, ValueError, IndexError) as exc:  # our own child cannot say this
            log.error("%s: unreadable reply from process %d: %r", self._name, self._child.pid, exc)
            self._child.kill()
            self._fail("after sending an unreadable reply")

    def _tokens_for(self, batch: Sequence[BatchItem]) -> tuple[list[int], list[int]]:
        """The batch's stream tokens (0: none), and the tokens of the streams that ended otherwise.

        A rescheduled request runs again with the token it had, so that its stream is one entry here
        however often it runs (and still ended if the process dies meanwhile).  A stream that ended
        without its final response coming from the process (a rescheduled request cancelled or timed
        out in the queue) was forgotten here when it ended (:meth:`_ended`); the process is told now.
        """
        forgotten: list[int] = []
        while self._ended_here:
            forgotten.append(self._ended_here.popleft())
        open_tokens = {id(sink): token for token, sink in list(self._streams.items())}
        tokens = []
        for item in batch:
            token = 0
            if item.stream is not None:
                token = open_tokens.get(id(item.stream)) or self._open(item.stream)
            tokens.append(token)
        return tokens, forgotten

    def _open(self, stream: ResponseSink) -> int:
        """A token for a new stream, whose cancellation is passed on to the process from now on.

        Before the request is sent, which carries the cancellation that came earlier (``x``).
        """
        token = next(self._tokens)
        self._streams[token] = stream
        stream.on_cancel = partial(self._cancel, token)
        stream.on_final = partial(self._ended, token, stream.on_final)
        if stream.finished:  # ended before this run (cancelled in the queue): its final will not come
            self._ended(token, None)
        return token

    def _ended(self, token: int, then: Callable[[], None] | None) -> None:
        """A stream's final response was put (on any thread): it is forgotten now, not at a next batch.

        Kept until then, the last stream cancelled in the queue held its request (inputs and all) for as
        long as no other request came.  One whose final came from the process was forgotten already.
        """
        try:
            if self._streams.pop(token, None) is not None:
                self._ended_here.append(token)
        finally:
            if then is not None:
                then()

    def _fail(self, when: str) -> NoReturn:
        assert self._child is not None
        reason = exit_reason(self._child.reap())
        self._failure = InstanceFailed(
            f"model {self._model!r}: instance {self._name} failed: its process {self._child.pid} {reason} "
            f"{when}"
        )
        log.error("%s", self._failure.message)
        raise self._failure

    def close(self) -> None:
        self._closing = True
        if self._child is not None:
            if self._failure is None:
                self._child.stop(FINALIZE_TIMEOUT_S)
            else:
                self._child.kill()
                self._child.channel.close()
            self._child = None
        for arena in (self._requests, self._responses):
            if arena.fd >= 0:
                arena.close()
                arena.fd = -1
