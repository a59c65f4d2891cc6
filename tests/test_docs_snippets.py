"""Every command in the README and the docs runs as written.

The README's and the docs pages' ``sh``/``bash``/``console`` and ``python`` fenced snippets are read
from the markdown and run, as a user would paste them, against one real daemon serving the example
repositories (``models/``, and ``models_ocr/`` where it was made).  A snippet that cannot run here
(a Jetson, root on a real box, a service, a measurement of minutes, ``./run serve`` itself, which
blocks) carries ``<!-- not-run: REASON -->`` on the line before its fence; a marker without a reason
fails, and so does a page with snippets none of which runs.  A snippet passes when it exits 0; a
Python snippet with one ``print(...)  # VALUE`` must also print VALUE, as its comment promises.

How the snippets reach the test daemon, in one place (:func:`snippet_environment` and
:func:`substitute_ports`):

* IPC: ``$EDGE_SERVER_IPC`` names the daemon's socket: the first thing every client's rule looks at
  (docs/clients.md), so ``edge-server status`` and ``Client()`` find it with no flag.
* KServe HTTP, gRPC and metrics listen on free ports, not 8000/8001/8002, which another test or a
  ``./run serve`` on this machine may hold: ``localhost:8000``, ``127.0.0.1:8001`` and so on in a
  snippet's text become the daemon's ports.  That is the only change made to a snippet's text.
* The working directory is a fresh folder whose entries link to the checkout's (``models/``,
  ``examples/``, ``.venv`` ...), so relative paths work as in a checkout and files a snippet writes
  (``--annotate out.png``) land in the test's folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemon import Daemon, ensure_examples, free_port

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parent.parent
# The user-facing pages: the README, every page under docs/, the Jetson and DLA guides.
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")), "jetson/README.md"]
PAGES.append("dla/README.md")
# Pages whose every snippet is marked not-run, and why none can run here.
NOTHING_RUNS = {
    "docs/sequences.md": "the example repositories hold no stateful model",
    "docs/benchmarks.md": "its commands run the benchmarks, for minutes, on a quiet machine",
    "docs/triton-qa.md": "its one command runs Triton's QA checkout, which is not here",
    "docs/development.md": "its commands run the test suite, this test included",
}
RUN_LANGUAGES = {"sh", "bash", "console", "python"}
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not-run(?::(?P<reason>.*?))?\s*-->\s*$")
DEFAULT_PORTS = re.compile(r"\b(localhost|127\.0\.0\.1):(8000|8001|8002)\b")
OCR_REPOSITORY = ROOT / "models_ocr"
PRINT_WITH_RESULT = re.compile(r"^\s*print\(.*\)\s+#\s*(?P<value>.+?)\s*$")


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    not_run: str | None  # None: runs; otherwise the marker's reason ("" when it gave none)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def snippets(page: str) -> list[Snippet]:
    """The shell and Python fenced snippets of ``page``, with the not-run marker before each."""
    lines = (ROOT / page).read_text().splitlines()
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page}:{i + 1}: a fence that never closes"
        lang = opening["lang"]
        if lang in RUN_LANGUAGES:
            indent = len(opening["indent"])
            body = [line[indent:] for line in lines[i + 1 : end]]  # the fence's indent off each line
            if lang == "console":  # only the commands, without their prompt; the rest is output
                body = [line[2:] for line in body if line.startswith("$ ")]
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = NOT_RUN.match(before)
            reason = None if marker is None else (marker["reason"] or "").strip()
            found.append(Snippet(page, i + 1, lang, "\n".join(body) + "\n", reason))
        i = end + 1
    return found


ALL = [snippet for page in PAGES for snippet in snippets(page)]
RUN = [snippet for snippet in ALL if snippet.not_run is None]


@pytest.mark.parametrize("page", PAGES)
def test_every_page_runs_its_snippets_or_says_why_not(page: str) -> None:
    found = snippets(page)
    unexplained = [s.id for s in found if s.not_run == ""]
    assert not unexplained, f"not-run markers without a reason: {unexplained}"
    running = [s for s in found if s.not_run is None]
    if page in NOTHING_RUNS:
        assert not running, f"{page} runs snippets now: take it out of NOTHING_RUNS"
    elif found:
        assert running, f"{page}: every snippet is marked not-run: run one, or say why in NOTHING_RUNS"


def test_the_reader_parses_markers_and_fences() -> None:
    """The reader itself: a marker applies to the next fence only, indented fences count, and
    ``console`` keeps only the prompted lines."""
    assert snippets("README.md")[0].not_run  # the two commands: ./run serve blocks
    readme_python = [s for s in snippets("README.md") if s.lang == "python"]
    assert readme_python and printed_result(readme_python[0]) == "3"
    indented = [s for s in snippets("docs/triton-compatibility.md") if "/v2" in s.text]
    assert indented and indented[0].text.startswith("curl ")
    assert len(RUN) >= 20, [s.id for s in RUN]


# -- the daemon the snippets call ----------------------------------------------------------------------


@dataclass
class DocsDaemon:
    daemon: Daemon
    ports: dict[str, int]  # the documented default port -> the test daemon's
    workdir: Path
    ocr: bool


def example_repository(root: Path) -> tuple[Path, bool]:
    """``models/`` and, where it was made, ``models_ocr/``, as one repository (copies: a model
    directory linked from outside a repository is refused), as a daemon serving both would see it."""
    repository = root / "repository"
    skip = shutil.ignore_patterns("make_models.py", "__pycache__", "*.pyc")
    shutil.copytree(ensure_examples(), repository, ignore=skip)
    ocr = (OCR_REPOSITORY / "text_detection" / "1" / "model.onnx").exists()
    if ocr:
        shutil.copytree(OCR_REPOSITORY, repository, ignore=skip, dirs_exist_ok=True)
    return repository, ocr


def working_directory(root: Path) -> Path:
    """A folder that looks like the checkout (each entry a link to the checkout's) but is the test's."""
    workdir = root / "checkout"
    workdir.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in {".git", ".venv"}:
            (workdir / entry.name).symlink_to(entry)
    (workdir / ".venv").symlink_to(Path(sys.prefix))  # the environment running these tests
    return workdir


@pytest.fixture(scope="module")
def docs_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocsDaemon]:
    root = tmp_path_factory.mktemp("docs")
    repository, ocr = example_repository(root)
    ports = {"8000": free_port(), "8001": free_port(), "8002": free_port()}
    daemon = Daemon(
        repository,
        f"ipc://{root}/edge-server.sock",
        root / "daemon.log",
        "--model-control-mode",
        "poll",  # docs/hot-reload.md loads a model through the API: a mode that obeys it
        "--allow-http",
        "true",
        "--http-port",
        str(ports["8000"]),
        "--allow-grpc",
        "true",
        "--grpc-port",
        str(ports["8001"]),
        "--allow-metrics",
        "true",
        "--metrics-port",
        str(ports["8002"]),
    )
    daemon.start(timeout=180)  # every example model, the OCR ones included, on a shared machine
    try:
        yield DocsDaemon(daemon, ports, working_directory(root), ocr)
    finally:
        status = daemon.stop()
        assert status == 0, f"the daemon exited with {status}:\n{daemon.log()}"


def substitute_ports(text: str, ports: dict[str, int]) -> str:
    """The documented default ports, as the test daemon's (the only change made to a snippet)."""
    return DEFAULT_PORTS.sub(lambda m: f"{m[1]}:{ports[m[2]]}", text)


def snippet_environment(server: DocsDaemon) -> dict[str, str]:
    """The user's shell: the daemon's socket in ``$EDGE_SERVER_IPC``; ``edge-server`` on ``PATH``."""
    env = dict(os.environ)
    env["EDGE_SERVER_IPC"] = server.daemon.address
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.parametrize("snippet", RUN, ids=[s.id for s in RUN])
def test_snippet_runs(snippet: Snippet, docs_daemon: DocsDaemon) -> None:
    if "models_ocr" in snippet.text and not docs_daemon.ocr:
        pytest.skip("the OCR example was not made here (rapidocr_onnxruntime is not installed)")
    text = substitute_ports(snippet.text, docs_daemon.ports)
    if snippet.lang == "python":
        script = docs_daemon.workdir.parent / f"snippet_{snippet.page.replace('/', '_')}_{snippet.line}.py"
        script.write_text(text)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", text]
    proc = subprocess.run(
        command,
        cwd=docs_daemon.workdir,
        env=snippet_environment(docs_daemon),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        f"{snippet.id} ({snippet.lang}) exited with {proc.returncode}:\n{text}\n"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}\n"
        f"--- the daemon's log\n{docs_daemon.daemon.log()[-2000:]}"
    )
    promised = printed_result(snippet)
    if promised is not None:
        assert proc.stdout.strip() == promised, f"{snippet.id} printed {proc.stdout!r}, not {promised}"


def printed_result(snippet: Snippet) -> str | None:
    """What a Python snippet with a single ``print(...)  # VALUE`` says it prints, else None."""
    if snippet.lang != "python":
        return None
    prints = [line for line in snippet.text.splitlines() if line.lstrip().startswith("print(")]
    matched = PRINT_WITH_RESULT.match(prints[0]) if len(prints) == 1 else None
    return None if matched is None else matched["value"]
