"""Per-model figures for ``edge-server status``: states, requests and errors, queue depth, busy time.

Read from what the lifecycle and the schedulers keep anyway; nothing is counted for it.  The ONNX
Runtime thread rule is reported twice, and labelled so: per model as it was when that model's
sessions were built (a session cannot change its threads, and the count of sessions on the box
changes as models load), and once for the box as it is now (:func:`thread_rule`).
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
                threads = dict(loaded.thread_settings)
                threads["rule_at_load"] = threads.pop("rule")
                row["threads"] = threads
        rows.append(row)
    return rows


def thread_rule(policy: str, sessions: int, cores: int) -> dict[str, Any]:
    """The ONNX Runtime thread rule as it stands now: the daemon's policy and what ``auto`` counts."""
    from edge_server.backends.onnxruntime import AUTO_ALONE_RULE  # the backend's rule, imported when asked

    if policy != "auto":
        rule = f"--onnxruntime-thread-policy {policy}"
    elif sessions <= 1:
        rule = AUTO_ALONE_RULE if sessions else "auto: no CPU ONNX Runtime instance"
    else:
        rule = f"auto: {sessions} CPU ONNX Runtime instances share {cores} cores"
    return {"policy": policy, "cpu_onnxruntime_instances": sessions, "cores": cores, "rule": rule}
