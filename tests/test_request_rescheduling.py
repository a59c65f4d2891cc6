"""Request rescheduling (Triton >= 23.11): a Python model runs a request again; IPC and in-process.

The models are written as Triton's iterative-sequence examples are: ``execute`` calls
``request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)``, keeps its state per
request, and answers ``None`` for a rescheduled request (non-decoupled) or sends a response and
reschedules before returning (decoupled).
"""

from __future__ import annotations

import gc
import os
import signal
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server import Server
from edge_server.client import Client
from edge_server.config.parser import parse_config_text
from edge_server.errors import ConfigError, InstanceFailed, ModelExecutionError, RequestTimeout
from edge_server.request import ResponseSink
from tests.daemon import Daemon, python_stubs, wait_for

_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "N" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
{extra}
"""
_ITERATIVE = "sequence_batching { iterative_sequence: true oldest { max_candidate_sequences: 4 } }"
_DECOUPLED = "model_transaction_policy { decoupled: true }"
_ITERATIVE_ISOLATED = (
    _ITERATIVE + "\n" + _DECOUPLED + '\nparameters { key: "isolation" value: { string_value: "process" } }'
)

# Counts up to N, one step per execution, rescheduling until done; answers the number of steps.
# State is keyed by request id, as Triton's iterative examples do, and by sequence: over IPC the request
# id is the client's message id, which another client reuses.
_COUNTER = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.steps = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().reshape(-1)[0])
            key = (request.request_id(), request.correlation_id())
            self.steps[key] = self.steps.get(key, 0) + 1
            if self.steps[key] < n:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
            else:
                out = pb_utils.Tensor("OUT", np.array([[self.steps.pop(key)]], np.int32))
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
        return responses
"""

# Streams N responses (N-1, ..., 0), one per execution; the last one carries the final flag.  Each
# execution is logged as "<request id> seq<correlation id>".
_STREAMER = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.remaining = {}
        self.log = LOG

    def execute(self, requests):
        for request in requests:
            key = (request.request_id(), request.correlation_id())
            if key not in self.remaining:
                self.remaining[key] = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0, 0])
            self.remaining[key] -= 1
            left = self.remaining[key]
            with open(self.log, "a") as f:
                f.write(f"{key[0]} seq{key[1]}\\n")
            out = pb_utils.Tensor("OUT", np.array([[left]], np.int32))
            sender = request.get_response_sender()
            if left <= 0:
                del self.remaining[key]
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                time.sleep(0.005)
        return None
"""

# Reschedules and still answers: Triton refuses that (a rescheduled request's response must be None).
_ANSWERS_TOO = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        out = pb_utils.Tensor("OUT", np.zeros((1, 1), np.int32))
        return [pb_utils.InferenceResponse(output_tensors=[out]) for _ in requests]
"""

# Never finishes: bounded only by the request's timeout.
_FOREVER = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        return [None] * len(requests)
"""

_BAD_FLAGS = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            request.set_release_flags(7)
        return [None] * len(requests)
"""


def _write(repo: Path, name: str, source: str, extra: str) -> None:
    version = repo / name / "1"
    version.mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(_CONFIG.format(name=name, extra=extra))
    (version / "model.py").write_text(textwrap.dedent(source))


def build(repo: Path, log: Path) -> Path:
    _write(repo, "counter", _COUNTER, _ITERATIVE)
    _write(
        repo,
        "counter_isolated",
        _COUNTER,
        _ITERATIVE + '\nparameters { key: "isolation" value: { string_value: "process" } }',
    )
    _write(repo, "streamer", _STREAMER.replace("LOG", repr(str(log))), _ITERATIVE + "\n" + _DECOUPLED)
    _write(repo, "streamer_isolated", _STREAMER.replace("LOG", repr(str(log))), _ITERATIVE_ISOLATED)
    _write(repo, "counter_plain", _COUNTER, "")  # no iterative_sequence: rescheduling is refused
    _write(repo, "streamer_plain", _STREAMER.replace("LOG", repr(str(log))), _DECOUPLED)
    _write(repo, "answers_too", _ANSWERS_TOO, _ITERATIVE)
    _write(repo, "forever", _FOREVER, _ITERATIVE)
    _write(repo, "bad_flags", _BAD_FLAGS, _ITERATIVE)
    return repo


