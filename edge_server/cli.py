"""``edge-server`` command line: serve, models, infer.  Flag names follow Triton's where it has one."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edge_server import __version__, dtypes
from edge_server.backends.base import ONNXRUNTIME_THREAD_POLICIES
from edge_server.errors import EdgeServerError, InvalidArgument
from edge_server.ipc import protocol
from edge_server.ipc.protocol import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from edge_server.kserve.frontends import add_kserve_arguments, kserve_options
from edge_server.limits import add_limit_arguments, limit_options
from edge_server.metrics.options import metrics_config_item, summary_options
from edge_server.server import CONTROL_MODES
from edge_server.service.journal import JOURNAL_SOCKET, JournalHandler, stderr_is_journal

log = logging.getLogger("edge_server")


class _Target(Protocol):
    """What ``models`` and ``infer`` need, from a running daemon (IPC client) or from a local Server."""

    def infer(self, model: str, inputs: dict[str, np.ndarray], **kwargs: Any) -> dict[str, np.ndarray]: ...

    def model_metadata(self, model: str) -> dict[str, Any]: ...

    def close(self) -> None: ...


def configure_logging(verbose: int, fmt: str) -> None:
    """One logging set-up for the process; under journald (JOURNAL_STREAM set) timestamps are left out."""
    level = logging.DEBUG if verbose > 0 else logging.INFO
    if fmt == "json":
        formatter: logging.Formatter = _JsonFormatter()
    elif os.environ.get("JOURNAL_STREAM") and fmt == "default":
        formatter = _JournalFormatter("%(name)s: %(message)s")
    else:
        datefmt = "%Y-%m-%dT%H:%M:%S" if fmt == "ISO8601" else None
        formatter = logging.Formatter("%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt)
    handler: logging.Handler = logging.StreamHandler()
    if fmt == "default" and os.path.exists(JOURNAL_SOCKET) and stderr_is_journal():
        handler = JournalHandler()  # structured fields (MODEL=, VERSION=) besides the message
        formatter = logging.Formatter("%(name)s: %(message)s")
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class _JournalFormatter(logging.Formatter):
    """journald reads a syslog priority from a ``<N>`` prefix on each stdout line and adds the time."""

    _PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self._PRIORITY.get(record.levelno, 6)}>{super().format(record)}"


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "ts": record.created,
                "level": record.levelname,
                "logger": record.name,
                "msg": record.getMessage(),
            }
        )


def boolean(text: str) -> bool:
    """Triton's boolean flag values: ``--exit-on-error false``."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def positive(text: str) -> int:
    """A limit: a whole number of at least 1 (0 would refuse everything)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edge-server", description=__doc__)
    parser.add_argument("--version", action="version", version=f"edge-server {__version__}")
    parser.add_argument("--log-verbose", type=int, default=0, help="0: info, 1 or more: debug")
    parser.add_argument("--log-format", choices=["default", "ISO8601", "json"], default="default")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the server on a model repository")
    serve.set_defaults(subparser=serve)  # the settings file becomes this parser's defaults
    serve.add_argument(
        "--settings",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML settings, one key per flag (default: $CONFIGURATION_DIRECTORY/edge-server.toml)",
    )
    serve.add_argument("--model-repository", type=Path, default=None, help="default: the bundled models/")
    serve.add_argument("--model-control-mode", choices=CONTROL_MODES, default="none")
    serve.add_argument(
        "--load-model",
        action="append",
        default=[],
        metavar="NAME",
        help="explicit mode: load NAME ('*': all)",
    )
    serve.add_argument("--ipc", default=None, metavar="ADDRESS", help="ipc://PATH or tcp://127.0.0.1:PORT")
    serve.add_argument("--no-ipc", action="store_true", help="serve no IPC frontend (in-process use only)")
    serve.add_argument(
        "--engine-build",
        choices=["none", "on-load"],
        default="none",
        help="on-load: rebuild TensorRT plans built for another TensorRT/device from the ONNX beside them",
    )
    serve.add_argument(
        "--onnxruntime-thread-policy",
        choices=list(ONNXRUNTIME_THREAD_POLICIES),
        default="auto",
        help="auto: ONNX Runtime's default threads for the only CPU ONNX Runtime instance on the box, "
        "else the cores split among them with spinning off; default/split: always that",
    )
    serve.add_argument(
        "--repository-quiet-secs",
        type=float,
        default=0.5,
        help="poll mode: how long a model's files must stay unchanged before it is (re)loaded",
    )
    serve.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    serve.add_argument(
        "--operator-group",
        default=None,
        metavar="GROUP",
        help=(
            "members may control the daemon (load, unload, log and trace settings) on every frontend, "
            "as root and the daemon's user may; the daemon's group may not"
        ),
    )
    serve.add_argument(
        "--model-load-timeout-secs",
        type=float,
        default=600.0,
        help="a model load (instances created and warmed up) taking longer fails and is abandoned",
    )
    serve.add_argument(
        "--max-client-reply-bytes",
        type=positive,
        default=protocol.DEFAULT_MAX_CLIENT_REPLY_BYTES,
        help="IPC and gRPC streams: a client (a stream) with more bytes of replies waiting for it (it does "
        "not read) is disconnected (cancelled)",
    )
    serve.add_argument(
        "--max-client-requests",
        type=positive,
        default=protocol.DEFAULT_MAX_CLIENT_REQUESTS,
        help="IPC: requests one client may have in flight (queued, running, open streams); more are refused; "
        "gRPC: requests one stream may have in flight; it reads no more until one is answered",
    )
    serve.add_argument(
        "--max-client-regions",
        type=positive,
        default=protocol.DEFAULT_MAX_CLIENT_REGIONS,
        help="IPC: shared-memory regions one client may register (the descriptor budget bounds all of them)",
    )
    serve.add_argument(
        "--max-requests",
        type=positive,
        default=protocol.DEFAULT_MAX_REQUESTS,
        help="IPC: requests all clients together may have in flight; more are refused",
    )
    serve.add_argument(
        "--max-frames",
        type=positive,
        default=protocol.MAX_FRAMES,
        help="IPC: frames in one message (a header and its tensors); more are dropped unread and refused",
    )
    serve.add_argument(
        "--max-header-bytes",
        type=int,
        default=DEFAULT_MAX_HEADER_BYTES,
        help="IPC: largest request header decoded (msgpack); larger ones are refused unread",
    )
    add_kserve_arguments(serve)
    add_limit_arguments(serve)
    serve.add_argument(
        "--exit-timeout-secs", type=float, default=30.0, help="how long to drain requests when stopping"
    )
    serve.add_argument(
        "--strict-readiness",
        type=boolean,
        default=True,
        metavar="BOOL",
        help="server ready only when every model that should load is ready (default true, as Triton)",
    )
    serve.add_argument("--allow-metrics", type=boolean, default=True, metavar="BOOL", help="default true")
    serve.add_argument("--metrics-address", default="127.0.0.1", help="default 127.0.0.1 (loopback only)")
    serve.add_argument(
        "--metrics-port", type=int, default=8002, help="Prometheus /metrics port (default 8002)"
    )
    serve.add_argument(
        "--metrics-config",
        type=metrics_config_item,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="as Triton: summary_latencies=true adds p50/p90/p95/p99/p999 latency summaries over the "
        "last minute; summary_quantiles=0.5:0.05,0.99:0.001 picks others",
    )
    serve.add_argument(
        "--exit-on-error",
        type=boolean,
        default=True,
        metavar="BOOL",
        help="exit non-zero when a model fails to load at start-up (default true, as Triton)",
    )

    for name, help_text in (
        ("models", "list models, versions and their state"),
        ("infer", "run one request"),
    ):
        sub = commands.add_parser(name, help=help_text, description=_TARGET_HELP)
        sub.add_argument("--ipc", default=None, metavar="ADDRESS", help="ask the daemon at this address")
        sub.add_argument(
            "--model-repository", type=Path, default=None, help="load this repository in this process"
        )
        sub.add_argument("--local", action="store_true", help="load the bundled repository in this process")
        if name == "infer":
            sub.add_argument("model")
            sub.add_argument("--model-version", type=int, default=None)
            sub.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
            sub.add_argument(
                "--image", type=Path, default=None, help="an image file for a one-input image model"
            )
            sub.add_argument(
                "--channel-order",
                choices=CHANNEL_ORDERS,
                default="bgr",
                help="the order of a colour --image's channels: bgr (default, as OpenCV reads images and "
                "OpenCV-based pipelines expect them) or rgb",
            )
            sub.add_argument("--output", action="append", default=None, metavar="NAME")
            sub.add_argument("--top", type=int, default=3, help="classes to print for classification outputs")
    _add_tools(commands)
    return parser


def _add_tools(commands: Any) -> None:
    """Register the tools in edge_server/tools (dla-report, build-engine, doctor); each sets ``tool_run``."""
    import importlib

    from edge_server.tools import TOOLS

    for name in TOOLS:
        importlib.import_module(f"edge_server.tools.{name}").add_parser(commands)
    importlib.import_module("edge_server.perf.command").add_parser(commands)  # perf: its own package


_TARGET_HELP = (
    "Asks the running daemon (found at $EDGE_SERVER_IPC, else /run/edge-server/edge-server.sock, else "
    "the per-user socket); --ipc names it; --model-repository DIR or --local load models in this process."
)


class UsageError(Exception):
    """A command line that cannot work as given: printed with the usage line, exit status 2."""


def _hoist_global_flags(argv: Sequence[str]) -> list[str]:
    """``--log-verbose``/``--log-format`` are accepted after the command too (``serve --log-verbose 1``)."""
    front: list[str] = []
    rest: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        name = item.split("=", 1)[0]
        if name in ("--log-verbose", "--log-format"):
            takes_next = "=" not in item and i + 1 < len(items)
            front += items[i : i + 2] if takes_next else [item]
            i += 2 if takes_next else 1
            continue
        if item == "--":
            rest += items[i:]
            break
        rest.append(item)
        i += 1
    return front + rest


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = _hoist_global_flags(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    configure_logging(args.log_verbose, args.log_format)
    try:
        if args.command == "serve":
            from edge_server.service.settings import apply_settings, settings_path

            path = settings_path(args.settings)
            if path is not None:
                apply_settings(args.subparser, path)
                args = parser.parse_args(argv)  # again: the settings are defaults, the flags win
                log.info("settings from %s", path)
        if args.command == "serve":
            return _serve(args)
        if args.command == "models":
            return _models(args)
        if hasattr(args, "tool_run"):  # a tool from edge_server/tools
            return int(args.tool_run(args))
        return _infer(args)
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        print(f"edge-server {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except EdgeServerError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _serve(args: argparse.Namespace) -> int:
    # Modules a model.py imports from the repository leave no bytecode there: the repository belongs to
    # its owner and its OTA agent, and may be read-only (model files themselves: backends/python.py).
    sys.dont_write_bytecode = True
    from edge_server.daemon import Daemon, DaemonOptions
    from edge_server.server import default_repository

    if args.model_repository is None and not default_repository().is_dir():
        raise UsageError(
            "no model repository: pass --model-repository DIR, a folder in Triton's layout "
            "(DIR/<model>/config.pbtxt, DIR/<model>/<version>/model.onnx|model.py|model.plan), or set "
            "model-repository in the settings file (--settings FILE; the service reads "
            "/etc/edge-server/edge-server.toml, written by `edge-server install-service`)"
        )

    options = DaemonOptions(
        model_repository=args.model_repository,
        model_control_mode=args.model_control_mode,
        load_models=tuple(args.load_model),
        ipc_address="" if args.no_ipc else args.ipc,
        max_message_bytes=args.max_message_bytes,
        max_header_bytes=args.max_header_bytes,
        max_client_reply_bytes=args.max_client_reply_bytes,
        max_client_requests=args.max_client_requests,
        max_requests=args.max_requests,
        max_client_regions=args.max_client_regions,
        limits=limit_options(args),
        max_frames=args.max_frames,
        operator_group=args.operator_group,
        drain_timeout=args.exit_timeout_secs,
        load_timeout=args.model_load_timeout_secs,
        watch_quiet_s=args.repository_quiet_secs,
        strict_readiness=args.strict_readiness,
        exit_on_error=args.exit_on_error,
        allow_metrics=args.allow_metrics,
        metrics_address=args.metrics_address,
        metrics_port=args.metrics_port,
        latency_summaries=summary_options(args.metrics_config),
        engine_build=args.engine_build,
        onnxruntime_thread_policy=args.onnxruntime_thread_policy,
        kserve=kserve_options(args),
    )
    return Daemon(options).run()


@contextlib.contextmanager
def _target(args: argparse.Namespace) -> Iterator[tuple[Any, bool]]:
    """A client of the running daemon, or a local Server (--model-repository, --local); and which one."""
    if args.ipc and (args.model_repository or args.local):
        raise UsageError("--ipc asks a daemon; --model-repository and --local load models here: pick one")
    if not (args.model_repository or args.local):
        from edge_server.client import Client
        from edge_server.ipc.addresses import find_daemon

        with Client(find_daemon(args.ipc), timeout=60) as client:
            yield client, True
        return
    from edge_server.server import Server

    logging.getLogger().setLevel(logging.WARNING)  # a local load should not drown the answer in logs
    # Models print() from their own threads: while they live here their output goes to stderr, never
    # into this command's answer, which is printed after they are closed.
    with contextlib.redirect_stdout(sys.stderr), Server(args.model_repository) as server:
        yield server, False


def _models(args: argparse.Namespace) -> int:
    with _target(args) as (target, remote):
        if remote:
            rows = [(m["name"], m["version"], m["state"], m.get("reason", "")) for m in target.models()]
        else:
            rows = [(s.name, s.version, s.state.value, s.reason) for s in target.models()]
    print(f"{'MODEL':<24} {'VERSION':<8} {'STATE':<12} REASON")
    for name, version, state, reason in rows:
        print(f"{name:<24} {'-' if version is None else version!s:<8} {state:<12} {reason}")
    return 0


def _infer(args: argparse.Namespace) -> int:
    with _target(args) as (target, remote):
        metadata = target.model_metadata(args.model)
        if remote:  # label files are read from the daemon's repository, on this same box
            config, repository = target.model_config(args.model), Path(target.status()["repository"])
        else:
            config, repository = target.model_config(args.model).to_triton_dict(), target.repository
        inputs, notes = _read_inputs(args, metadata, config)
        outputs = target.infer(args.model, inputs, version=args.model_version, outputs=args.output)
        labels = _labels(config, repository / args.model)
    for note in notes:  # what was sent, where it is not plain (an image's channel order)
        print(note)
    for name, array in outputs.items():
        print(f"{name}: {array.dtype} {list(array.shape)}")
        print(np.array2string(array, threshold=64, precision=5))
        if name in labels and array.ndim >= 1 and array.dtype.kind == "f":
            scores = array.reshape(-1, array.shape[-1])[0]
            top = np.argsort(scores)[::-1][: args.top]
            for rank, index in enumerate(top, 1):
                print(f"  #{rank}: {labels[name][index]} ({scores[index]:.4f})")
    return 0


def _read_inputs(
    args: argparse.Namespace, metadata: dict[str, Any], config: dict[str, Any]
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The request's tensors from --input and --image, and lines saying how an image was converted."""
    inputs: dict[str, np.ndarray] = {}
    notes: list[str] = []
    for item in args.input:
        name, sep, path = item.partition("=")
        if not sep:
            raise UsageError(f"--input expects NAME=FILE.npy, got {item!r}")
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as exc:  # missing, unreadable, not .npy, pickled objects
            raise InvalidArgument(f"--input {name}: cannot read {path} as a .npy array: {exc}") from None
        spec = next((t for t in metadata["inputs"] if t["name"] == name), None)
        if spec is not None and array.ndim == len(spec["shape"]) - 1 and spec["shape"][:1] == [-1]:
            array = array[None]  # a single sample for a batching model: add the batch axis
        inputs[name] = array
    if args.image is not None:
        if len(metadata["inputs"]) != 1:
            raise EdgeServerError(
                f"--image needs a model with one input; {args.model!r} has {metadata['inputs']}"
            )
        spec = metadata["inputs"][0]
        layout = next(
            (t.get("format", "") for t in config.get("input", []) if t.get("name") == spec["name"]), ""
        )
        array, described = image_tensor(
            args.image,
            spec,
            channel_order=args.channel_order,
            batched=int(config.get("max_batch_size", 0)) > 0,
            layout=str(layout),
        )
        inputs[spec["name"]] = array
        notes.append(f"image {args.image} -> input {spec['name']!r}: {described}")
    if not inputs:
        raise UsageError("give --input NAME=FILE.npy (repeatable) or --image FILE")
    return inputs, notes


