"""The sequence batcher in-process: Triton's simple_sequence outputs, implicit state, expiry, errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from sequence_models import (
    CORRID_ECHO_CONFIG,
    DIRECT,
    DYNA_CONFIG,
    DYNA_MODEL,
    OLDEST,
    SMOOTHER_CONFIG,
    VALUES,
    accumulate_config,
    accumulate_onnx,
    corrid_echo_onnx,
    history_config,
    history_onnx,
    simple_sequence_config,
    simple_sequence_onnx,
    smoother_onnx,
    triton_expected,
    write_model,
)

from edge_server import Server
from edge_server.errors import InvalidArgument, QueueFull
from edge_server.metrics.collector import ServerCollector
from edge_server.scheduler import sequence

STRATEGIES = {"direct": DIRECT, "oldest": OLDEST}


def one(value: int) -> dict[str, np.ndarray]:
    return {"INPUT": np.array([[value]], np.int32)}


def scalar(outputs: dict[str, np.ndarray], name: str = "OUTPUT") -> int:
    return int(outputs[name][0, 0])


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sequence_repo")
    for strategy, text in STRATEGIES.items():
        write_model(
            root,
            f"simple_{strategy}",
            simple_sequence_config(f"simple_{strategy}", text),
            simple_sequence_onnx,
        )
        write_model(root, f"acc_{strategy}", accumulate_config(f"acc_{strategy}", text), accumulate_onnx)
    write_model(root, "smoother", SMOOTHER_CONFIG, smoother_onnx)
    write_model(root, "dyna", DYNA_CONFIG, python=DYNA_MODEL)
    return root


@pytest.fixture
def server(repo: Path) -> Iterator[Server]:
    with Server(repo) as srv:
        yield srv


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_triton_simple_sequence_interleaved_from_several_clients(server: Server, strategy: str) -> None:
    """Triton's sequence clients' sequences, from three threads at once, give Triton's expected outputs."""
    model = f"simple_{strategy}"
    sequences = {
        1000: [0, *VALUES],
        1001: [100, *[-v for v in VALUES]],
        1002: [20, *[-v for v in VALUES]],
    }
    results: dict[int, list[int]] = {}

    def client(corrid: int, values: list[int]) -> None:
        results[corrid] = [
            scalar(
                server.infer(
                    model,
                    one(v),
                    correlation_id=corrid,
                    sequence_start=i == 0,
                    sequence_end=i == len(values) - 1,
                )
            )
            for i, v in enumerate(values)
        ]

    threads = [threading.Thread(target=client, args=item) for item in sequences.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for corrid, values in sequences.items():
        assert results[corrid] == triton_expected(values[0], values[1:])
    stats = server.statistics(model)[0]["sequence_stats"]
    assert stats["active"] == 0 and stats["ended"] >= 3


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_implicit_state_accumulates_per_sequence_in_order_under_concurrent_load(
    server: Server, strategy: str
) -> None:
    """Sixteen sequences submitted without waiting: each sees its own running sum, step by step."""
    model = f"acc_{strategy}"
    rng = np.random.default_rng(7)
    inputs = {corrid: rng.integers(-50, 50, size=30).tolist() for corrid in range(1, 17)}
    futures: dict[int, list] = {c: [] for c in inputs}
    for step in range(30):
        for corrid, values in inputs.items():
            futures[corrid].append(
                server.submit(
                    model,
                    one(values[step]),
                    correlation_id=corrid,
                    sequence_start=step == 0,
                    sequence_end=step == 29,
                )
            )
    for corrid, values in inputs.items():
        got = [scalar(f.result(timeout=30)) for f in futures[corrid]]
        assert got == np.cumsum(values).tolist()
    stats = server.statistics(model)[0]
    assert stats["sequence_stats"]["active"] == 0
    # Sequences batched together: fewer executions than requests.
    assert stats["execution_count"] < stats["inference_count"]


def test_stateful_onnx_equals_running_it_by_hand(server: Server, repo: Path) -> None:
    session = ort.InferenceSession(
        str(repo / "smoother" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(3)
    frames = {c: rng.standard_normal((12, 1, 4)).astype(np.float32) for c in ("cam-a", "cam-b", "cam-c")}
    futures = {c: [] for c in frames}
    for step in range(12):
        for cam, xs in frames.items():
            futures[cam].append(
                server.submit(
                    "smoother",
                    {"x": xs[step]},
                    correlation_id=cam,
                    sequence_start=step == 0,
                    sequence_end=step == 11,
                )
            )
    for cam, xs in frames.items():
        state = np.zeros((1, 4), np.float32)
        for step in range(12):
            y, state = session.run(["y", "S_OUT"], {"x": xs[step], "S_IN": state})
            got = futures[cam][step].result(timeout=30)
            assert set(got) == {"y"}  # the state output stays in the server
            np.testing.assert_array_equal(got["y"], y)


def test_python_model_sees_control_inputs_correlation_id_and_flags(server: Server) -> None:
    """Triton's simple_dyna_sequence behaviour: a running sum, plus the correlation id on END."""
    results = {}

    def client(corrid: int) -> None:
        results[corrid] = [
            scalar(
                server.infer(
                    "dyna",
                    one(v),
                    correlation_id=corrid,
                    sequence_start=i == 0,
                    sequence_end=i == len(VALUES) - 1,
                )
            )
            for i, v in enumerate(VALUES)
        ]

    threads = [threading.Thread(target=client, args=(c,)) for c in (1000, 1001, 1002)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for corrid in (1000, 1001, 1002):
        expected = np.cumsum(VALUES).tolist()
        expected[-1] += corrid
        assert results[corrid] == expected


@pytest.mark.parametrize(
    ("kwargs", "inputs", "message"),
    [
        ({}, None, "must specify a non-zero or non-empty correlation ID"),
        (
            {"correlation_id": 77},
            None,
            "inference request for sequence 77 to model 'acc_oldest' must specify the START flag",
        ),
        ({"correlation_id": 78, "sequence_end": True}, None, "it is not in progress"),
        (
            {"correlation_id": 79, "sequence_start": True},
            {"ACC_IN": np.zeros((1, 1), np.int32)},
            "server fills",
        ),
        (
            {"correlation_id": 80, "sequence_start": True},
            {"INPUT": np.zeros((2, 1), np.int32)},
            "must specify batch-size 1 due to requirements of sequence batcher",
        ),
        ({"correlation_id": True, "sequence_start": True}, None, "integer or a string"),
        ({"correlation_id": "x" * 300, "sequence_start": True}, None, "at most"),
    ],
)
def test_bad_sequence_requests_get_clear_errors(
    server: Server, kwargs: dict, inputs: dict | None, message: str
) -> None:
    request = one(1) if inputs is None else {**one(1), **inputs} if "ACC_IN" in inputs else inputs
    with pytest.raises(InvalidArgument, match=message):
        server.infer("acc_oldest", request, **kwargs)


def test_start_twice_restarts_and_state_output_request_is_refused(server: Server) -> None:
    server.infer("acc_direct", one(1), correlation_id=90, sequence_start=True)
    assert scalar(server.infer("acc_direct", one(7), correlation_id=90)) == 8
    # Triton's rule: a START on a live id ends that sequence and starts it again, with fresh state.
    assert scalar(server.infer("acc_direct", one(1), correlation_id=90, sequence_start=True)) == 1
    with pytest.raises(InvalidArgument, match="implicit state"):
        server.infer("acc_direct", one(1), correlation_id=90, outputs=["ACC_OUT"])
    assert scalar(server.infer("acc_direct", one(5), correlation_id=90, sequence_end=True)) == 6
    stats = server.statistics("acc_direct")[0]["sequence_stats"]
    assert stats["started"] - stats["ended"] == stats["active"] == 0
    with pytest.raises(InvalidArgument, match="not in progress"):
        server.infer("acc_direct", one(1), correlation_id=90)


def test_idle_sequence_is_released_and_its_next_request_fails(tmp_path: Path) -> None:
    write_model(tmp_path, "acc", accumulate_config("acc", DIRECT, idle_us=100_000), accumulate_onnx)
    with Server(tmp_path) as server:
        assert scalar(server.infer("acc", one(3), correlation_id=5, sequence_start=True)) == 3
        done = threading.Event()
        while not done.wait(0.02):  # ask the server, not the clock
            if server.statistics("acc")[0]["sequence_stats"]["expired"] == 1:
                done.set()
        with pytest.raises(InvalidArgument, match="idle for more than 100000 us"):
            server.infer("acc", one(1), correlation_id=5)
        # Started again, it begins from a fresh state.
        assert (
            scalar(server.infer("acc", one(4), correlation_id=5, sequence_start=True, sequence_end=True)) == 4
        )


def test_direct_slots_backlog_and_occupancy(tmp_path: Path) -> None:
    """Two slots, three sequences: the third waits for a slot and runs once the first ends."""
    write_model(tmp_path, "acc", accumulate_config("acc", DIRECT, max_batch_size=2), accumulate_onnx)
    with Server(tmp_path) as server:
        server.infer("acc", one(1), correlation_id=1, sequence_start=True)
        server.infer("acc", one(2), correlation_id=2, sequence_start=True)
        third = server.submit("acc", one(3), correlation_id=3, sequence_start=True)
        stats = server.statistics("acc")[0]["sequence_stats"]
        assert stats["slots"] == [{"instance": "acc_0_0", "total": 2, "occupied": 2}]
        assert stats["backlog"] == 1 and stats["active"] == 3
        metrics = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in ServerCollector(server).collect()
            for sample in family.samples
        }
        labels = (("model", "acc"), ("version", "1"))
        assert metrics[("edge_sequence_active", labels)] == 3
        assert metrics[("edge_sequence_backlog", labels)] == 1
        assert metrics[("edge_sequence_slots_occupied", (("instance", "acc_0_0"), *labels))] == 2
        assert not third.done()
        assert scalar(server.infer("acc", one(10), correlation_id=1, sequence_end=True)) == 11
        assert scalar(third.result(timeout=10)) == 3
        assert scalar(server.infer("acc", one(1), correlation_id=3, sequence_end=True)) == 4
        assert scalar(server.infer("acc", one(1), correlation_id=2, sequence_end=True)) == 3


def test_initial_state_from_a_data_file(tmp_path: Path) -> None:
    initial = 'initial_state { data_type: TYPE_INT32 dims: [ 1 ] data_file: "hundred" name: "init" }'
    write_model(tmp_path, "acc", accumulate_config("acc", OLDEST, initial=initial), accumulate_onnx)
    (tmp_path / "acc" / "initial_state").mkdir()
    (tmp_path / "acc" / "initial_state" / "hundred").write_bytes(np.array([100], np.int32).tobytes())
    with Server(tmp_path) as server:
        assert scalar(server.infer("acc", one(1), correlation_id=1, sequence_start=True)) == 101
        assert scalar(server.infer("acc", one(2), correlation_id=1, sequence_end=True)) == 103


def test_reload_lets_live_sequences_finish_on_the_old_version(tmp_path: Path) -> None:
    write_model(tmp_path, "acc", accumulate_config("acc", OLDEST), accumulate_onnx)
    with Server(tmp_path, model_control_mode="explicit", load_models=["acc"]) as server:
        assert scalar(server.infer("acc", one(1), correlation_id=1, sequence_start=True)) == 1
        accumulate_onnx(tmp_path / "acc" / "2" / "model.onnx", offset=1000)
        loading = threading.Thread(target=server.load_model, args=("acc",))
        loading.start()
        swapped = threading.Event()
        while not swapped.wait(0.02):
            if 2 in server.routing.serving().get("acc", {}):
                swapped.set()
        # The live sequence goes on on version 1; a new one starts on version 2.
        assert scalar(server.infer("acc", one(2), correlation_id=1)) == 3
        assert scalar(server.infer("acc", one(5), correlation_id=2, sequence_start=True)) == 1005
        # A second START restarts it where it lives (Triton's rule), so it still finishes on version 1.
        assert scalar(server.infer("acc", one(1), correlation_id=1, sequence_start=True)) == 1
        assert loading.is_alive()  # version 1 waits for its sequence
        assert scalar(server.infer("acc", one(3), correlation_id=1, sequence_end=True)) == 4
        loading.join(timeout=10)
        assert not loading.is_alive()
        assert sorted(server.routing.serving()["acc"]) == [2]
        assert scalar(server.infer("acc", one(1), correlation_id=2, sequence_end=True)) == 1006


def test_sequence_model_without_control_inputs_in_its_graph_fails_to_load(tmp_path: Path) -> None:
    config = simple_sequence_config("bad", DIRECT).replace('name: "READY"', 'name: "NOT_THERE"')
    write_model(tmp_path, "bad", config, simple_sequence_onnx)
    with Server(tmp_path) as server:
        (status,) = [s for s in server.models() if s.name == "bad"]
        assert status.state.value == "UNAVAILABLE"
        assert "'NOT_THERE' is not an input of the ONNX model" in status.reason


PROBE_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        ready = [int(pb_utils.get_input_tensor_by_name(r, "READY").as_numpy()[0, 0]) for r in requests]
        code = len(requests) * 100 + sum(ready)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.array([[code]], np.int32))])
            for _ in requests
        ]
