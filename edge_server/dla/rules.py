"""DLA rules as data: which ONNX operators become which TensorRT layers, and each layer's DLA limits.

The rules live in JSON files beside this module (``rules/common.json`` plus one file per DLA generation:
``orin.json`` for DLA v2, ``xavier.json`` for v1), each rule with the reason it prints and the section of
TensorRT's "DLA Supported Layers and Restrictions" it comes from.  They are data so that a new TensorRT
release's limits are an edit to a table, reviewed against the guide, not a code change.  The repository's
``dla/rules`` points here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_server.errors import ConfigError

RULES_DIR = Path(__file__).with_name("rules")

# module name (as --module takes it) -> rules file
MODULE_RULES = {"orin": "orin.json", "xavier": "xavier.json"}

# The checks analyze.py implements; a rules file naming another is rejected when it is read.
CHECKS = frozenset(
    {
        "input_rank",
        "attr_range",
        "attr_in",
        "pads_below_kernel",
        "weight_dim_range",
        "const_input",
        "const_inputs_from",
        "fc_outputs_range",
        "input_spatial_range",
        "clip_relu",
        "broadcast",
        "min_inputs",
        "axis_channel",
        "perm_keeps_batch",
        "reduce_chw",
        "softmax_axis",
        "next_is_cast",
        "input_from",
    }
)


@dataclass(frozen=True)
class Rule:
    check: str
    reason: str
    params: dict[str, Any]


@dataclass(frozen=True)
class OpRules:
    """How one ONNX operator maps to a TensorRT layer, and the limits that layer has on the DLA."""

    op: str
    layer: str
    source: str
    rules: tuple[Rule, ...]
    input_types: tuple[str, ...] = ()  # tensor types allowed beyond the general ones (e.g. BOOL)
    output_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class General:
    max_batch: int
    max_dim: int
    max_rank: int
    data_types: frozenset[str]
    source: str


@dataclass(frozen=True)
class RuleSet:
    name: str  # "orin", "xavier"
    title: str
    generation: str  # "v2", "v1"
    source: str
    general: General
    elided: frozenset[str]
    elided_reason: str
    ops: dict[str, OpRules] = field(default_factory=dict)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read DLA rules: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: DLA rules must be a JSON object")
    return data


def _op_rules(op: str, entry: dict[str, Any], path: Path) -> OpRules:
    rules = []
    for raw in entry.get("rules", []):
        params = dict(raw)
        check = params.pop("check", None)
        reason = params.pop("reason", None)
        if check not in CHECKS or not reason:
            raise ConfigError(f"{path}: op {op!r}: rule {raw!r} needs a known 'check' and a 'reason'")
        rules.append(Rule(check=check, reason=reason, params=params))
    if not entry.get("layer") or not entry.get("source"):
        raise ConfigError(f"{path}: op {op!r} needs 'layer' and 'source'")
    return OpRules(
        op=op,
        layer=entry["layer"],
        source=entry["source"],
        rules=tuple(rules),
        input_types=tuple(entry.get("input_types", ())),
        output_types=tuple(entry.get("output_types", ())),
    )


def load_rules(module: str = "orin", *, directory: Path = RULES_DIR) -> RuleSet:
    """The rules for ``module`` ("orin" or "xavier"), merged over the common file they extend."""
    try:
        filename = MODULE_RULES[module]
    except KeyError:
        raise ConfigError(f"unknown DLA module {module!r}; known: {sorted(MODULE_RULES)}") from None
    path = directory / filename
    top = _read(path)
    base = _read(directory / top["extends"]) if top.get("extends") else {}
    ops_raw = {**base.get("ops", {}), **top.get("ops", {})}
    general_raw = {**base.get("general", {}), **top.get("general", {})}
    elided_raw = {**base.get("elided", {}), **top.get("elided", {})}
    try:
        general = General(
            max_batch=int(general_raw["max_batch"]),
            max_dim=int(general_raw["max_dim"]),
            max_rank=int(general_raw["max_rank"]),
            data_types=frozenset(general_raw["data_types"]),
            source=str(general_raw["source"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: 'general' section is incomplete: {exc}") from exc
    return RuleSet(
        name=module,
        title=str(top.get("title", module)),
        generation=str(top.get("generation", "")),
        source=str(top.get("source", base.get("source", ""))),
        general=general,
        elided=frozenset(elided_raw.get("ops", ())),
        elided_reason=str(elided_raw.get("reason", "")),
        ops={op: _op_rules(op, entry, path) for op, entry in ops_raw.items()},
    )
