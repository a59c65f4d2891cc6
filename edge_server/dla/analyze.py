"""Which layers of an ONNX model TensorRT can place on a DLA core, from the graph alone.

Each node is mapped to the TensorRT layer the ONNX parser makes of it and checked against the DLA rules
of one generation (``rules.py``): general limits (data types, rank, dimension and batch sizes, static
shapes) and the layer's own (kernel, stride, padding, dilation, channels, broadcast forms, ...).  A node
that fails any check falls back to the GPU with every reason listed.  The summary counts the tensors that
cross between DLA and GPU (each crossing is a copy and a synchronisation) and the DLA subgraphs (each is
one DLA loadable; a core holds at most 16).

This is a prediction from TensorRT's documented rules: ``build-engine`` asks the builder
(``IBuilderConfig.can_run_on_DLA``) for the final word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_server.dla.rules import OpRules, Rule, RuleSet
from edge_server.errors import ConfigError, MissingDependency

DLA, GPU, NONE = "DLA", "GPU", "-"


@dataclass(frozen=True)
class LayerVerdict:
    index: int
    name: str
    op: str
    layer: str  # the TensorRT layer the parser makes of it
    device: str  # "DLA", "GPU", or "-" for nodes that become no layer
    reasons: tuple[str, ...] = ()  # why not on the DLA (empty when it runs there)
    source: str = ""  # the guide's section the deciding rules come from


@dataclass(frozen=True)
class DlaReport:
    model: str
    module: str
    generation: str
    batch: int
    layers: tuple[LayerVerdict, ...]
    transitions: int
    dla_subgraphs: int
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def on_dla(self) -> int:
        return sum(1 for layer in self.layers if layer.device == DLA)

    @property
    def on_gpu(self) -> int:
        return sum(1 for layer in self.layers if layer.device == GPU)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["on_dla"], out["on_gpu"] = self.on_dla, self.on_gpu
        return out


@dataclass
class _Tensor:
    dtype: str
    dims: list[int | None] | None  # None: shape unknown; an entry None: dynamic


class _Graph:
    """The facts the checks need: tensor types and shapes, constants, producers and consumers."""

    def __init__(self, model: Any, batch: int) -> None:
        import onnx
        from onnx import numpy_helper

        graph = model.graph
        self.batch = batch
        self.tensors: dict[str, _Tensor] = {}
        for info in (*graph.input, *graph.value_info, *graph.output):
            ttype = info.type.tensor_type
            dtype = onnx.TensorProto.DataType.Name(ttype.elem_type) if ttype.elem_type else "UNDEFINED"
            dims: list[int | None] | None = None
            if ttype.HasField("shape"):
                dims = [d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim]
            self.tensors[info.name] = _Tensor(dtype, dims)
        self.constants: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.output:
                for attr in node.attribute:
                    if attr.name == "value":
                        self.constants[node.output[0]] = numpy_helper.to_array(attr.t)
        self.producer: dict[str, Any] = {}
        self.consumers: dict[str, list[Any]] = {}
        for node in graph.node:
            for out in node.output:
                self.producer[out] = node
            for inp in node.input:
                self.consumers.setdefault(inp, []).append(node)

    def dims(self, name: str) -> list[int | None] | None:
        if name in self.constants:
            return list(self.constants[name].shape)
        tensor = self.tensors.get(name)
        if tensor is None or tensor.dims is None:
            return None
        dims = list(tensor.dims)
        if dims and dims[0] is None:
            dims[0] = self.batch  # the batch axis: the engine is built for this batch size
        return dims

    def is_const(self, name: str) -> bool:
        return name in self.constants


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    values = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        values[attr.name] = value.decode() if isinstance(value, bytes) else value
    return values


class _Checker:
    """One node against one op's rules; each check returns a failure reason or None."""

    def __init__(self, graph: _Graph, node: Any) -> None:
        self.g = graph
        self.node = node
        self.attrs = _attrs(node)

    def _input(self, index: int) -> str:
        inputs = self.node.input
        return inputs[index] if index < len(inputs) else ""

    def _attr(self, rule: Rule) -> Any:
        name = rule.params["attr"]
        if name in self.attrs:
            return self.attrs[name]
        if name == "kernel_shape" and self.g.is_const(self._input(1)):
            return list(self.g.constants[self._input(1)].shape[2:])  # Conv: from the weights
        return rule.params.get("default")

    def run(self, rule: Rule) -> str | None:
        method = getattr(self, f"check_{rule.check}")
        ok = method(rule.params)
        return None if ok in (True, None) else rule.reason

    # Each check: True/None when it holds (None: not decidable from the graph), False when it fails.

    def check_input_rank(self, p: dict[str, Any]) -> bool | None:
        dims = self.g.dims(self._input(p["index"]))
        return None if dims is None else len(dims) in p["values"]

    def check_attr_range(self, p: dict[str, Any]) -> bool | None:
        value = self._attr(Rule("attr_range", "", p))
        if value is None:
            return None
        values = value if isinstance(value, (list, tuple)) else [value]
        return all(p["min"] <= v <= p["max"] for v in values)

    def check_attr_in(self, p: dict[str, Any]) -> bool | None:
        value = self._attr(Rule("attr_in", "", p))
        return None if value is None else value in p["values"]

    def check_pads_below_kernel(self, p: dict[str, Any]) -> bool | None:
        pads = self.attrs.get("pads")
        kernel = self._attr(Rule("", "", {"attr": "kernel_shape"}))
        if not pads or not kernel:
            return None
        return all(pad < kernel[i % len(kernel)] for i, pad in enumerate(pads))

    def check_weight_dim_range(self, p: dict[str, Any]) -> bool | None:
        name = self._input(p["index"])
        if not self.g.is_const(name):
            return None
        shape = self.g.constants[name].shape
        size = shape[p["axis"]] * (self.attrs.get("group", 1) if self.node.op_type == "ConvTranspose" else 1)
        return p["min"] <= size <= p["max"]

    def check_const_input(self, p: dict[str, Any]) -> bool:
        name = self._input(p["index"])
        return not name or self.g.is_const(name)

    def check_const_inputs_from(self, p: dict[str, Any]) -> bool:
        return all(not name or self.g.is_const(name) for name in self.node.input[p["index"] :])

    def check_fc_outputs_range(self, p: dict[str, Any]) -> bool | None:
        name = self._input(1)
        if not self.g.is_const(name):
            return None
        shape = self.g.constants[name].shape
        outputs = shape[0] if self.node.op_type == "Gemm" and self.attrs.get("transB", 0) else shape[-1]
        return p["min"] <= outputs <= p["max"]

    def check_input_spatial_range(self, p: dict[str, Any]) -> bool | None:
        dims = self.g.dims(self._input(p["index"]))
        if dims is None or any(d is None for d in dims[2:]):
            return None
        return all(p["min"] <= d <= p["max"] for d in dims[2:] if d is not None)

    def check_clip_relu(self, p: dict[str, Any]) -> bool:
        low, high = self.attrs.get("min"), self.attrs.get("max")  # opset < 11 attributes
        for index, current in ((1, low), (2, high)):
            name = self._input(index)
            if name:
                if not self.g.is_const(name):
                    return False
                value = float(self.g.constants[name])
                low, high = (value, high) if index == 1 else (low, value)
            elif index == 1:
                low = current
        return low == p["min"] and high is not None and p["max_low"] <= high <= p["max_high"]

    def check_broadcast(self, p: dict[str, Any]) -> bool | None:
        out = self.g.dims(self.node.output[0])
        if out is None or len(out) != 4:
            return None
        for name in self.node.input:
            dims = self.g.dims(name)
            if dims is None:
                return None
            shape = [1] * (4 - len(dims)) + list(dims)
            if shape == out:
                continue
            per_channel = shape[2:] == [1, 1] and shape[1] in (out[1], 1) and shape[0] in (out[0], 1)
            if not per_channel:
                return False
        return True

    def check_min_inputs(self, p: dict[str, Any]) -> bool:
        return len([name for name in self.node.input if name]) >= p["count"]

    def _rank(self) -> int | None:
        dims = self.g.dims(self._input(0))
        return None if dims is None else len(dims)

    def check_axis_channel(self, p: dict[str, Any]) -> bool | None:
        rank, axis = self._rank(), self.attrs.get("axis")
        if rank is None or axis is None:
            return None
        return axis % rank == 1

    def check_perm_keeps_batch(self, p: dict[str, Any]) -> bool | None:
        perm = self.attrs.get("perm")
        return None if perm is None else perm[0] == 0

    def check_reduce_chw(self, p: dict[str, Any]) -> bool | None:
        rank = self._rank()
        axes = self.attrs.get("axes")
        if axes is None and self._input(1):
            axes = list(self.g.constants.get(self._input(1), np.array([0])).ravel())
        if rank is None:
            return None
        if axes is None:
            return False  # all axes, the batch included
        return sorted(a % rank for a in axes) == [1, 2, 3]

    def check_softmax_axis(self, p: dict[str, Any]) -> bool | None:
        rank = self._rank()
        axis = self.attrs.get("axis", -1)
        return None if rank is None else axis % rank != 0

    def check_next_is_cast(self, p: dict[str, Any]) -> bool:
        consumers = self.g.consumers.get(self.node.output[0], [])
        return bool(consumers) and all(c.op_type == "Cast" for c in consumers)

    def check_input_from(self, p: dict[str, Any]) -> bool:
        producer = self.g.producer.get(self._input(0))
        return producer is not None and producer.op_type in p["ops"]


