"""The real daemon as a subprocess, the repository the IPC tests serve, and their fixtures.

PYTEST_DONT_REWRITE: test modules import helpers from here before registering it as a plugin.

``Daemon`` runs ``python -m edge_server serve --model-repository DIR --ipc ipc://...`` and waits for
readiness by asking the daemon over IPC (``server_ready``), never by sleeping or reading its log.
Test modules import the fixtures they use from here.

The repository holds copies of the example ONNX models plus three test models:

* ``frame``: any 3-D UINT8 tensor -> its ``shape`` and its first and last 8 bytes (``head``,
  ``tail``), without reading the rest: the cost of a request is the cost of moving the frame.
* ``gate``: FP32 identity that, per request, writes a byte to the ``started`` FIFO and then blocks
  until the test writes a byte to the ``gate`` FIFO: requests in flight, under the test's control.
* ``text``: BYTES in, upper-cased BYTES out (the length-prefixed BYTES encoding).
"""

from __future__ import annotations

import fcntl
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from edge_server.client import Client
from edge_server.errors import EdgeServerError
from edge_server.ipc import protocol

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "models"

FRAME_CONFIG = """
name: "frame"
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "frame", data_type: TYPE_UINT8, dims: [ -1, -1, -1 ] } ]
output [
  { name: "shape", data_type: TYPE_INT64, dims: [ 3 ] },
  { name: "head", data_type: TYPE_UINT8, dims: [ 8 ] },
  { name: "tail", data_type: TYPE_UINT8, dims: [ 8 ] }
]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

GATE_CONFIG = """
name: "gate"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
parameters [
  { key: "gate", value: { string_value: "%(gate)s" } },
  { key: "started", value: { string_value: "%(started)s" } }
]
"""

GATE_MODEL = """
import json
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        # O_RDWR: opening a FIFO this way never blocks, and reads block until the test writes.
        self.gate = os.open(params["gate"]["string_value"], os.O_RDWR)
        self.started = os.open(params["started"]["string_value"], os.O_RDWR)

    def execute(self, requests):
        responses = []
        for request in requests:
            os.write(self.started, b"s")
            os.read(self.gate, 1)
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x.copy())]))
        return responses

    def finalize(self):
        os.close(self.gate)
        os.close(self.started)
