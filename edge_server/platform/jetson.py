"""Which Jetson this is: module, L4T release, JetPack version, DLA cores.

Everything is read from files under a root directory (``/`` on a device, a recorded tree in tests):
``/proc/device-tree/model`` and ``compatible``, ``/etc/nv_tegra_release``, dpkg's status database for
``nvidia-l4t-core``, and the DLA device nodes.  Standard library only: this module must work where
TensorRT is not installed, and on any Linux box, where it says "not a Jetson".
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModuleInfo:
    """What a module part number tells: its marketing name, SoC, DLA generation and DLA core count."""

    name: str
    soc: str  # "tegra234" (Orin), "tegra194" (Xavier), ...
    dla_cores: int
    dla_generation: str  # "v2" (Orin), "v1" (Xavier), "" (no DLA)


# Module part numbers (the second half of "nvidia,p3737-0000+p3701-0005" in the device tree's compatible
# list) to what the module is.  DLA counts are NVIDIA's module data sheets; TensorRT's
# Runtime.num_DLA_cores is preferred where it is available (see platform_report).
MODULES: dict[str, ModuleInfo] = {
    "p3701-0000": ModuleInfo("Jetson AGX Orin 32GB", "tegra234", 2, "v2"),
    "p3701-0004": ModuleInfo("Jetson AGX Orin 32GB", "tegra234", 2, "v2"),
    "p3701-0005": ModuleInfo("Jetson AGX Orin 64GB", "tegra234", 2, "v2"),
    "p3701-0008": ModuleInfo("Jetson AGX Orin Industrial", "tegra234", 2, "v2"),
    "p3767-0000": ModuleInfo("Jetson Orin NX 16GB", "tegra234", 2, "v2"),
    "p3767-0001": ModuleInfo("Jetson Orin NX 8GB", "tegra234", 1, "v2"),
    "p3767-0003": ModuleInfo("Jetson Orin Nano 8GB", "tegra234", 0, ""),
    "p3767-0004": ModuleInfo("Jetson Orin Nano 4GB", "tegra234", 0, ""),
    "p3767-0005": ModuleInfo("Jetson Orin Nano 8GB (developer kit)", "tegra234", 0, ""),
    "p3668-0000": ModuleInfo("Jetson Xavier NX (developer kit)", "tegra194", 2, "v1"),
    "p3668-0001": ModuleInfo("Jetson Xavier NX", "tegra194", 2, "v1"),
    "p3668-0003": ModuleInfo("Jetson Xavier NX 16GB", "tegra194", 2, "v1"),
    "p2888-0001": ModuleInfo("Jetson AGX Xavier 16GB", "tegra194", 2, "v1"),
    "p2888-0004": ModuleInfo("Jetson AGX Xavier 32GB", "tegra194", 2, "v1"),
    "p2888-0006": ModuleInfo("Jetson AGX Xavier 8GB", "tegra194", 2, "v1"),
    "p2888-0008": ModuleInfo("Jetson AGX Xavier Industrial", "tegra194", 2, "v1"),
    "p3448-0000": ModuleInfo("Jetson Nano (developer kit)", "tegra210", 0, ""),
    "p3448-0002": ModuleInfo("Jetson Nano", "tegra210", 0, ""),
    "p3310-1000": ModuleInfo("Jetson TX2", "tegra186", 0, ""),
}

# When the part number is unknown, the SoC still says the DLA generation.
_SOC_DLA_GENERATION = {"tegra234": "v2", "tegra194": "v1"}

# L4T release (major.minor[.patch]) to JetPack, from NVIDIA's JetPack archive.  Longest prefix wins.
JETPACK_BY_L4T: dict[str, str] = {
    "36.4.4": "6.2.1",
    "36.4.3": "6.2",
    "36.4": "6.1",
    "36.3": "6.0",
    "36.2": "6.0 DP",
    "35.6": "5.1.4",
    "35.5": "5.1.3",
    "35.4": "5.1.2",
    "35.3": "5.1.1",
    "35.2": "5.1",
    "35.1": "5.0.2",
    "32.7": "4.6.x",
    "32.6": "4.6",
}


@dataclass(frozen=True)
class JetsonIdentity:
    """The module as the device tree names it, and the software release it runs."""

    model: str  # /proc/device-tree/model, e.g. "NVIDIA Jetson AGX Orin Developer Kit"
    compatible: tuple[str, ...]
    part_number: str  # "p3701-0005", "" when the compatible list names none
    module: ModuleInfo | None
    soc: str
    l4t: str  # "36.3.0", "" when unknown
    jetpack: str  # "6.0", "" when unknown
    l4t_source: str  # which file said it: "nvidia-l4t-core" or "nv_tegra_release"


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", "replace")
    except OSError:
        return None


def read_compatible(root: Path) -> tuple[str, ...]:
    """The device tree's compatible strings (NUL-separated in the file), most specific first."""
    raw = _read_text(root / "proc/device-tree/compatible")
    return tuple(part for part in (raw or "").split("\0") if part)


