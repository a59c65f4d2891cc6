"""models/make_models.py builds a complete, servable example repository anywhere it is pointed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort
import pytest

from edge_server import EdgeServerError, Server
from edge_server.errors import InvalidArgument, ModelExecutionError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "models" / "make_models.py"
ONNX_MODELS = ("digits", "cnn", "identity", "detector")
STATIC_FILES = (
    "digits/config.pbtxt",
    "digits/labels.txt",
    "cnn/config.pbtxt",
    "identity/config.pbtxt",
    "preprocess/config.pbtxt",
    "preprocess/1/model.py",
    "detector/config.pbtxt",
    "detect_preprocess/config.pbtxt",
    "detect_preprocess/1/model.py",
    "detect_postprocess/config.pbtxt",
    "detect_postprocess/1/model.py",
    "detect/config.pbtxt",
    "detect_classify/config.pbtxt",
    "detect_classify/1/model.py",
)


def _build(repo: Path, *extra: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--repository", str(repo), *extra],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    repo = tmp_path_factory.mktemp("repo") / "models"
    return repo, _build(repo)


@pytest.fixture(scope="session")
def repo(built: tuple[Path, str]) -> Path:
    return built[0]


def _session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def _read_png(path: Path) -> np.ndarray:
    """A sample image as stored (8-bit grayscale), failing clearly where OpenCV cannot read it."""
    image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    assert image is not None, f"{path}: not readable by OpenCV"
    return image


# --- a minimal reader for the protobuf text format, enough for config.pbtxt -----------------------------

_TOKEN = re.compile(r'\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"#]+')


def _tokens(text: str) -> list[str]:
    out = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m, f"bad pbtxt at {text[pos : pos + 20]!r}"
        tok = m.group()
        if tok.strip() and not tok.startswith("#"):
            out.append(tok)
        pos = m.end()
    return out


def _scalar(tok: str):
    if tok.startswith('"'):
        return tok[1:-1]
    try:
        return int(tok)
    except ValueError:
        return tok


def _message(toks: list[str], i: int, end: str | None) -> tuple[dict, int]:
    msg: dict[str, list] = {}
    while i < len(toks) and toks[i] != end:
        name = toks[i]
        i += 1
        if toks[i] == ":":
            i += 1
        values = msg.setdefault(name, [])
        if toks[i] == "[":
            i += 1
            while toks[i] != "]":
                if toks[i] == ",":
                    i += 1
                    continue
                value, i = _value(toks, i)
                values.append(value)
            i += 1
        else:
            value, i = _value(toks, i)
            values.append(value)
    return msg, i + 1


def _value(toks: list[str], i: int):
    if toks[i] == "{":
        return _message(toks, i + 1, "}")
    return _scalar(toks[i]), i + 1


def read_config(path: Path) -> dict:
    return _message(_tokens(path.read_text()), 0, None)[0]


# --- tests --------------------------------------------------------------------------------------------


def test_static_files_copied_verbatim(repo: Path) -> None:
    for rel in STATIC_FILES:
        assert (repo / rel).read_bytes() == (ROOT / "models" / rel).read_bytes(), rel
    assert (repo / "digits/labels.txt").read_text().split() == [str(i) for i in range(10)]


def test_reports_accuracy_and_batch_ratio(built: tuple[Path, str]) -> None:
    out = built[1]
    accuracy = re.search(r"accuracy ([0-9.]+)", out)
    assert accuracy, out
    assert float(accuracy.group(1)) >= 0.93
    assert re.search(r"time\(b8\) / \(8 \* time\(b1\)\) = [0-9.]+", out), out


def test_second_run_builds_nothing(repo: Path) -> None:
    files = sorted(p for p in repo.rglob("*") if p.is_file())
    before = {p: p.stat().st_mtime_ns for p in files}
    out = _build(repo)
    assert out.count("up to date") == 4, out
    assert {p: p.stat().st_mtime_ns for p in files} == before


def test_missing_samples_are_rebuilt_without_retraining(tmp_path: Path, repo: Path) -> None:
    copy = tmp_path / "models"
    shutil.copytree(repo, copy)
    model = copy / "digits/1/model.onnx"
    mtime = model.stat().st_mtime_ns
    shutil.rmtree(copy / "digits/samples")
    out = _build(copy)
    assert "digits: samples built" in out, out
    assert model.stat().st_mtime_ns == mtime
    for sample in (repo / "digits/samples").iterdir():
        assert (copy / "digits/samples" / sample.name).read_bytes() == sample.read_bytes(), sample.name


def test_onnx_graphs_are_loadable_by_older_runtimes(repo: Path) -> None:
    import onnx

    for name in ONNX_MODELS:
        model = onnx.load(str(repo / name / "1" / "model.onnx"))
        onnx.checker.check_model(model)
        assert model.ir_version == 8
        assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]


def test_digits_classifies_samples(repo: Path) -> None:
    sess = _session(repo / "digits/1/model.onnx")
    samples = sorted((repo / "digits/samples").glob("digit_*.npy"))
    assert len(samples) >= 5
    for npy in samples:
        label = int(npy.stem.split("_")[1])
        image = np.load(npy)
        assert image.dtype == np.float32 and image.shape == (1, 8, 8)
        assert 0.0 <= image.min() and image.max() <= 1.0
        probs = sess.run(["probabilities"], {"image": image[None]})[0]
        assert probs.shape == (1, 10)
        assert int(probs.argmax()) == label, npy.name
        np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-5)

        png = _read_png(npy.with_suffix(".png"))
        assert png.dtype == np.uint8 and png.shape == (8, 8)
        np.testing.assert_array_equal(png, np.rint(image[0] * 255).astype(np.uint8))
        from_png = (png.astype(np.float32) / 255.0)[None, None]
        assert int(sess.run(["probabilities"], {"image": from_png})[0].argmax()) == label, npy.name


def test_digits_batches(repo: Path) -> None:
    sess = _session(repo / "digits/1/model.onnx")
    images = np.stack([np.load(p) for p in sorted((repo / "digits/samples").glob("digit_*.npy"))][:5])
    assert images.shape == (5, 1, 8, 8)
    batch = sess.run(None, {"image": images})[0]
    assert batch.shape == (5, 10)
    single = sess.run(None, {"image": images[:1]})[0]
    assert single.shape == (1, 10)
    np.testing.assert_allclose(batch[:1], single, rtol=1e-5, atol=1e-6)


def test_cnn_batches(repo: Path) -> None:
    sess = _session(repo / "cnn/1/model.onnx")
    x = np.random.default_rng(0).random((8, 3, 64, 64), dtype=np.float32)
    out8 = sess.run(["logits"], {"input": x})[0]
    out1 = sess.run(["logits"], {"input": x[:1]})[0]
    assert out8.shape == (8, 10) and out1.shape == (1, 10)
    assert np.isfinite(out8).all()
    np.testing.assert_allclose(out8[:1], out1, rtol=1e-4, atol=1e-5)


def test_identity_is_bit_exact(repo: Path) -> None:
    sess = _session(repo / "identity/1/model.onnx")
    x = np.array([0.0, -0.0, 1.5, np.inf, -np.inf, np.nan, 1e-45, 3.4e38], dtype=np.float32)
    y = sess.run(["OUTPUT0"], {"INPUT0": x})[0]
    assert y.dtype == np.float32 and y.tobytes() == x.tobytes()
    assert sess.run(None, {"INPUT0": np.empty(0, np.float32)})[0].shape == (0,)


@pytest.mark.parametrize("name", ONNX_MODELS)
def test_config_matches_graph(repo: Path, name: str) -> None:
    config = read_config(repo / name / "config.pbtxt")
    assert config["name"] == [name]
    assert config["backend"] == ["onnxruntime"]
    max_batch = config["max_batch_size"][0]
    sess = _session(repo / name / "1" / "model.onnx")
    for key, graph_tensors in (("input", sess.get_inputs()), ("output", sess.get_outputs())):
        specs = config[key]
        assert [s["name"][0] for s in specs] == [t.name for t in graph_tensors]
        for spec, tensor in zip(specs, graph_tensors, strict=True):
            assert spec["data_type"] == ["TYPE_FP32"] and tensor.type == "tensor(float)"
            shape = [d if isinstance(d, int) else -1 for d in tensor.shape]
            if max_batch > 0:
                assert shape[0] == -1, f"{name}.{tensor.name}: batch axis must be dynamic"
                shape = shape[1:]
            assert shape == spec["dims"], f"{name}.{tensor.name}"


def test_configs_batching_fields(repo: Path) -> None:
    digits = read_config(repo / "digits/config.pbtxt")
    assert digits["max_batch_size"] == [8]
    assert digits["dynamic_batching"][0]["max_queue_delay_microseconds"] == [500]
    assert digits["output"][0]["label_filename"] == ["labels.txt"]
    cnn = read_config(repo / "cnn/config.pbtxt")
    assert cnn["max_batch_size"] == [16]
    assert cnn["dynamic_batching"][0]["preferred_batch_size"] == [4, 8]
    assert cnn["dynamic_batching"][0]["max_queue_delay_microseconds"] == [2000]
    identity = read_config(repo / "identity/config.pbtxt")
    assert identity["max_batch_size"] == [0] and "dynamic_batching" not in identity
    for config in (digits, cnn, identity):
        assert config["instance_group"] == [{"kind": ["KIND_CPU"], "count": [1]}]


# --- the Python-backend model, served by the real server ------------------------------------------------


@pytest.fixture
def server(repo: Path) -> Iterator[Server]:
    """The built repository's preprocess -> digits pair, served in this process."""
    with Server(repo, model_control_mode="explicit", load_models=["preprocess", "digits"]) as server:
        yield server