CHANNEL_ORDERS = ("bgr", "rgb")


def image_tensor(
    path: Path,
    spec: dict[str, Any],
    *,
    channel_order: str = "bgr",
    batched: bool | None = None,
    layout: str = "",
) -> tuple[np.ndarray, str]:
    """Load an image as the tensor a KServe input spec asks for: CHW or HWC, 1 or 3 channels, resized.

    Float inputs are scaled to [0, 1]; integer inputs keep 0..255.  A leading -1 in the shape is the
    batch axis and becomes 1 (``batched``: the model's ``max_batch_size`` is above 0; None: guessed
    from the shape); ``layout`` is the input's config ``format`` (``FORMAT_NCHW``, ``FORMAT_NHWC``),
    which says where the channels are when the dims cannot.  Colour channels stay in OpenCV's BGR
    order unless ``channel_order`` is ``rgb``: a model cannot say which it expects (Triton's
    ``format`` is the layout only), and camera pipelines built on OpenCV feed BGR.  Returns the array
    and a line that says what was sent.
    """
    if channel_order not in CHANNEL_ORDERS:
        raise InvalidArgument(f"--channel-order is {channel_order!r}; expected one of {list(CHANNEL_ORDERS)}")
    try:
        import cv2
    except ImportError:
        raise InvalidArgument(
            "--image needs OpenCV: pip install 'edge-server[image]' (on a Jetson, JetPack's python3-opencv)"
        ) from None

    shape = list(spec["shape"])
    if batched is None:
        batched = len(shape) == 4 or (len(shape) == 3 and shape[0] == -1 and shape[-1] not in (1, 3))
    dims = shape[1:] if batched else shape
    if len(dims) == 2:
        channels, chw, (height, width) = 1, False, dims
    elif layout == "FORMAT_NHWC" and dims[-1] in (1, 3):
        channels, chw, height, width = dims[-1], False, dims[0], dims[1]
    elif dims[0] in (1, 3):
        channels, chw, height, width = dims[0], True, dims[1], dims[2]
    elif dims[-1] in (1, 3):
        channels, chw, height, width = dims[-1], False, dims[0], dims[1]
    else:
        raise EdgeServerError(f"--image: cannot tell the channel axis of input shape {shape}")
    image = cv2.imread(str(path), cv2.IMREAD_GRAYSCALE if channels == 1 else cv2.IMREAD_COLOR)
    if image is None:
        raise InvalidArgument(f"--image: cannot read {path} as an image")
    if channels == 3 and channel_order == "rgb":
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    if height > 0 and width > 0:
        image = cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)
    dtype = dtypes.to_numpy(dtypes.from_wire(spec["datatype"]))
    array = image.astype(dtype) / 255.0 if dtype.kind == "f" else image.astype(dtype)
    if channels == 1 and len(dims) == 3:
        array = array[None] if chw else array[..., None]
    elif chw:
        array = array.transpose(2, 0, 1)
    array = np.ascontiguousarray(array, dtype=dtype)
    array = array[None] if batched else array
    order = channel_order.upper() if channels == 3 else "grayscale"
    scale = " scaled to [0, 1]" if dtype.kind == "f" else ""
    return array, f"{order} {array.dtype} {list(array.shape)}{scale}"


def _labels(config: dict[str, Any], model_dir: Path) -> dict[str, list[str]]:
    """Class names of outputs with a ``label_filename``, read from the model's directory on this box."""
    labels: dict[str, list[str]] = {}
    for spec in config.get("output", []):
        path = model_dir / spec.get("label_filename", "")
        if spec.get("label_filename") and path.is_file():
            with contextlib.suppress(OSError):  # not readable by this user: print scores without names
                labels[spec["name"]] = path.read_text().split("\n")
    return labels


if __name__ == "__main__":
    sys.exit(main())
