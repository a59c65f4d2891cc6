"""Sequence-batcher refusals carry Triton's texts over HTTP and gRPC (L0_sequence_batcher, issue 28).

Triton's clients and QA match these texts with ``startswith``; ours follow in parentheses.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.daemon import Daemon, free_port, kserve_flags
from tests.sequence_models import DIRECT, accumulate_config, accumulate_onnx, write_model

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

Client = httpclient.InferenceServerClient | grpcclient.InferenceServerClient

# An ensemble over the sequence model: Triton puts "in ensemble 'NAME', " before the member's text.
ENSEMBLE = """
name: "ens_acc"
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [ { model_name: "acc" model_version: -1
  input_map { key: "INPUT" value: "IN" } output_map { key: "OUTPUT" value: "OUT" } } ] }
"""


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Client]]:
    repo = tmp_path_factory.mktemp("seq") / "repo"
    write_model(repo, "acc", accumulate_config("acc", DIRECT, max_batch_size=4), accumulate_onnx)
    write_model(repo, "ens_acc", ENSEMBLE)
    root = tmp_path_factory.mktemp("sock")
    http_port, grpc_port = free_port(), free_port()
    daemon = Daemon(repo, f"ipc://{root}/t.sock", root / "t.log", *kserve_flags(http_port, grpc_port))
    daemon.start()
    try:
        yield [
            httpclient.InferenceServerClient(f"127.0.0.1:{http_port}"),
            grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}"),
        ]
    finally:
        assert daemon.stop() == 0, daemon.log()


def _refusal(client: Client, rows: int, model: str = "acc", **kwargs: object) -> str:
    module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    inp = module.InferInput("INPUT" if model == "acc" else "IN", [rows, 1], "INT32")
    inp.set_data_from_numpy(np.ones((rows, 1), np.int32))
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, [inp], **kwargs)
    return info.value.message()


def test_a_request_without_a_correlation_id(clients: list[Client]) -> None:
    for client in clients:
        assert _refusal(client, 1).startswith(
            "inference request to model 'acc' must specify a non-zero or non-empty correlation ID"
        )


def test_a_sequence_that_did_not_start(clients: list[Client]) -> None:
    for n, client in enumerate(clients):
        for end in (False, True):
            corrid = 37469245 + n
            assert _refusal(client, 1, sequence_id=corrid, sequence_end=end).startswith(
                f"inference request for sequence {corrid} to model 'acc' must specify the START flag "
                "on the first request of the sequence"
            )


def test_a_request_of_a_sequence_with_two_rows(clients: list[Client]) -> None:
    for n, client in enumerate(clients):
        assert _refusal(client, 2, sequence_id=500 + n, sequence_start=True).startswith(
            "inference request to model 'acc' must specify batch-size 1 due to requirements of "
            "sequence batcher"
        )


def test_a_members_refusal_through_an_ensemble_begins_with_tritons_ensemble_prefix(
    clients: list[Client],
) -> None:
    for n, client in enumerate(clients):
        assert _refusal(client, 1, "ens_acc").startswith(
            "in ensemble 'ens_acc', inference request to model 'acc' must specify a non-zero or non-empty "
            "correlation ID"
        )
        assert _refusal(client, 2, "ens_acc", sequence_id=900 + n, sequence_start=True).startswith(
            "in ensemble 'ens_acc', inference request to model 'acc' must specify batch-size 1"
        )


def test_a_refused_ensemble_request_counts_as_a_failure_not_an_execution(clients: list[Client]) -> None:
    """Triton: a failed ensemble request adds to its failures (reason OTHER), not to its executions."""
    grpc = clients[1]
    assert isinstance(grpc, grpcclient.InferenceServerClient)
    before = grpc.get_inference_statistics("ens_acc", "1").model_stats[0]
    for client in clients:
        _refusal(client, 1, "ens_acc")
    after = grpc.get_inference_statistics("ens_acc", "1").model_stats[0]
    assert after.execution_count == before.execution_count
    assert sum(b.compute_infer.count for b in after.batch_stats) == sum(
        b.compute_infer.count for b in before.batch_stats
    )
    assert after.inference_stats.fail.count == before.inference_stats.fail.count + 2
