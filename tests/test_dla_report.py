"""DLA report: small ONNX graphs built to hit each rule, the bundled models, the rule files, the CLI."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edge_server.cli import main
from edge_server.dla import analyze, load_onnx, load_rules
from edge_server.dla.rules import RULES_DIR, ConfigError

ORIN = load_rules("orin")
XAVIER = load_rules("xavier")
F = TensorProto.FLOAT


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """main() configures the root logger onto this test's captured stderr; put the old handlers back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def model(
    nodes: list[Any],
    inputs: list[tuple[str, int, list[Any]]],
    outputs: list[tuple[str, int, list[Any]]],
    inits: dict[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, d) for n, t, d in inputs],
        [helper.make_tensor_value_info(n, t, d) for n, t, d in outputs],
        [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return onnx.shape_inference.infer_shapes(m)


def weights(*shape: int) -> np.ndarray:
    return np.zeros(shape, dtype=np.float32)


def conv_model(k: int = 3, stride: int = 1, pad: int = 0, dil: int = 1, cout: int = 4, group: int = 1) -> Any:
    node = helper.make_node(
        "Conv",
        ["x", "w"],
        ["y"],
        kernel_shape=[k, k],
        strides=[stride] * 2,
        pads=[pad] * 4,
        dilations=[dil] * 2,
        group=group,
    )
    return model([node], [("x", F, [1, 4, 64, 64])], [("y", F, None)], {"w": weights(cout, 4 // group, k, k)})


def verdict(m: Any, rules: Any = ORIN, **kw: Any) -> tuple[str, tuple[str, ...]]:
    layer = analyze(m, rules, **kw).layers[0]
    return layer.device, layer.reasons


@pytest.mark.parametrize(
    ("kwargs", "device", "reason"),
    [
        ({}, "DLA", None),
        ({"k": 33}, "GPU", "each kernel dimension must be in [1, 32]"),
        ({"stride": 9}, "GPU", "each stride must be in [1, 8]"),
        ({"k": 3, "pad": 3}, "GPU", "padding must be less than the corresponding kernel dimension"),
        ({"dil": 33}, "GPU", "dilation must be in [1, 32]"),
        ({"cout": 8193}, "GPU", "the number of output maps must be in [1, 8192]"),
        ({"group": 2}, "DLA", None),
    ],
)
def test_convolution_limits(kwargs: dict[str, int], device: str, reason: str | None) -> None:
    got_device, reasons = verdict(conv_model(**kwargs))
    assert got_device == device
    if reason:
        assert reason in reasons


def test_convolution_weights_must_be_constant() -> None:
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3, 3])
    m = model([node], [("x", F, [1, 4, 8, 8]), ("w", F, [4, 4, 3, 3])], [("y", F, None)])
    assert "weights must be build-time constants" in verdict(m)[1]


def test_deconvolution_padding_and_groups() -> None:
    def deconv(**attrs: Any) -> Any:
        node = helper.make_node(
            "ConvTranspose", ["x", "w"], ["y"], kernel_shape=[2, 2], strides=[2, 2], **attrs
        )
        return model(
            [node],
            [("x", F, [1, 4, 8, 8])],
            [("y", F, None)],
            {"w": weights(4, 4 // attrs.get("group", 1), 2, 2)},
        )

    assert verdict(deconv())[0] == "DLA"
    assert "padding must be 0" in verdict(deconv(pads=[1, 1, 1, 1]))[1]
    assert "grouped deconvolution is not supported" in verdict(deconv(group=2))[1]


@pytest.mark.parametrize(
    ("attrs", "reason"),
    [
        ({"kernel_shape": [2, 2], "strides": [2, 2]}, None),
        ({"kernel_shape": [9, 9]}, "the window size must be in [1, 8]"),
        ({"kernel_shape": [2, 2], "strides": [17, 17]}, "the stride must be in [1, 16]"),
        ({"kernel_shape": [8, 8], "pads": [8, 8, 8, 8]}, "padding must be in [0, 7]"),
    ],
)
def test_pooling_limits(attrs: dict[str, Any], reason: str | None) -> None:
    m = model(
        [helper.make_node("MaxPool", ["x"], ["y"], **attrs)], [("x", F, [1, 4, 64, 64])], [("y", F, None)]
    )
    device, reasons = verdict(m)
    assert (device, reason in reasons if reason else True) == ("GPU" if reason else "DLA", True)


def test_global_pool_window_is_the_feature_map() -> None:
    def gap(side: int) -> Any:
        node = helper.make_node("GlobalAveragePool", ["x"], ["y"])
        return model([node], [("x", F, [1, 8, side, side])], [("y", F, None)])

    assert verdict(gap(7))[0] == "DLA"
    assert verdict(gap(16))[0] == "GPU"


@pytest.mark.parametrize(
    ("low", "high", "device"), [(0.0, 6.0, "DLA"), (0.0, 200.0, "GPU"), (-1.0, 6.0, "GPU")]
)
def test_clip_runs_only_as_clipped_relu(low: float, high: float, device: str) -> None:
    node = helper.make_node("Clip", ["x", "lo", "hi"], ["y"])
    inits = {"lo": np.array(low, np.float32), "hi": np.array(high, np.float32)}
    m = model([node], [("x", F, [1, 4, 8, 8])], [("y", F, None)], inits)
    assert verdict(m)[0] == device


def test_concat_only_on_channels() -> None:
    def concat(axis: int) -> Any:
        node = helper.make_node("Concat", ["a", "b"], ["y"], axis=axis)
        return model([node], [("a", F, [1, 4, 8, 8]), ("b", F, [1, 4, 8, 8])], [("y", F, None)])

    assert verdict(concat(1))[0] == "DLA"
    assert "concatenation is supported only along the channel axis" in verdict(concat(2))[1]


def test_elementwise_broadcast_forms() -> None:
    def add(shape: list[int]) -> Any:
        node = helper.make_node("Add", ["x", "c"], ["y"])
        return model([node], [("x", F, [1, 4, 8, 8])], [("y", F, None)], {"c": weights(*shape)})

    assert verdict(add([1, 4, 1, 1]))[0] == "DLA"  # per channel
    assert verdict(add([4, 1, 1]))[0] == "DLA"  # per channel, numpy-style rank
    assert verdict(add([1]))[0] == "DLA"  # uniform
    assert verdict(add([1, 1, 8, 8]))[0] == "GPU"  # per pixel, shared over channels


def test_softmax_is_orin_only() -> None:
    m = model([helper.make_node("Softmax", ["x"], ["y"], axis=1)], [("x", F, [1, 4, 8, 8])], [("y", F, None)])
    assert verdict(m, ORIN)[0] == "DLA"
    device, reasons = verdict(m, XAVIER)
    assert device == "GPU" and "Softmax has no DLA implementation on DLA v1 (xavier)" in reasons
    m0 = model(
        [helper.make_node("Softmax", ["x"], ["y"], axis=0)], [("x", F, [1, 4, 8, 8])], [("y", F, None)]
    )
    assert "the axis must be a non-batch dimension" in verdict(m0, ORIN)[1]


def test_comparison_then_cast_on_orin() -> None:
    nodes = [
        helper.make_node("Greater", ["x", "t"], ["mask"]),
        helper.make_node("Cast", ["mask"], ["y"], to=TensorProto.FLOAT16),
    ]
    m = model(nodes, [("x", F, [1, 4, 8, 8])], [("y", TensorProto.FLOAT16, None)], {"t": weights(1)})
    report = analyze(m, ORIN)
    assert [layer.device for layer in report.layers] == ["DLA", "DLA"]
    assert [layer.device for layer in analyze(m, XAVIER).layers] == ["GPU", "GPU"]


def test_integer_tensors_and_unknown_ops_fall_back() -> None:
    nodes = [helper.make_node("ArgMax", ["x"], ["y"], axis=1)]
    m = model(nodes, [("x", F, [1, 4, 8, 8])], [("y", TensorProto.INT64, None)])
    device, reasons = verdict(m)
    assert device == "GPU" and any("ArgMax has no DLA implementation" in r for r in reasons)
    relu_int = model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [("x", TensorProto.INT32, [1, 4, 8, 8])],
        [("y", TensorProto.INT32, None)],
    )
    assert any("is INT32; the DLA runs FP16 and INT8 tensors only" in r for r in verdict(relu_int)[1])


def test_dynamic_and_oversized_dimensions() -> None:
    relu = helper.make_node("Relu", ["x"], ["y"])
    dynamic = model([relu], [("x", F, ["n", 4, "h", 8])], [("y", F, None)])
    report = analyze(dynamic, ORIN)
    assert any("dynamic dimensions" in r for r in report.layers[0].reasons)
    assert any("min = opt = max" in note for note in report.notes)
    assert (
        analyze(model([relu], [("x", F, ["n", 4, 8, 8])], [("y", F, None)]), ORIN).layers[0].device == "DLA"
    )
    wide = model([relu], [("x", F, [1, 4, 1, 9000])], [("y", F, None)])
    assert any("dimension over 8192" in r for r in verdict(wide)[1])
    big_batch = model([relu], [("x", F, ["n", 4, 8, 8])], [("y", F, None)])
    assert any("over the DLA's 4096" in r for r in verdict(big_batch, batch=5000)[1])


def test_lrn_reduce_transpose_rules() -> None:
    x = [("x", F, [1, 4, 8, 8])]
    assert verdict(model([helper.make_node("LRN", ["x"], ["y"], size=5)], x, [("y", F, None)]))[0] == "DLA"
    assert verdict(model([helper.make_node("LRN", ["x"], ["y"], size=4)], x, [("y", F, None)]))[0] == "GPU"
    chw = model([helper.make_node("ReduceMax", ["x"], ["y"], axes=[1, 2, 3])], x, [("y", F, None)])
    assert verdict(chw)[0] == "DLA"
    c_only = model([helper.make_node("ReduceMax", ["x"], ["y"], axes=[1])], x, [("y", F, None)])
    assert "only a MAX reduction over all of C, H and W is supported" in verdict(c_only)[1]
    swap_batch = model([helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0, 2, 3])], x, [("y", F, None)])
    assert verdict(swap_batch)[0] == "GPU"


def test_transitions_and_subgraphs() -> None:
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], kernel_shape=[1, 1]),
        helper.make_node("LRN", ["a"], ["b"], size=4),  # GPU
        helper.make_node("Conv", ["b", "w2"], ["c"], kernel_shape=[1, 1]),
        helper.make_node("Identity", ["c"], ["d"]),  # no layer: looked through
        helper.make_node("Relu", ["d"], ["y"]),
    ]
    m = model(
        nodes,
        [("x", F, [1, 4, 8, 8])],
        [("y", F, None)],
        {"w1": weights(4, 4, 1, 1), "w2": weights(4, 4, 1, 1)},
    )
    report = analyze(m, ORIN)
    assert [layer.device for layer in report.layers] == ["DLA", "GPU", "DLA", "-", "DLA"]
    assert (report.on_dla, report.on_gpu, report.transitions, report.dla_subgraphs) == (3, 1, 2, 2)