def read_model(root: Path) -> str:
    """The device tree's model string without its NUL terminator ('' where there is none)."""
    return (_read_text(root / "proc/device-tree/model") or "").strip("\0").strip()


def part_number(compatible: tuple[str, ...]) -> str:
    """The module part number (``pNNNN-NNNN``) from compatible strings like ``nvidia,p3737-0000+p3701-0005``.

    The carrier board comes first in the ``+`` pair, the module second; a plain ``nvidia,p3701-0005``
    entry names the module alone.
    """
    for entry in compatible:
        _, _, value = entry.partition(",")
        candidates = value.split("+")
        for candidate in reversed(candidates):
            if re.fullmatch(r"p\d{4}-\d{4}", candidate) and candidate in MODULES:
                return candidate
    for entry in compatible:  # an unknown module still has a part number worth showing
        match = re.search(r"\+?(p\d{4}-\d{4})$", entry)
        if match:
            return match.group(1)
    return ""


def soc_of(compatible: tuple[str, ...]) -> str:
    for entry in compatible:
        match = re.fullmatch(r"nvidia,(tegra\d+)", entry)
        if match:
            return match.group(1)
    return ""


_RELEASE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)")


def l4t_from_release_file(root: Path) -> str:
    """``# R36 (release), REVISION: 3.0, ...`` in /etc/nv_tegra_release gives "36.3.0"."""
    text = _read_text(root / "etc/nv_tegra_release") or ""
    match = _RELEASE.search(text)
    return f"{match.group(1)}.{match.group(2)}" if match else ""


def l4t_from_dpkg(root: Path) -> str:
    """The version of the installed ``nvidia-l4t-core`` package ("36.3.0-20240506102626" gives "36.3.0").

    Read from dpkg's status database rather than by running dpkg, so that it works on a recorded tree and
    costs no process.  On JetPack 6 this is the reliable source: nv_tegra_release is not always updated by
    OTA package upgrades.
    """
    text = _read_text(root / "var/lib/dpkg/status") or ""
    for stanza in text.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" ")
        )
        if fields.get("Package") == "nvidia-l4t-core" and "installed" in fields.get("Status", ""):
            match = re.match(r"(\d+\.\d+(?:\.\d+)?)", fields.get("Version", ""))
            if match:
                return match.group(1)
    return ""


def jetpack_for(l4t: str) -> str:
    """The JetPack release that ships L4T ``l4t`` ('' when not in the table)."""
    best = ""
    for prefix in JETPACK_BY_L4T:
        if (l4t == prefix or l4t.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return JETPACK_BY_L4T.get(best, "")


def identify(root: Path) -> JetsonIdentity | None:
    """The Jetson under ``root``, or None when this is not a Jetson (no NVIDIA Tegra in the device tree)."""
    compatible = read_compatible(root)
    model = read_model(root)
    soc = soc_of(compatible)
    if not soc and "jetson" not in model.lower():
        return None
    part = part_number(compatible)
    module = MODULES.get(part)
    l4t, source = l4t_from_dpkg(root), "nvidia-l4t-core"
    if not l4t:
        l4t, source = l4t_from_release_file(root), "nv_tegra_release"
    if not l4t:
        source = ""
    return JetsonIdentity(
        model=model,
        compatible=compatible,
        part_number=part,
        module=module,
        soc=soc or (module.soc if module else ""),
        l4t=l4t,
        jetpack=jetpack_for(l4t),
        l4t_source=source,
    )


def dla_generation(identity: JetsonIdentity | None) -> str:
    """The DLA generation: "v2" (Orin), "v1" (Xavier), "" where the module has none or is unknown."""
    if identity is None:
        return ""
    if identity.module is not None:
        return identity.module.dla_generation
    return _SOC_DLA_GENERATION.get(identity.soc, "")


def dla_cores_from_devices(root: Path) -> int | None:
    """DLA cores the kernel created devices for, or from enabled device-tree nodes; None when neither says.

    The kernel creates ``<addr>.nvdla<N>`` platform devices only for DLA nodes whose device-tree status is
    "okay"; an Orin Nano carries the nodes but disabled.  Depth is bounded: the nodes sit under host1x.
    """
    found: set[str] = set()
    for pattern in ("*.nvdla[0-9]", "*/*.nvdla[0-9]", "*/*/*.nvdla[0-9]"):
        found.update(path.name for path in (root / "sys/devices/platform").glob(pattern))
    if found:
        return len(found)
    tree = root / "proc/device-tree"
    nodes = [p for pattern in ("*/nvdla*", "*/*/nvdla*") for p in tree.glob(pattern) if p.is_dir()]
    if not nodes:
        return None
    return sum(1 for node in nodes if (_read_text(node / "status") or "okay").strip("\0").strip() == "okay")