def _n(n: int) -> dict[str, np.ndarray]:
    return {"N": np.array([[n]], np.int32)}


_seq_ids = iter(range(1, 1 << 30))


def _seq() -> dict:
    """A fresh one-request sequence (an iterative sequence is started and ended by its one request)."""
    return {"correlation_id": next(_seq_ids), "sequence_start": True, "sequence_end": True}


def _ipc_seq() -> dict:
    return {"sequence_id": next(_seq_ids), "sequence_start": True, "sequence_end": True}


def _executions(log: Path, request_id: str) -> int:
    return log.read_text().split().count(request_id) if log.exists() else 0


def _settled(log: Path, request_id: str, sync: Callable[[str], object]) -> int:
    """The number of executions of ``request_id`` once it stops growing: counted before and after
    ``sync`` streams a short sequence through the same model (a live iterative request would run in
    its batches), until two counts agree; fails if they never do (20 rounds)."""
    last = -1
    for i in range(20):
        now = _executions(log, request_id)
        if now == last:
            return now
        last = now
        sync(f"{request_id}-sync{i}")
    raise AssertionError(f"{request_id} still runs: {last} executions and counting")


# -- in-process ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inproc_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("inproc")


@pytest.fixture(scope="module")
def server(inproc_root: Path) -> Iterator[Server]:
    """One server for the module: every test uses request and sequence ids of its own."""
    with Server(build(inproc_root / "repo", inproc_root / "runs.log")) as server:
        yield server


@pytest.mark.parametrize("model", ["counter", "counter_isolated"])
def test_non_decoupled_request_runs_until_the_model_answers(server: Server, model: str) -> None:
    out = server.infer(model, _n(5), request_id="a", **_seq())
    assert out["OUT"].tolist() == [[5]]


