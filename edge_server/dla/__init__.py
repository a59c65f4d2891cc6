"""DLA placement report: TensorRT's documented DLA rules as data, applied to an ONNX graph."""

from __future__ import annotations

from edge_server.dla.analyze import DlaReport, LayerVerdict, analyze, load_onnx
from edge_server.dla.rules import MODULE_RULES, RuleSet, load_rules

__all__ = ["MODULE_RULES", "DlaReport", "LayerVerdict", "RuleSet", "analyze", "load_onnx", "load_rules"]
