"""The model lifecycle without the watcher: swaps, failures, version policy, content hashes, unload."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from edge_server import ModelState, Server, VersionStatus
from edge_server.errors import ModelNotReady
from tests.onnx_factory import affine_model
from tests.reload_helpers import (
    ALL,
    ZEROS,
    Load,
    answer,
    loads_of,
    model_bytes,
    state_of,
    write_config,
    write_model,
)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    return path


def _instance_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"edge-{name}_")]


def test_new_version_loads_beside_the_old_then_swaps(repo: Path) -> None:
    write_model(repo, versions=(1,))
    events: list[VersionStatus] = []
    with Server(repo, model_control_mode="explicit", load_models=["m"]) as server:
        server.add_listener(events.append)
        old = server.routing.serving()["m"][1]
        affine_model(repo / "m" / "2" / "model.onnx", offset=2.0)
        server.load_model("m")
        assert answer(server) == 2.0
        # the version it replaced stays in the index, unloaded, as in Triton
        assert [(s.version, s.state, s.reason) for s in server.models()] == [
            (2, ModelState.READY, ""),
            (1, ModelState.UNAVAILABLE, "unloaded"),
        ]
        seen = [(e.version, e.state) for e in events]
        # v2 is loaded and published before v1 starts to drain; v1 is unloaded at the end
        assert seen == [
            (2, ModelState.LOADING),
            (2, ModelState.READY),
            (1, ModelState.UNLOADING),
            (1, ModelState.UNAVAILABLE),
        ]
        assert old.scheduler._pool.workers_alive() == 0


def test_corrupt_version_never_takes_traffic(repo: Path) -> None:
    write_model(repo, versions=(1, 2))
    with Server(repo, model_control_mode="explicit", load_models=["m"]) as server:
        (repo / "m" / "3").mkdir()
        (repo / "m" / "3" / "model.onnx").write_bytes(b"\x08\x07garbage, not a protobuf" * 10)
        server.rescan()
        assert answer(server) == 2.0
        state, reason = state_of(server, "m", 3) or ("", "")
        assert state == "UNAVAILABLE" and "not a loadable ONNX model" in reason
        assert state_of(server, "m", 2) == ("READY", "")


def test_version_whose_model_disagrees_with_the_config_is_unavailable(repo: Path) -> None:
    write_model(repo, versions=(2,))
    with Server(repo, model_control_mode="explicit", load_models=["m"]) as server:
        (repo / "m" / "3").mkdir()
        (repo / "m" / "3" / "model.onnx").write_bytes(model_bytes(3.0, dims=5))
        server.rescan()
        assert answer(server) == 2.0
        state, reason = state_of(server, "m", 3) or ("", "")
        assert state == "UNAVAILABLE" and "dims [4]" in reason and "[5]" in reason


def test_failed_content_is_retried_only_when_it_changes_or_on_request(repo: Path) -> None:
    write_model(repo, versions=(1,))
    with Server(repo, model_control_mode="explicit", load_models=["m"]) as server:
        loads = loads_of(server)
        (repo / "m" / "2").mkdir()
        (repo / "m" / "2" / "model.onnx").write_bytes(b"half a file")
        server.manager.rescan(["m"], retry_failed=False)
        server.manager.rescan(["m"], retry_failed=False)  # same bytes: not tried again
        assert loads == [2]
        server.manager.rescan(["m"])  # SIGHUP and explicit loads retry
        assert loads == [2, 2]
        affine_model(repo / "m" / "2" / "model.onnx", offset=2.0)  # the rest of the file arrived
        server.manager.rescan(["m"], retry_failed=False)
        assert loads == [2, 2, 2]
        assert answer(server) == 2.0


def test_removing_the_latest_version_brings_the_previous_one_back(repo: Path) -> None:
    write_model(repo, versions=(1, 2))
    with Server(repo, model_control_mode="explicit", load_models=["m"]) as server:
        assert answer(server) == 2.0
        for path in (repo / "m" / "2").iterdir():
            path.unlink()
        (repo / "m" / "2").rmdir()
        server.rescan()
        assert answer(server) == 1.0
        assert [(s.version, s.state.value) for s in server.models()] == [(2, "UNAVAILABLE"), (1, "READY")]


def test_broken_latest_version_at_startup_falls_back_to_the_next(repo: Path) -> None:
    write_model(repo, versions=(1,))
    (repo / "m" / "2").mkdir()
    (repo / "m" / "2" / "model.onnx").write_bytes(b"truncated")
    with Server(repo) as server:
        assert answer(server) == 1.0
        assert state_of(server, "m", 2)[0] == "UNAVAILABLE"  # type: ignore[index]
        assert state_of(server, "m", 1) == ("READY", "")


def test_decisions_follow_content_not_timestamps(repo: Path) -> None:
    write_model(repo, versions=(1,))
    model = repo / "m" / "1" / "model.onnx"
    with Server(repo) as server:
        first = server.routing.serving()["m"][1]
        os.utime(model)  # touched, identical: no reload
        server.rescan()
        assert server.routing.serving()["m"][1] is first
        stat = model.stat()
        model.write_bytes(model_bytes(7.0))  # new content, old timestamps (a cp -p copy)
        os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        server.rescan()
        assert server.routing.serving()["m"][1] is not first
        assert answer(server) == 7.0
        # the replaced copy of version 1 is the only index row: retiring the old copy left it alone
        assert [(s.version, s.state.value) for s in server.models()] == [(1, "READY")]


def test_changed_config_reloads_and_a_broken_one_keeps_serving(repo: Path) -> None:
    write_model(repo, versions=(1, 2))
    with Server(repo) as server:
        write_config(repo / "m", policy=ALL)
        server.rescan()
        assert answer(server, version=1) == 1.0 and answer(server) == 2.0
        (repo / "m" / "config.pbtxt").write_text("max_batch_size: [ broken")
        server.rescan()
        assert answer(server) == 2.0
        rows = {s.version: (s.state.value, s.reason) for s in server.models()}
        assert rows[None][0] == "UNAVAILABLE" and "config.pbtxt" in rows[None][1]
        assert rows[2][0] == "READY" and "still serving" in rows[2][1]


def test_removed_model_is_unloaded_and_listed_as_unloaded(repo: Path) -> None:
    """As in Triton: the index keeps it, UNAVAILABLE, and a request says it has no available versions."""
    write_model(repo, "a")
    write_model(repo, "b")
    with Server(repo) as server:
        assert _instance_threads("a")
        for path in sorted((repo / "a").rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        (repo / "a").rmdir()
        server.rescan()
        assert not _instance_threads("a")
        assert [(s.name, s.state.value, s.reason) for s in server.models() if s.name == "a"] == [
            ("a", "UNAVAILABLE", "unloaded")
        ]
        with pytest.raises(ModelNotReady, match="has no available versions"):
            answer(server, "a")


def test_explicit_load_star_unload_and_reload(repo: Path) -> None:
    write_model(repo, "a")
    write_model(repo, "b")
    with Server(repo, model_control_mode="explicit", load_models=["*"]) as server:
        assert {s.name for s in server.models() if s.state is ModelState.READY} == {"a", "b"}
        server.unload_model("a")
        assert not _instance_threads("a")
        assert state_of(server, "a", 1) == ("UNAVAILABLE", "unloaded")  # per version, as in Triton
        statuses = server.load_model("a")
        assert [(s.version, s.state) for s in statuses] == [(1, ModelState.READY)]
        assert answer(server, "a") == 1.0
    with Server(repo, model_control_mode="explicit", load_models=["b"]) as server:
        assert {s.name for s in server.models()} == {"b"}


def test_unload_frees_sessions_and_threads(repo: Path) -> None:
    write_model(repo, versions=(1,))
    with Server(repo, model_control_mode="explicit", load_models=["m"]) as server:
        loaded = server.routing.serving()["m"][1]
        instances = loaded.scheduler._pool.backends()
        server.unload_model("m")
        assert not _instance_threads("m")
        assert all(getattr(backend, "_session", None) is None for backend in instances)
        assert "m" not in server.routing.serving()


def test_requests_queued_on_the_old_version_finish_there(repo: Path) -> None:
    write_model(repo, versions=(1,))
    write_config(repo / "m", delay_us=300_000)  # batches wait 0.3 s: requests sit in v1's queue
    with Server(repo, model_control_mode="explicit", load_models=["m"]) as server:
        futures: list[Future[dict[str, np.ndarray]]] = [
            server.submit("m", {"INPUT0": ZEROS}) for _ in range(40)
        ]
        assert server.routing.serving()["m"][1].scheduler.queue_size() > 0
        affine_model(repo / "m" / "2" / "model.onnx", offset=2.0)
        server.load_model("m")
        values = {float(f.result(timeout=10)["OUTPUT0"][0, 0]) for f in futures}
        assert values <= {1.0, 2.0} and 1.0 in values
        assert answer(server) == 2.0


def test_no_request_fails_across_repeated_swaps_under_load(repo: Path) -> None:
    write_model(repo, versions=(1,))
    with Server(repo, model_control_mode="explicit", load_models=["m"]) as server:
        with Load(lambda: answer(server), threads=4) as load:
            for version in range(2, 12):
                affine_model(repo / "m" / str(version) / "model.onnx", offset=float(version))
                server.load_model("m")
                # the switch is atomic: once the load returns, every new request gets the new version
                assert answer(server) == float(version)
        assert load.errors == []
        values = [v for _, v in sorted(load.answers)]
        assert set(values) <= {float(v) for v in range(1, 12)}
        assert values[-1] == 11.0


@pytest.mark.parametrize("changed", ["config.pbtxt", "2/model.onnx"])
def test_files_changing_during_a_load_discard_it(repo: Path, changed: str) -> None:
    """A version whose files (or model config) change while it loads may be half-written: not served."""
    write_model(repo, versions=(1,))
    with Server(repo, model_control_mode="explicit", load_models=["m"]) as server:
        replacement = (
            CONFIG_CHANGE if changed == "config.pbtxt" else model_bytes(2.0)  # same bytes, new ctime
        )

        def write_during_load(status: VersionStatus) -> None:
            if status.state is ModelState.LOADING and not written:
                written.append(True)
                target = repo / "m" / changed
                target.write_bytes(replacement)

        written: list[bool] = []
        server.add_listener(write_during_load)
        affine_model(repo / "m" / "2" / "model.onnx", offset=2.0)
        server.load_model("m")
        assert written and answer(server) == 1.0
        assert "changed while loading" in (state_of(server, "m", 2) or ("", ""))[1]
        server.load_model("m")  # settled now
        assert answer(server) == 2.0


CONFIG_CHANGE = b"""
name: "m"
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""
