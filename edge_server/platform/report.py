"""One summary of the platform: what `doctor` prints, what metrics and the TensorRT backend consult."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_server.platform import jetson, sensors

NOT_A_JETSON = "not a Jetson (no NVIDIA Tegra SoC in the device tree)"


@dataclass(frozen=True)
class PlatformReport:
    """What this machine is and what it reads now.  Absent readings are None or empty, never zero."""

    is_jetson: bool
    summary: str  # one line: "Jetson AGX Orin 64GB, JetPack 6.0 (L4T 36.3.0)" or NOT_A_JETSON
    model: str = ""
    module: str = ""
    part_number: str = ""
    soc: str = ""
    l4t: str = ""
    l4t_source: str = ""
    jetpack: str = ""
    dla_cores: int = 0
    dla_cores_source: str = ""  # "TensorRT", "devices", "module table" or "" (not a Jetson)
    dla_generation: str = ""  # "v2" (Orin), "v1" (Xavier), ""
    power_mode: sensors.PowerMode | None = None
    gpu: sensors.GpuLoad | None = None
    emc: sensors.EmcLoad | None = None
    thermal: list[sensors.ThermalZone] = field(default_factory=list)
    rails: list[sensors.PowerRail] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def platform_report(
    root: str | Path = "/", *, runtime_dla_cores: int | None = None, run_nvpmodel: bool = False
) -> PlatformReport:
    """Detect the platform under ``root``.

    ``runtime_dla_cores`` is TensorRT's ``Runtime.num_DLA_cores`` when the caller has TensorRT: it is the
    authority (it counts what the driver can use); without it the DLA devices the kernel created count,
    then the module table.  This module never imports TensorRT itself.
    """
    base = Path(root)
    identity = jetson.identify(base)
    if identity is None:
        return PlatformReport(is_jetson=False, summary=NOT_A_JETSON)
    if runtime_dla_cores is not None:
        dla, dla_source = runtime_dla_cores, "TensorRT"
    else:
        from_devices = jetson.dla_cores_from_devices(base)
        if from_devices is not None:
            dla, dla_source = from_devices, "devices"
        elif identity.module is not None:
            dla, dla_source = identity.module.dla_cores, "module table"
        else:
            dla, dla_source = 0, "unknown"
    module_name = identity.module.name if identity.module else identity.model or "unknown Jetson"
    release = (
        f"JetPack {identity.jetpack or 'unknown'} (L4T {identity.l4t})" if identity.l4t else "L4T unknown"
    )
    return PlatformReport(
        is_jetson=True,
        summary=f"{module_name}, {release}",
        model=identity.model,
        module=module_name,
        part_number=identity.part_number,
        soc=identity.soc,
        l4t=identity.l4t,
        l4t_source=identity.l4t_source,
        jetpack=identity.jetpack,
        dla_cores=dla,
        dla_cores_source=dla_source,
        dla_generation=jetson.dla_generation(identity) if dla else "",
        power_mode=sensors.power_mode(base, run_nvpmodel=run_nvpmodel),
        gpu=sensors.gpu_load(base),
        emc=sensors.emc_load(base),
        thermal=sensors.thermal_zones(base),
        rails=sensors.power_rails(base),
    )
