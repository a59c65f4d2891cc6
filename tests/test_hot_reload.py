"""The watched repository: real files dropped into a live directory while clients keep sending requests.

Every integration test runs a poll-mode :class:`Server` on a ``tmp_path`` repository with several client
threads; version ``k`` answers ``x + k``, so each answer names the version that produced it.  Nothing
sleeps to synchronise: tests poll answers and :meth:`Server.models` with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from watchdog.events import (
    FileClosedEvent,
    FileCreatedEvent,
    FileModifiedEvent,
    FileMovedEvent,
)

from edge_server import ModelState, Server, VersionStatus
from edge_server.client import Client
from edge_server.errors import EdgeServerError, ModelNotReady
from edge_server.watcher import AttribEvent, ChangeTracker, RepositoryWatcher
from tests.daemon import Daemon, start_pyzmq_gc
from tests.onnx_factory import affine_model
from tests.reload_helpers import (
    ALL,
    Load,
    answer,
    ipc_answer,
    ipc_state,
    live,
    loads_of,
    model_bytes,
    reason_of,
    rename_into_place,
    stage_version,
    state_of,
    wait_until,
    write_config,
    write_model,
)

QUIET = 0.2

# watchdog warns when a directory tree created in one go gets its watches added twice; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:Callback with id:RuntimeWarning")

# -- the settle rules, without inotify ----------------------------------------------------------


def _tracker(root: str = "/repo") -> ChangeTracker:
    return ChangeTracker(root, quiet_s=0.5, max_hold_s=10.0)


def test_each_event_restarts_its_models_quiet_period() -> None:
    tracker = _tracker()
    tracker.observe(FileCreatedEvent("/repo/a/2/model.onnx"), now=0.0)
    tracker.observe(FileCreatedEvent("/repo/b/1/model.onnx"), now=0.3)
    assert tracker.take_due(0.4) == []
    tracker.observe(FileClosedEvent("/repo/a/config.pbtxt"), now=0.4)
    assert tracker.take_due(0.79) == []
    assert tracker.take_due(0.8) == ["b"]  # a was touched again at 0.4: not yet
    assert tracker.next_check(0.8) == pytest.approx(0.1)
    assert tracker.take_due(0.9) == ["a"]
    assert tracker.take_due(5.0) == [] and tracker.next_check(5.0) is None


def test_a_file_open_for_writing_holds_its_model_until_closed() -> None:
    tracker = _tracker()
    tracker.observe(FileModifiedEvent("/repo/a/2/model.onnx"), now=0.0)
    tracker.observe(FileModifiedEvent("/repo/b/1/model.onnx"), now=0.0)
    tracker.observe(FileClosedEvent("/repo/b/1/model.onnx"), now=0.1)
    assert tracker.take_due(3.0) == ["b"]  # a's writer pauses for 3 s: still held
    tracker.observe(FileClosedEvent("/repo/a/2/model.onnx"), now=3.0)
    assert tracker.take_due(3.4) == []
    assert tracker.take_due(3.5) == ["a"]
    tracker.observe(FileModifiedEvent("/repo/a/2/model.onnx"), now=20.0)  # a writer that died
    assert tracker.take_due(29.0) == []
    assert tracker.take_due(30.0) == ["a"]


def test_touch_and_rename_do_not_count_as_writing() -> None:
    tracker = _tracker()
    tracker.observe(AttribEvent("/repo/a/1/model.onnx"), now=0.0)
    tracker.observe(FileModifiedEvent("/repo/b/2/.model.onnx.tmp"), now=0.0)  # ignored: a temp file
    tracker.observe(FileMovedEvent("/repo/b/2/.model.onnx.tmp", "/repo/b/2/model.onnx"), now=0.1)
    assert tracker.take_due(0.6) == ["a", "b"]


def test_hidden_temporary_and_outside_paths_are_ignored() -> None:
    tracker = _tracker()
    for path in (
        "/repo/.staging/m/1/model.onnx",
        "/repo/m/.hidden",
        "/repo/m/1/model.onnx.part",
        "/repo/m/.2/model.onnx",
        "/repo",
        "/elsewhere/m/1/model.onnx",
        "",
    ):
        assert not tracker.observe(FileCreatedEvent(path), now=0.0), path
    assert tracker.model_of("/repo/m/1/model.onnx") == "m"
    assert tracker.observe(FileMovedEvent("/repo/.staging/7", "/repo/m/7"), now=0.0)
    assert tracker.observe(FileMovedEvent("/repo/m/3", "/repo/m/.old-3"), now=0.0)
    assert tracker.pending() == ["m"]


# -- a live repository -------------------------------------------------------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    return path


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    """Where OTA drops are written first: the same filesystem, outside the watched tree."""
    path = tmp_path / "staging"
    path.mkdir()
    return path


@pytest.fixture
def server(repo: Path) -> Iterator[Server]:
    write_model(repo, versions=(1,))
    with Server(repo, model_control_mode="poll", watch_quiet_s=QUIET) as server:
        yield server


def _watcher(server: Server) -> RepositoryWatcher:
    assert server.watcher is not None
    return server.watcher


def _answers_only(load: Load, value: float, since: float) -> bool:
    recent = load.values_since(since)
    return bool(recent) and set(recent) == {value}


def test_renamed_version_serves_with_no_failed_request(server: Server, repo: Path, staging: Path) -> None:
    with Load(lambda: answer(server)) as load:
        staged = stage_version(staging, 2)
        rename_into_place(staged, repo / "m" / "2")  # how soon it answers: bench/bench_reload.py
        wait_until(lambda: answer(server) == 2.0, what="version 2 to answer")
        cutoff = time.monotonic()
        wait_until(lambda: load.count() > 0 and bool(load.values_since(cutoff)), what="more answers")
    assert load.errors == []
    assert set(load.values_since(0)) == {1.0, 2.0}
    assert set(load.values_since(cutoff)) == {2.0}
    assert [(s.version, s.state.value) for s in live(server.models())] == [(2, "READY")]


def _empty_version_dir(server: Server, path: Path) -> None:
    """Create a version directory and wait until the watcher has seen it (and found no model in it)."""
    path.mkdir()
    wait_until(
        lambda: "missing" in (state_of(server, path.parent.name, int(path.name)) or ("", ""))[1],
        what="the empty version directory to be rejected",
    )


def test_slow_copy_into_the_live_directory_is_loaded_only_when_complete(server: Server, repo: Path) -> None:
    """One writer holding the file open with pauses longer than the quiet period: held until closed."""
    attempts = loads_of(server)
    data = model_bytes(2.0)
    chunks = [data[i : i + 64] for i in range(0, 192, 64)] + [data[192:]]
    with Load(lambda: answer(server)) as load:
        _empty_version_dir(server, repo / "m" / "2")
        tried = len(attempts)
        with open(repo / "m" / "2" / "model.onnx", "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                f.flush()
                pause = time.monotonic()
                wait_until(lambda p=pause: time.monotonic() - p > 2 * QUIET, what="a pause")  # type: ignore[misc]
                assert answer(server) == 1.0
        wait_until(lambda: answer(server) == 2.0, what="version 2 after the close")
    assert load.errors == []
    assert set(load.values_since(0)) == {1.0, 2.0}
    assert len(attempts) == tried + 1  # the half-written file was never even tried


def test_chunked_copy_reopened_per_chunk_retries_until_the_file_is_whole(server: Server, repo: Path) -> None:
    """A writer that closes after every chunk looks settled between chunks; half loads fail, later
    writes retry, and no answer ever comes from a half-loaded model."""
    data = model_bytes(2.0)
    cut = len(data) // 2
    with Load(lambda: answer(server)) as load:
        _empty_version_dir(server, repo / "m" / "2")
        (repo / "m" / "2" / "model.onnx").write_bytes(data[:cut])
        wait_until(lambda: "not a loadable" in reason_of(server, "m", 2), what="the half file to fail")
        assert answer(server) == 1.0
        with open(repo / "m" / "2" / "model.onnx", "ab") as f:
            f.write(data[cut:])
        wait_until(lambda: answer(server) == 2.0, what="version 2 once whole")
    assert load.errors == []
    assert set(load.values_since(0)) == {1.0, 2.0}


def test_broken_drops_keep_the_good_version_and_never_wedge_the_watcher(
    server: Server, repo: Path, staging: Path
) -> None:
    with Load(lambda: answer(server)) as load:
        rename_into_place(stage_version(staging, 2), repo / "m" / "2")
        wait_until(lambda: answer(server) == 2.0, what="version 2")
        # corrupt version 3
        rename_into_place(stage_version(staging, 3, data=b"\x0a\x05trunc"), repo / "m" / "3")
        wait_until(lambda: (state_of(server, "m", 3) or ("",))[0] == "UNAVAILABLE", what="v3 rejected")
        assert "not a loadable ONNX model" in state_of(server, "m", 3)[1]  # type: ignore[index]
        assert answer(server) == 2.0 and state_of(server, "m", 2) == ("READY", "")
        # version 3 whose model disagrees with the config (5 values where config.pbtxt says 4)
        os.rename(repo / "m" / "3", staging / "broken-3")
        rename_into_place(stage_version(staging, 3, data=model_bytes(3.0, dims=5)), repo / "m" / "3")
        wait_until(lambda: "dims" in (state_of(server, "m", 3) or ("", ""))[1], what="v3 mismatch reported")
        assert answer(server) == 2.0
        # the next good drop of that model is picked up
        os.rename(repo / "m" / "3", staging / "mismatch-3")
        rename_into_place(stage_version(staging, 3), repo / "m" / "3")
        wait_until(lambda: answer(server) == 3.0, what="the good version 3")
    assert load.errors == []
    assert set(load.values_since(0)) == {1.0, 2.0, 3.0}
    # version 2 may still be draining (UNLOADING) for a moment after version 3 answers
    wait_until(
        lambda: [(s.version, s.state.value) for s in live(server.models())] == [(3, "READY")],
        what="version 3 alone",
    )


def test_removed_version_hands_over_to_the_previous_one(server: Server, repo: Path, staging: Path) -> None:
    with Load(lambda: answer(server)) as load:
        rename_into_place(stage_version(staging, 2), repo / "m" / "2")
        wait_until(lambda: answer(server) == 2.0, what="version 2")
        shutil.rmtree(repo / "m" / "2")
        wait_until(lambda: answer(server) == 1.0, what="version 1 back")
    assert load.errors == []
    assert [(s.version, s.state.value) for s in live(server.models())] == [(1, "READY")]


def test_replaced_model_file_and_changed_config(server: Server, repo: Path) -> None:
    with Load(lambda: answer(server)) as load:
        temp = repo / "m" / "1" / ".model.onnx.tmp"
        temp.write_bytes(model_bytes(5.0))
        os.replace(temp, repo / "m" / "1" / "model.onnx")
        wait_until(lambda: answer(server) == 5.0, what="the replaced file")
        (repo / "m" / "2").mkdir()
        (repo / "m" / "2" / "model.onnx").write_bytes(model_bytes(2.0))
        wait_until(lambda: answer(server) == 2.0, what="version 2")
        write_config(repo / "m", policy=ALL)
        wait_until(
            lambda: [(s.version, s.state.value) for s in server.models()] == [(2, "READY"), (1, "READY")],
            what="both versions under policy all",
        )
        assert answer(server, version=1) == 5.0 and answer(server, version=2) == 2.0
    assert load.errors == []


def test_new_and_removed_model_directories(server: Server, repo: Path, staging: Path) -> None:
    write_model(staging, "fresh", versions=(4,))
    os.rename(staging / "fresh", repo / "fresh")
    wait_until(lambda: server.is_ready("fresh"), what="the new model")
    assert answer(server, "fresh") == 4.0
    shutil.rmtree(repo / "fresh")
    # as in Triton, it stays in the index, unloaded, and a request says it has no available versions
    wait_until(
        lambda: "fresh" not in {s.name for s in live(server.models())}, what="the removed model to unload"
    )
    with pytest.raises(ModelNotReady, match="has no available versions"):
        answer(server, "fresh")
    assert [(s.name, s.version, s.reason) for s in server.models()] == [
        ("fresh", 4, "unloaded"),
        ("m", 1, ""),
    ]


def test_hidden_and_temporary_files_are_ignored(server: Server, repo: Path) -> None:
    write_model(repo, "other")
    watcher = _watcher(server)
    wait_until(lambda: server.is_ready("other") and watcher.idle(), what="other model")
    rounds = watcher.rounds("m")
    (repo / "m" / "1" / "model.onnx.part").write_bytes(b"partial")
    (repo / "m" / ".notes").write_text("hidden")
    (repo / ".staging").mkdir()
    (repo / ".staging" / "model.onnx").write_bytes(model_bytes(9.0))
    # a later change elsewhere: once it is handled, the events before it were seen (and ignored)
    other_rounds = watcher.rounds("other")
    os.utime(repo / "other" / "config.pbtxt")
    wait_until(lambda: watcher.rounds("other") > other_rounds, what="the sentinel change")
    assert watcher.rounds("m") == rounds
    assert answer(server) == 1.0


def test_touched_file_does_not_reload_but_a_timestamp_preserving_copy_does(
    server: Server, repo: Path, tmp_path: Path
) -> None:
    watcher = _watcher(server)
    model = repo / "m" / "1" / "model.onnx"
    first = server.routing.serving()["m"][1]
    rounds = watcher.rounds("m")
    os.utime(model)
    wait_until(lambda: watcher.rounds("m") > rounds, what="the touch to be handled")
    assert server.routing.serving()["m"][1] is first
    source = tmp_path / "copy-source.onnx"
    source.write_bytes(model_bytes(6.0))
    stat = model.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    shutil.copy2(source, model)  # new bytes, same size and same mtime as before
    assert model.stat().st_mtime_ns == stat.st_mtime_ns and model.stat().st_size == stat.st_size
    wait_until(lambda: answer(server) == 6.0, what="the copied content")


def test_changes_arriving_during_a_load_are_queued(server: Server, repo: Path, staging: Path) -> None:
    """Version 3 is renamed into place while version 2 is loading; it is loaded right after."""
    dropped: list[float] = []

    def during_load(status: VersionStatus) -> None:
        if status.version == 2 and status.state is ModelState.LOADING and not dropped:
            dropped.append(rename_into_place(stage_version(staging, 3), repo / "m" / "3"))

    server.add_listener(during_load)
    rename_into_place(stage_version(staging, 2), repo / "m" / "2")
    wait_until(lambda: answer(server) == 3.0, what="version 3")
    assert dropped
    assert [(s.version, s.state.value) for s in live(server.models())] == [(3, "READY")]


def test_explicit_rescan_retries_what_the_watcher_will_not(server: Server, repo: Path) -> None:
    """SIGHUP (server.rescan) tries a failed version again even though its bytes did not change."""
    attempts = loads_of(server)
    (repo / "m" / "2").mkdir()
    (repo / "m" / "2" / "model.onnx").write_bytes(b"junk")
    wait_until(lambda: (state_of(server, "m", 2) or ("",))[0] == "UNAVAILABLE", what="v2 rejected")
    before = len(attempts)
    server.rescan()
    assert len(attempts) == before + 1
    assert answer(server) == 1.0


def test_versions_renamed_out_and_back_never_deafen_the_watcher(
    server: Server, repo: Path, staging: Path
) -> None:
    """A rollback by rename, a new drop under the same number, then the backup deleted: with watchdog
    7.1 alone its inotify thread dies at that last step and no later drop is ever seen."""
    rename_into_place(stage_version(staging, 2), repo / "m" / "2")
    wait_until(lambda: answer(server) == 2.0, what="version 2")
    os.rename(repo / "m" / "2", staging / "backup-2")
    wait_until(lambda: answer(server) == 1.0, what="the rollback to version 1")
    rename_into_place(stage_version(staging, 2, offset=2.5), repo / "m" / "2")
    wait_until(lambda: answer(server) == 2.5, what="the new version 2")
    shutil.rmtree(repo / "m" / "2")
    wait_until(lambda: answer(server) == 1.0, what="version 1 again")
    shutil.rmtree(staging / "backup-2")
    rename_into_place(stage_version(staging, 3), repo / "m" / "3")
    wait_until(lambda: answer(server) == 3.0, what="version 3: the watcher still hears")


def test_model_directory_swapped_by_two_renames(server: Server, repo: Path, staging: Path) -> None:
    write_model(staging, "m", versions=(1,))
    affine_model(staging / "m" / "1" / "model.onnx", offset=8.0)
    with Load(lambda: answer(server)) as load:
        os.rename(repo / "m", staging / "m-old")
        os.rename(staging / "m", repo / "m")
        wait_until(lambda: answer(server) == 8.0, what="the new model directory")
    assert load.errors == []
    assert set(load.values_since(0)) == {1.0, 8.0}


# -- the real daemon, real IPC clients, real signals ------------------------------------------------


@pytest.fixture(scope="module")
def zmq_gc() -> None:
    """pyzmq's process-wide helper thread, started before the per-test thread-leak check looks."""
    start_pyzmq_gc()


