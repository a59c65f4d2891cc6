"""``edge-server install-service`` / ``uninstall-service``: the systemd appliance in one command.

Install creates the ``edge-server`` system user (in groups ``video`` and ``render`` where they exist,
which own the GPU and DLA device nodes on a Jetson) and the ``edge-server-operators`` group (who may
load and unload models), puts the unit in ``/etc/systemd/system`` fitted to this machine (see
:mod:`edge_server.tools.service_unit`), creates the repository directory (seeded with the example models
on request) and writes ``/etc/edge-server/edge-server.toml`` unless one exists.  It prints each thing it
did and the next command.  ``--root DIR`` stages the files under DIR without touching users or systemd
(for images, and for the tests).  ``uninstall-service --purge`` removes the user and both groups and
says what it could not remove.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from edge_server.errors import InvalidArgument
from edge_server.tools.service_unit import (
    DEVICE_GROUPS,
    OPERATOR_GROUP,
    UNIT_NAME,
    group_names,
    render_unit,
    this_machine_devices,
)

SERVICE_USER = "edge-server"
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


def _run(command: list[str], done: list[str], *, check: bool = True) -> bool:
    """Run ``command``; with ``check`` a failure raises, without it the failure is reported in ``done``."""
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:  # the program is missing
        result = subprocess.CompletedProcess(command, 127, "", str(exc))
    said = result.stderr.strip()
    if result.returncode != 0:
        if check:
            raise InvalidArgument(f"{' '.join(command)} failed: {said}")
        done.append(f"ERROR: {' '.join(command)} failed (status {result.returncode}): {said}")
        return False
    done.append(f"ran {' '.join(command)}" + (f" ({said})" if said else ""))
    return True


def _systemd_running() -> bool:
    """sd_booted(): in a chroot or an image build there is no systemd to reload."""
    return shutil.which("systemctl") is not None and os.path.isdir("/run/systemd/system")


def _ensure_user(done: list[str]) -> list[str]:
    """The service user and the operator group; returns the device groups the user is in."""
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
    present = group_names(None) or set()
    groups = [g for g in DEVICE_GROUPS if g in present]
    if groups:
        _run(["usermod", "--append", "--groups", ",".join(groups), SERVICE_USER], done)
    missing = [g for g in DEVICE_GROUPS if g not in groups]
    if missing:
        done.append(
            f"no group {', '.join(missing)} on this system (not a Jetson?): not added, and left out of "
            "the unit's SupplementaryGroups="
        )
    if OPERATOR_GROUP in present:
        done.append(f"kept the existing group {OPERATOR_GROUP}")
    else:
        _run(["groupadd", "--system", OPERATOR_GROUP], done)
    return groups


def install_service(args: argparse.Namespace) -> int:
    from edge_server.cli import build_parser
    from edge_server.service.settings import SETTINGS_NAME, render_settings

    root: Path = args.root
    staged = _check_root(root, "install-service")
    done: list[str] = []
    groups: list[str] | None
    devices: list[str] | None
    if staged:
        done.append(
            f"staged under {root}: no user or group created ({SERVICE_USER}, {OPERATOR_GROUP}), "
            "systemctl not run"
        )
        image_groups = group_names(root / "etc" / "group")
        groups = None if image_groups is None else [g for g in DEVICE_GROUPS if g in image_groups]
        devices = None
    else:
        groups = _ensure_user(done)
        devices = this_machine_devices()
    program = args.exec or this_program()
    if program.startswith(("/home/", "/root/")):
        done.append(f"WARNING: {program} is under a home directory, which the unit hides (ProtectHome=yes)")
    unit = root / UNIT_DIR / UNIT_NAME
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(render_unit(program, groups=groups, devices=devices))
    done.append(f"wrote {unit} (ExecStart={program} serve --operator-group {OPERATOR_GROUP})")
    if devices is not None:
        listed = ", ".join(rule.split()[0] for rule in devices) or "none (no GPU or DLA node here)"
        done.append(f"devices the unit allows besides /dev/null and the like: {listed}")

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
        # A list: more repositories may be added beside the first (model names unique across them).
        chosen = {"model-repository": [f"/{STATE_DIR}/models"], "model-control-mode": "poll"}
        settings.write_text(render_settings(serve, chosen))
        done.append(f"wrote {settings} (every serve flag listed; model-repository and poll mode set)")
    if not staged and _systemd_running():
        _run(["systemctl", "daemon-reload"], done)
    for line in done:
        print(f"  {line}")
    print("who may do what:")
    print(f"  group {SERVICE_USER}: reach the socket (status, models, infer); add client users to it")
    print(f"  group {OPERATOR_GROUP}: also load and unload models; add the people who deploy models")
    print("next:")
    print("  sudo systemctl enable --now edge-server    # returns once the models are loaded")
    print(f"  sudo usermod --append --groups {SERVICE_USER} USER    # then log in again; edge-server status")
    return 0


def uninstall_service(args: argparse.Namespace) -> int:
    root: Path = args.root
    staged = _check_root(root, "uninstall-service")
    done: list[str] = []
    if not staged and _systemd_running():
        _run(["systemctl", "disable", "--now", UNIT_NAME], done, check=False)
    unit = root / UNIT_DIR / UNIT_NAME
    if unit.exists():
        unit.unlink()
        done.append(f"removed {unit}")
    if not staged and _systemd_running():
        _run(["systemctl", "daemon-reload"], done)
    for path in (root / CONFIG_DIR, root / STATE_DIR):
        if not path.exists():
            continue
        if args.purge:
            shutil.rmtree(path)
            done.append(f"deleted {path}")
        else:
            done.append(f"kept {path} (--purge deletes it)")
    ok = True
    if args.purge and not staged:
        ok = _remove_accounts(done)
    for line in done:
        print(f"  {line}")
    return 0 if ok else 1


def _remove_accounts(done: list[str]) -> bool:
    """The user, its group and the operator group, whoever else is in them; False if one stayed."""
    import pwd

    ok = True
    try:
        pwd.getpwnam(SERVICE_USER)
    except KeyError:
        done.append(f"no user {SERVICE_USER}")
    else:
        ok = _run(["userdel", SERVICE_USER], done, check=False)
    # userdel leaves the user's group when other users are in it ("group edge-server not removed
    # because it has other members"), and exits 0: remove it here, members or not.
    for group in (SERVICE_USER, OPERATOR_GROUP):
        if group in (group_names(None) or set()):
            ok = _run(["groupdel", group], done, check=False) and ok
        else:
            done.append(f"no group {group}")
    return ok
