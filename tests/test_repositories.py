"""Several model repositories (Triton's repeated ``--model-repository``), one namespace of model names.

The daemon test serves two folders in poll mode and is driven through the real tritonclient (HTTP and
gRPC) and our IPC client: both folders' models load and answer, a model dropped into the second folder
is hot-loaded, a name dropped into both is refused with both paths while the first copy keeps serving,
and the repository index lists both folders' models.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from edge_server.cli import build_parser
from edge_server.cli.serve import bundled_repositories
from edge_server.client import Client
from edge_server.errors import EdgeServerError, InvalidArgument
from edge_server.examples.make_ocr import not_made
from edge_server.repository import DuplicateModel, Repositories
from edge_server.server import default_repository
from edge_server.service.settings import apply_settings
from edge_server.tools.status import render
from edge_server.watcher import ChangeTracker
from tests.daemon import ROOT, Daemon, ensure_examples, free_port, kserve_flags, start_pyzmq_gc, wait_for
from tests.kserve_daemon import KServeDaemon

# -- without a daemon ---------------------------------------------------------------------------------


def test_a_repository_inside_another_or_given_twice_is_refused(tmp_path: Path) -> None:
    (tmp_path / "outer" / "inner").mkdir(parents=True)
    with pytest.raises(InvalidArgument, match=r"outer/inner is inside model repository .*outer"):
        Repositories([tmp_path / "outer", tmp_path / "outer" / "inner"])
    with pytest.raises(InvalidArgument, match=r"outer/inner is inside model repository .*outer"):
        Repositories([tmp_path / "outer" / "inner", tmp_path / "outer"])
    with pytest.raises(InvalidArgument, match="is given twice"):
        Repositories([tmp_path / "outer", tmp_path / "outer" / ".." / "outer"])
    with pytest.raises(InvalidArgument, match="is not a directory"):
        Repositories([tmp_path / "outer", tmp_path / "missing"])


def test_a_name_in_two_repositories_is_one_refusal_naming_both(tmp_path: Path) -> None:
    for repo, models in (("a", ("m", "only_a")), ("b", ("m", "only_b"))):
        for model in models:
            (tmp_path / repo / model / "1").mkdir(parents=True)
    repos = Repositories([tmp_path / "a", tmp_path / "b"])
    found = repos.scan()
    assert sorted(found) == ["m", "only_a", "only_b"]
    duplicate = found["m"]
    assert isinstance(duplicate, DuplicateModel)
    assert str(tmp_path / "a" / "m") in duplicate.message and str(tmp_path / "b" / "m") in duplicate.message
    with pytest.raises(DuplicateModel):
        repos.find("m")
    only_b = repos.find("only_b")
    assert only_b is not None and only_b.path == tmp_path / "b" / "only_b"
    assert repos.find("nowhere") is None


def test_a_link_from_one_repository_into_another_is_refused(tmp_path: Path) -> None:
    """Each repository's owner decides what is code in it: a model linked in from another is left out."""
    (tmp_path / "a" / "m" / "1").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "linked").symlink_to(tmp_path / "a" / "m")
    repos = Repositories([tmp_path / "a", tmp_path / "b"])
    assert sorted(repos.scan()) == ["m"]
    assert repos.find("linked") is None


def test_the_change_tracker_knows_models_in_every_root(tmp_path: Path) -> None:
    tracker = ChangeTracker(tmp_path / "a", tmp_path / "b", quiet_s=0.5, max_hold_s=10.0)
    assert tracker.model_of(str(tmp_path / "a" / "m" / "1" / "model.onnx")) == "m"
    assert tracker.model_of(str(tmp_path / "b" / "n" / "config.pbtxt")) == "n"
    assert tracker.model_of(str(tmp_path / "b")) is None
    assert tracker.model_of(str(tmp_path / "c" / "x" / "config.pbtxt")) is None
    assert tracker.model_of(str(tmp_path / "b" / "n" / ".config.pbtxt.tmp")) is None


