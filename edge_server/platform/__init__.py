"""The platform edge-server runs on: Jetson module, L4T/JetPack, DLA cores, power mode, sensors.

Standard library only, and every reader takes a root directory, so the same code reads a device's ``/``
and the recorded sysfs trees in ``tests/data/jetson_sysfs``.  On any other Linux box it reports
"not a Jetson".
"""

from __future__ import annotations

from edge_server.platform.report import NOT_A_JETSON, PlatformReport, platform_report

__all__ = ["NOT_A_JETSON", "PlatformReport", "platform_report"]
