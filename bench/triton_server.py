"""Find, prepare and run the ``tritonserver`` binary that PyTriton ships, CPU only, for bench_triton.py.

``pip install -e '.[bench]'`` brings ``nvidia-pytriton``, whose wheel carries a CPU+GPU build of
``tritonserver`` with the python backend, its shared libraries (``nvidia_pytriton.libs``) and one
python_backend stub per Python version.  The stub embeds the system's ``libpython3.X.so`` (Debian:
package ``libpython3.11``), so its modules come from the system's standard library plus, through
``PYTHONPATH``, this interpreter's site-packages (numpy and ONNX Runtime for the models).

Anything that stops Triton from running raises ``TritonUnavailable`` with the reason, which the
benchmark prints before measuring edge-server alone.
"""

from __future__ import annotations

import ctypes.util
import http.client
import os
import shutil
import site
import subprocess
import sys
import time
from pathlib import Path


class TritonUnavailable(RuntimeError):
    """tritonserver cannot run here; the message says why."""


def find_tritonserver(explicit: str | None = None) -> Path:
    """``explicit``, else the binary in the installed ``pytriton`` package, else ``tritonserver`` on PATH."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise TritonUnavailable(f"no tritonserver binary at {path}")
        return path
    try:
        import pytriton  # type: ignore[import-not-found]

        path = Path(pytriton.__file__).parent / "tritonserver" / "bin" / "tritonserver"
        if path.is_file():
            return path
    except ImportError:
        pass
    found = shutil.which("tritonserver")
    if found:
        return Path(found)
    raise TritonUnavailable(
        "tritonserver not found: install it with `pip install -e '.[bench]'` (nvidia-pytriton, "
        "Linux x86_64, glibc >= 2.35) or pass --tritonserver PATH"
    )


def prepare_install(binary: Path, workdir: Path) -> tuple[Path, dict[str, str]]:
    """A backend directory with the stub for this Python, and the environment tritonserver needs.

    Mirrors what PyTriton does before it starts the server: the python backend looks for
    ``triton_python_backend_stub`` in its own directory, and the wheel keeps one per Python version apart.
    """
    dist = binary.parent.parent  # .../tritonserver
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    backends = dist / "backends"
    if not (backends / "python" / "libtriton_python.so").is_file():
        raise TritonUnavailable(f"no python backend beside {binary} (expected {backends}/python)")
    if not stub.is_file() and not (backends / "python" / "triton_python_backend_stub").is_file():
        raise TritonUnavailable(f"the wheel has no python_backend stub for Python {version}")
    libpython = f"python{version}"
    if ctypes.util.find_library(libpython) is None:
        raise TritonUnavailable(
            f"the python_backend stub needs the shared lib{libpython}.so (Debian/Ubuntu: apt-get install "
            f"lib{libpython})"
        )
    target = workdir / "backends"
    shutil.copytree(backends, target, ignore=shutil.ignore_patterns("triton_python_backend_stub"))
    if stub.is_file():
        shutil.copy2(stub, target / "python" / "triton_python_backend_stub")
    env = dict(os.environ)
    libs = [p for p in (dist.parent.parent / "nvidia_pytriton.libs", dist / "external_libs") if p.is_dir()]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(p) for p in libs] + [v for v in [os.environ.get("LD_LIBRARY_PATH")] if v]
    )
    # The stub's embedded interpreter starts from the system's stdlib; give it this venv's packages.
    env["PYTHONPATH"] = os.pathsep.join(site.getsitepackages() + [os.environ.get("PYTHONPATH", "")])
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU only, even where a GPU exists
    return target, env


class Tritonserver:
    """``tritonserver`` on a repository, explicit model control, CPU only; ``start`` waits until ready."""

    def __init__(
        self, binary: Path, repository: Path, models: list[str], workdir: Path, http_port: int, grpc_port: int
    ) -> None:
        self.binary, self.repository, self.models = binary, repository, models
        self.workdir, self.http_port, self.grpc_port = workdir, http_port, grpc_port
        self.log_path = workdir / "tritonserver.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> Tritonserver:
        backends, env = prepare_install(self.binary, self.workdir)
        command = [
            str(self.binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            "--model-control-mode=explicit",
            *[f"--load-model={name}" for name in self.models],
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--allow-metrics=false",
            "--allow-gpu-metrics=false",
            "--exit-on-error=true",
            "--strict-readiness=true",
            "--log-verbose=0",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TritonUnavailable(
                    f"tritonserver exited with {self.proc.returncode} while starting:\n{self.log()}"
                )
            if self._ready():
                return self
            time.sleep(0.2)
        self.stop()
        raise TritonUnavailable(f"tritonserver was not ready within {timeout:.0f} s:\n{self.log()}")

    def _ready(self) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=1)
            conn.request("GET", "/v2/health/ready")
            status = conn.getresponse().status
            conn.close()
            return status == 200
        except OSError:
            return False

    def log(self, tail: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
