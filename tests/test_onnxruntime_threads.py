"""The ONNX Runtime backend's thread rule: ORT's defaults for one instance, split cores for several."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_server.backends.base import InstanceSpec
from edge_server.backends.onnxruntime import OnnxRuntimeBackend, session_options, thread_policy
from edge_server.config.model import InstanceGroup, ModelConfig, TensorSpec
from edge_server.errors import ConfigError, InvalidArgument
from edge_server.loader import instance_specs
from edge_server.server import Server
from edge_server.status_index import ModelState
from tests.daemon import EXAMPLES, ROOT, Daemon

SPIN = "session.intra_op.allow_spinning"


def _specs(count: int, cpu_count: int = 4) -> list[InstanceSpec]:
    config = ModelConfig(
        name="m",
        backend="onnxruntime",
        inputs=(TensorSpec(name="x", data_type="TYPE_FP32", dims=(1,)),),
        outputs=(TensorSpec(name="y", data_type="TYPE_FP32", dims=(1,)),),
        instance_groups=(InstanceGroup(kind="KIND_CPU", count=count),),
    )
    return instance_specs(config, OnnxRuntimeBackend, cpu_count=cpu_count)


def test_one_instance_keeps_onnxruntime_defaults() -> None:
    (spec,) = _specs(1)
    assert thread_policy({}, spec, source="t")[0] == "default"
    options = session_options({}, spec, source="t")
    assert options.intra_op_num_threads == 0  # ONNX Runtime picks one thread per core
    assert options.get_session_config_entry(SPIN) == "1"


def test_several_instances_split_the_cores_and_do_not_spin() -> None:
    specs = _specs(2)
    assert {thread_policy({}, s, source="t")[0] for s in specs} == {"split"}
    options = session_options({}, specs[0], source="t")
    assert options.intra_op_num_threads == 2
    assert options.inter_op_num_threads == 1
    assert options.get_session_config_entry(SPIN) == "0"


def test_explicit_parameters_win() -> None:
    (spec,) = _specs(1)
    options = session_options({"thread_policy": "split"}, spec, source="t")
    assert options.intra_op_num_threads == 4 and options.get_session_config_entry(SPIN) == "0"
    params = {"intra_op_thread_count": "3", SPIN: "0"}
    options = session_options(params, spec, source="t")
    assert options.intra_op_num_threads == 3 and options.get_session_config_entry(SPIN) == "0"
    options = session_options({"thread_policy": "default"}, _specs(2)[0], source="t")
    assert options.intra_op_num_threads == 0 and options.get_session_config_entry(SPIN) == "1"


@pytest.mark.parametrize(
    ("params", "message"),
    [({"thread_policy": "fast"}, "thread_policy is 'fast'"), ({"intra_op_thread_count": "x"}, "integers")],
)
def test_bad_parameters_are_config_errors(params: dict[str, str], message: str) -> None:
    (spec,) = _specs(1)
    with pytest.raises(ConfigError, match=message):
        session_options(params, spec, source="t")


# -- the daemon-wide rule, through a real Server and a real daemon -----------------------------------

CPUS = os.cpu_count() or 1


def _repo(root: Path, *names: str, params: dict[str, dict[str, str]] | None = None) -> Path:
    """Copies of the identity model (one CPU instance each); ``params`` go into every config."""
    if not (EXAMPLES / "identity" / "1" / "model.onnx").exists():
        subprocess.run([sys.executable, str(EXAMPLES / "make_models.py")], check=True, capture_output=True)
    repo = root / "repo"
    for name in names:
        shutil.copytree(EXAMPLES / "identity", repo / name)
        text = (repo / name / "config.pbtxt").read_text().replace('name: "identity"', f'name: "{name}"')
        for key, value in (params or {}).get(name, {}).items():
            text += f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        (repo / name / "config.pbtxt").write_text(text)
    return repo


def _threads(server: Server) -> dict[str, dict[str, object]]:
    return {row["name"]: row["threads"] for row in server.status()["models"] if row["state"] == "READY"}


def _check_works(server: Server, name: str) -> None:
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(server.infer(name, {"INPUT0": x})["OUTPUT0"], x)


def test_a_model_alone_on_the_box_keeps_onnxruntime_defaults(tmp_path: Path) -> None:
    with Server(_repo(tmp_path, "a")) as server:
        threads = _threads(server)["a"]
        assert threads["policy"] == "default" and threads["spinning"] is True
        assert threads["intra_op_threads"] == 0  # ONNX Runtime picks one per core
        assert str(threads["rule_at_load"]).startswith("auto: the only")
        _check_works(server, "a")


def test_two_models_of_one_repository_split_the_cores_from_their_first_load(tmp_path: Path) -> None:
    loads: list[str] = []

    def heard(status: object) -> None:
        if getattr(status, "state", None) is ModelState.LOADING:
            loads.append(getattr(status, "name", ""))

    with Server(_repo(tmp_path, "a", "b"), listeners=[heard]) as server:  # decided from the repository
        for name, threads in _threads(server).items():
            assert threads["policy"] == "split", name
            assert threads["intra_op_threads"] == max(1, CPUS // 2) and threads["inter_op_threads"] == 1
            assert threads["spinning"] is False
            assert threads["rule_at_load"] == f"auto: 2 CPU ONNX Runtime instances share {CPUS} cores"
            _check_works(server, name)
        assert sorted(loads) == ["a", "b"]  # each built once, split from the start


def _counts(server: Server, name: str) -> tuple[int, int]:
    (row,) = server.statistics(name)
    return row["inference_count"], row["execution_count"]


def test_a_model_loaded_later_never_reloads_the_one_alone(tmp_path: Path) -> None:
    """Loading b leaves a serving as it is (its session, its statistics): a split waits for a's reload."""
    repo = _repo(tmp_path, "a", "b")
    loads: list[str] = []

    def heard(status: object) -> None:
        if getattr(status, "state", None) is ModelState.LOADING:
            loads.append(getattr(status, "name", ""))

    with Server(repo, model_control_mode="explicit", load_models=["a"], listeners=[heard]) as server:
        assert _threads(server)["a"]["policy"] == "default"
        _check_works(server, "a")
        _check_works(server, "a")
        server.load_model("b")
        assert _threads(server)["b"]["policy"] == "split"  # b counts a, which shares the cores
        assert _threads(server)["a"]["policy"] == "default"  # not rebuilt: it serves on
        assert _counts(server, "a") == (2, 2)  # statistics are cumulative per version
        assert loads == ["a", "b"]  # a was loaded once
        _check_works(server, "a")
        server.load_model("a")  # unchanged files: kept as it is
        assert _counts(server, "a") == (3, 3) and loads == ["a", "b"]
        (repo / "a" / "config.pbtxt").write_text((repo / "a" / "config.pbtxt").read_text() + "\n")
        server.load_model("a")  # a real reload: now it is built with b beside it
        assert _threads(server)["a"]["policy"] == "split" and loads == ["a", "b", "a"]


