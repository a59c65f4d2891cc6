"""The unit file ``install-service`` writes: the shipped template fitted to the machine it lands on.

Two lines depend on the machine.  ``SupplementaryGroups=`` may name only groups that exist: systemd
refuses to start a unit naming a missing group (``status=216/GROUP``, restarted forever), and
``render`` is missing on minimal images, in containers and on older L4T.  ``DeviceAllow=`` lists the
GPU and DLA device drivers present, because the unit closes the device policy (only the pseudo devices
such as ``/dev/null`` are open otherwise): a driver with a major number of its own is allowed as a
whole (``char-<name>`` from ``/proc/devices``, so nodes it adds later are covered), a node of a shared
major (``misc``, e.g. ``/dev/nvmap``) by its path only.
"""

from __future__ import annotations

import glob
import importlib.resources
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

UNIT_NAME = "edge-server.service"
DEVICE_GROUPS = ("video", "render")
OPERATOR_GROUP = "edge-server-operators"
# Accelerator nodes the daemon may open: a Jetson's GPU (nvgpu, nvhost channels), DLA cores, nvmap and
# host1x/NvSci synchronisation; a desktop NVIDIA GPU (onnxruntime-gpu) and DRI render nodes.
DEVICE_NODES = (
    "/dev/nvhost-*",
    "/dev/nvmap",
    "/dev/nvgpu/*/*",
    "/dev/nvidia*",
    "/dev/nvidia-caps/*",
    "/dev/dri/renderD*",
    "/dev/nvsciipc",
    "/dev/host1x-fence",
    "/dev/nvdla*",
)
# Majors shared with unrelated devices: a node of one of these is allowed by its path, never the group.
SHARED_MAJORS = frozenset({"misc", "mem", "tty", "pts", "ptm", "input", "/dev/tty", "/dev/console"})
_DEVICE_LINE = "@DEVICE_ALLOW@"
_GROUPS_LINE = "SupplementaryGroups=" + " ".join(DEVICE_GROUPS)


def group_names(group_file: Path | None) -> set[str] | None:
    """Groups of this system (``group_file`` None) or of an image's ``etc/group``; None if unreadable."""
    if group_file is None:
        import grp

        return {entry.gr_name for entry in grp.getgrall()}
    try:
        text = group_file.read_text()
    except OSError:
        return None
    return {line.split(":", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def char_majors(proc_devices: str) -> dict[int, str]:
    """The "Character devices" section of ``/proc/devices``: major number -> driver name."""
    majors: dict[int, str] = {}
    in_char = False
    for line in proc_devices.splitlines():
        if line.strip().endswith(":"):
            in_char = line.strip() == "Character devices:"
            continue
        fields = line.split(None, 1)
        if in_char and len(fields) == 2 and fields[0].isdigit():
            majors.setdefault(int(fields[0]), fields[1].strip())
    return majors


def present_nodes(patterns: Iterable[str] = DEVICE_NODES) -> list[tuple[str, int]]:
    """(path, major) of every character device matching ``patterns`` on this machine."""
    nodes = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                info = os.stat(path)
            except OSError:
                continue
            if stat.S_ISCHR(info.st_mode):
                nodes.append((path, os.major(info.st_rdev)))
    return nodes


def device_rules(nodes: Iterable[tuple[str, int]], majors: dict[int, str]) -> list[str]:
    """``DeviceAllow=`` values (``char-nvhost rw``, ``/dev/nvmap rw``) for the nodes found."""
    rules: list[str] = []
    for path, major in nodes:
        name = majors.get(major)
        rule = f"{path} rw" if name is None or name in SHARED_MAJORS or " " in name else f"char-{name} rw"
        if rule not in rules:
            rules.append(rule)
    return rules


def render_unit(program: str, *, groups: Sequence[str] | None, devices: Sequence[str] | None) -> str:
    """The shipped unit for this machine.

    ``groups``: the device groups that exist (None: unknown, keep the template's); ``devices``: the
    ``DeviceAllow=`` values (None: unknown, e.g. staged for an image on another machine: the device
    policy stays open, ``DevicePolicy=auto``).
    """
    text = importlib.resources.files("edge_server.service").joinpath(UNIT_NAME).read_text()
    text = text.replace("@EDGE_SERVER@", program)
    if groups is not None:
        if groups:
            line = "SupplementaryGroups=" + " ".join(groups)
        else:
            line = f"# SupplementaryGroups= none: no group {' or '.join(DEVICE_GROUPS)} on this system"
        text = text.replace(_GROUPS_LINE, line)
    if devices is None:
        text = text.replace(
            "DevicePolicy=closed\n" + _DEVICE_LINE,
            "# Staged for another machine: its devices are unknown here, so the device policy stays open\n"
            "# (install-service on the device itself writes the list).\nDevicePolicy=auto",
        )
    elif devices:
        text = text.replace(_DEVICE_LINE, "\n".join(f"DeviceAllow={rule}" for rule in devices))
    else:
        text = text.replace(_DEVICE_LINE, "# DeviceAllow= none: no GPU or DLA device node on this system")
    return text


def this_machine_devices() -> list[str]:
    try:
        majors = char_majors(Path("/proc/devices").read_text())
    except OSError:
        majors = {}
    return device_rules(present_nodes(), majors)