def test_bundled_models(example_repository: Path) -> None:
    cnn = analyze(load_onnx(example_repository / "cnn/1/model.onnx"), ORIN, name="cnn")
    convs = [layer for layer in cnn.layers if layer.op in ("Conv", "MaxPool")]
    assert convs and all(layer.device == "DLA" for layer in convs)
    digits_xavier = analyze(load_onnx(example_repository / "digits/1/model.onnx"), XAVIER)
    softmax = next(layer for layer in digits_xavier.layers if layer.op == "Softmax")
    assert softmax.device == "GPU"
    identity = analyze(load_onnx(example_repository / "identity/1/model.onnx"), ORIN)
    assert (identity.on_dla, identity.on_gpu, identity.transitions) == (0, 0, 0)


def test_rule_files_name_their_sources() -> None:
    for rules in (ORIN, XAVIER):
        assert rules.source and rules.general.source
        for entry in rules.ops.values():
            assert entry.source and entry.layer and all(rule.reason for rule in entry.rules)
    assert "Softmax" in ORIN.ops and "Softmax" not in XAVIER.ops


def test_bad_rule_files_are_rejected(tmp_path: Path) -> None:
    data = json.loads((RULES_DIR / "common.json").read_text())
    data["ops"]["Relu"]["rules"] = [{"check": "no_such_check", "reason": "x"}]
    (tmp_path / "common.json").write_text(json.dumps(data))
    (tmp_path / "orin.json").write_text((RULES_DIR / "orin.json").read_text())
    with pytest.raises(ConfigError, match="needs a known 'check'"):
        load_rules("orin", directory=tmp_path)
    with pytest.raises(ConfigError, match="unknown DLA module"):
        load_rules("thor")


def test_cli_table_and_json(example_repository: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = example_repository / "digits/1/model.onnx"
    assert main(["dla-report", str(path), "--module", "xavier"]) == 0
    out = capsys.readouterr().out
    assert (
        "WHY NOT DLA" in out and "Softmax has no DLA implementation" in out and "DLA<->GPU transitions" in out
    )
    assert main(["dla-report", str(path), "--module", "orin", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["module"] == "orin" and data["on_dla"] + data["on_gpu"] == len(data["layers"])


def test_cli_not_an_onnx_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"not a model")
    assert main(["dla-report", str(bad), "--module", "orin"]) == 1
    assert "INVALID_CONFIG" in capsys.readouterr().err


def test_missing_onnx_package_is_a_clear_error(
    example_repository: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "onnx", None)  # what an install without the 'dla' extra looks like
    assert main(["dla-report", str(example_repository / "cnn/1/model.onnx"), "--module", "orin"]) == 1
    err = capsys.readouterr().err
    assert "MISSING_DEPENDENCY" in err and "pip install 'edge-server[dla]'" in err
