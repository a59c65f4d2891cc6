"""``edge-server perf``: open the target, check the model against the flags, sweep, report."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any

from edge_server.perf.options import (
    DEFAULT_SEQUENCE_LENGTH,
    PerfError,
    PerfOptions,
    PerfUsageError,
    options_from,
)
from edge_server.perf.options import add_parser as _add_options


def add_parser(subparsers: Any) -> None:
    parser = _add_options(subparsers)
    parser.set_defaults(tool_run=run, perf_parser=parser)


def run(args: argparse.Namespace) -> int:
    """Exit status 2 for what the user can fix in the command line or the model choice, 1 for failures."""
    try:
        options = options_from(args)
        if options.plot is not None:
            from edge_server.perf.report import require_matplotlib

            require_matplotlib()
        return measure(options)
    except PerfUsageError as exc:
        args.perf_parser.print_usage(sys.stderr)
        print(f"edge-server perf: error: {exc}", file=sys.stderr)
        return 2
    except PerfError as exc:
        print(f"edge-server perf: error: {exc}", file=sys.stderr)
        return 1


def open_target(options: PerfOptions) -> tuple[Any, str]:
    """The target and how the report names it."""
    if options.transport == "local":
        from edge_server.perf.targets import LocalTarget

        assert options.repository is not None
        return LocalTarget(options.repository, options.model, options.model_version), (
            f"in-process {options.repository}"
        )
    if options.transport in ("http", "grpc"):
        from edge_server.perf.kserve_targets import KServeTarget

        assert options.address is not None
        target = KServeTarget(options.transport, options.address, options.model, options.model_version)
        return target, f"{options.transport} {options.address}"
    from edge_server.perf.targets import IpcTarget

    ipc = IpcTarget(options.address, options.model, options.model_version)
    return ipc, ipc.address


def plan(options: PerfOptions, info: Any) -> tuple[list[Any], int | None]:
    """The request data and the sequence length, once the model's kind is known."""
    from edge_server.perf.inputs import make_steps

    name = options.model
    batched = info.max_batch_size > 0
    if options.batch_size > 1 and not batched:
        raise PerfUsageError(f"model {name!r} does not batch (max_batch_size 0): --batch-size must be 1")
    if batched and options.batch_size > info.max_batch_size:
        raise PerfUsageError(
            f"--batch-size {options.batch_size} exceeds model {name!r}'s max_batch_size {info.max_batch_size}"
        )
    if info.decoupled and not options.streaming:
        raise PerfUsageError(f"model {name!r} is decoupled (its responses are streamed): add --streaming")
    if options.sequence_length is not None and not info.sequence:
        raise PerfUsageError(f"--sequence-length: model {name!r} is not a sequence model")
    sequence_length = (options.sequence_length or DEFAULT_SEQUENCE_LENGTH) if info.sequence else None
    if sequence_length is not None and options.mode == "request_rate":
        raise PerfUsageError(
            f"model {name!r} is a sequence model: measure it with --concurrency-range (one sequence per "
            "concurrent client), not --request-rate-range"
        )
    steps = make_steps(
        options.input_data,
        info.metadata,
        batched=batched,
        batch_size=options.batch_size,
        shapes=options.shapes,
    )
    return steps, sequence_length


class _Progress:
    """One line per window on stderr: rewritten in place on a terminal, appended with ``--verbose``."""

    def __init__(self, options: PerfOptions) -> None:
        self.tty = sys.stderr.isatty()
        self.on = self.tty or options.verbose
        self.options = options

    def __call__(self, level: float, trial: int, window: Any, stable: bool) -> None:
        if not self.on:
            return
        from edge_server.perf.measure import latency_figure
        from edge_server.perf.report import level_name

        figure = latency_figure(window.latencies_us, self.options.percentile)
        which = f"p{self.options.percentile}" if self.options.percentile else "avg"
        line = (
            f"{level_name(self.options)} {level:g}: window {trial}/{self.options.max_trials}: "
            f"{window.throughput * self.options.batch_size:.1f} infer/s, {which} latency {figure:.0f} us"
            f"{', stable' if stable else ''}"
        )
        if self.tty:
            print(f"\r\x1b[2K{line}", end="" if not stable else "\n", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.on and self.tty:
            print("\r\x1b[2K", end="", file=sys.stderr, flush=True)


def measure(options: PerfOptions) -> int:
    from edge_server.perf import report
    from edge_server.perf.load import ConcurrencyLoad, RateLoad
    from edge_server.perf.measure import LevelResult, measure_level

    target, where = open_target(options)
    results: list[LevelResult] = []
    decoupled = False
    try:
        info = target.model_info()
        decoupled = bool(info.decoupled)
        steps, sequence_length = plan(options, info)
        shared_memory = options.shared_memory == "system"
        outputs = None
        if shared_memory and not options.streaming:  # streamed responses come back inline (docs/perf.md)
            from edge_server.perf.inputs import output_sizes

            outputs = output_sizes(
                info.metadata,
                batched=info.max_batch_size > 0,
                batch_size=options.batch_size,
                default_size=options.output_shared_memory_size,
            )
        target.prepare(steps, shared_memory=shared_memory, streaming=options.streaming, outputs=outputs)
        # Correlation ids unlikely to meet another client's (perf_analyzer starts at 1 by default).
        ids = itertools.count(1 + (os.getpid() % 4096) * 1_000_000)
        progress = _Progress(options)
        for level in options.levels:
            load: ConcurrencyLoad | RateLoad
            if options.mode == "request_rate":
                load = RateLoad(target, level, steps=len(steps), threads=options.max_threads)
            else:
                load = ConcurrencyLoad(
                    target, int(level), steps=len(steps), sequence_length=sequence_length, ids=ids
                )
            result = measure_level(
                target,
                load,
                level,
                batch_size=options.batch_size,
                interval_ms=options.measurement_interval_ms,
                max_trials=options.max_trials,
                stability_percentage=options.stability_percentage,
                percentile=options.percentile,
                progress=progress,
            )
            progress.done()
            results.append(result)
            if result.error:
                break
            if not result.stable:
                print(
                    f"edge-server perf: warning: {report.level_name(options).lower()} {level:g} "
                    "was not stable "
                    f"within {options.max_trials} windows of {options.measurement_interval_ms:g} ms; "
                    "raise --measurement-interval or --max-trials",
                    file=sys.stderr,
                )
    finally:
        target.close()
    report.print_table(options, results, where, sys.stdout)
    if options.csv is not None:
        report.write_csv(options, results, options.csv, decoupled=decoupled)
    if options.json is not None:
        report.write_json(options, results, where, options.json)
    if options.plot is not None:
        report.write_plot(options, results, options.plot)
    if results and results[-1].error:
        raise PerfError(f"requests failed: {results[-1].error}")
    return 0