"""


@pytest.mark.parametrize(("strategy", "expected"), [("direct", 201), ("oldest", 101)])
def test_direct_fills_slots_without_a_ready_request_with_ready_0_rows(
    tmp_path: Path, strategy: str, expected: int
) -> None:
    """Sequence 2 holds slot 1; its lone request runs with a READY=0 row for slot 0 (direct only)."""
    config = simple_sequence_config("probe", STRATEGIES[strategy], max_batch_size=4)
    write_model(
        tmp_path,
        "probe",
        config.replace('platform: "onnxruntime_onnx"', 'backend: "python"'),
        python=PROBE_MODEL,
    )
    with Server(tmp_path) as server:
        assert scalar(server.infer("probe", one(0), correlation_id=1, sequence_start=True)) == 101
        assert scalar(server.infer("probe", one(0), correlation_id=2, sequence_start=True)) == expected
        assert scalar(server.infer("probe", one(0), correlation_id=2, sequence_end=True)) == expected
        assert scalar(server.infer("probe", one(0), correlation_id=1, sequence_end=True)) == 101


def test_warmup_sample_of_a_sequence_model_gets_its_control_and_state_inputs(tmp_path: Path) -> None:
    warmup = """
model_warmup [ { name: "w" batch_size: 2
  inputs { key: "INPUT" value: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } } ]
