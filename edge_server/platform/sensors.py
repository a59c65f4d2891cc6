"""Live device readings from sysfs: GPU, EMC (memory controller), temperatures, rails, power mode.

Every reader takes the root directory of the tree it reads (``/`` on a device, a recorded tree in the
tests) and returns None or an empty list when the file is absent or unreadable: a reading that is not
there is reported as absent, never as zero.  Standard library only.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Where the GPU's load file (per mille of busy time) sits: JetPack 6 moved it under bus@0.
_GPU_LOAD_GLOBS = (
    "sys/devices/platform/bus@0/*.gpu/load",
    "sys/devices/platform/*.gpu/load",
    "sys/devices/platform/gpu.0/load",
    "sys/devices/gpu.0/load",
)
# devfreq names the GPU by its address and chip: 17000000.ga10b (Orin), 17000000.gv11b (Xavier).
_GPU_DEVFREQ_GLOBS = ("sys/class/devfreq/*.ga10b", "sys/class/devfreq/*.gv11b", "sys/class/devfreq/*.gpu")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _first(root: Path, patterns: tuple[str, ...]) -> Path | None:
    for pattern in patterns:
        for path in sorted(root.glob(pattern)):
            return path
    return None


@dataclass(frozen=True)
class GpuLoad:
    load_percent: float
    freq_hz: int | None
    max_freq_hz: int | None


def gpu_load(root: Path) -> GpuLoad | None:
    """The integrated GPU's busy share (the load file is in tenths of a percent) and its clock."""
    path = _first(root, _GPU_LOAD_GLOBS)
    value = _read_int(path) if path else None
    if value is None:
        return None
    devfreq = _first(root, _GPU_DEVFREQ_GLOBS)
    freq = _read_int(devfreq / "cur_freq") if devfreq else None
    max_freq = _read_int(devfreq / "max_freq") if devfreq else None
    return GpuLoad(load_percent=value / 10.0, freq_hz=freq, max_freq_hz=max_freq)


@dataclass(frozen=True)
class EmcLoad:
    load_percent: float | None  # None where the activity monitor is not readable
    freq_hz: int | None


def emc_load(root: Path) -> EmcLoad | None:
    """Memory-controller utilisation: the activity monitor's average (kHz of busy cycles) over the clock.

    The clock rate is in debugfs (root only on a device); without it there is no load figure.
    """
    activity = _read_int(root / "sys/kernel/actmon_avg_activity/mc_all")
    rate = _read_int(root / "sys/kernel/debug/bpmp/debug/clk/emc/rate")
    if activity is None and rate is None:
        return None
    load = None
    if activity is not None and rate:
        load = min(100.0, 100.0 * activity / (rate / 1000.0))
    return EmcLoad(load_percent=load, freq_hz=rate)


@dataclass(frozen=True)
class ThermalZone:
    name: str  # the zone's type: "gpu-thermal", "CPU-therm", ...
    celsius: float


# Zones of absent hardware (an Orin's cv* zones with no DLA/PVA powered) report -256 degC.
_INVALID_MILLIDEG = -40000


def thermal_zones(root: Path) -> list[ThermalZone]:
    """Every thermal zone with a valid reading, in zone order."""
    zones = []
    base = root / "sys/class/thermal"
    paths = sorted(base.glob("thermal_zone*"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    for path in paths:
        try:
            name = (path / "type").read_text().strip()
        except OSError:
            continue
        milli = _read_int(path / "temp")
        if milli is None or milli <= _INVALID_MILLIDEG:
            continue
        zones.append(ThermalZone(name=name, celsius=milli / 1000.0))
    return zones


@dataclass(frozen=True)
class PowerRail:
    name: str  # the INA3221 channel label: "VDD_GPU_SOC", "VDD_IN", ...
    voltage_mv: int | None
    current_ma: int | None

    @property
    def power_mw(self) -> float | None:
        if self.voltage_mv is None or self.current_ma is None:
            return None
        return self.voltage_mv * self.current_ma / 1000.0


def power_rails(root: Path) -> list[PowerRail]:
    """INA3221 channels: ``in<N>_label`` names a rail, ``in<N>_input`` (mV) and ``curr<N>_input`` (mA).

    Unconnected channels are labelled "NC"; the "sum of shunt voltages" channel is not a rail.
    """
    rails = []
    for hwmon in sorted((root / "sys/bus/i2c/drivers/ina3221").glob("*/hwmon/hwmon*")):
        for label_path in sorted(hwmon.glob("in*_label")):
            channel = label_path.name[2:].split("_", 1)[0]
            try:
                label = label_path.read_text().strip()
            except OSError:
                continue
            if not label or label == "NC" or label.lower().startswith("sum of"):
                continue
            rails.append(
                PowerRail(
                    name=label,
                    voltage_mv=_read_int(hwmon / f"in{channel}_input"),
                    current_ma=_read_int(hwmon / f"curr{channel}_input"),
                )
            )
    return rails


@dataclass(frozen=True)
class PowerMode:
    id: int
    name: str  # "MAXN", "15W", ... ("" when nvpmodel.conf does not name it)
    source: str  # "nvpmodel -q", "status file" or "default in nvpmodel.conf"


_MODEL_LINE = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)")
_DEFAULT_LINE = re.compile(r"<\s*PM_CONFIG\s+DEFAULT=(\d+)")
_STATUS = re.compile(r"pmode:(\d+)")


def power_modes(conf_text: str) -> tuple[dict[int, str], int | None]:
    """Mode id to name from /etc/nvpmodel.conf, and its default mode."""
    modes = {int(m.group(1)): m.group(2) for m in _MODEL_LINE.finditer(conf_text)}
    default = _DEFAULT_LINE.search(conf_text)
    return modes, int(default.group(1)) if default else None


def parse_nvpmodel_query(output: str) -> tuple[str, int | None]:
    """``nvpmodel -q`` prints "NV Power Mode: MAXN" and the mode id on the next line."""
    name, mode_id = "", None
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("NV Power Mode:"):
            name = line.split(":", 1)[1].strip()
        elif line.isdigit():
            mode_id = int(line)
    return name, mode_id


def power_mode(root: Path, *, run_nvpmodel: bool = False) -> PowerMode | None:
    """The current nvpmodel mode.

    Order: ``nvpmodel -q`` when asked for and installed (only on the real root), then nvpmodel's status
    file (``pmode:0002 fmode:quiet``), then the default that nvpmodel.conf declares (what a fresh boot
    applies).  None where there is no nvpmodel.conf: not a Jetson, or nvpmodel not installed.
    """
    conf = root / "etc/nvpmodel.conf"
    try:
        conf_text = conf.read_text()
    except OSError:
        return None
    modes, default = power_modes(conf_text)
    if run_nvpmodel and root == Path("/") and shutil.which("nvpmodel"):
        try:
            done = subprocess.run(["nvpmodel", "-q"], capture_output=True, text=True, timeout=5, check=False)
        except (OSError, subprocess.SubprocessError):
            done = None
        if done is not None and done.returncode == 0:
            name, mode_id = parse_nvpmodel_query(done.stdout)
            if mode_id is not None:
                return PowerMode(mode_id, name or modes.get(mode_id, ""), "nvpmodel -q")
    try:
        status = (root / "var/lib/nvpmodel/status").read_text()
    except OSError:
        status = ""
    match = _STATUS.search(status)
    if match:
        mode_id = int(match.group(1))
        return PowerMode(mode_id, modes.get(mode_id, ""), "status file")
    if default is not None:
        return PowerMode(default, modes.get(default, ""), "default in nvpmodel.conf")
    return None
