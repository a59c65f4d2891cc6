"""``edge-server install-service`` / ``uninstall-service``: the systemd appliance in one command.

Install creates the ``edge-server`` system user (groups ``video`` and ``render``, which own the GPU and
DLA device nodes on a Jetson), puts the unit in ``/etc/systemd/system`` with ``ExecStart`` pointing at
this installation, creates the repository directory (seeded with the example models on request) and
writes ``/etc/edge-server/edge-server.toml`` unless one exists.  It prints each thing it did and the
next command.  ``--root DIR`` stages the files under DIR without touching users or systemd (for
images, and for the tests).
"""

from __future__ import annotations

import argparse
import importlib.resources
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from edge_server.errors import InvalidArgument

UNIT_NAME = "edge-server.service"
SERVICE_USER = "edge-server"
DEVICE_GROUPS = ("video", "render")
CONFIG_DIR = Path("etc/edge-server")
STATE_DIR = Path("var/lib/edge-server")
UNIT_DIR = Path("etc/systemd/system")


def add_parser(subparsers: Any) -> None:
    install = subparsers.add_parser(
        "install-service", help="install the systemd service (user, unit, repository, settings); needs root"
    )
    install.add_argument(
        "--with-examples",
        nargs="?",
        type=Path,
        const=True,
        default=None,
        metavar="DIR",
        help="put the example models into the repository: copied from DIR, or made by the installed "
        "package (the models extra) when DIR is not given",
    )
    install.add_argument("--exec", default=None, metavar="PATH", help="the edge-server program systemd runs")
    install.add_argument(
        "--root", type=Path, default=Path("/"), help="stage under DIR (no user, no systemctl)"
    )
    install.set_defaults(tool_run=install_service)
    remove = subparsers.add_parser(
        "uninstall-service", help="stop and remove the systemd service; needs root"
    )
    remove.add_argument("--purge", action="store_true", help="also delete the repository, settings and user")
    remove.add_argument("--root", type=Path, default=Path("/"), help="the --root given to install-service")
    remove.set_defaults(tool_run=uninstall_service)


def unit_text(program: str) -> str:
    """The shipped unit with ``ExecStart`` pointing at ``program``."""
    template = importlib.resources.files("edge_server.service").joinpath(UNIT_NAME).read_text()
    return template.replace("@EDGE_SERVER@", program)


def this_program() -> str:
    """The ``edge-server`` beside this interpreter (a virtual environment's bin/), else ``python -m``."""
    beside = Path(sys.executable).with_name("edge-server")
    return str(beside) if beside.is_file() else f"{sys.executable} -m edge_server"


def _check_root(root: Path, verb: str) -> bool:
    staged = root.resolve() != Path("/")
    if not staged and os.geteuid() != 0:
        raise InvalidArgument(
            f"{verb} needs root: sudo {shutil.which('edge-server') or 'edge-server'} {verb}"
        )
    return staged


def _run(command: list[str], done: list[str], *, check: bool = True) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise InvalidArgument(f"{' '.join(command)} failed: {result.stderr.strip()}")
    done.append(f"ran {' '.join(command)}")


def _group_exists(name: str) -> bool:
    import grp

    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _ensure_user(done: list[str]) -> None:
    import pwd

    try:
        pwd.getpwnam(SERVICE_USER)
        done.append(f"kept the existing user {SERVICE_USER}")
    except KeyError:
        home = f"/{STATE_DIR}"
        shell = "/usr/sbin/nologin"
        command = [
            "useradd",
            "--system",
            "--user-group",
            "--home-dir",
            home,
            "--no-create-home",
            "--shell",
            shell,
        ]
        _run([*command, SERVICE_USER], done)
    groups = [g for g in DEVICE_GROUPS if _group_exists(g)]
    if groups:
        _run(["usermod", "--append", "--groups", ",".join(groups), SERVICE_USER], done)
    missing = [g for g in DEVICE_GROUPS if g not in groups]
    if missing:
        done.append(f"no group {', '.join(missing)} on this system (not a Jetson?): not added")