def _label(server: Server, repo: Path, image: np.ndarray) -> str:
    """The digits model's class name for one preprocessed image, from its config's label file."""
    probabilities = server.infer("digits", {"image": image[None]})["probabilities"]
    assert probabilities.shape == (1, 10)
    spec = server.model_config("digits").output("probabilities")
    assert spec is not None and spec.label_filename
    labels = (repo / "digits" / spec.label_filename).read_text().split()
    return labels[int(probabilities.argmax())]


def test_preprocess_feeds_digits(server: Server, repo: Path) -> None:
    pngs = sorted((repo / "digits/samples").glob("digit_*.png"))
    assert len(pngs) >= 5
    for png_path in pngs:
        digit = png_path.stem.split("_")[1]
        png = _read_png(png_path)
        big = cv2.resize(png, (32, 40), interpolation=cv2.INTER_NEAREST)  # any size, not square
        for raw in (png, big):
            image = server.infer("preprocess", {"raw": raw})["image"]
            assert image.dtype == np.float32 and image.shape == (1, 8, 8)
            assert _label(server, repo, image) == digit, (png_path.name, raw.shape)
            if raw is png:  # already 8x8: only scaled to [0, 1]
                np.testing.assert_allclose(image[0], png / 255.0, atol=1e-6)


@pytest.mark.parametrize(
    ("raw", "error", "message"),
    [
        (np.zeros((0, 5), np.uint8), ModelExecutionError, "is empty"),  # the model's own error response
        (np.zeros((0, 0), np.uint8), ModelExecutionError, "is empty"),
        (np.zeros((4, 4, 3), np.uint8), InvalidArgument, "expected shape [-1, -1]"),  # refused at the door
        (np.zeros((4, 4), np.float32), InvalidArgument, "TYPE_UINT8"),
    ],
    ids=["empty-rows", "empty", "3-D", "float"],
)
def test_bad_image_fails_alone(
    server: Server, repo: Path, raw: np.ndarray, error: type[EdgeServerError], message: str
) -> None:
    png = _read_png(repo / "digits/samples/digit_3.png")
    # Shape and dtype are checked when the request is submitted, emptiness by the model when it runs:
    # either way the bad request fails on its own and the good ones in flight around it are answered.
    before = server.submit("preprocess", {"raw": png})
    with pytest.raises(error, match=re.escape(message)):
        server.submit("preprocess", {"raw": raw}).result(timeout=10)
    after = server.submit("preprocess", {"raw": png})
    for future in (before, after):
        assert _label(server, repo, future.result(timeout=10)["image"]) == "3"


def test_force_rebuild_is_deterministic(tmp_path: Path, repo: Path) -> None:
    copy = tmp_path / "models"
    shutil.copytree(repo, copy)
    out = _build(copy, "--force")
    assert "up to date" not in out, out
    for name in ONNX_MODELS:
        rel = f"{name}/1/model.onnx"
        assert (copy / rel).read_bytes() == (repo / rel).read_bytes(), rel