def test_model_repository_flags_replace_the_settings_list(tmp_path: Path) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).model_repository is None
    args = parser.parse_args(["serve", "--model-repository", "a", "--model-repository", "b"])
    assert args.model_repository == [Path("a"), Path("b")]
    settings = tmp_path / "edge-server.toml"
    settings.write_text('model-repository = ["/x", "/y"]\n')
    apply_settings(parser.parse_args(["serve"]).subparser, settings)
    assert parser.parse_args(["serve"]).model_repository == [Path("/x"), Path("/y")]
    assert parser.parse_args(["serve", "--model-repository", "c"]).model_repository == [Path("c")]


def test_serve_defaults_to_both_examples_when_the_ocr_models_are_made(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ocr = ROOT / "models_ocr"
    with caplog.at_level(logging.INFO, logger="edge_server"):
        chosen = bundled_repositories()
    why = not_made(ocr)
    if why is None:
        assert chosen == [default_repository(), ocr]
    else:
        assert chosen == [default_repository()]
        assert f"not serving the OCR example {ocr}: {why}" in caplog.text


def test_not_made_says_why(tmp_path: Path) -> None:
    why = not_made(tmp_path)
    assert why is not None and ("text_detection/1/model.onnx" in why or "is not installed" in why)


def test_status_lists_every_repository() -> None:
    text = render({"state": "serving", "repositories": ["/a", "/b"], "models": []}, "ipc://x")
    assert "repository  /a\nrepository  /b\n" in text


# -- the daemon, two repositories, poll mode ----------------------------------------------------------


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KServeDaemon, Path, Path]]:
    examples = ensure_examples()
    root = tmp_path_factory.mktemp("repos")
    first, second = root / "first", root / "second"
    shutil.copytree(examples / "identity", first / "identity")
    shutil.copytree(examples / "digits", second / "digits")
    start_pyzmq_gc()
    http_port, grpc_port = free_port(), free_port()
    flags = [
        *kserve_flags(http_port, grpc_port),
        "--model-repository",
        str(second),
        "--model-control-mode",
        "poll",
    ]
    daemon = Daemon(first, f"ipc://{root}/r.sock", root / "r.log", *flags).start()
    server = KServeDaemon(daemon, http_port, grpc_port)
    try:
        yield server, first, second
    finally:
        assert daemon.stop() == 0, daemon.log()


def _rows(client: Client, name: str) -> list[tuple[object, str, str]]:
    rows = [m for m in client.models() if m["name"] == name and "state" in m]  # not {"name"}: not loaded
    return [(m["version"], m["state"], m.get("reason", "")) for m in rows]


def _drop(source: Path, target: Path, *, name: str | None = None) -> None:
    """Copy a model beside ``target`` under a hidden name, then rename it into place (the OTA way)."""
    staging = target.parent / f".{target.name}.part"
    shutil.copytree(source, staging)
    if name is not None:
        config = staging / "config.pbtxt"
        config.write_text(config.read_text().replace(f'name: "{source.name}"', f'name: "{name}"'))
    staging.rename(target)