def _general_reasons(graph: _Graph, node: Any, rules: RuleSet, op: OpRules) -> list[str]:
    general = rules.general
    reasons = []
    for role, names, extra in (
        ("input", node.input, op.input_types),
        ("output", node.output, op.output_types),
    ):
        for name in names:
            if not name or graph.is_const(name):
                continue
            tensor = graph.tensors.get(name)
            if tensor is not None and tensor.dtype not in general.data_types | set(extra):
                reasons.append(f"{role} {name!r} is {tensor.dtype}; the DLA runs FP16 and INT8 tensors only")
            dims = graph.dims(name)
            if dims is None:
                continue
            if len(dims) > general.max_rank:
                reasons.append(f"{role} {name!r} has {len(dims)} dimensions; the DLA takes at most 4")
            if any(d is None for d in dims[1:]):
                reasons.append(f"{role} {name!r} has dynamic dimensions {dims}; the DLA needs static shapes")
            elif any(d is not None and d > general.max_dim for d in dims[1:]):
                reasons.append(f"{role} {name!r} has a dimension over {general.max_dim}: {dims}")
            if dims and dims[0] is not None and dims[0] > general.max_batch:
                reasons.append(f"{role} {name!r} has batch {dims[0]} over the DLA's {general.max_batch}")
    return reasons