def test_concurrent_iterative_sequences_batch_together_and_keep_their_state(server: Server) -> None:
    counts = [1, 3, 7, 12]
    results: dict[int, int] = {}

    def one(n: int) -> None:
        results[n] = int(server.infer("counter", _n(n), request_id=f"r{n}", **_seq())["OUT"][0, 0])

    threads = [threading.Thread(target=one, args=(n,)) for n in counts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {n: n for n in counts}


@pytest.mark.parametrize("model", ["streamer", "streamer_isolated"])
def test_decoupled_model_streams_one_response_per_execution(
    server: Server, inproc_root: Path, model: str
) -> None:
    responses = list(server.stream(model, _n(4), timeout=10, request_id=f"{model}4", **_seq()))
    assert [int(r["OUT"][0, 0]) for r in responses] == [3, 2, 1, 0]
    assert _executions(inproc_root / "runs.log", f"{model}4") == 4


@pytest.mark.parametrize("model", ["streamer", "streamer_isolated"])
def test_a_finished_iterative_stream_is_not_kept(server: Server, model: str) -> None:
    """The isolated instance registered each execution's stream anew and forgot only the last: every
    iteration of every request kept its stream (and what it holds: the request) for the daemon's life,
    and so did a request cancelled while rescheduled."""

    def open_sinks() -> int:
        gc.collect()
        return sum(isinstance(o, ResponseSink) for o in gc.get_objects())

    list(server.stream(model, _n(2), timeout=10, request_id=f"{model}-warm", **_seq()))
    before = open_sinks()
    for i in range(3):
        responses = server.stream(model, _n(5), timeout=10, request_id=f"{model}-kept{i}", **_seq())
        assert [int(r["OUT"][0, 0]) for r in responses] == [4, 3, 2, 1, 0]
        del responses
    with server.stream(model, _n(100_000), timeout=10, request_id=f"{model}-closed", **_seq()) as closed:
        assert int(next(closed)["OUT"][0, 0]) == 99_999  # then cancelled between two of its runs
    del closed
    # The cancelled request may run once more, beside the first of these.
    for i in range(2):
        list(server.stream(model, _n(1), timeout=10, request_id=f"{model}-sync{i}", **_seq()))
    # (a thread that delivered a final response may hold its sink a moment longer)
    wait_for(lambda: open_sinks() <= before, 10, what="the finished streams to be let go")


def test_a_stream_cancelled_in_the_queue_is_let_go_without_a_later_batch(server: Server) -> None:
    """The isolated instance forgot a stream that ended outside its process (a rescheduled request
    cancelled in the queue) only at its next batch: with no later request it kept the stream, and the
    request it holds, until one came (a test that counted on two later requests failed under load)."""

    def open_sinks() -> int:
        gc.collect()
        return sum(isinstance(o, ResponseSink) for o in gc.get_objects())

    model = "streamer_isolated"
    list(server.stream(model, _n(2), timeout=10, request_id=f"{model}-alone-warm", **_seq()))
    before = open_sinks()
    for _ in range(10):  # a thread that delivered a final response may hold its sink a moment longer
        time.sleep(0.1)
        before = min(before, open_sinks())
    with server.stream(model, _n(100_000), timeout=10, request_id=f"{model}-alone", **_seq()) as closed:
        assert int(next(closed)["OUT"][0, 0]) == 99_999  # then cancelled between two of its runs
    del closed
    wait_for(lambda: open_sinks() <= before, 10, what="the cancelled stream to be let go")


def test_reschedule_without_iterative_sequence_fails_precisely(server: Server) -> None:
    with pytest.raises(ModelExecutionError, match=r"iterative_sequence: true"):
        server.infer("counter_plain", _n(3), request_id="p")
    stream = server.stream("streamer_plain", _n(3), timeout=10, request_id="q")
    assert int(next(stream)["OUT"][0, 0]) == 2  # sent before execute returned
    with pytest.raises(
        ModelExecutionError, match=r"TRITONSERVER_REQUEST_RELEASE_RESCHEDULE.*iterative_sequence"
    ):
        next(stream)


def test_rescheduled_request_with_a_response_fails(server: Server) -> None:
    with pytest.raises(  # Triton's text (its typo too: Triton's QA matches it), then ours
        ModelExecutionError,
        match=r"^Expected a None object in the execute function return list for reschduled request "
        r"\(model 'answers_too' returned InferenceResponse\)",
    ):
        server.infer("answers_too", _n(1), **_seq())


def test_unknown_release_flags_fail_the_batch(server: Server) -> None:
    with pytest.raises(ModelExecutionError, match="set_release_flags"):
        server.infer("bad_flags", _n(1), **_seq())


def test_endless_rescheduling_is_bounded_by_the_request_timeout(server: Server) -> None:
    with pytest.raises(RequestTimeout, match="rescheduled"):
        server.infer("forever", _n(1), timeout_us=300_000, **_seq())
    assert server.infer("counter", _n(2), request_id="after", **_seq())["OUT"].tolist() == [[2]]


@pytest.mark.parametrize("model", ["streamer", "streamer_isolated"])
def test_closing_the_stream_stops_the_iterations(server: Server, inproc_root: Path, model: str) -> None:
    log = inproc_root / "runs.log"
    stream = server.stream(model, _n(100_000), timeout=10, request_id=f"{model}-cancel-me", **_seq())
    assert int(next(stream)["OUT"][0, 0]) == 99_999
    stream.close()

    def sync(request_id: str) -> object:
        return list(server.stream(model, _n(2), timeout=10, request_id=request_id, **_seq()))

    assert _settled(log, f"{model}-cancel-me", sync) < 100_000
    assert server.infer("counter", _n(2), request_id="next", **_seq())["OUT"].tolist() == [[2]]


def test_a_killed_process_ends_its_iterative_streams(tmp_path: Path) -> None:
    """A request the process rescheduled is that process's (its state, keyed by request, is there):
    killed between two of its runs or in one, its stream ends with INSTANCE_FAILED."""
    repo = tmp_path / "repo"
    _write(
        repo,
        "streamer_isolated",
        _STREAMER.replace("LOG", repr(str(tmp_path / "runs.log"))),
        _ITERATIVE_ISOLATED,
    )
    others = set(python_stubs(os.getpid()).values())  # the module's server's
    with Server(repo) as server:  # its own: the restarted instance's threads end with it
        stream = server.stream("streamer_isolated", _n(100_000), timeout=30, request_id="killed", **_seq())
        assert int(next(stream)["OUT"][0, 0]) == 99_999
        (pid,) = set(python_stubs(os.getpid()).values()) - others
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(InstanceFailed, match="killed by SIGKILL"):
            for _ in stream:
                pass
        again = server.stream("streamer_isolated", _n(2), timeout=60, request_id="after-kill", **_seq())
        assert [int(r["OUT"][0, 0]) for r in again] == [1, 0]  # its restarted process


# -- the real daemon over IPC ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resched")


@pytest.fixture(scope="module")
def daemon(root: Path) -> Iterator[Daemon]:
    proc = Daemon(build(root / "repo", root / "runs.log"), f"ipc://{root}/r.sock", root / "r.log")
    proc.start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=30) as c:
        yield c