def test_per_model_and_triton_parameters_win_over_the_daemon_rule(tmp_path: Path) -> None:
    params = {
        "a": {"thread_policy": "default"},
        "b": {"intra_op_thread_count": "3", "session.intra_op.allow_spinning": "1"},
        "c": {},
    }
    with Server(_repo(tmp_path, "a", "b", "c", params=params)) as server:
        threads = _threads(server)
        assert threads["a"]["policy"] == "default" and threads["a"]["spinning"] is True
        assert threads["a"]["rule_at_load"] == "the model's thread_policy parameter"
        assert threads["b"]["policy"] == "split" and threads["b"]["intra_op_threads"] == 3
        assert threads["b"]["spinning"] is True
        explicit = "explicit intra_op_thread_count, session.intra_op.allow_spinning"
        assert explicit in str(threads["b"]["rule_at_load"])
        assert threads["c"]["policy"] == "split" and threads["c"]["intra_op_threads"] == max(1, CPUS // 3)


@pytest.mark.parametrize("policy", ["default", "split"])
def test_the_daemon_policy_forces_one_rule(tmp_path: Path, policy: str) -> None:
    names = ("a", "b") if policy == "default" else ("a",)
    with Server(_repo(tmp_path, *names), onnxruntime_thread_policy=policy) as server:
        threads = _threads(server)
        assert {t["policy"] for t in threads.values()} == {policy}
        assert {t["rule_at_load"] for t in threads.values()} == {"--onnxruntime-thread-policy"}
        if policy == "split":
            assert threads["a"]["intra_op_threads"] == CPUS and threads["a"]["spinning"] is False


def test_a_bad_policy_is_refused_by_the_server(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="onnxruntime_thread_policy must be one of"):
        Server(_repo(tmp_path, "a"), onnxruntime_thread_policy="fast")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edge_server", *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


def test_the_daemon_reads_the_setting_and_status_shows_it(tmp_path: Path) -> None:
    settings = tmp_path / "edge-server.toml"
    settings.write_text('onnxruntime-thread-policy = "split"\n')
    address = f"ipc://{tmp_path}/threads.sock"
    daemon = Daemon(_repo(tmp_path, "a"), address, tmp_path / "daemon.log", "--settings", str(settings))
    try:
        daemon.start()
        result = _cli("status", "--ipc", address, "--json")
        assert result.returncode == 0, result.stderr
        (row,) = json.loads(result.stdout)["models"]
        assert row["threads"]["policy"] == "split"
        assert row["threads"]["rule_at_load"] == "--onnxruntime-thread-policy"
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_bad_flag_and_setting_values_are_clear_errors(tmp_path: Path) -> None:
    result = _cli("serve", "--model-repository", str(tmp_path), "--onnxruntime-thread-policy", "fast")
    assert result.returncode == 2
    assert "--onnxruntime-thread-policy: invalid choice: 'fast'" in result.stderr
    settings = tmp_path / "edge-server.toml"
    settings.write_text('onnxruntime-thread-policy = "fast"\n')
    result = _cli("serve", "--model-repository", str(tmp_path), "--settings", str(settings))
    assert result.returncode == 1  # as every bad settings-file value (edge_server/service/settings.py)
    assert "onnxruntime-thread-policy = 'fast': expected one of ['auto', 'default', 'split']" in result.stderr


def test_status_labels_each_model_rule_as_at_load_and_shows_the_current_one(tmp_path: Path) -> None:
    # a loads alone, b beside it (2 share), c last (3 share); a is rebuilt once c is there.  What each
    # model was built with stays what it was; the box's rule is reported once, as it is now.
    with Server(_repo(tmp_path, "a", "b", "c")) as server:
        status = server.status()
        rows = {row["name"]: row["threads"] for row in status["models"]}
        assert {name: "rule" in threads for name, threads in rows.items()} == dict.fromkeys("abc", False)
        assert rows["c"]["rule_at_load"] == f"auto: 3 CPU ONNX Runtime instances share {CPUS} cores"
        assert str(rows["b"]["rule_at_load"]).startswith("auto: ")
        assert status["onnxruntime_threads"] == {
            "policy": "auto",
            "cpu_onnxruntime_instances": 3,
            "cores": CPUS,
            "rule": f"auto: 3 CPU ONNX Runtime instances share {CPUS} cores",
        }
