"""Platform detection on recorded Jetson trees (labelled test data, tests/data/jetson_sysfs) and on this
machine, which is not a Jetson."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from edge_server.platform import NOT_A_JETSON, jetson, platform_report, sensors

DATA = Path(__file__).parent / "data" / "jetson_sysfs"


def test_agx_orin() -> None:
    report = platform_report(DATA / "agx_orin")
    assert report.is_jetson
    assert report.module == "Jetson AGX Orin 64GB"
    assert report.part_number == "p3701-0005"
    assert report.soc == "tegra234"
    assert (report.l4t, report.jetpack, report.l4t_source) == ("36.3.0", "6.0", "nvidia-l4t-core")
    assert (report.dla_cores, report.dla_cores_source, report.dla_generation) == (2, "devices", "v2")
    assert report.power_mode == sensors.PowerMode(0, "MAXN", "status file")
    assert report.gpu == sensors.GpuLoad(34.7, 1300500000, 1300500000)
    assert report.emc is not None and report.emc.load_percent == pytest.approx(20.0)
    names = [z.name for z in report.thermal]
    assert "cv0-thermal" not in names  # -256 degC: hardware not powered
    assert names[0] == "cpu-thermal" and report.thermal[0].celsius == pytest.approx(45.531)
    rails = {r.name: r for r in report.rails}
    assert set(rails) == {"VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"}
    assert rails["VDD_GPU_SOC"].power_mw == pytest.approx(4984 * 1800 / 1000)
    assert report.summary == "Jetson AGX Orin 64GB, JetPack 6.0 (L4T 36.3.0)"


def test_orin_nano_has_disabled_dla_and_default_power_mode() -> None:
    report = platform_report(DATA / "orin_nano")
    assert report.module == "Jetson Orin Nano 8GB (developer kit)"
    assert (report.l4t, report.jetpack, report.l4t_source) == ("36.4.0", "6.1", "nv_tegra_release")
    assert (report.dla_cores, report.dla_cores_source, report.dla_generation) == (0, "devices", "")
    assert report.power_mode == sensors.PowerMode(0, "15W", "default in nvpmodel.conf")
    assert report.emc is None
    assert report.gpu is not None and report.gpu.load_percent == 0.0
    assert [r.name for r in report.rails] == ["VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC"]


def test_xavier_nx() -> None:
    report = platform_report(DATA / "xavier_nx")
    assert report.module == "Jetson Xavier NX"
    assert (report.l4t, report.jetpack) == ("35.4.1", "5.1.2")
    assert (report.dla_cores, report.dla_generation) == (2, "v1")
    assert report.power_mode == sensors.PowerMode(8, "MODE_20W_6CORE", "status file")
    assert report.gpu is not None and report.gpu.load_percent == 52.0 and report.gpu.freq_hz == 1109250000
    assert {z.name for z in report.thermal} >= {"CPU-therm", "GPU-therm"}


def test_tensorrt_dla_count_wins(tmp_path: Path) -> None:
    report = platform_report(DATA / "agx_orin", runtime_dla_cores=1)
    assert (report.dla_cores, report.dla_cores_source) == (1, "TensorRT")


def test_module_table_when_no_dla_nodes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(DATA / "agx_orin", root)
    shutil.rmtree(root / "sys/devices/platform/bus@0/13e00000.host1x")
    report = platform_report(root)
    assert (report.dla_cores, report.dla_cores_source) == (2, "module table")


def test_unknown_part_still_a_jetson(tmp_path: Path) -> None:
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/compatible").write_bytes(b"nvidia,p9999-0000\0nvidia,tegra234\0")
    report = platform_report(tmp_path)
    assert report.is_jetson and report.part_number == "p9999-0000" and report.soc == "tegra234"
    assert report.dla_cores_source == "unknown" and report.summary.endswith("L4T unknown")


def test_empty_tree_is_not_a_jetson(tmp_path: Path) -> None:
    report = platform_report(tmp_path)
    assert not report.is_jetson and report.summary == NOT_A_JETSON
    assert report.to_dict()["dla_cores"] == 0


def test_this_machine_is_not_a_jetson() -> None:
    if jetson.identify(Path("/")) is not None:
        pytest.skip("this machine is a Jetson")
    report = platform_report()
    assert not report.is_jetson and report.summary == NOT_A_JETSON


@pytest.mark.parametrize(
    ("l4t", "jetpack"),
    [("36.4.3", "6.2"), ("36.4.0", "6.1"), ("36.4.4", "6.2.1"), ("35.5.0", "5.1.3"), ("34.0", "")],
)
def test_jetpack_mapping(l4t: str, jetpack: str) -> None:
    assert jetson.jetpack_for(l4t) == jetpack


def test_nvpmodel_query_output() -> None:
    assert sensors.parse_nvpmodel_query("NV Power Mode: MODE_30W\n2\n") == ("MODE_30W", 2)
    assert sensors.parse_nvpmodel_query("garbage") == ("", None)


def test_unreadable_sensor_values_are_absent(tmp_path: Path) -> None:
    zone = tmp_path / "sys/class/thermal/thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("gpu-thermal\n")
    (zone / "temp").write_text("not a number\n")
    assert sensors.thermal_zones(tmp_path) == []
    assert sensors.gpu_load(tmp_path) is None and sensors.power_rails(tmp_path) == []


@pytest.mark.jetson
def test_real_jetson() -> None:
    if jetson.identify(Path("/")) is None:
        pytest.skip("not a Jetson: needs /proc/device-tree naming an NVIDIA Tegra SoC")
    report = platform_report(run_nvpmodel=True)
    assert report.is_jetson and report.module and report.thermal
