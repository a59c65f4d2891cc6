"""``edge-server`` command line: every command's parser, and the one place errors become exit statuses.

Each command's flags and work live in a module of their own (:mod:`.serve`, :mod:`.client_commands`,
the tools in :mod:`edge_server.tools`, :mod:`edge_server.perf`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from edge_server import __version__
from edge_server.cli.arguments import UsageError
from edge_server.cli.client_commands import add_client_parsers, run_infer, run_models
from edge_server.cli.log_setup import configure_logging
from edge_server.cli.serve import add_serve_parser, run_serve
from edge_server.errors import EdgeServerError

log = logging.getLogger("edge_server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-server",
        description="``edge-server`` command line: serve, models, infer.  Flag names follow Triton's "
        "where it has one.",
    )
    parser.add_argument("--version", action="version", version=f"edge-server {__version__}")
    parser.add_argument("--log-verbose", type=int, default=0, help="0: info, 1 or more: debug")
    parser.add_argument("--log-format", choices=["default", "ISO8601", "json"], default="default")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    add_client_parsers(commands)
    _add_tools(commands)
    return parser


def _add_tools(commands: Any) -> None:
    """Register the tools in edge_server/tools (dla-report, build-engine, doctor); each sets ``tool_run``."""
    from edge_server.tools import TOOLS

    for name in TOOLS:
        importlib.import_module(f"edge_server.tools.{name}").add_parser(commands)
    importlib.import_module("edge_server.perf.command").add_parser(commands)  # perf: its own package


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
            return run_serve(args)
        if args.command == "models":
            return run_models(args)
        if hasattr(args, "tool_run"):  # a tool from edge_server/tools
            return int(args.tool_run(args))
        return run_infer(args)
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        print(f"edge-server {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except EdgeServerError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
