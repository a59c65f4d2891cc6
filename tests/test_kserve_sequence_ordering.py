"""The sequence batcher's ``oldest`` strategy as L0_sequence_batcher's
``SequenceBatcherPreserveOrderingTest`` needs it: a sequence runs on one instance for its lifetime
(its model, like Triton's ``sequence_py``, keeps the sequence's state in the instance), and with
``preserve_ordering`` batches that run on different instances answer in the order they were formed,
as Triton's dynamic batcher under the oldest strategy does; without it, each as it finishes.
Checked over gRPC with ``tritonclient``.
"""

from __future__ import annotations

import queue
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.daemon import Daemon, free_port, kserve_flags

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 1
input [ {{ name: "SLEEP_MS", data_type: TYPE_INT32, dims: [ 1 ] }} ]
output [ {{ name: "END", data_type: TYPE_FP64, dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU, count: 2 }} ]
sequence_batching {{
  oldest {{ max_candidate_sequences: 4, preserve_ordering: {preserve} }}
  max_sequence_idle_microseconds: 10000000
}}
"""
MODEL = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            time.sleep(int(pb_utils.get_input_tensor_by_name(request, "SLEEP_MS").as_numpy()[0, 0]) / 1000)
            end = pb_utils.Tensor("END", np.array([[time.monotonic()]], np.float64))
            responses.append(pb_utils.InferenceResponse([end]))
        return responses
"""


STATEFUL_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    \"\"\"Counts each sequence's steps in the instance, as Triton's sequence_py does.\"\"\"

    def initialize(self, args):
        self.steps = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            corrid = request.correlation_id()
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.steps[corrid] = 0
            elif corrid not in self.steps:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("not started here")))
                continue
            self.steps[corrid] += 1
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("END", np.array([[self.steps[corrid]]], np.float64))
            ]))
        return responses
"""


def _write(repo: Path, name: str, preserve: bool, model: str = MODEL) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        textwrap.dedent(CONFIG.format(name=name, preserve=str(preserve).lower()))
    )
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(model))


@pytest.fixture(scope="module")
def grpc_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    repo = tmp_path_factory.mktemp("order") / "repo"
    _write(repo, "ordered", True)
    _write(repo, "unordered", False)
    _write(repo, "stateful", False, STATEFUL_MODEL)
    root = tmp_path_factory.mktemp("sock")
    http_port, port = free_port(), free_port()
    daemon = Daemon(repo, f"ipc://{root}/o.sock", root / "o.log", *kserve_flags(http_port, port))
    daemon.start()
    try:
        yield port
    finally:
        assert daemon.stop() == 0, daemon.log()


def _answers(port: int, model: str) -> list[tuple[str, float]]:
    """A slow request of sequence 1, then a fast one of sequence 2, on one stream: (id, END) as answered."""
    answers: queue.Queue[tuple[str, float] | Exception] = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")

    def on_answer(result: grpcclient.InferResult | None, error: Exception | None) -> None:
        if result is None:
            answers.put(error or RuntimeError("no result"))
        else:
            answers.put((result.get_response().id, float(result.as_numpy("END")[0, 0])))

    client.start_stream(callback=on_answer)
    try:
        for corrid, sleep_ms in ((1, 600), (2, 0)):
            tensor = grpcclient.InferInput("SLEEP_MS", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[sleep_ms]], np.int32))
            client.async_stream_infer(
                model,
                [tensor],
                request_id=f"seq{corrid}",
                sequence_id=corrid,
                sequence_start=True,
                sequence_end=True,
            )
        got = [answers.get(timeout=60) for _ in range(2)]
    finally:
        client.stop_stream()
        client.close()
    for answer in got:
        assert not isinstance(answer, Exception), answer
    return got  # type: ignore[return-value]


def test_preserve_ordering_answers_in_the_order_the_batches_were_formed(grpc_port: int) -> None:
    (first, first_end), (second, second_end) = _answers(grpc_port, "ordered")
    assert [first, second] == ["seq1", "seq2"]
    assert second_end < first_end  # sequence 2 did finish first, on the other instance: it was held back


def test_without_it_each_answer_goes_as_it_finishes(grpc_port: int) -> None:
    (first, _), (second, _) = _answers(grpc_port, "unordered")
    assert [first, second] == ["seq2", "seq1"]


def test_a_sequence_stays_on_one_instance(grpc_port: int) -> None:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    tensor = grpcclient.InferInput("SLEEP_MS", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.zeros((1, 1), np.int32))
    try:
        for step in range(1, 5):  # four sequences, interleaved step by step, over two instances
            for corrid in range(1, 5):
                result = client.infer(
                    "stateful", [tensor], sequence_id=corrid, sequence_start=step == 1, sequence_end=step == 4
                )
                assert result.as_numpy("END")[0, 0] == step
    finally:
        client.close()
