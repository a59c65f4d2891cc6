"""``edge-server status``: what the running daemon is doing, for the person operating the box."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status",
        help="the running daemon: state, uptime, models, requests, errors, queues, instance busy time",
    )
    parser.add_argument("--ipc", default=None, metavar="ADDRESS", help="ask the daemon at this address")
    parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    parser.set_defaults(tool_run=run)


def run(args: argparse.Namespace) -> int:
    from edge_server.client import Client
    from edge_server.ipc.addresses import find_daemon

    address = find_daemon(args.ipc)
    with Client(address, timeout=10) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    print(render(status, address))
    return 0


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes}m"
    if hours:
        return f"{hours}h {minutes}m {secs}s"
    return f"{minutes}m {secs}s"


def render(status: dict[str, Any], address: str) -> str:
    """The human form: a header, then one line per model version."""
    lines = [f"daemon      {address}"]
    state = status.get("state", "?")
    if "ready" in status:
        state += ", ready" if status["ready"] else ", NOT ready"
    lines.append(f"state       {state}")
    if "uptime_s" in status:
        lines.append(f"uptime      {_duration(status['uptime_s'])}")
    for repository in status.get("repositories", ["?"]):
        lines.append(f"repository  {repository}")
    reload = status.get("last_reload")
    if reload:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(reload["at"]))
        outcome = "ok" if reload["ok"] else f"FAILED ({reload['detail']})"
        lines.append(f"last reload {when} {outcome} ({status.get('reloads', 0)} in all)")
    for ipc in status.get("ipc", []):
        lines.append(f"ipc         {ipc['clients']} client(s), {ipc['regions']} shared-memory region(s)")
    for stuck in status.get("stuck", []):
        lines.append(f"STUCK       {stuck}: no progress; the watchdog stopped pinging systemd")
    lines.append("")
    lines.append(f"{'MODEL':<20} {'VER':<4} {'STATE':<12} {'REQUESTS':>9} {'ERRORS':>7} {'QUEUED':>6}  BUSY")
    for row in status.get("models", []):
        version = "-" if row["version"] is None else str(row["version"])
        busy = ", ".join(f"{name} {s:.1f}s" for name, s in sorted(row.get("busy_s", {}).items()))
        requests = row.get("requests", "")
        lines.append(
            f"{row['name']:<20} {version:<4} {row['state']:<12} {requests!s:>9} {row.get('errors', '')!s:>7} "
            f"{row.get('queue_depth', '')!s:>6}  {busy}"
        )
        if row.get("reason"):
            lines.append(f"{'':<26}{row['reason']}")
    return "\n".join(lines)