"""
    write_model(tmp_path, "acc", accumulate_config("acc", OLDEST) + warmup, accumulate_onnx)
    write_model(
        tmp_path,
        "simple",
        simple_sequence_config("simple", DIRECT)
        + warmup.replace(
            "} } } ]",
            '} } inputs { key: "START" value: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } } } ]',
        ),
        simple_sequence_onnx,
    )
    with Server(tmp_path) as server:
        assert {s.name: s.state.value for s in server.models()} == {"acc": "READY", "simple": "READY"}
        assert (
            scalar(server.infer("acc", one(2), correlation_id=1, sequence_start=True, sequence_end=True)) == 2
        )


def test_unload_does_not_wait_for_idle_sequences(tmp_path: Path) -> None:
    write_model(tmp_path, "acc", accumulate_config("acc", OLDEST, idle_us=60_000_000), accumulate_onnx)
    with Server(tmp_path, model_control_mode="explicit", load_models=["acc"], drain_timeout=30) as server:
        server.infer("acc", one(1), correlation_id=1, sequence_start=True)
        began = time.monotonic()
        server.unload_model("acc")  # does not wait 30 s for the sequence: it is dropped
        assert time.monotonic() - began < 10
        assert "acc" not in server.routing.serving()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_two_instances_share_the_sequences_and_keep_each_in_order(tmp_path: Path, strategy: str) -> None:
    write_model(
        tmp_path,
        "acc",
        accumulate_config("acc", STRATEGIES[strategy], max_batch_size=4, count=2),
        accumulate_onnx,
    )
    with Server(tmp_path) as server:
        for corrid in (1, 2):
            server.infer("acc", one(corrid), correlation_id=corrid, sequence_start=True)
        if strategy == "direct":  # one sequence on each instance before a second slot of either is used
            slots = server.statistics("acc")[0]["sequence_stats"]["slots"]
            assert [s["occupied"] for s in slots] == [1, 1]
        rng = np.random.default_rng(11)
        inputs = {c: rng.integers(-9, 9, size=40).tolist() for c in range(3, 15)}
        futures = {c: [] for c in inputs}
        for step in range(40):
            for corrid, values in inputs.items():
                futures[corrid].append(
                    server.submit(
                        "acc",
                        one(values[step]),
                        correlation_id=corrid,
                        sequence_start=step == 0,
                        sequence_end=step == 39,
                    )
                )
        for corrid, values in inputs.items():
            assert [scalar(f.result(timeout=30)) for f in futures[corrid]] == np.cumsum(values).tolist()
        for corrid in (1, 2):
            assert scalar(server.infer("acc", one(0), correlation_id=corrid, sequence_end=True)) == corrid


def test_live_sequences_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sequence, "MAX_SEQUENCES", 3)
    write_model(tmp_path, "acc", accumulate_config("acc", OLDEST), accumulate_onnx)
    with Server(tmp_path) as server:
        for corrid in (1, 2, 3):
            server.infer("acc", one(1), correlation_id=corrid, sequence_start=True)
        with pytest.raises(QueueFull, match="3 live sequences"):
            server.infer("acc", one(1), correlation_id=4, sequence_start=True)
        server.infer("acc", one(1), correlation_id=1, sequence_end=True)
        assert scalar(server.infer("acc", one(7), correlation_id=4, sequence_start=True)) == 7
        for corrid in (2, 3, 4):
            server.infer("acc", one(0), correlation_id=corrid, sequence_end=True)


@pytest.mark.parametrize(
    "strategy",
    [
        "direct { max_queue_delay_microseconds: 60000000 minimum_slot_utilization: 1.0 }",
        "oldest { max_queue_delay_microseconds: 60000000 preferred_batch_size: [ 2 ] }",
    ],
)
def test_queue_delay_waits_for_a_full_batch_then_runs_at_once(tmp_path: Path, strategy: str) -> None:
    """Two slots (direct, all must be ready) or preferred size 2 (oldest): one request waits for the other."""
    config = simple_sequence_config("probe", strategy, max_batch_size=2)
    write_model(
        tmp_path,
        "probe",
        config.replace('platform: "onnxruntime_onnx"', 'backend: "python"'),
        python=PROBE_MODEL,
    )
    with Server(tmp_path) as server:
        first = server.submit("probe", one(0), correlation_id=1, sequence_start=True)
        assert not first.done()  # held for the delay, waiting for a second sequence
        second = server.submit("probe", one(0), correlation_id=2, sequence_start=True)
        # ran when full: after the 60 s delay, these 10 s would have run out
        assert scalar(first.result(timeout=10)) == 202 and scalar(second.result(timeout=10)) == 202
        for corrid in (1, 2):
            server.submit("probe", one(0), correlation_id=corrid, sequence_end=True)


FLAKY_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        values = [int(pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy()[0, 0]) for r in requests]
        if 13 in values:
            raise RuntimeError("unlucky")
        out = [np.array([[v]], np.int32) for v in values]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", o)]) for o in out]
"""