def load_onnx(path: Path) -> Any:
    """The ONNX model at ``path`` with shapes inferred; a clear error when ``onnx`` is not installed."""
    try:
        import onnx
    except ImportError:
        raise MissingDependency(
            "the DLA report reads ONNX graphs with the 'onnx' package, which is not installed: "
            "pip install 'edge-server[dla]'"
        ) from None
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # onnx raises DecodeError, OSError, ...
        raise ConfigError(f"{path}: not a readable ONNX model: {exc}") from exc
    try:
        return onnx.shape_inference.infer_shapes(model)
    except Exception:  # a model shape inference cannot follow is still worth reporting on
        return model


def analyze(model: Any, rules: RuleSet, *, batch: int = 1, name: str = "") -> DlaReport:
    """Classify every node of ``model`` (an ``onnx.ModelProto``, see :func:`load_onnx`)."""
    graph = _Graph(model, batch)
    verdicts: list[LayerVerdict] = []
    device_of: dict[int, str] = {}
    notes: list[str] = []
    for index, node in enumerate(model.graph.node):
        op = node.op_type
        label = node.name or f"{op}_{index}"
        if op in rules.elided:
            verdicts.append(LayerVerdict(index, label, op, "(none)", NONE, (rules.elided_reason,)))
            continue
        entry = rules.ops.get(op)
        if entry is None:
            reason = f"{op} has no DLA implementation on DLA {rules.generation} ({rules.name})"
            verdicts.append(
                LayerVerdict(index, label, op, "?", GPU, (reason,), "Layer Support and Restrictions")
            )
            device_of[id(node)] = GPU
            continue
        checker = _Checker(graph, node)
        reasons = _general_reasons(graph, node, rules, entry)
        reasons += [r for r in (checker.run(rule) for rule in entry.rules) if r]
        device = GPU if reasons else DLA
        device_of[id(node)] = device
        verdicts.append(LayerVerdict(index, label, op, entry.layer, device, tuple(reasons), entry.source))
    transitions, subgraphs = _crossings(model.graph.node, graph, rules, device_of)
    if any(d is None for info in model.graph.input for d in (graph.dims(info.name) or [])[1:]):
        notes.append("the model has dynamic non-batch input dimensions; a DLA build needs min = opt = max")
    if subgraphs > 16:
        notes.append(f"{subgraphs} DLA subgraphs: a DLA core holds at most 16 loadables at once")
    return DlaReport(
        model=name,
        module=rules.name,
        generation=rules.generation,
        batch=batch,
        layers=tuple(verdicts),
        transitions=transitions,
        dla_subgraphs=subgraphs,
        notes=tuple(notes),
    )


def _crossings(
    nodes: Sequence[Any], graph: _Graph, rules: RuleSet, device_of: dict[int, str]
) -> tuple[int, int]:
    """Tensors that cross DLA<->GPU, and connected DLA subgraphs (no-op nodes are looked through)."""

    def source(tensor: str) -> Any:
        node = graph.producer.get(tensor)
        while node is not None and node.op_type in rules.elided and node.input:
            node = graph.producer.get(node.input[0])
        return node if node is not None and id(node) in device_of else None

    crossings: set[tuple[str, str]] = set()
    parent: dict[int, int] = {id(n): id(n) for n in nodes if device_of.get(id(n)) == DLA}

    def find(key: int) -> int:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for node in nodes:
        device = device_of.get(id(node))
        if device is None:
            continue
        for tensor in node.input:
            producer = source(tensor) if tensor else None
            if producer is None:
                continue
            if device_of[id(producer)] != device:
                crossings.add((tensor, device))
            elif device == DLA:
                parent[find(id(node))] = find(id(producer))
    subgraphs = len({find(key) for key in parent})
    return len(crossings), subgraphs
