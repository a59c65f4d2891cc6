"""Isolated Python models stay contained: what a model forks dies with it.

A model that forks a child (as ``multiprocessing`` does) and then exits gets its request an
INSTANCE_FAILED reply, not a hang (the child holds the pipe open: the daemon watches the stub's pid,
not the pipe's end).  Every stub runs in a process group of its own, killed whole when the instance
fails, at unload and at the daemon's stop: no forked worker or stopped stub outlives them.
"""

from __future__ import annotations

import os
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_server.client import Client
from edge_server.errors import EdgeServerError
from tests.daemon import Daemon, build_repository, start_daemon, stop_daemon, wait_for

CONFIG = """
name: "forker"
backend: "python"
max_batch_size: 0
input [ { name: "IN", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUT", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
parameters [
  { key: "isolation", value: { string_value: "process" } },
  { key: "pids", value: { string_value: "%(pids)s" } }
]
"""

# IN[0] == 1: fork a worker that sleeps (holding every descriptor, the pipe too), answer normally.
# IN[0] == 2: the same, then the stub exits: its request must fail, not hang.
# Each forked worker's pid (and the stub's own) is appended to the "pids" file.
MODEL = """
import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.pids = json.loads(args["model_config"])["parameters"]["pids"]["string_value"]

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            if x[0] in (1, 2):
                pid = os.fork()
                if pid == 0:
                    time.sleep(600)
                    os._exit(0)
                with open(self.pids, "a") as out:
                    out.write(f"{os.getpid()} {pid}\\n")
                if x[0] == 2:
                    os._exit(3)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        return responses
"""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed worker reaped by init, or not yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.fixture()
def forker(tmp_path: Path) -> Iterator[tuple[Daemon, Path]]:
    repo = build_repository(tmp_path)
    pids = tmp_path / "pids.txt"
    (repo / "forker" / "1").mkdir(parents=True)
    (repo / "forker" / "config.pbtxt").write_text(CONFIG % {"pids": pids})
    (repo / "forker" / "1" / "model.py").write_text(textwrap.dedent(MODEL))
    proc = start_daemon(tmp_path, repo, "f.sock")
    try:
        yield proc, pids
    finally:
        stop_daemon(proc)
        for line in pids.read_text().splitlines() if pids.exists() else ():
            for pid in map(int, line.split()):  # never leave a sleeper behind, whatever failed
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


def forked(pids: Path) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (line.split() for line in pids.read_text().splitlines())]


def test_a_model_that_forks_and_exits_gets_an_error_not_a_hang(forker: tuple[Daemon, Path]) -> None:
    daemon, pids = forker
    with Client(daemon.address, timeout=60) as client:
        with pytest.raises(EdgeServerError) as caught:
            client.infer("forker", {"IN": np.array([2], np.float32)})
        assert caught.value.code == "INSTANCE_FAILED", caught.value
        ((stub, worker),) = forked(pids)
        wait_for(lambda: not alive(worker), what="the forked worker to be killed with its stub's group")
        # the instance comes back and serves
        wait_for(lambda: client.model_ready("forker"), what="the instance's restart")
        assert client.infer("forker", {"IN": np.array([5], np.float32)})["OUT"].tolist() == [5]


def test_unload_kills_what_the_model_forked(forker: tuple[Daemon, Path]) -> None:
    daemon, pids = forker
    with Client(daemon.address, timeout=60) as client:
        assert client.infer("forker", {"IN": np.array([1], np.float32)})["OUT"].tolist() == [1]
        ((stub, worker),) = forked(pids)
        assert alive(stub) and alive(worker)
        client.unload_model("forker")
    assert not alive(stub) and not alive(worker)


def test_the_daemons_stop_kills_forked_workers_and_stopped_stubs(forker: tuple[Daemon, Path]) -> None:
    daemon, pids = forker
    with Client(daemon.address, timeout=60) as client:
        assert client.infer("forker", {"IN": np.array([1], np.float32)})["OUT"].tolist() == [1]
    ((stub, worker),) = forked(pids)
    os.kill(stub, signal.SIGSTOP)  # a stub that can no longer answer finalize()
    assert daemon.stop() == 0, daemon.log()
    assert not alive(stub) and not alive(worker)