def test_a_failed_step_fails_that_request_and_the_sequence_goes_on(tmp_path: Path) -> None:
    config = simple_sequence_config("flaky", OLDEST, max_batch_size=2)
    write_model(
        tmp_path,
        "flaky",
        config.replace('platform: "onnxruntime_onnx"', 'backend: "python"'),
        python=FLAKY_MODEL,
    )
    with Server(tmp_path) as server:
        assert scalar(server.infer("flaky", one(1), correlation_id=1, sequence_start=True)) == 1
        with pytest.raises(Exception, match="unlucky"):
            server.infer("flaky", one(13), correlation_id=1)
        assert scalar(server.infer("flaky", one(2), correlation_id=1, sequence_end=True)) == 2
        assert server.statistics("flaky")[0]["sequence_stats"]["active"] == 0


def test_string_correlation_ids_reach_an_onnx_model_as_its_corrid_input(tmp_path: Path) -> None:
    write_model(tmp_path, "echo", CORRID_ECHO_CONFIG, corrid_echo_onnx)
    with Server(tmp_path) as server:
        futures = [
            server.submit("echo", one(i), correlation_id=f"cam-{i}", sequence_start=True, sequence_end=True)
            for i in range(6)
        ]
        for i, future in enumerate(futures):
            outputs = future.result(timeout=10)
            assert outputs["ECHO"].tolist() == [[f"cam-{i}".encode()]] and scalar(outputs) == i
        with pytest.raises(InvalidArgument, match="takes string correlation ids"):
            server.infer("echo", one(1), correlation_id=5, sequence_start=True)