def _answers_over(client: Client) -> Callable[[], float]:
    return lambda: ipc_answer(client)


@contextlib.contextmanager
def running(repo: Path, root: Path, *args: str) -> Iterator[tuple[Daemon, contextlib.ExitStack]]:
    """The daemon on ``repo``, and a stack that closes the clients made for it before it stops."""
    daemon = Daemon(repo, f"ipc://{root}/reload.sock", root / "reload.log", *args)
    try:
        daemon.start()
        with contextlib.ExitStack() as clients:
            yield daemon, clients
    finally:
        status = daemon.stop()
    assert status == 0, f"the daemon exited with {status}:\n{daemon.log()}"


def connect(daemon: Daemon, clients: contextlib.ExitStack) -> Client:
    return clients.enter_context(Client(daemon.address, timeout=30))


@pytest.fixture
def daemon_repo(tmp_path: Path, zmq_gc: None) -> Path:
    path = tmp_path / "live"
    path.mkdir()
    write_model(path, versions=(1,))
    return path


def test_daemon_swaps_under_load_from_several_ipc_clients(
    daemon_repo: Path, staging: Path, tmp_path: Path
) -> None:
    with running(daemon_repo, tmp_path, "--model-control-mode", "poll") as (daemon, clients):
        control = connect(daemon, clients)
        with Load([_answers_over(connect(daemon, clients)) for _ in range(3)]) as load:
            # OTA drop by rename: then every answer comes from version 2 (how soon: bench/bench_reload.py)
            rename_into_place(stage_version(staging, 2), daemon_repo / "m" / "2")
            wait_until(lambda: ipc_answer(control) == 2.0, what="version 2 over IPC")
            cutoff = time.monotonic()
            wait_until(lambda: bool(load.values_since(cutoff)), what="answers after the swap")
            assert set(load.values_since(cutoff)) == {2.0}
            # a slow chunked copy straight into the live directory: never loaded half-way
            data = model_bytes(3.0)
            (daemon_repo / "m" / "3").mkdir()
            with open(daemon_repo / "m" / "3" / "model.onnx", "wb") as f:
                for start in range(0, len(data), 100):
                    f.write(data[start : start + 100])
                    f.flush()
                    pause = time.monotonic()
                    wait_until(lambda p=pause: time.monotonic() - p > 0.3, what="a pause")  # type: ignore[misc]
            wait_until(lambda: ipc_answer(control) == 3.0, what="version 3 after the copy")
            # a corrupt version 4 and a version 4 that disagrees with the config: 3 keeps serving
            rename_into_place(stage_version(staging, 4, data=b"\x0a\x03bad"), daemon_repo / "m" / "4")
            wait_until(lambda: (ipc_state(control, "m", 4) or ("",))[0] == "UNAVAILABLE", what="v4 refused")
            assert "not a loadable ONNX model" in ipc_state(control, "m", 4)[1]  # type: ignore[index]
            os.rename(daemon_repo / "m" / "4", staging / "bad-4")
            bad = stage_version(staging, 4, data=model_bytes(4.0, dims=5))
            rename_into_place(bad, daemon_repo / "m" / "4")
            wait_until(lambda: "dims" in (ipc_state(control, "m", 4) or ("", ""))[1], what="v4 mismatch")
            assert ipc_answer(control) == 3.0 and ipc_state(control, "m", 3) == ("READY", "")
            # removing the serving version with policy latest 1: the newest one that loads takes over
            shutil.rmtree(daemon_repo / "m" / "4")
            shutil.rmtree(daemon_repo / "m" / "3")
            wait_until(lambda: ipc_answer(control) == 2.0, what="version 2 back")
        assert load.errors == []
        assert set(load.values_since(0)) == {1.0, 2.0, 3.0}
        # the removed versions may still be draining (UNLOADING) for a moment after version 2 answers
        wait_until(
            lambda: [(r["version"], r["state"]) for r in live(control.models())] == [(2, "READY")],
            what="version 2 alone",
        )


