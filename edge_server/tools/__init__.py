"""Command-line tools beside the daemon: ``dla-report``, ``build-engine``, ``doctor``.

Each module exposes ``add_parser(subparsers)`` and ``run(args) -> int``; ``edge_server.cli`` registers
them with a few lines, so a tool's imports (onnx, TensorRT) happen only when that tool runs.
"""

from __future__ import annotations

# module names under edge_server.tools, in the order the CLI lists them
TOOLS = ("dla_report", "build_engine", "doctor", "status", "install_service", "make_examples")
