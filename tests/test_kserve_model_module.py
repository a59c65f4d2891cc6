"""A Python model's ``model.py`` is importable as ``model``, as in Triton's stub.

Triton's python_backend QA models (L0_backend_python: bls, argument_validation, custom_metrics,
request_rescheduling, ...) run their checks with ``unittest.main("model", exit=False)`` inside
``execute``: unittest imports ``model`` and loads the test cases from it.  Here several models share
one interpreter, so ``model`` must be the calling model's own module.  Through the daemon and the real
tritonclient (gRPC, as Triton's ``test_infer_shm_leak.py`` calls them), for a thread and a process.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from queue import Queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.daemon import Daemon, free_port, kserve_flags

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
output [ {{ name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 2 ] }} ]
{extra}
"""

# OUTPUT0 = [1 if every test passed, tests run]; TESTS test methods, each checking its model's name.
MODEL = """
import unittest

import numpy as np
import triton_python_backend_utils as pb_utils


class ModelTest(unittest.TestCase):
{methods}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for _ in requests:
            import model  # noqa: the calling model's own module, as in Triton

            assert model.NAME == NAME, (model.NAME, NAME)
            test = unittest.main("model", exit=False)
            result = [int(test.result.wasSuccessful()), test.result.testsRun]
            out = pb_utils.Tensor("OUTPUT0", np.array(result, np.int32))
            responses.append(pb_utils.InferenceResponse([out]))
        return responses


NAME = {name!r}
"""


def _write(repo: Path, name: str, tests: int, extra: str = "") -> None:
    methods = "\n".join(
        f"    def test_{i}(self):\n        self.assertEqual(NAME, {name!r})\n" for i in range(tests)
    )
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, extra=extra))
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(MODEL).format(methods=methods, name=name))


# sys.exit() in execute (or an argparse error in the model's code): the request fails, the server stays.
EXITS = """
import sys

class TritonPythonModel:
    def execute(self, requests):
        sys.exit(2)
"""


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[grpcclient.InferenceServerClient]:
    root = tmp_path_factory.mktemp("modmod")
    repo = root / "repo"
    _write(repo, "two_tests", 2)
    _write(repo, "three_tests", 3)
    _write(repo, "isolated", 1, 'parameters { key: "isolation" value: { string_value: "process" } }')
    for name, extra in (("exits", ""), ("exits_decoupled", "model_transaction_policy { decoupled: true }")):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, extra=extra))
        (repo / name / "1" / "model.py").write_text(EXITS)
    http_port, grpc_port = free_port(), free_port()
    daemon = Daemon(repo, f"ipc://{root}/m.sock", root / "m.log", *kserve_flags(http_port, grpc_port))
    daemon.start()
    try:
        yield grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    finally:
        assert daemon.stop() == 0, daemon.log()


@pytest.mark.parametrize(("model", "tests"), [("two_tests", 2), ("three_tests", 3), ("isolated", 1)])
def test_unittest_main_of_model_runs_the_calling_models_tests(
    client: grpcclient.InferenceServerClient, model: str, tests: int
) -> None:
    for _ in range(2):  # and again: nothing cached from another model
        result = client.infer(model, []).as_numpy("OUTPUT0")
        assert np.asarray(result).tolist() == [1, tests]


def test_a_model_that_calls_sys_exit_fails_the_request_and_the_server_stays(
    client: grpcclient.InferenceServerClient,
) -> None:
    for _ in range(2):
        with pytest.raises(InferenceServerException, match="SystemExit: 2"):
            client.infer("exits", [], client_timeout=30)
    got: Queue = Queue()
    client.start_stream(callback=lambda result, error: got.put(error or result))
    try:
        client.async_stream_infer("exits_decoupled", [])
        assert "SystemExit: 2" in str(got.get(timeout=30))
    finally:
        client.stop_stream()
    assert client.is_server_live()