def test_daemon_rescans_on_sighup(daemon_repo: Path, staging: Path, tmp_path: Path) -> None:
    """Without a watcher (control mode none) a drop changes nothing until SIGHUP."""
    with running(daemon_repo, tmp_path) as (daemon, clients):
        client = connect(daemon, clients)
        rename_into_place(stage_version(staging, 2), daemon_repo / "m" / "2")
        assert ipc_answer(client) == 1.0
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: ipc_answer(client) == 2.0, what="version 2 after SIGHUP")


def test_daemon_explicit_control_over_ipc(daemon_repo: Path, tmp_path: Path) -> None:
    write_model(daemon_repo, "other", versions=(3,))
    args = ("--model-control-mode", "explicit", "--load-model", "*")
    with running(daemon_repo, tmp_path, *args) as (daemon, clients):
        client = connect(daemon, clients)
        assert ipc_answer(client, "other") == 3.0
        client.unload_model("other")
        assert ipc_state(client, "other", 3) == ("UNAVAILABLE", "unloaded")  # as in Triton: per version
        with pytest.raises(EdgeServerError):
            ipc_answer(client, "other")
        affine_model(daemon_repo / "other" / "4" / "model.onnx", offset=4.0)
        client.load_model("other")
        assert ipc_answer(client, "other") == 4.0
