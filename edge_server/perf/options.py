"""``edge-server perf`` flags: perf_analyzer's names where it has one, parsed and checked once.

Everything that can be wrong with a command line is found here or, for what depends on the model
(its inputs, batching, sequence or decoupled kind), by :func:`edge_server.perf.command.plan` before
any request is sent; either way the user gets one line and exit status 2, as argparse gives.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

USAGE = (
    "edge-server perf MODEL [--ipc ADDR | --http URL | --grpc URL | --model-repository DIR] "
    "[--concurrency-range START:END:STEP | --request-rate-range START:END:STEP] [options]"
)

DEFAULT_SEQUENCE_LENGTH = 20  # perf_analyzer's default for sequence models


class PerfUsageError(Exception):
    """A command line, or a model, that cannot be measured as asked: one line, exit status 2."""


class PerfError(Exception):
    """A measurement that failed on the way (no server, requests answered with errors): exit status 1."""


@dataclass(frozen=True)
class LoadRange:
    """``START:END:STEP`` as perf_analyzer reads it: END defaults to START, STEP to 1."""

    start: float
    end: float
    step: float

    def values(self) -> list[float]:
        count = int(math.floor((self.end - self.start) / self.step + 1e-9)) + 1
        return [self.start + i * self.step for i in range(count)]


def _range(text: str, *, integer: bool) -> LoadRange:
    parts = text.split(":")
    kind = "integers" if integer else "numbers"
    if not 1 <= len(parts) <= 3 or any(p.strip() == "" for p in parts):
        raise argparse.ArgumentTypeError(f"expected START[:END[:STEP]], got {text!r}")
    try:
        numbers = [int(p) if integer else float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START[:END[:STEP]] of {kind}, got {text!r}") from None
    start = numbers[0]
    end = numbers[1] if len(numbers) > 1 else start
    step = numbers[2] if len(numbers) > 2 else 1
    if not all(math.isfinite(n) for n in numbers) or start <= 0:
        raise argparse.ArgumentTypeError(f"START must be greater than 0, got {text!r}")
    if end < start:
        raise argparse.ArgumentTypeError(f"END must not be below START, got {text!r}")
    if step <= 0:
        raise argparse.ArgumentTypeError(f"STEP must be greater than 0, got {text!r}")
    if (end - start) / step > 1000:
        raise argparse.ArgumentTypeError(f"more than 1000 load levels in {text!r}: use a larger STEP")
    return LoadRange(start, end, step)


def concurrency_range(text: str) -> LoadRange:
    return _range(text, integer=True)


def rate_range(text: str) -> LoadRange:
    return _range(text, integer=False)


def _bounded(kind: type, low: float, high: float | None = None) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (high is not None and value > high):
            span = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text!r}")
        return value

    return parse


def shape_flag(text: str) -> tuple[str, tuple[int, ...]]:
    """``--shape NAME:D1,D2`` (perf_analyzer's): the sample shape of an input with variable dims."""
    name, sep, dims = text.rpartition(":")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        shape = ()
    if not sep or not name or not shape or any(d < 0 for d in shape):
        raise argparse.ArgumentTypeError(f"expected NAME:D1,D2,... with non-negative dims, got {text!r}")
    return name, shape


@dataclass(frozen=True)
class PerfOptions:
    """The validated command line."""

    model: str
    model_version: int | None
    transport: str  # "ipc", "http", "grpc" or "local"
    address: str | None  # IPC address or HTTP/gRPC URL; None: find the daemon as `status` does
    repository: Path | None
    concurrency: tuple[int, ...]
    request_rates: tuple[float, ...]  # non-empty: request-rate mode
    max_threads: int
    batch_size: int
    shared_memory: str
    output_shared_memory_size: int
    input_data: str
    shapes: dict[str, tuple[int, ...]]
    measurement_interval_ms: float
    percentile: int | None
    stability_percentage: float
    max_trials: int
    sequence_length: int | None
    streaming: bool
    csv: Path | None
    verbose_csv: bool
    plot: Path | None
    json: Path | None
    verbose: bool

    @property
    def mode(self) -> str:
        return "request_rate" if self.request_rates else "concurrency"

    @property
    def levels(self) -> tuple[float, ...]:
        return self.request_rates or tuple(float(c) for c in self.concurrency)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "perf",
        help="measure a model's latency and throughput as perf_analyzer does",
        usage=USAGE,
        description=(
            "Drives MODEL at each load level of a concurrency or request-rate sweep, measures windows "
            "until throughput and latency are stable, and reports client latency beside the daemon's "
            "own statistics (queue, compute, batch sizes). Default target: the running daemon, found as "
            "`edge-server status` finds it."
        ),
    )
    parser.add_argument("model")
    parser.add_argument(
        "-x", "--model-version", type=_bounded(int, 1), default=None, metavar="N", help="default: latest"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--ipc", default=None, metavar="ADDR", help="the daemon's IPC address")
    where.add_argument("--http", default=None, metavar="URL", help="KServe HTTP, e.g. 127.0.0.1:8000")
    where.add_argument("--grpc", default=None, metavar="URL", help="KServe gRPC, e.g. 127.0.0.1:8001")
    where.add_argument(
        "--model-repository", type=Path, default=None, metavar="DIR", help="load DIR in this process"
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency-range",
        type=concurrency_range,
        default=None,
        metavar="START:END:STEP",
        help="requests kept in flight, one level per value (default 1)",
    )
    load.add_argument(
        "--request-rate-range",
        type=rate_range,
        default=None,
        metavar="START:END:STEP",
        help="requests per second on a fixed schedule, one level per value",
    )
    parser.add_argument(
        "--max-threads",
        type=_bounded(int, 1, 1024),
        default=16,
        metavar="N",
        help="request-rate mode: senders, so requests in flight at most (default 16)",
    )
    parser.add_argument(
        "-b", "--batch-size", type=_bounded(int, 1), default=1, metavar="N", help="rows per request"
    )
    parser.add_argument(
        "--shared-memory",
        choices=["none", "system"],
        default="none",
        help="inputs and outputs through system shared memory (outputs inline with --streaming)",
    )
    parser.add_argument(
        "--output-shared-memory-size",
        type=_bounded(int, 1, 1 << 30),
        default=102400,
        metavar="BYTES",
        help="room for an output of variable shape or BYTES in shared memory (default 102400)",
    )
    parser.add_argument(
        "--input-data",
        default="random",
        metavar="random|zero|FILE|DIR",
        help="random or zero tensors, a JSON file in perf_analyzer's format, or a directory of raw files",
    )
    parser.add_argument(
        "--shape", type=shape_flag, action="append", default=[], metavar="NAME:DIMS", help="repeatable"
    )
    parser.add_argument(
        "-p",
        "--measurement-interval",
        type=_bounded(float, 1),
        default=5000.0,
        metavar="MS",
        help="window length (default 5000)",
    )
    parser.add_argument(
        "--percentile",
        type=_bounded(int, 1, 99),
        default=None,
        metavar="P",
        help="judge stability and report latency at this percentile (default: the average)",
    )
    parser.add_argument(
        "-s",
        "--stability-percentage",
        type=_bounded(float, 0.001),
        default=10.0,
        metavar="PCT",
        help="stable: the last 3 windows within PCT %% of their mean (default 10)",
    )
    parser.add_argument(
        "-r", "--max-trials", type=_bounded(int, 1), default=10, metavar="N", help="windows per level at most"
    )
    parser.add_argument(
        "--sequence-length",
        type=_bounded(int, 1),
        default=None,
        metavar="N",
        help=f"requests per sequence, sequence models (default {DEFAULT_SEQUENCE_LENGTH})",
    )
    parser.add_argument("--streaming", action="store_true", help="stream responses (decoupled models)")
    parser.add_argument("-f", type=Path, default=None, metavar="FILE", dest="csv", help="CSV report")
    parser.add_argument(
        "--verbose-csv",
        action="store_true",
        help="CSV also has Avg latency, request/response and response wait (Model Analyzer reads them)",
    )
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE", help="latency-throughput PNG")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="every figure, as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr even off a TTY")
    return parser


def options_from(args: argparse.Namespace) -> PerfOptions:
    """Check what argparse cannot (combinations, files) and freeze the result."""
    if args.http is not None:
        transport, address = "http", args.http
    elif args.grpc is not None:
        transport, address = "grpc", args.grpc
    elif args.model_repository is not None:
        transport, address = "local", None
        if not args.model_repository.is_dir():
            raise PerfUsageError(f"--model-repository {args.model_repository} is not a directory")
    else:
        transport, address = "ipc", args.ipc
    if transport in ("http", "grpc") and not address:
        raise PerfUsageError(
            f"--{transport} needs a URL such as 127.0.0.1:{8000 if transport == 'http' else 8001}"
        )
    if args.shared_memory == "system" and transport == "local":
        raise PerfUsageError("--shared-memory system needs a daemon: in-process requests never copy")
    if args.streaming and transport == "http":
        raise PerfUsageError("--streaming needs --ipc, --grpc or --model-repository: HTTP cannot stream")
    if args.input_data not in ("random", "zero") and not Path(args.input_data).exists():
        raise PerfUsageError(f"--input-data {args.input_data}: no such file or directory")
    shapes = dict(args.shape)
    for path in (args.csv, args.plot, args.json):
        if path is not None and not path.parent.is_dir():
            raise PerfUsageError(f"cannot write {path}: {path.parent} is not a directory")
    rates = tuple(args.request_rate_range.values()) if args.request_rate_range else ()
    concurrency = args.concurrency_range or LoadRange(1, 1, 1)
    return PerfOptions(
        model=args.model,
        model_version=args.model_version,
        transport=transport,
        address=address,
        repository=args.model_repository,
        concurrency=tuple(int(c) for c in concurrency.values()) if not rates else (),
        request_rates=rates,
        max_threads=args.max_threads,
        batch_size=args.batch_size,
        shared_memory=args.shared_memory,
        output_shared_memory_size=args.output_shared_memory_size,
        input_data=args.input_data,
        shapes=shapes,
        measurement_interval_ms=args.measurement_interval,
        percentile=args.percentile,
        stability_percentage=args.stability_percentage,
        max_trials=args.max_trials,
        sequence_length=args.sequence_length,
        streaming=args.streaming,
        csv=args.csv,
        verbose_csv=args.verbose_csv,
        plot=args.plot,
        json=args.json,
        verbose=args.verbose,
    )