def test_both_repositories_load_answer_and_are_indexed(two: tuple[KServeDaemon, Path, Path]) -> None:
    server, first, second = two
    http = httpclient.InferenceServerClient(server.http_url)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert {row["name"] for row in http.get_model_repository_index()} == {"identity", "digits"}
        assert {m.name for m in grpc.get_model_repository_index().models} == {"identity", "digits"}
        x = np.arange(4, dtype=np.float32)
        tensor = httpclient.InferInput("INPUT0", [4], "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_array_equal(http.infer("identity", [tensor]).as_numpy("OUTPUT0"), x)
        image = np.zeros((1, 1, 8, 8), np.float32)
        digit = httpclient.InferInput("image", list(image.shape), "FP32")
        digit.set_data_from_numpy(image)
        assert http.infer("digits", [digit]).as_numpy("probabilities").shape == (1, 10)
        with Client(server.daemon.address, timeout=30) as client:
            assert {m["name"] for m in client.models()} == {"identity", "digits"}
            np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
            assert client.infer("digits", {"image": image})["probabilities"].shape == (1, 10)
            assert client.status()["repositories"] == [str(first), str(second)]
    finally:
        http.close()
        grpc.close()


def test_a_model_dropped_into_the_second_repository_hot_loads(two: tuple[KServeDaemon, Path, Path]) -> None:
    server, first, second = two
    _drop(first / "identity", second / "echo", name="echo")
    with Client(server.daemon.address, timeout=30) as client:
        wait_for(lambda: _rows(client, "echo") == [(1, "READY", "")], timeout=60, what="echo to load")
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        x = np.ones(3, np.float32)
        tensor = httpclient.InferInput("INPUT0", [3], "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_array_equal(http.infer("echo", [tensor]).as_numpy("OUTPUT0"), x)
        assert "echo" in {row["name"] for row in http.get_model_repository_index()}
    finally:
        http.close()


def test_a_name_in_both_repositories_is_refused_and_the_first_keeps_serving(
    two: tuple[KServeDaemon, Path, Path],
) -> None:
    server, first, second = two
    both = f"({first / 'identity'}, {second / 'identity'})"
    _drop(first / "identity", second / "identity")
    x = np.arange(5, dtype=np.float32)
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        with Client(server.daemon.address, timeout=30) as client:

            def refused() -> bool:
                rows = _rows(client, "identity")
                return any(state == "UNAVAILABLE" and both in reason for _, state, reason in rows)

            wait_for(refused, timeout=60, what="the duplicate to be refused")
            rows = _rows(client, "identity")
            assert (None, "UNAVAILABLE", rows[-1][2]) in rows
            assert "model names must be unique across repositories" in rows[-1][2]
            assert any(v == 1 and state == "READY" and both in reason for v, state, reason in rows)
            # The copy that served keeps serving, over both frontends.
            np.testing.assert_array_equal(client.infer("identity", {"INPUT0": x})["OUTPUT0"], x)
            tensor = httpclient.InferInput("INPUT0", [5], "FP32")
            tensor.set_data_from_numpy(x)
            np.testing.assert_array_equal(http.infer("identity", [tensor]).as_numpy("OUTPUT0"), x)
            # An explicit load is refused with the same precise reason, on every way in.
            with pytest.raises(EdgeServerError) as ipc_error:
                client.load_model("identity")
            assert ipc_error.value.code == "INVALID_CONFIG" and both in ipc_error.value.message
            # Triton's words first (L0_lifecycle test_multiple_model_repository_control matches them)
            triton = r"^\[400\] failed to load .identity., failed to poll from model repository .*more than"
            with pytest.raises(InferenceServerException, match=triton):
                http.load_model("identity")
            assert client.infer("identity", {"INPUT0": x})["OUTPUT0"].tolist() == x.tolist()
            # Removing the second copy ends the refusal; the serving copy was never reloaded.
            shutil.rmtree(second / "identity")
            wait_for(
                lambda: _rows(client, "identity") == [(1, "READY", "")], timeout=60, what="the refusal to end"
            )
    finally:
        http.close()


def test_an_unknown_model_names_every_repository(two: tuple[KServeDaemon, Path, Path]) -> None:
    server, first, second = two
    with Client(server.daemon.address, timeout=30) as client:
        with pytest.raises(EdgeServerError) as error:
            client.load_model("nowhere")
        assert error.value.code == "MODEL_NOT_FOUND"
        assert f"no model directory 'nowhere' in {first}, {second}" in error.value.message
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        with pytest.raises(InferenceServerException, match="nowhere"):
            http.get_model_metadata("nowhere")
    finally:
        http.close()


def test_cli_infer_reads_labels_from_the_repository_that_holds_the_model(
    two: tuple[KServeDaemon, Path, Path], tmp_path: Path
) -> None:
    server, _, _ = two
    image = tmp_path / "image.npy"
    np.save(image, np.zeros((1, 8, 8), np.float32))
    result = subprocess.run(
        [sys.executable, "-m", "edge_server", "infer", "digits", "--ipc", server.daemon.address]
        + ["--input", f"image={image}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "#1: " in result.stdout  # a class name from second/digits/labels.txt


def test_serve_refuses_nested_repositories_before_loading(tmp_path: Path) -> None:
    (tmp_path / "outer" / "inner").mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, "-m", "edge_server", "serve", "--no-ipc", "--allow-http", "false"]
        + ["--allow-grpc", "false", "--allow-metrics", "false"]
        + [
            "--model-repository",
            str(tmp_path / "outer"),
            "--model-repository",
            str(tmp_path / "outer" / "inner"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "is inside model repository" in result.stderr


@pytest.mark.slow
def test_serve_in_a_checkout_serves_both_example_repositories(tmp_path: Path) -> None:
    """What ``./run serve`` runs on a fresh clone: ``edge-server serve`` with no repository flag."""
    ensure_examples()
    ocr = ROOT / "models_ocr"
    script = ocr / "make_models.py"
    if importlib.util.find_spec("rapidocr_onnxruntime") is not None:
        with open(script, "rb") as lock:  # as ensure_examples: one xdist worker makes it, others wait
            fcntl.flock(lock, fcntl.LOCK_EX)
            subprocess.run([sys.executable, str(script)], check=True, capture_output=True)
    why = not_made(ocr)
    start_pyzmq_gc()
    address = f"ipc://{tmp_path}/fresh.sock"
    daemon = Daemon(ROOT / "models", address, tmp_path / "fresh.log")
    command = [sys.executable, "-m", "edge_server", "serve", "--ipc", address, "--allow-http", "false"]
    command += ["--allow-grpc", "false", "--allow-metrics", "false"]  # the defaults of ./run serve otherwise
    with open(daemon.log_path, "ab") as log:
        daemon.proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        daemon.wait_ready(300)
        with Client(address, timeout=30) as client:
            models = client.models()
            status = client.status()
    finally:
        assert daemon.stop() == 0, daemon.log()
    names = {m["name"] for m in models}
    assert all(m["state"] == "READY" for m in models), models
    assert {"digits", "detect", "identity"} <= names
    if why is None:
        assert status["repositories"] == [str(ROOT / "models"), str(ocr)]
        assert {"ocr", "text_detection", "text_recognition"} <= names
    else:
        assert status["repositories"] == [str(ROOT / "models")]
        assert f"not serving the OCR example {ocr}: {why}" in daemon.log()


def test_sighup_rescans_every_repository(tmp_path: Path) -> None:
    """Control mode none: nothing changes until SIGHUP, which scans both folders."""
    examples = ensure_examples()
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(examples / "identity", first / "identity")
    second.mkdir()
    start_pyzmq_gc()
    daemon = Daemon(first, f"ipc://{tmp_path}/h.sock", tmp_path / "h.log", "--model-repository", str(second))
    daemon.start()
    try:
        _drop(examples / "digits", second / "digits")
        with Client(daemon.address, timeout=30) as client:
            # on disk but not scanned yet: listed by name alone, as Triton's index does
            assert {m["name"]: m.get("state") for m in client.models()} == {
                "identity": "READY",
                "digits": None,
            }
            os.kill(daemon.pid, signal.SIGHUP)
            wait_for(lambda: _rows(client, "digits") == [(1, "READY", "")], timeout=60, what="the rescan")
            image = np.zeros((1, 1, 8, 8), np.float32)
            assert client.infer("digits", {"image": image})["probabilities"].shape == (1, 10)
    finally:
        assert daemon.stop() == 0, daemon.log()
