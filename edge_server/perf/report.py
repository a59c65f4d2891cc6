"""The results of ``edge-server perf``: a terminal table, perf_analyzer's CSV, a PNG plot, JSON.

Latencies are in microseconds, as perf_analyzer writes them.  Our clients time a request as one
span, so the CSV's "Client Send" and "Client Recv" (and with ``--verbose-csv`` "request/response") are
0, "Network+Server Send/Recv" is what the average latency has beyond the daemon's own time (queue and
compute), and "response wait" is the whole average latency.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from edge_server.perf.measure import LevelResult, percentiles
from edge_server.perf.options import PerfOptions, PerfUsageError

# perf_analyzer's -f columns between the level and the percentiles (with server statistics on).
CSV_COLUMNS = (
    "Client Send",
    "Network+Server Send/Recv",
    "Server Queue",
    "Server Compute Input",
    "Server Compute Infer",
    "Server Compute Output",
    "Client Recv",
)
# What --verbose-csv adds after the percentiles; Model Analyzer runs perf_analyzer with it and reads
# these (perf_latency_avg, perf_client_send_recv, perf_client_response_wait).
VERBOSE_CSV_COLUMNS = ("Avg latency", "request/response", "response wait")


def level_name(options: PerfOptions) -> str:
    return "Request Rate" if options.mode == "request_rate" else "Concurrency"


def _level(options: PerfOptions, value: float) -> str:
    return f"{value:g}"


def _batches(batches: dict[int, int]) -> str:
    return ", ".join(f"{size}x{count}" for size, count in sorted(batches.items())) or "-"


def print_table(options: PerfOptions, results: Sequence[LevelResult], target: str, out: TextIO) -> None:
    """Each level's client and server figures, then one summary row per level."""
    name = level_name(options)
    print(
        f"*** edge-server perf: {options.model} over {target}; batch size {options.batch_size}; "
        f"measurement interval {options.measurement_interval_ms:g} ms; stability "
        f"{options.stability_percentage:g}% over 3 windows, at most {options.max_trials} ***",
        file=out,
    )
    for result in results:
        print(file=out)
        lat = result.latency()
        state = (
            f"stable after {len(result.windows)} windows"
            if result.stable
            else f"UNSTABLE after {len(result.windows)} windows"
        )
        print(f"{name} {_level(options, result.level)}: {result.throughput:.1f} infer/s, {state}", file=out)
        if result.error:
            print(f"  stopped by an error: {result.error}", file=out)
        count = len(result.latencies_us)
        print(
            f"  client  {count} requests in the reported windows; latency avg {lat['avg']:.0f} us, "
            f"p50 {lat['p50']:.0f}, p90 {lat['p90']:.0f}, p95 {lat['p95']:.0f}, p99 {lat['p99']:.0f} us",
            file=out,
        )
        if options.streaming:
            print(f"          {result.response_throughput:.1f} responses/s", file=out)
        server = result.server.summary()
        print(
            f"  server  {server['request_count']} requests, {server['inference_count']} inferences, "
            f"{server['execution_count']} executions (batch sizes {_batches(result.server.batches)}); "
            f"per request: queue {server['queue_us']:.0f} us, "
            f"compute input {server['compute_input_us']:.0f}, "
            f"infer {server['compute_infer_us']:.0f}, output {server['compute_output_us']:.0f} us",
            file=out,
        )
        total = result.server_total
        note = "" if total.success_count == result.answered else "  (others used the model meanwhile?)"
        print(
            f"  check   {result.sent} sent, {result.answered} answered; the daemon counted "
            f"{total.success_count} (+{total.fail_count} failed){note}",
            file=out,
        )
        if result.late:
            print(f"  {result.late} requests went out more than 1 ms late: raise --max-threads", file=out)
    print(file=out)
    header = (
        f"{name:>12} {'infer/s':>10} {'p50 us':>9} {'p90 us':>9} {'p95 us':>9} {'p99 us':>9} {'avg us':>9}"
        f" | {'queue':>7} {'in':>6} {'infer':>8} {'out':>6}  stable"
    )
    print(header, file=out)
    for result in results:
        lat, server = result.latency(), result.server.summary()
        print(
            f"{_level(options, result.level):>12} {result.throughput:>10.1f} {lat['p50']:>9.0f} "
            f"{lat['p90']:>9.0f} {lat['p95']:>9.0f} {lat['p99']:>9.0f} {lat['avg']:>9.0f}"
            f" | {server['queue_us']:>7.0f} {server['compute_input_us']:>6.0f}"
            f" {server['compute_infer_us']:>8.0f}"
            f" {server['compute_output_us']:>6.0f}  {'yes' if result.stable else 'NO'}",
            file=out,
        )


