"""``edge-server dla-report model.onnx``: which layers will run on a DLA core, before a long build."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from edge_server.dla import MODULE_RULES, DlaReport, analyze, load_onnx, load_rules


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "dla-report",
        help="predict which layers of an ONNX model run on the DLA and which fall back to the GPU",
        description=(
            "Check every node of an ONNX model against TensorRT's documented DLA restrictions for one DLA "
            "generation and count the DLA<->GPU transitions. No GPU or TensorRT needed."
        ),
    )
    parser.add_argument("model", type=Path, help="an ONNX model file")
    parser.add_argument(
        "--module",
        choices=sorted(MODULE_RULES),
        default=None,
        help="DLA generation (default: this device's, else orin)",
    )
    parser.add_argument("--batch", type=int, default=1, help="the batch size the engine will be built for")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(tool_run=run)


def _default_module() -> str:
    from edge_server.platform import platform_report

    report = platform_report()
    return "xavier" if report.dla_generation == "v1" else "orin"


def format_report(report: DlaReport) -> str:
    """The table a person reads: one row per node, then the summary."""
    rows = [("#", "NODE", "OP", "TENSORRT LAYER", "DEVICE", "WHY NOT DLA")]
    for layer in report.layers:
        why = "; ".join(layer.reasons) if layer.device != "DLA" else ""
        rows.append((str(layer.index), layer.name, layer.op, layer.layer, layer.device, why))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:5])) + "  " + row[5] for row in rows
    ]
    counted = report.on_dla + report.on_gpu
    lines.append("")
    lines.append(
        f"{report.model}: DLA {report.generation} ({report.module}), batch {report.batch}: "
        f"{report.on_dla} of {counted} layers on the DLA, {report.on_gpu} fall back to the GPU, "
        f"{report.transitions} DLA<->GPU transitions, {report.dla_subgraphs} DLA subgraphs"
    )
    lines.extend(f"note: {note}" for note in report.notes)
    return "\n".join(line.rstrip() for line in lines)


def run(args: argparse.Namespace) -> int:
    if args.batch < 1:
        raise SystemExit("--batch must be at least 1")
    module = args.module or _default_module()
    rules = load_rules(module)
    report = analyze(load_onnx(args.model), rules, batch=args.batch, name=str(args.model))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    return 0
