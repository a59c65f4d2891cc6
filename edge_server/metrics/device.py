"""The device's own figures on a Jetson: GPU and EMC load, temperatures, power rails, power mode.

Triton exports no GPU metrics on Jetson.  These come from :mod:`edge_server.platform.sensors`, which
reads sysfs (no jetson-stats); on a box without those files every reading is absent and this collector
yields nothing.  ``root`` lets the tests read a recorded sysfs tree.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)


class DeviceCollector:
    def __init__(self, root: str | Path = "/") -> None:
        self.root = Path(root)
        try:
            from edge_server.platform import sensors
        except ImportError:  # the platform package is optional for this collector
            sensors = None  # type: ignore[assignment]
        self._sensors = sensors

    def collect(self) -> Iterator[Metric]:
        sensors = self._sensors
        if sensors is None:
            return
        root = self.root
        gpu = sensors.gpu_load(root)
        if gpu is not None:
            yield _one("edge_gpu_utilization_percent", "Integrated GPU busy share", gpu.load_percent)
            if gpu.freq_hz is not None:
                yield _one("edge_gpu_frequency_hz", "Integrated GPU clock", gpu.freq_hz)
        emc = sensors.emc_load(root)
        if emc is not None and emc.load_percent is not None:
            yield _one("edge_emc_utilization_percent", "Memory controller (EMC) busy share", emc.load_percent)
        zones = sensors.thermal_zones(root)
        if zones:
            temps = Metric("edge_temperature_celsius", "Thermal zone temperatures", "gauge")
            for zone in zones:
                temps.add_sample(temps.name, {"zone": zone.name}, zone.celsius)
            yield temps
        rails = sensors.power_rails(root)
        if rails:
            power = Metric("edge_power_rail_milliwatts", "Power drawn per INA3221 rail", "gauge")
            for rail in rails:
                if rail.power_mw is not None:
                    power.add_sample(power.name, {"rail": rail.name}, rail.power_mw)
            yield power
        mode = sensors.power_mode(root)
        if mode is not None:
            info = Metric("edge_power_mode", "The nvpmodel power mode in force (1 for it)", "gauge")
            info.add_sample(info.name, {"id": str(mode.id), "name": mode.name}, 1)
            yield info


def _one(name: str, documentation: str, value: float) -> Metric:
    metric = Metric(name, documentation, "gauge")
    metric.add_sample(name, {}, value)
    return metric