def csv_header(options: PerfOptions, *, decoupled: bool = False) -> list[str]:
    """perf_analyzer's header, column for column, so that tools reading its CSV read ours.

    "Response Throughput" only for a decoupled model; the percentiles are 50, 90, 95, 99 and
    ``--percentile`` in order; ``--verbose-csv`` adds "Avg latency" (only without ``--percentile``),
    "request/response" and "response wait".
    """
    header = [level_name(options), "Inferences/Second"]
    if decoupled:
        header.append("Response Throughput")
    header += [*CSV_COLUMNS, *(f"p{p} latency" for p in percentiles(options.percentile))]
    if options.verbose_csv:
        header += VERBOSE_CSV_COLUMNS if options.percentile is None else VERBOSE_CSV_COLUMNS[1:]
    return header


def csv_row(options: PerfOptions, result: LevelResult, *, decoupled: bool = False) -> list[Any]:
    """One level, in whole microseconds as perf_analyzer writes them (truncated, not rounded)."""
    lat, server = result.latency(options.percentile), result.server.summary()
    on_server = (
        server["queue_us"]
        + server["compute_input_us"]
        + server["compute_infer_us"]
        + server["compute_output_us"]
    )
    send_us = recv_us = 0  # one span per request: see the module's docstring
    row: list[Any] = [_level(options, result.level), f"{result.throughput:g}"]
    if decoupled:
        row.append(f"{result.response_throughput:g}")
    row += [
        send_us,
        int(max(0.0, lat["avg"] - send_us - recv_us - on_server)),
        int(server["queue_us"]),
        int(server["compute_input_us"]),
        int(server["compute_infer_us"]),
        int(server["compute_output_us"]),
        recv_us,
        *(int(lat[f"p{p}"]) for p in percentiles(options.percentile)),
    ]
    if options.verbose_csv:
        if options.percentile is None:
            row.append(int(lat["avg"]))
        row += [send_us + recv_us, int(lat["avg"]) - send_us - recv_us]
    return row


def write_csv(
    options: PerfOptions, results: Sequence[LevelResult], path: Path, *, decoupled: bool = False
) -> None:
    """perf_analyzer's ``-f`` file: one row per load level, latencies in microseconds.

    The rows are in increasing order of throughput, as perf_analyzer sorts them.
    """
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(csv_header(options, decoupled=decoupled))
        for result in sorted(results, key=lambda r: r.throughput):
            writer.writerow(csv_row(options, result, decoupled=decoupled))


def write_plot(options: PerfOptions, results: Sequence[LevelResult], path: Path) -> None:
    """Latency against throughput, one point per load level, labelled with the level."""
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    x = [r.throughput for r in results]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    try:
        tail = options.percentile or 99
        for key, label in (("avg", "average"), (f"p{tail}", f"p{tail}")):
            values = [r.latency(options.percentile)[key] / 1000 for r in results]
            axes.plot(x, values, marker="o", label=label)
        for result, xi in zip(results, x, strict=True):
            axes.annotate(
                _level(options, result.level),
                (xi, result.latency()["avg"] / 1000),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
        axes.set_xlabel("throughput (inferences/s)")
        axes.set_ylabel("latency (ms)")
        axes.set_title(f"{options.model}: latency vs throughput ({level_name(options).lower()} sweep)")
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, format="png", dpi=100)
    finally:
        plt.close(figure)


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PerfUsageError("--plot needs matplotlib: pip install 'edge-server[plot]'") from None
    return matplotlib


def write_json(options: PerfOptions, results: Sequence[LevelResult], target: str, path: Path) -> None:
    levels = []
    for result in results:
        levels.append(
            {
                level_name(options).lower().replace(" ", "_"): result.level,
                "stable": result.stable,
                "error": result.error or None,
                "throughput": result.throughput,
                "request_throughput": result.request_throughput,
                "response_throughput": result.response_throughput,
                "latency_us": result.latency(options.percentile),
                "server": result.server.summary(),
                "level_check": {
                    "sent": result.sent,
                    "answered": result.answered,
                    "server": result.server_total.summary(),
                    "client_avg_us": result.client_avg_us,
                },
                "windows": [
                    {
                        "seconds": w.seconds,
                        "requests": len(w.latencies_us),
                        "responses": w.responses,
                        "requests_per_second": w.throughput,
                        "server_requests": w.server.success_count,
                    }
                    for w in result.windows
                ],
            }
        )
    document = {
        "model": options.model,
        "target": target,
        "batch_size": options.batch_size,
        "mode": options.mode,
        "measurement_interval_ms": options.measurement_interval_ms,
        "levels": levels,
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