UNBATCHED_CONFIG = """
name: "running"
backend: "python"
max_batch_size: 0
sequence_batching {
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "SUM_IN" output_name: "SUM_OUT" data_type: TYPE_INT64 dims: [ 2 ] } ]
}
input [ { name: "INPUT" data_type: TYPE_INT64 dims: [ 2 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT64 dims: [ 2 ] } ]
instance_group [ { kind: KIND_CPU count: 2 } ]
"""

UNBATCHED_MODEL = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            get = lambda name: pb_utils.get_input_tensor_by_name(r, name).as_numpy()
            assert get("START").shape == (1,) and get("SUM_IN").shape == (2,)
            total = get("SUM_IN") + get("INPUT")
            out = pb_utils.Tensor("OUTPUT", total * (1 + get("START")[0]))
            responses.append(pb_utils.InferenceResponse([out, pb_utils.Tensor("SUM_OUT", total)]))
        return responses
"""


def test_a_model_without_batching_gets_unbatched_controls_and_state(tmp_path: Path) -> None:
    """max_batch_size 0: one slot per instance, controls of shape [1], state of its own dims."""
    write_model(tmp_path, "running", UNBATCHED_CONFIG, python=UNBATCHED_MODEL)
    with Server(tmp_path) as server:
        x = {"INPUT": np.array([1, 2], np.int64)}
        outputs = [
            server.infer("running", x, correlation_id=c, sequence_start=True)["OUTPUT"].tolist()
            for c in (1, 2)
        ]
        assert outputs == [[2, 4], [2, 4]]  # START doubles the first answer
        assert server.infer("running", x, correlation_id=1)["OUTPUT"].tolist() == [2, 4]
        assert server.infer("running", x, correlation_id=1, sequence_end=True)["OUTPUT"].tolist() == [3, 6]
        assert server.infer("running", x, correlation_id=2, sequence_end=True)["OUTPUT"].tolist() == [2, 4]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_growing_state_batches_only_with_states_of_its_shape(tmp_path: Path, strategy: str) -> None:
    """Sequences started at different times hold histories of different lengths; each stays right."""
    write_model(tmp_path, "history", history_config(STRATEGIES[strategy]), history_onnx)
    with Server(tmp_path) as server:
        inputs = {c: list(range(c, c + 12)) for c in (1, 2, 3, 4)}
        futures: dict[int, list] = {c: [] for c in inputs}
        for c, values in inputs.items():  # sequence c runs 5 - c steps alone: the histories differ
            for i in range(5 - c):
                futures[c].append(
                    server.submit("history", one(values[i]), correlation_id=c, sequence_start=i == 0)
                )
                futures[c][-1].result(timeout=10)
        for i in range(12):  # then every remaining step of every sequence, without waiting
            for c, values in inputs.items():
                if i >= 5 - c:
                    futures[c].append(
                        server.submit("history", one(values[i]), correlation_id=c, sequence_end=i == 11)
                    )
        for c, values in inputs.items():
            assert [scalar(f.result(timeout=30)) for f in futures[c]] == np.cumsum(values).tolist()
