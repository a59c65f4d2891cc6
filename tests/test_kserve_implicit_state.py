"""Implicit state as Triton's L0_implicit_state and L0_sequence_batcher (IMPLICIT_STATE=1) use it.

Through the daemon and the real tritonclient over HTTP and gRPC: a ``TYPE_STRING`` state (starting as
empty strings, as Triton's zeroed string state does), a state output that the config also lists in
``output`` (the client may then ask for it), and Triton's text for a requested output the model does
not have, a kept state included ("unexpected inference output 'X' for model 'Y'").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests.daemon import Daemon, free_port, kserve_flags
from tests.sequence_models import (
    DIRECT,
    OLDEST,
    accumulate_config,
    accumulate_onnx,
    history_config,
    history_onnx,
    write_model,
)

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

Client = httpclient.InferenceServerClient | grpcclient.InferenceServerClient

# The previous step's string comes back: OUTPUT = S_IN, S_OUT = INPUT.
STRING_CONFIG = """
name: "{name}"
backend: "onnxruntime"
max_batch_size: 4
sequence_batching {{
  {strategy}
  state [ {{ input_name: "S_IN" output_name: "S_OUT" data_type: TYPE_STRING dims: [ 1 ] }} ]
}}
input [ {{ name: "INPUT" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""


def _previous_string_onnx(path: Path) -> Path:
    def text(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.STRING, ["batch", 1])

    nodes = [
        helper.make_node("Identity", ["S_IN"], ["OUTPUT"]),
        helper.make_node("Identity", ["INPUT"], ["S_OUT"]),
    ]
    graph = helper.make_graph(
        nodes, "previous", [text("INPUT"), text("S_IN")], [text("OUTPUT"), text("S_OUT")]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Client]]:
    repo = tmp_path_factory.mktemp("state") / "repo"
    for name, strategy in (("previous_direct", DIRECT), ("previous_oldest", OLDEST)):
        write_model(repo, name, STRING_CONFIG.format(name=name, strategy=strategy), _previous_string_onnx)
    write_model(repo, "acc", accumulate_config("acc", DIRECT, max_batch_size=4), accumulate_onnx)
    shown = accumulate_config("acc_shown", DIRECT, max_batch_size=4).replace(
        'output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]',
        'output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] },'
        ' { name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]',
    )
    write_model(repo, "acc_shown", shown, accumulate_onnx)
    # A variable-dim state without initial_state starts with each -1 as 1 (Triton's rule): [[0]] here.
    unset = history_config(DIRECT).replace('name: "history"', 'name: "history_unset"')
    unset = unset.replace(
        'initial_state { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "empty" }', ""
    )
    write_model(repo, "history_unset", unset, history_onnx)
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


def _module(client: Client):  # type: ignore[no-untyped-def]
    return httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient


def _infer(client: Client, model: str, value: np.ndarray, outputs: list[str] | None = None, **kwargs: object):  # type: ignore[no-untyped-def]
    module = _module(client)
    datatype = "BYTES" if value.dtype == object else "INT32"
    inp = module.InferInput("INPUT", [1, 1], datatype)
    inp.set_data_from_numpy(value.reshape(1, 1))
    requested = [module.InferRequestedOutput(name) for name in outputs] if outputs else None
    return client.infer(model, [inp], outputs=requested, **kwargs)


@pytest.mark.parametrize("model", ["previous_direct", "previous_oldest"])
def test_a_string_state_starts_empty_and_carries_each_step(clients: list[Client], model: str) -> None:
    for n, client in enumerate(clients):
        corrid = 7100 + n
        words = [b"alpha", b"beta", b"gamma", b""]
        got = []
        for i, word in enumerate(words):
            result = _infer(
                client,
                model,
                np.array([word], dtype=object),
                sequence_id=corrid,
                sequence_start=i == 0,
                sequence_end=i == len(words) - 1,
            )
            got.append(result.as_numpy("OUTPUT").reshape(-1)[0])
        assert got == [b"", b"alpha", b"beta", b"gamma"]


def test_a_state_output_listed_in_output_is_returned_when_asked(clients: list[Client]) -> None:
    for n, client in enumerate(clients):
        corrid = 7200 + n
        first = _infer(
            client,
            "acc_shown",
            np.array([5], np.int32),
            ["ACC_OUT", "OUTPUT"],
            sequence_id=corrid,
            sequence_start=True,
        )
        assert first.as_numpy("ACC_OUT").reshape(-1).tolist() == [5]
        every = _infer(
            client, "acc_shown", np.array([2], np.int32), sequence_id=corrid
        )  # no outputs named: all
        assert every.as_numpy("OUTPUT").reshape(-1).tolist() == [7]
        assert every.as_numpy("ACC_OUT").reshape(-1).tolist() == [7]
        last = _infer(
            client, "acc_shown", np.array([1], np.int32), ["OUTPUT"], sequence_id=corrid, sequence_end=True
        )
        assert last.as_numpy("OUTPUT").reshape(-1).tolist() == [8]  # the state went on being kept
        assert last.as_numpy("ACC_OUT") is None


def test_a_kept_state_or_unknown_output_is_refused_with_tritons_text(clients: list[Client]) -> None:
    for n, client in enumerate(clients):
        for name in ("ACC_OUT", "NOPE"):
            with pytest.raises(InferenceServerException) as info:
                _infer(
                    client,
                    "acc",
                    np.array([1], np.int32),
                    [name],
                    sequence_id=7300 + n,
                    sequence_start=True,
                    sequence_end=True,
                )
            assert info.value.message().startswith(f"unexpected inference output '{name}' for model 'acc'")


def test_a_variable_state_without_initial_state_starts_with_its_variable_dims_as_one(
    clients: list[Client],
) -> None:
    for n, client in enumerate(clients):
        corrid = 7400 + n
        sums = [
            _infer(
                client, "history_unset", np.array([v], np.int32), sequence_id=corrid, sequence_start=i == 0
            )
            .as_numpy("OUTPUT")
            .reshape(-1)
            .tolist()
            for i, v in enumerate([5, 2, 1])
        ]
        assert sums == [[5], [7], [8]]
