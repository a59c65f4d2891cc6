"""Installing the service: files staged under a root directory, the unit checked by systemd-analyze, the
settings file driving `serve` with flags overriding it, and a wheel installed into a fresh virtual
environment with no source tree serving and answering clients."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_server.cli import build_parser
from edge_server.client import Client
from edge_server.errors import EdgeServerError, InvalidArgument
from edge_server.service.settings import apply_settings
from edge_server.tools.service_unit import char_majors, device_rules, render_unit
from tests.daemon import ROOT, start_pyzmq_gc


def cli(*args: str, env: dict[str, str] | None = None, python: str = sys.executable, cwd: Path = ROOT):
    return subprocess.run(
        [python, "-m", "edge_server", *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd
    )


def wait_ready(address: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with Client(address, timeout=0.5) as client:
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if client.server_ready():
                    return
            except EdgeServerError:
                continue


def stop(proc: subprocess.Popen, log: Path) -> None:
    proc.terminate()
    assert proc.wait(20) == 0, log.read_text()


def test_install_and_uninstall_staged_under_a_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    result = cli("install-service", "--root", str(root), "--with-examples")
    assert result.returncode == 0, result.stderr
    unit = root / "etc/systemd/system/edge-server.service"
    settings = root / "etc/edge-server/edge-server.toml"
    repository = root / "var/lib/edge-server/models"
    assert f"wrote {unit}" in result.stdout and f"wrote {settings}" in result.stdout
    assert "sudo systemctl enable --now edge-server" in result.stdout
    text = unit.read_text()
    program = Path(sys.executable).with_name("edge-server")
    assert f"ExecStart={program} serve --operator-group edge-server-operators\n" in text
    assert "Type=notify" in text and "WatchdogSec=" in text and "\nPrivateDevices" not in text
    assert "group edge-server-operators: also load and unload models" in result.stdout
    # Staged for an image on another machine: its devices and groups are unknown here.
    assert "\nSupplementaryGroups=video render\n" in text and "\nDevicePolicy=auto\n" in text
    assert 'model-repository = ["/var/lib/edge-server/models"]' in settings.read_text()
    assert (repository / "digits" / "1" / "model.onnx").is_file()
    assert (repository / "preprocess" / "1" / "model.py").is_file()
    # A second install keeps the operator's settings.
    settings.write_text('model-control-mode = "explicit"\n')
    again = cli("install-service", "--root", str(root))
    assert f"kept the existing {settings}" in again.stdout
    assert settings.read_text() == 'model-control-mode = "explicit"\n'

    removed = cli("uninstall-service", "--root", str(root))
    assert removed.returncode == 0, removed.stderr
    assert not unit.exists() and repository.is_dir()
    assert "--purge deletes it" in removed.stdout
    purged = cli("uninstall-service", "--root", str(root), "--purge")
    assert purged.returncode == 0 and not (root / "var/lib/edge-server").exists()


def test_the_unit_names_only_groups_the_system_has(tmp_path: Path) -> None:
    """A group in SupplementaryGroups= that does not exist stops the unit from ever starting (216/GROUP)."""
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "group").write_text("root:x:0:\nvideo:x:44:\nusers:x:100:\n")  # no render
    assert cli("install-service", "--root", str(root)).returncode == 0
    text = (root / "etc/systemd/system/edge-server.service").read_text()
    assert "\nSupplementaryGroups=video\n" in text and "render\n" not in text.split("[Service]")[1]
    (root / "etc" / "group").write_text("root:x:0:\n")
    assert cli("install-service", "--root", str(root)).returncode == 0
    text = (root / "etc/systemd/system/edge-server.service").read_text()
    assert "\nSupplementaryGroups=" not in text
    assert "# SupplementaryGroups= none: no group video or render on this system" in text


def test_device_rules_allow_a_driver_whole_and_a_shared_major_by_path() -> None:
    majors = char_majors(
        "Character devices:\n  1 mem\n 10 misc\n226 drm\n235 nvhost\n236 17000000.gpu\n"
        "\nBlock devices:\n  7 loop\n235 sd\n"
    )
    assert majors == {1: "mem", 10: "misc", 226: "drm", 235: "nvhost", 236: "17000000.gpu"}
    nodes = [
        ("/dev/nvhost-ctrl", 235),
        ("/dev/nvhost-ctrl-nvdla0", 235),
        ("/dev/nvmap", 10),
        ("/dev/nvgpu/igpu0/ctrl", 236),
        ("/dev/dri/renderD128", 226),
        ("/dev/unknown", 99),
    ]
    assert device_rules(nodes, majors) == [
        "char-nvhost rw",
        "/dev/nvmap rw",
        "char-17000000.gpu rw",
        "char-drm rw",
        "/dev/unknown rw",
    ]
    text = render_unit("/usr/bin/edge-server", groups=["video"], devices=["char-nvhost rw", "/dev/nvmap rw"])
    assert "\nDevicePolicy=closed\nDeviceAllow=char-nvhost rw\nDeviceAllow=/dev/nvmap rw\n" in text
    closed = render_unit("/usr/bin/edge-server", groups=["video"], devices=[])
    assert "\nDevicePolicy=closed\n" in closed and "\nDeviceAllow=" not in closed


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_the_unit_for_a_jetson_passes_verify_and_scores_ok(tmp_path: Path) -> None:
    unit = tmp_path / "edge-server.service"
    unit.write_text(
        render_unit("/bin/true", groups=["video", "render"], devices=["char-nvhost rw", "/dev/nvmap rw"])
    )
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "edge-server.service" not in result.stderr, result.stderr
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "--offline" in result.stderr:
        pytest.skip("systemd-analyze security has no --offline here (systemd < 250)")
    score = float(result.stdout.split("Overall exposure level for edge-server.service:")[1].split()[0])
    assert score <= 2.0, result.stdout  # 6.0 MEDIUM before the unit was tightened


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert cli("install-service", "--root", str(root)).returncode == 0
    unit = root / "etc/systemd/system/edge-server.service"
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "edge-server.service" not in result.stderr, result.stderr  # no warning about our unit


def test_every_serve_flag_is_a_setting_and_bad_settings_are_named(tmp_path: Path) -> None:
    serve = build_parser().parse_args(["serve"]).subparser
    path = tmp_path / "s.toml"
    path.write_text(
        'model-control-mode = "explicit"\nload-model = ["a", "b"]\nexit-on-error = false\n'
        "metrics-port = 9102\nno-ipc = true\nrepository-quiet-secs = 2\n"
    )
    apply_settings(serve, path)
    args = build_parser().parse_args(["serve"])  # a fresh parser has none of it
    assert args.model_control_mode == "none"
    args = serve.parse_args(["--metrics-port", "9200"])
    assert args.model_control_mode == "explicit" and args.load_model == ["a", "b"]
    assert args.exit_on_error is False and args.no_ipc is True and args.repository_quiet_secs == 2.0
    assert args.metrics_port == 9200  # the flag wins
    for text, message in (
        ("modle-repository = 'x'\n", "unknown setting 'modle-repository'"),
        ("model-control-mode = 'sometimes'\n", "expected one of"),
        ("metrics-port = 'eighty'\n", "invalid literal"),
        ("no-ipc = 'yes'\n", "expected true or false"),
        ("= broken\n", "settings file"),
    ):
        path.write_text(text)
        with pytest.raises(InvalidArgument, match=message):
            apply_settings(build_parser().parse_args(["serve"]).subparser, path)


def test_serve_reads_the_settings_of_its_configuration_directory(tmp_path: Path) -> None:
    start_pyzmq_gc()
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "models" / "identity", repo / "identity")
    config = tmp_path / "etc"
    config.mkdir()
    (config / "edge-server.toml").write_text(
        f'model-repository = "{repo}"\nipc = "ipc://{tmp_path}/settings.sock"\n'
        "allow-http = false\nallow-grpc = false\nallow-metrics = false\n"
    )
    env = {**os.environ, "CONFIGURATION_DIRECTORY": str(config)}
    log = tmp_path / "serve.log"
    for extra, address in (
        ([], f"ipc://{tmp_path}/settings.sock"),
        (["--ipc", f"ipc://{tmp_path}/flag.sock"], None),
    ):
        address = address or extra[1]
        with open(log, "ab") as out:
            command = [sys.executable, "-m", "edge_server", "serve", *extra]
            proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(address, proc, log)
            with Client(address, timeout=10) as client:
                assert [m["name"] for m in client.models()] == ["identity"]
        finally:
            stop(proc, log)
    assert f"settings from {config / 'edge-server.toml'}" in log.read_text()


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_serves_without_the_source_tree(tmp_path: Path) -> None:
    """Build the wheel, install it (no dependencies: they come from this environment's site-packages,
    added by path so that the editable install of the checkout stays out), run from outside the tree."""
    start_pyzmq_gc()
    dist = tmp_path / "dist"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-w",
            str(dist),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("edge_server-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages")]
    (Path(site) / "deps.pth").write_text(
        "\n".join(ours) + "\n"
    )  # a path line: its own .pth files stay unread
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if install.returncode != 0 and "no such option: --python" in install.stderr:
        pytest.skip("pip is too old for --python")
    assert install.returncode == 0, install.stderr
    edge = venv / "bin" / "edge-server"
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "EDGE_SERVER_IPC")}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)

    where = subprocess.run(
        [str(python), "-c", "import edge_server; print(edge_server.__file__)"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
    )
    assert where.stdout.startswith(site), where.stdout + where.stderr
    result = subprocess.run(
        [str(edge), "serve"], capture_output=True, text=True, cwd=work, env=env, timeout=60
    )
    assert result.returncode == 2 and "no model repository: pass --model-repository DIR" in result.stderr

    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "models" / "identity", repo / "identity")
    address = f"ipc://{tmp_path}/edge-server/edge-server.sock"
    log = tmp_path / "wheel.log"
    command = [
        str(edge),
        "serve",
        "--model-repository",
        str(repo),
        "--allow-http",
        "false",
        "--allow-grpc",
        "false",
    ]
    command += ["--allow-metrics", "false"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(address, proc, log)
        models = subprocess.run(
            [str(edge), "models"], capture_output=True, text=True, cwd=work, env=env, timeout=60
        )
        assert models.returncode == 0, models.stderr
        assert "identity" in models.stdout and "READY" in models.stdout
        status = subprocess.run(
            [str(edge), "status"], capture_output=True, text=True, cwd=work, env=env, timeout=60
        )
        assert status.returncode == 0 and "state       serving, ready" in status.stdout
    finally:
        stop(proc, log)
    staged = subprocess.run(
        [str(edge), "install-service", "--root", str(tmp_path / "root")],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
    )
    assert staged.returncode == 0, staged.stderr
    assert f"ExecStart={edge} serve" in (tmp_path / "root/etc/systemd/system/edge-server.service").read_text()
