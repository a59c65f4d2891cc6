"""A Python model's own readiness function (``is_ready``, Triton's python_backend) decides its readiness.

From Triton's QA (L0_backend_python/model_readiness): ``/v2/models/X/ready``, gRPC ``ModelReady`` and
the IPC ``ready`` ask the model's ``is_ready()`` (sync or ``async def``), in the daemon's thread and in
a process of its own alike.  False, an exception or a non-boolean answer mean not ready; an answer
that does not come within five seconds means not ready for that probe (one call in flight per
instance: later probes wait for it); inference is never held up by it, and the daemon logs a
misbehaving function once, not per probe.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from edge_server.client import Client
from tests.daemon import Daemon, free_port, kserve_flags, python_stubs, wait_for

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

MODEL = textwrap.dedent(
    """
    import asyncio, json, os, time
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def initialize(self, args):
            params = json.loads(args["model_config"]).get("parameters", {})
            self.mode = params["MODE"]["string_value"]
            self.flag = os.path.join(args["model_repository"], "ready.flag")

        def execute(self, requests):
            inputs = [pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() for r in requests]
            if self.mode == "slow" and inputs[0][0][0] == 9:
                time.sleep(7)  # longer than a probe waits
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]) for x in inputs]

        def is_ready(self):
            if self.mode == "flag":
                return os.path.exists(self.flag)
            if self.mode == "raise":
                raise RuntimeError("the feature store is unreachable")
            if self.mode == "nonbool":
                return "ready"
            if self.mode == "hang":
                time.sleep(7)
                return True
            if self.mode == "async":
                return self._async_ready()
            if self.mode == "exit" and os.path.exists(self.flag):
                os.unlink(self.flag)
                raise SystemExit(3)  # a BaseException: once, then ready again
            return True

        async def _async_ready(self):
            await asyncio.sleep(0.05)
            return True
    """
)

PLAIN = textwrap.dedent(
    """
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            return [
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())]
                )
                for r in requests
            ]
    """
)

MODES = ("flag", "raise", "nonbool", "hang", "async", "slow", "exit")


def _add(repo: Path, name: str, source: str, isolation: str, mode: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    params = f'parameters {{ key: "isolation" value {{ string_value: "{isolation}" }} }}\n'
    if mode:
        params += f'parameters {{ key: "MODE" value {{ string_value: "{mode}" }} }}\n'
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 4\n'
        'input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]\n' + params
    )


class Served:
    def __init__(self, daemon: Daemon, repo: Path, isolation: str, http_port: int, grpc_port: int) -> None:
        self.daemon, self.repo, self.isolation = daemon, repo, isolation
        self.http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=60)
        self.grpc_url = f"127.0.0.1:{grpc_port}"
        self.grpc = grpcclient.InferenceServerClient(self.grpc_url)

    def ready(self, name: str) -> tuple[bool, bool, bool]:
        """(HTTP, gRPC, IPC) model readiness."""
        with Client(self.daemon.address, timeout=30) as ipc:
            by_ipc = ipc.model_ready(name)
        return self.http.is_model_ready(name), self.grpc.is_model_ready(name), by_ipc

    def infer(self, name: str) -> None:
        data = np.array([[1.0, 2.0]], dtype=np.float32)
        inputs = [httpclient.InferInput("IN", [1, 2], "FP32")]
        inputs[0].set_data_from_numpy(data)
        assert (self.http.infer(name, inputs).as_numpy("OUT") == data).all()
        ginputs = [grpcclient.InferInput("IN", [1, 2], "FP32")]
        ginputs[0].set_data_from_numpy(data)
        assert (self.grpc.infer(name, ginputs).as_numpy("OUT") == data).all()


@pytest.fixture(scope="module", params=["thread", "process"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    isolation = request.param
    root = tmp_path_factory.mktemp(f"readiness-{isolation}")
    repo = root / "repo"
    for mode in MODES:
        _add(repo, mode, MODEL, isolation, mode)
    _add(repo, "plain", PLAIN, isolation)
    http_port, grpc_port = free_port(), free_port()
    daemon = Daemon(repo, f"ipc://{root}/d.sock", root / "d.log", *kserve_flags(http_port, grpc_port))
    daemon.start()
    served = Served(daemon, repo, isolation, http_port, grpc_port)
    try:
        yield served
    finally:
        served.http.close()
        served.grpc.close()
        assert daemon.stop() == 0, daemon.log()


def test_a_model_without_is_ready_is_ready(served: Served) -> None:
    assert served.ready("plain") == (True, True, True)


def test_is_ready_decides_and_follows_the_model(served: Served) -> None:
    flag = served.repo / "flag" / "ready.flag"
    flag.unlink(missing_ok=True)
    assert served.ready("flag") == (False, False, False)
    served.infer("flag")  # not ready is advice to a balancer: inference still runs, as in Triton
    flag.touch()
    assert served.ready("flag") == (True, True, True)
    flag.unlink()
    assert served.ready("flag") == (False, False, False)


def test_an_async_is_ready_is_awaited(served: Served) -> None:
    assert served.ready("async") == (True, True, True)


def test_is_ready_that_exits_once_is_not_ready_that_once_and_asked_again_after(served: Served) -> None:
    """``sys.exit()`` in ``is_ready`` is a BaseException: it once left the probe marked as calling for
    good (thread mode) or the stub's answer unsent (process mode), so every later probe waited 5 s
    and read not ready although the model said ready again."""
    assert served.ready("exit") == (True, True, True)
    (served.repo / "exit" / "ready.flag").touch()
    assert not served.http.is_model_ready("exit")
    assert served.ready("exit") == (True, True, True)


@pytest.mark.parametrize("name", ["raise", "nonbool"])
def test_a_raising_or_non_boolean_is_ready_means_not_ready_logged_once(served: Served, name: str) -> None:
    for _ in range(3):
        assert served.ready(name) == (False, False, False)
        served.infer(name)
    assert served.ready("plain") == (True, True, True)  # the daemon is unharmed
    why = "the feature store is unreachable" if name == "raise" else "must return a boolean"
    assert served.daemon.log().count(why) == 1, served.daemon.log()


def test_grpc_probes_of_a_hanging_is_ready_never_take_the_workers(served: Served) -> None:
    """gRPC ``ModelReady`` holds a worker while it waits (HTTP and IPC do not): a flood of probes of a
    hanging ``is_ready`` took every worker, and other clients' calls waited.  At most 8 wait now; the
    rest are refused at once, and health and inference calls go on beside them."""
    from tritonclient.utils import InferenceServerException

    def probe(_: int) -> str:
        client = grpcclient.InferenceServerClient(served.grpc_url)
        try:
            return "ready" if client.is_model_ready("hang") else "not ready"
        except InferenceServerException as exc:
            return str(exc.status())
        finally:
            client.close()

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(probe, range(32)))
    assert "StatusCode.RESOURCE_EXHAUSTED" in answers, answers
    assert set(answers) <= {"not ready", "StatusCode.RESOURCE_EXHAUSTED"}, answers
    assert served.grpc.is_server_live()
    served.infer("plain")
    # the call in flight answers True at last (7 s): the next test starts a call of its own
    wait_for(lambda: served.http.is_model_ready("hang"), 60, what="the hanging call to end")


def test_a_hanging_is_ready_times_out_without_holding_anything(served: Served) -> None:
    # The first probe starts the call (7 s) and gives up after 5 s: not ready for that probe ...
    assert served.http.is_model_ready("hang") is False
    served.infer("hang")  # ... inference does not wait for it ...
    assert served.ready("plain") == (True, True, True)  # ... nor does any other probe ...
    # ... and a probe meanwhile waits for the call in flight (no second call) and gets its answer.
    assert served.grpc.is_model_ready("hang") is True
    assert served.daemon.log().count("did not answer within 5 s") == 1, served.daemon.log()


def test_a_probe_does_not_queue_behind_a_long_execute(served: Served) -> None:
    data = np.full((1, 2), 9.0, dtype=np.float32)
    inputs = [grpcclient.InferInput("IN", [1, 2], "FP32")]
    inputs[0].set_data_from_numpy(data)
    # tritonclient.http is gevent-based (one thread): the long request goes over gRPC
    grpc = grpcclient.InferenceServerClient(served.grpc_url)
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(grpc.infer, "slow", inputs)  # execute() runs 7 s
        time.sleep(1.0)  # let execute() start
        # Asked beside the running execute(): answered (had it queued behind it, it would time out).
        assert served.ready("slow") == (True, True, True)
        assert (long.result().as_numpy("OUT") == data).all()
    grpc.close()


def test_an_instance_whose_process_died_is_not_ready_until_it_is_replaced(served: Served) -> None:
    # The half of Triton's test that kills its stub process (by its program name), with ours.
    if served.isolation != "process":
        pytest.skip("an in-thread model has no process of its own")
    victim = python_stubs(served.daemon.pid)["plain_0"]  # the instance's label, without an instance_group
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: served.ready("plain") == (False, False, False), what="not ready after the kill")
    wait_for(lambda: served.ready("plain") == (True, True, True), timeout=60, what="ready once replaced")
    served.infer("plain")