def test_ipc_non_decoupled_iterations(client: Client) -> None:
    assert client.infer("counter", _n(6), request_id="i6", **_ipc_seq())["OUT"].tolist() == [[6]]
    assert client.infer("counter_isolated", _n(3), request_id="i3", **_ipc_seq())["OUT"].tolist() == [[3]]


def test_ipc_decoupled_stream(client: Client) -> None:
    outs = [int(r["OUT"][0, 0]) for r in client.stream("streamer", _n(5), request_id="d5", **_ipc_seq())]
    assert outs == [4, 3, 2, 1, 0]


def test_ipc_errors(client: Client) -> None:
    with pytest.raises(ModelExecutionError, match="iterative_sequence: true"):
        client.infer("counter_plain", _n(2))
    with pytest.raises(RequestTimeout, match="rescheduled"):
        client.infer("forever", _n(1), queue_timeout_us=300_000, **_ipc_seq())


def test_ipc_cancel_mid_iteration(client: Client, root: Path) -> None:
    seq = _ipc_seq()
    with client.stream("streamer", _n(100_000), **seq) as stream:
        assert int(next(stream)["OUT"][0, 0]) == 99_999
        assert int(next(stream)["OUT"][0, 0]) == 99_998

    def sync(request_id: str) -> object:
        return list(client.stream("streamer", _n(2), request_id=request_id, **_ipc_seq()))

    assert 2 <= _settled(root / "runs.log", f"seq{seq['sequence_id']}", sync) < 100_000
    assert client.infer("counter", _n(2), request_id="i2", **_ipc_seq())["OUT"].tolist() == [[2]]


def test_decoupled_sequence_batching_needs_iterative_sequence() -> None:
    text = _CONFIG.format(name="m", extra="sequence_batching { }\n" + _DECOUPLED)
    with pytest.raises(ConfigError, match="only with iterative_sequence: true"):
        parse_config_text(text, source="config.pbtxt", default_name="m")
    config, warnings = parse_config_text(
        _CONFIG.format(name="m", extra=_ITERATIVE + "\n" + _DECOUPLED),
        source="config.pbtxt",
        default_name="m",
    )
    assert warnings == [] and config.decoupled
    assert config.sequence_batching is not None and config.sequence_batching.iterative_sequence