"""

TEXT_CONFIG = """
name: "text"
backend: "python"
max_batch_size: 0
input [ { name: "TEXT", data_type: TYPE_STRING, dims: [ -1 ] } ]
output [ { name: "UPPER", data_type: TYPE_STRING, dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""

TEXT_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([bytes(v).upper() for v in text.reshape(-1)], dtype=object).reshape(text.shape)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", upper)]))
        return responses
"""


def frame_model(path: Path) -> None:
    """ONNX: frame (UINT8 h x w x c) -> Shape, and Slices of the flattened bytes (no full read)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    inp = helper.make_tensor_value_info("frame", TensorProto.UINT8, ["h", "w", "c"])
    outs = [
        helper.make_tensor_value_info("shape", TensorProto.INT64, [3]),
        helper.make_tensor_value_info("head", TensorProto.UINT8, [8]),
        helper.make_tensor_value_info("tail", TensorProto.UINT8, [8]),
    ]
    consts = {
        "flat": np.array([-1], np.int64),
        "zero": np.array([0], np.int64),
        "eight": np.array([8], np.int64),
        "minus8": np.array([-8], np.int64),
        "end": np.array([np.iinfo(np.int64).max], np.int64),
    }
    nodes = [
        helper.make_node("Shape", ["frame"], ["shape"]),
        helper.make_node("Reshape", ["frame", "flat"], ["flattened"]),
        helper.make_node("Slice", ["flattened", "zero", "eight"], ["head"]),
        helper.make_node("Slice", ["flattened", "minus8", "end"], ["tail"]),
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    graph = helper.make_graph(nodes, "frame", [inp], outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())


def python_stubs(pid: int) -> dict[str, int]:
    """The isolated Python models' stub processes that ``pid`` started: instance label -> pid."""
    found: dict[str, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended (ESRCH: while it was read)
            continue
        for child in children:
            try:
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"edge_server.backends.python_stub" in argv:
                found[argv[argv.index(b"edge_server.backends.python_stub") + 1].decode()] = int(child)
    return found


def ensure_examples() -> Path:
    """The bundled example repository, made by its script where a file is missing.  xdist workers
    call this at once: an exclusive lock on the script itself lets one build and the others find it
    made (the script builds nothing when the repository is up to date)."""
    script = EXAMPLES / "make_models.py"
    with open(script, "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run([sys.executable, str(script)], check=True, capture_output=True)
    return EXAMPLES


def gate_fifos(root: Path) -> tuple[Path, Path]:
    """The gate model's FIFOs in a daemon's root (gate, started): start_daemon opens them, used or not."""
    gate, started = root / "gate.fifo", root / "started.fifo"
    os.mkfifo(gate)
    os.mkfifo(started)
    return gate, started


def build_repository(root: Path) -> Path:
    """The IPC test repository under ``root`` (FIFOs for the gate model beside it)."""
    if not (EXAMPLES / "identity" / "1" / "model.onnx").exists():
        ensure_examples()
    repo = root / "repo"
    for name in ("identity", "digits", "cnn"):
        shutil.copytree(EXAMPLES / name, repo / name, ignore=shutil.ignore_patterns("samples"))
    frame_model(repo / "frame" / "1" / "model.onnx")
    (repo / "frame" / "config.pbtxt").write_text(FRAME_CONFIG)
    gate, started = gate_fifos(root)
    (repo / "gate" / "1").mkdir(parents=True)
    (repo / "gate" / "config.pbtxt").write_text(GATE_CONFIG % {"gate": gate, "started": started})
    (repo / "gate" / "1" / "model.py").write_text(GATE_MODEL)
    (repo / "text" / "1").mkdir(parents=True)
    (repo / "text" / "config.pbtxt").write_text(TEXT_CONFIG)
    (repo / "text" / "1" / "model.py").write_text(TEXT_MODEL)
    return repo


class Gate:
    """The test's side of the ``gate`` model: see requests start, let them finish one by one."""

    def __init__(self, root: Path) -> None:
        self._started = os.open(root / "started.fifo", os.O_RDWR | os.O_NONBLOCK)
        self._gate = os.open(root / "gate.fifo", os.O_RDWR | os.O_NONBLOCK)
        self.started = 0
        self.released = 0

    def wait_started(self, count: int = 1, timeout: float = 10.0) -> None:
        """Block until ``count`` more gated requests are executing (an event, not a sleep)."""
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._started], [], [], remaining)[0]:
                raise TimeoutError(f"{seen} of {count} gated requests started within {timeout} s")
            seen += len(os.read(self._started, count - seen))
        self.started += seen

    def release(self, count: int = 1) -> None:
        os.write(self._gate, b"g" * count)
        self.released += count

    def settle(self) -> None:
        """Let every request that entered the model finish, so the next test starts with a closed gate."""
        try:
            while marks := os.read(self._started, 4096):
                self.started += len(marks)
        except BlockingIOError:
            pass
        if self.started > self.released:
            self.release(self.started - self.released)

    def close(self) -> None:
        if self._gate >= 0:
            os.close(self._started)
            os.close(self._gate)
            self._started = self._gate = -1


class Daemon:
    """``python -m edge_server serve`` in a subprocess; its output goes to ``log_path``."""

    def __init__(
        self, repository: Path, address: str, log_path: Path, *args: str, checkout: Path = ROOT
    ) -> None:
        """``checkout``: whose ``edge_server`` runs (its working directory): a benchmark's before/after."""
        self.checkout = checkout
        self.gate: Gate | None = None
        self.repository = repository
        self.address = address
        self.log_path = log_path
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self.nofile: int | None = None  # RLIMIT_NOFILE (soft and hard) for the daemon, when set
        self.env: dict[str, str] | None = None  # the daemon's environment, when not the test's own

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 60.0) -> Daemon:
        command = [
            sys.executable,
            "-m",
            "edge_server",
            "serve",
            "--model-repository",
            str(self.repository),
            "--ipc",
            self.address,
            "--exit-timeout-secs",
            "5",
            "--allow-http",  # KServe tests turn these on, on ports of their own (later flags win)
            "false",
            "--allow-grpc",
            "false",
            "--allow-metrics",  # metrics tests turn it on, on a port of their own
            "false",
            # Test repositories hold broken models on purpose: serve the rest and call that ready
            # (the systemd tests check both flags' defaults with flags of their own; later flags win).
            "--exit-on-error",
            "false",
            "--strict-readiness",
            "false",
            *self.args,
        ]
        nofile = self.nofile
        limit = (
            None if nofile is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
        )
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=self.checkout,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=limit,
                env=self.env,
            )
        try:
            self.wait_ready(timeout)
        except BaseException:  # not ready in time (or interrupted): leave no daemon behind
            self.kill()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        """Ask the daemon whether it is ready until it says so; fail early if it died."""
        deadline = time.monotonic() + timeout
        with Client(self.address, timeout=0.5) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    if client.server_ready():
                        return
                except EdgeServerError:
                    continue  # not listening yet: ZeroMQ keeps reconnecting
        raise TimeoutError(f"the daemon was not ready within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM (drain and stop), SIGKILL if it does not exit in time; returns the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def mapped_segments(self) -> set[str]:
        """Names of client segments (memfds, /dev/shm files) the daemon has mapped now (/proc/PID/maps)."""
        names = set()
        with open(f"/proc/{self.pid}/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip() if len(line.split()) >= 6 else ""
                for prefix in ("/dev/shm/", "/memfd:"):
                    if path.startswith(prefix):
                        names.add(path[len(prefix) :].removesuffix(" (deleted)"))
        return names


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: for a frontend's port, or a server of a benchmark's own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kserve_flags(http_port: int, grpc_port: int) -> list[str]:
    """The daemon's flags that turn its KServe HTTP and gRPC frontends on, on these ports."""
    http = ["--allow-http", "true", "--http-port", str(http_port)]
    return [*http, "--allow-grpc", "true", "--grpc-port", str(grpc_port)]


def status_kib(pid: int, field: str) -> int:
    """A memory figure of ``/proc/PID/status``, KiB: ``VmRSS`` (resident now) or ``VmHWM`` (its peak)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field}")


def minor_faults(pid: int) -> int:
    """The minor page faults ``pid`` has taken (``/proc/PID/stat``): new pages it touched."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[7])


def wait_rss_back(
    pid: int, before_kib: int, within_mib: int, poke: Any = None, timeout: float = 30.0
) -> None:
    """Wait until ``pid``'s RSS is within ``within_mib`` of ``before_kib``; the failure says where it stayed.

    ``poke``, called before each look: traffic the daemon needs to give memory back (a model's run).
    """
    seen: list[int] = []

    def back() -> bool:
        if poke is not None:
            poke()
        seen.append(status_kib(pid, "VmRSS"))
        return seen[-1] - before_kib < within_mib << 10

    try:
        wait_for(back, timeout, f"RSS back within {within_mib} MiB of {before_kib >> 10} MiB")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: still {seen[-1] >> 10} MiB") from None


def wait_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Re-check ``predicate`` (which asks the daemon or the OS) until true; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def raw_request(address: str, frames: list[Any], timeout: float = 10.0) -> dict[str, Any]:
    """Send hand-made frames on a fresh DEALER and return the decoded reply header."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart(frames)
        if not sock.poll(int(timeout * 1000)):
            raise AssertionError("the daemon did not answer")
        reply = sock.recv_multipart()
        return protocol.unpack(reply[0])
    finally:
        sock.close(0)
        ctx.term()


class RawPeer:
    """One DEALER connection kept open across several hand-made requests (regions are per connection)."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, frames: list[Any]) -> dict[str, Any]:
        """Send one request and return its reply; the daemon's liveness pings (sent to clients that
        hold regions whenever any connection closes) are skipped, as the real client skips them."""
        self.sock.send_multipart(frames)
        return self.recv()

    def recv(self, timeout: float = 30.0) -> dict[str, Any]:
        """The next reply header, skipping the daemon's liveness pings (see :meth:`ask`)."""
        while True:
            assert self.sock.poll(int(timeout * 1000)), f"no answer within {timeout:g} s"
            reply = protocol.unpack(self.sock.recv_multipart()[0])
            if reply.get("op") != protocol.PING:
                return reply

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def header(**fields: Any) -> bytes:
    return protocol.pack({"v": protocol.PROTOCOL_VERSION, "id": 1, **fields})


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ipc_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ipc")


@pytest.fixture(scope="module")
def ipc_repository(ipc_root: Path) -> Path:
    return build_repository(ipc_root)


def start_pyzmq_gc() -> None:
    """pyzmq keeps zero-copy send buffers alive with one process-wide helper thread, started lazily
    by the first large zero-copy send.  Start it before the per-test thread-leak check looks, so that
    check still catches every thread our own code starts."""
    from zmq.utils.garbage import gc

    if not gc.is_alive():
        gc.start()


# At import (collection time), so that no test, whatever its fixtures' order, sees this thread appear.
start_pyzmq_gc()


@pytest.fixture(scope="module")
def daemon(ipc_root: Path, ipc_repository: Path) -> Iterator[Daemon]:
    """One daemon per test module, in explicit mode with every model loaded (tests may unload)."""
    start_pyzmq_gc()
    proc = start_daemon(ipc_root, ipc_repository, "d.sock")
    try:
        yield proc
    finally:
        status = stop_daemon(proc)
        assert status == 0, f"the daemon exited with {status}:\n{proc.log()}"


def start_daemon(
    root: Path,
    repository: Path,
    socket_name: str,
    *args: str,
    nofile: int | None = None,
    env: dict[str, str] | None = None,
) -> Daemon:
    proc = Daemon(
        repository,
        f"ipc://{root}/{socket_name}",
        root / f"{socket_name}.log",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        "--max-message-bytes",
        str(32 << 20),
        *args,
    )
    proc.gate = Gate(root)
    proc.nofile = nofile
    proc.env = env
    try:
        proc.start()
    except BaseException:
        proc.gate.close()
        raise
    return proc


def stop_daemon(proc: Daemon) -> int:
    assert proc.gate is not None
    proc.gate.release(1000)  # nothing may stay blocked in the gate model while the daemon drains
    try:
        return proc.stop()
    finally:
        proc.gate.close()


def _children() -> set[int]:
    pids: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(pid) for pid in f.read().split())
        except (FileNotFoundError, ProcessLookupError):  # the thread ended (ESRCH: while it was read)
            continue
    return pids


@pytest.fixture
def no_leaked_processes() -> Iterator[None]:
    """Fail a test that leaves a daemon (or any child process) running; kill what it left."""
    before = _children()
    yield
    deadline = time.monotonic() + 5.0
    while (left := _children() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the test left child processes running: {sorted(left)}"


@pytest.fixture
def gate(daemon: Daemon) -> Iterator[Gate]:
    assert daemon.gate is not None
    yield daemon.gate
    daemon.gate.settle()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    with Client(daemon.address, timeout=30) as c:
        yield c