def install_service(args: argparse.Namespace) -> int:
    from edge_server.cli import build_parser
    from edge_server.service.settings import SETTINGS_NAME, render_settings

    root: Path = args.root
    staged = _check_root(root, "install-service")
    done: list[str] = []
    if staged:
        done.append(f"staged under {root}: no user created, systemctl not run")
    else:
        _ensure_user(done)
    program = args.exec or this_program()
    if program.startswith(("/home/", "/root/")):
        done.append(f"WARNING: {program} is under a home directory, which the unit hides (ProtectHome=yes)")
    unit = root / UNIT_DIR / UNIT_NAME
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(unit_text(program))
    done.append(f"wrote {unit} (ExecStart={program} serve)")

    repository = root / STATE_DIR / "models"
    repository.mkdir(parents=True, exist_ok=True)
    if not staged:
        for path in (repository.parent, repository):
            shutil.chown(path, SERVICE_USER, SERVICE_USER)
            path.chmod(0o750)
    done.append(f"created {repository} (the model repository)")
    if args.with_examples is True:
        from edge_server.tools.make_examples import make_examples, missing_modules

        if missing_modules():
            done.append(
                f"example models skipped: making them needs {', '.join(missing_modules())} "
                "(pip install 'edge-server[models]', then `edge-server make-examples "
                f"{repository}`)"
            )
        else:
            make_examples(repository)
            done.append(f"made the example models in {repository}")
        if not staged:
            for path in repository.rglob("*"):
                shutil.chown(path, SERVICE_USER, SERVICE_USER)
    elif args.with_examples is not None:
        examples = args.with_examples
        if any(examples.glob("*/config.pbtxt")) and any(examples.glob("*/[0-9]*/model.*")):
            shutil.copytree(
                examples,
                repository,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("make_models.py", "__pycache__"),
            )
            done.append(f"copied the example models from {examples}")
        else:
            done.append(
                f"no models in {examples}: skipped (`--with-examples` alone makes them, or "
                f"`edge-server make-examples {repository}`)"
            )

    settings = root / CONFIG_DIR / SETTINGS_NAME
    if settings.exists():
        done.append(f"kept the existing {settings}")
    else:
        settings.parent.mkdir(parents=True, exist_ok=True)
        serve = build_parser().parse_args(["serve"]).subparser
        chosen = {"model-repository": f"/{STATE_DIR}/models", "model-control-mode": "poll"}
        settings.write_text(render_settings(serve, chosen))
        done.append(f"wrote {settings} (every serve flag listed; model-repository and poll mode set)")
    if not staged and shutil.which("systemctl"):
        _run(["systemctl", "daemon-reload"], done)
    for line in done:
        print(f"  {line}")
    print("next:")
    print("  sudo systemctl enable --now edge-server    # returns once the models are loaded")
    print("  edge-server status                         # as root or a member of group edge-server")
    return 0


def uninstall_service(args: argparse.Namespace) -> int:
    root: Path = args.root
    staged = _check_root(root, "uninstall-service")
    done: list[str] = []
    if not staged and shutil.which("systemctl"):
        _run(["systemctl", "disable", "--now", UNIT_NAME], done, check=False)
    unit = root / UNIT_DIR / UNIT_NAME
    if unit.exists():
        unit.unlink()
        done.append(f"removed {unit}")
    if not staged and shutil.which("systemctl"):
        _run(["systemctl", "daemon-reload"], done)
    for path in (root / CONFIG_DIR, root / STATE_DIR):
        if not path.exists():
            continue
        if args.purge:
            shutil.rmtree(path)
            done.append(f"deleted {path}")
        else:
            done.append(f"kept {path} (--purge deletes it)")
    if args.purge and not staged:
        _run(["userdel", SERVICE_USER], done, check=False)
    for line in done:
        print(f"  {line}")
    return 0
