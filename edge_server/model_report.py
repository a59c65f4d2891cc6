"""Per-model figures for ``edge-server status``: states, requests and errors, queue depth, busy time.

Read from what the lifecycle and the schedulers keep anyway; nothing is counted for it.
"""

from __future__ import annotations

from typing import Any

from edge_server.routing import RoutingView


def model_report(routing: RoutingView) -> list[dict[str, Any]]:
    """One row per known model version; serving versions carry their counters."""
    serving = routing.serving()
    rows = []
    for status in routing.index():
        row: dict[str, Any] = {
            "name": status.name,
            "version": status.version,
            "state": status.state.value,
            "reason": status.reason,
        }
        loaded = serving.get(status.name, {}).get(status.version) if status.version is not None else None
        if loaded is not None:
            stats = loaded.stats.as_dict()
            inference = stats["inference_stats"]
            row.update(
                requests=inference["success"]["count"] + inference["fail"]["count"],
                errors=inference["fail"]["count"],
                executions=stats["execution_count"],
                queue_depth=loaded.scheduler.queue_size(),
                busy_s={name: ns / 1e9 for name, ns in loaded.scheduler.instance_busy_ns().items()},
                last_inference_ms=stats["last_inference"],
            )
            if loaded.thread_settings is not None:
                row["threads"] = loaded.thread_settings
        rows.append(row)
    return rows
