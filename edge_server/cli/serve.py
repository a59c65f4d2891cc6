"""``edge-server serve``: its flags (names follow Triton's where it has one), and the daemon they start."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from edge_server.backends.base import ONNXRUNTIME_THREAD_POLICIES
from edge_server.cli.arguments import RepeatedFlag, UsageError
from edge_server.flag_types import boolean, positive
from edge_server.ipc import protocol
from edge_server.ipc.protocol import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from edge_server.kserve import grpc_env
from edge_server.kserve.frontends import add_kserve_arguments, kserve_options
from edge_server.limits import add_limit_arguments, limit_options
from edge_server.metrics.options import metrics_config_item, summary_options
from edge_server.server import CONTROL_MODES, default_repository

log = logging.getLogger("edge_server")


def add_serve_parser(commands: Any) -> None:
    """Register ``serve`` and its flags; the settings file becomes this parser's defaults."""
    serve = commands.add_parser("serve", help="run the server on a model repository")
    serve.set_defaults(subparser=serve)  # the settings file becomes this parser's defaults
    serve.add_argument(
        "--settings",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML settings, one key per flag (default: $CONFIGURATION_DIRECTORY/edge-server.toml)",
    )
    serve.add_argument(
        "--model-repository",
        type=Path,
        action=RepeatedFlag,
        default=None,
        metavar="DIR",
        help="a model repository; repeat it to serve several (model names must be unique across them); "
        "default in a checkout: the bundled models/ and, when its models are made, models_ocr/",
    )
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
        help="IPC and gRPC streams: bytes of replies one user (uid) may leave unread over all its "
        "connections and streams; past it the one holding the most is disconnected (cancelled)",
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


def bundled_repositories() -> list[Path]:
    """What ``serve`` serves without ``--model-repository`` in a checkout: both example repositories.

    ``models/`` always; ``models_ocr/`` when its models are made (they are copied from a wheel that
    installs only on Python < 3.13), else one log line says why not.  An installed package has
    neither: empty.
    """
    models = default_repository()
    if not models.is_dir():
        return []
    ocr = models.parent / "models_ocr"
    if not ocr.is_dir():
        return [models]
    from edge_server.examples.make_ocr import not_made

    why = not_made(ocr)
    if why is not None:
        log.info("not serving the OCR example %s: %s", ocr, why)
        return [models]
    return [models, ocr]


def run_serve(args: argparse.Namespace) -> int:
    """``edge-server serve``: the daemon, until SIGTERM or SIGINT."""
    # Modules a model.py imports from the repository leave no bytecode there: the repository belongs to
    # its owner and its OTA agent, and may be read-only (model files themselves: backends/python.py).
    sys.dont_write_bytecode = True
    # Python models see the argv of Triton's stub, the program alone: a model's unittest.main() or
    # argparse must not parse the daemon's flags (L0_backend_python's models call unittest.main).
    sys.argv[1:] = []
    # before anything (a model.py) imports grpc, which reads its settings then
    grpc_env.poll_connections_on_the_queue()
    from edge_server.daemon import Daemon, DaemonOptions

    repositories = args.model_repository or bundled_repositories()
    if not repositories:
        raise UsageError(
            "no model repository: pass --model-repository DIR, a folder in Triton's layout "
            "(DIR/<model>/config.pbtxt, DIR/<model>/<version>/model.onnx|model.py|model.plan), or set "
            "model-repository in the settings file (--settings FILE; the service reads "
            "/etc/edge-server/edge-server.toml, written by `edge-server install-service`)"
        )

    options = DaemonOptions(
        model_repositories=tuple(repositories),
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
