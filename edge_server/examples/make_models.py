"""Build the example Triton-style model repository from data shipped inside packages.

Usage::

    edge-server make-examples DIR [--force]              # from an installed edge-server
    python models/make_models.py [--repository models] [--force]   # in a checkout

Needs the ``models`` extra (onnx, scikit-learn, OpenCV).

Without ``--force`` only what is missing is built, so the script is cheap to run before every test or
server start.  Everything is deterministic (fixed seeds): the digits classifier is trained on
scikit-learn's bundled ``load_digits`` (no downloads), the other ONNX graphs use seeded weights.

The hand-written files (``config.pbtxt``, ``labels.txt``, the Python models) are committed in the
checkout's ``models/``; the package sees them as ``edge_server/examples/repository`` (a link to
``models/`` in a checkout, real files in a wheel) and copies them into any other directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

# The committed files: models/ in a checkout (through the link), package data in a wheel.
HERE = (Path(__file__).parent / "repository").resolve()

OPSET = 17
IR_VERSION = 8  # onnxruntime >= 1.11 loads IR 8; newer onnx would otherwise stamp a newer IR version.
SEED = 0

# Committed, hand-written files of the repository, relative to it.
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

DIGITS_HIDDEN = 64
DIGITS_MIN_ACCURACY = 0.93
SAMPLE_LABELS = tuple(range(10))

CNN_SIZE = 64
CNN_CHANNELS = (3, 32, 32, 64)  # each conv is followed by a 2x2 max pool: 64 -> 8
CNN_HIDDEN = 1024
CNN_CLASSES = 10


# --------------------------------------------------------------------------------------------- helpers

_UMASK = os.umask(0)
os.umask(_UMASK)


def _atomic_write(path: Path, write: Callable[[Path], object]) -> None:
    """Write via a temporary file and rename, so a watching server never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _save_model(model, path: Path) -> None:
    """Check the graph before writing it, so a broken model never lands in the repository."""
    import onnx

    onnx.checker.check_model(model, full_check=True)
    data = model.SerializeToString()
    _atomic_write(path, lambda p: p.write_bytes(data))


def _make_model(graph):
    """Pin opset and IR version so older onnxruntime releases (JetPack wheels) still load the file."""
    from onnx import helper

    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="edge-server make_models"
    )
    model.ir_version = IR_VERSION
    return model


def _init(name: str, array: np.ndarray):
    """Float32 initializer; ONNX has no implicit casts, so every weight must match the input dtype."""
    from onnx import numpy_helper

    return numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name)


def _session(path: Path, threads: int = 1):
    """A CPU session with fixed threads, so timings are comparable between runs and machines."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------------------------- static


def copy_static(repo: Path, force: bool, *, here: Path = HERE, files: tuple[str, ...] = STATIC_FILES) -> None:
    """Give a repository outside ``here`` (models/) the committed ``files``, so it is servable on its own."""
    if repo.resolve() == here:
        missing = [f for f in files if not (here / f).is_file()]
        if missing:
            raise SystemExit(f"committed files missing from {here}: {', '.join(missing)}")
        return
    for rel in files:
        src, dst = here / rel, repo / rel
        if dst.exists() and not force:
            continue
        _atomic_write(dst, lambda p, src=src: shutil.copyfile(src, p))  # type: ignore[misc]
        print(f"copied {rel}")


# --------------------------------------------------------------------------------------------- digits


def digits_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fixed train/test split, shared by training and the sample picker so samples stay held out."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None, :, :]  # [N, 1, 8, 8] in [0, 1]
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=SEED, stratify=y)
    return x_train, x_test, y_train, y_test


def build_digits_model(path: Path, x_train: np.ndarray, y_train: np.ndarray) -> None:
    """Train a small MLP and copy its weights into Flatten -> Gemm -> Relu -> Gemm -> Softmax."""
    from onnx import TensorProto, helper
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    clf = MLPClassifier(hidden_layer_sizes=(DIGITS_HIDDEN,), alpha=1e-3, max_iter=400, random_state=SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(x_train.reshape(len(x_train), -1), y_train)
    assert list(clf.classes_) == list(range(10)), clf.classes_
    w1, w2 = clf.coefs_
    b1, b2 = clf.intercepts_

    nodes = [
        helper.make_node("Flatten", ["image"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "w1", "b1"], ["hidden_pre"]),
        helper.make_node("Relu", ["hidden_pre"], ["hidden"]),
        helper.make_node("Gemm", ["hidden", "w2", "b2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "digits",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 10])],
        initializer=[_init("w1", w1), _init("b1", b1), _init("w2", w2), _init("b2", b2)],
    )
    _save_model(_make_model(graph), path)


def _png_roundtrip(image: np.ndarray) -> np.ndarray:
    """What the model sees after the sample PNG is read back and scaled, for picking robust samples."""
    return (np.rint(image * 255.0).astype(np.uint8).astype(np.float32) / 255.0).astype(np.float32)


def write_digits_samples(
    model_path: Path, samples_dir: Path, x_test: np.ndarray, y_test: np.ndarray
) -> float:
    """Evaluate the model file itself on held-out data and keep correctly classified samples for users."""
    import cv2

    sess = _session(model_path)
    probs = sess.run(["probabilities"], {"image": x_test})[0]
    pred = probs.argmax(axis=1)
    accuracy = float((pred == y_test).mean())
    if accuracy < DIGITS_MIN_ACCURACY:
        raise SystemExit(f"digits: held-out accuracy {accuracy:.4f} < {DIGITS_MIN_ACCURACY}")

    # Both the exact float image (.npy) and its 8-bit PNG form must be classified correctly.
    pred_png = sess.run(["probabilities"], {"image": _png_roundtrip(x_test)})[0].argmax(axis=1)
    ok = (pred == y_test) & (pred_png == y_test)
    samples_dir.mkdir(parents=True, exist_ok=True)
    for label in SAMPLE_LABELS:
        candidates = np.flatnonzero(ok & (y_test == label))
        if candidates.size == 0:
            raise SystemExit(f"digits: no correctly classified held-out sample for label {label}")
        # The most confident correct one makes the friendliest demo.
        idx = int(candidates[np.argmax(probs[candidates, label])])
        image = np.ascontiguousarray(x_test[idx], dtype=np.float32)  # [1, 8, 8]
        png = np.rint(image[0] * 255.0).astype(np.uint8)
        _atomic_write(samples_dir / f"digit_{label}.npy", lambda p, a=image: np.save(p, a))  # type: ignore[misc]

        def write_png(p: Path, img: np.ndarray = png) -> None:
            if not cv2.imwrite(str(p), img):
                raise OSError(f"cv2.imwrite failed for {p}")

        _atomic_write(samples_dir / f"digit_{label}.png", write_png)
    return accuracy


def make_digits(repo: Path, force: bool) -> None:
    """Build the classifier and/or its samples, whichever is missing."""
    model_path = repo / "digits" / "1" / "model.onnx"
    samples_dir = repo / "digits" / "samples"
    sample_files = [samples_dir / f"digit_{i}.{ext}" for i in SAMPLE_LABELS for ext in ("npy", "png")]
    build_model = force or not model_path.is_file()
    build_samples = build_model or not all(p.is_file() for p in sample_files)
    if not build_samples:
        print("digits: up to date")
        return
    t0 = time.perf_counter()
    x_train, x_test, y_train, y_test = digits_data()
    if build_model:
        build_digits_model(model_path, x_train, y_train)
    accuracy = write_digits_samples(model_path, samples_dir, x_test, y_test)
    what = "model + samples" if build_model else "samples"
    print(
        f"digits: {what} built in {time.perf_counter() - t0:.2f} s; "
        f"held-out test accuracy {accuracy:.4f} ({len(y_test)} images)"
    )


# --------------------------------------------------------------------------------------------- cnn


def build_cnn_model(path: Path) -> None:
    """Three conv/pool stages and a fully connected head, He-initialised from a fixed seed.

    The head (Flatten -> Gemm 4096x1024) is what makes batching pay off on a CPU: convolutions cost
    the same per image at any batch size, but the 16 MiB head weights are streamed once per call, so a
    batch of 8 shares them.  With global average pooling instead, time(b8) / (8 * time(b1)) stayed ~1.
    """
    from onnx import TensorProto, helper

    rng = np.random.default_rng(SEED)
    nodes = []
    inits = []
    x, size = "input", CNN_SIZE
    for i, (cin, cout) in enumerate(zip(CNN_CHANNELS[:-1], CNN_CHANNELS[1:], strict=True), start=1):
        w = rng.normal(0.0, np.sqrt(2.0 / (cin * 9)), size=(cout, cin, 3, 3))
        inits += [_init(f"conv{i}.w", w), _init(f"conv{i}.b", np.zeros(cout))]
        nodes += [
            helper.make_node(
                "Conv", [x, f"conv{i}.w", f"conv{i}.b"], [f"conv{i}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]
            ),
            helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"]),
            helper.make_node("MaxPool", [f"relu{i}"], [f"pool{i}"], kernel_shape=[2, 2], strides=[2, 2]),
        ]
        x, size = f"pool{i}", size // 2
    features = CNN_CHANNELS[-1] * size * size
    fc1_w = rng.normal(0.0, np.sqrt(2.0 / features), size=(CNN_HIDDEN, features))
    fc2_w = rng.normal(0.0, np.sqrt(2.0 / CNN_HIDDEN), size=(CNN_CLASSES, CNN_HIDDEN))
    inits += [
        _init("fc1.w", fc1_w),
        _init("fc1.b", np.zeros(CNN_HIDDEN)),
        _init("fc2.w", fc2_w),
        _init("fc2.b", np.zeros(CNN_CLASSES)),
    ]
    nodes += [
        helper.make_node("Flatten", [x], ["features"], axis=1),
        helper.make_node("Gemm", ["features", "fc1.w", "fc1.b"], ["fc1"], transB=1),
        helper.make_node("Relu", ["fc1"], ["hidden"]),
        helper.make_node("Gemm", ["hidden", "fc2.w", "fc2.b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, CNN_SIZE, CNN_SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CNN_CLASSES])],
        initializer=inits,
    )
    _save_model(_make_model(graph), path)


def median_run_seconds(sess, feed: dict[str, np.ndarray], budget_s: float = 0.4) -> float:
    """Median seconds per call; the median resists the odd scheduler hiccup on a busy machine."""
    for _ in range(5):
        sess.run(None, feed)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 15 or (time.perf_counter() < deadline and len(times) < 2000):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_cnn(path: Path) -> tuple[float, float, float]:
    """Show what dynamic batching buys on this model: per-call times at batch 1 and 8 on one thread."""
    sess = _session(path, threads=1)
    rng = np.random.default_rng(SEED + 1)
    x8 = rng.random((8, 3, CNN_SIZE, CNN_SIZE), dtype=np.float32)
    t1 = median_run_seconds(sess, {"input": x8[:1]})
    t8 = median_run_seconds(sess, {"input": x8})
    return t1, t8, t8 / (8 * t1)


def make_cnn(repo: Path, force: bool) -> None:
    """Build the benchmark CNN if missing and report its batching efficiency."""
    path = repo / "cnn" / "1" / "model.onnx"
    if path.is_file() and not force:
        print("cnn: up to date")
        return
    build_cnn_model(path)
    t1, t8, ratio = measure_cnn(path)
    print(
        f"cnn: built; 1 intra-op thread: batch 1 {t1 * 1e3:.3f} ms, batch 8 {t8 * 1e3:.3f} ms, "
        f"time(b8) / (8 * time(b1)) = {ratio:.2f}"
    )


# --------------------------------------------------------------------------------------------- identity


def make_identity(repo: Path, force: bool) -> None:
    """A one-node graph whose run time is pure serving overhead."""
    from onnx import TensorProto, helper

    path = repo / "identity" / "1" / "model.onnx"
    if path.is_file() and not force:
        print("identity: up to date")
        return
    graph = helper.make_graph(
        [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
        "identity",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["n"])],
    )
    _save_model(_make_model(graph), path)
    print("identity: built")


# --------------------------------------------------------------------------------------------- detect


def make_detect_example(repo: Path, force: bool) -> None:
    """The detector of the detect-then-classify example and its sample scenes (see make_detect.py)."""
    from edge_server.examples import make_detect

    (repo / "detect" / "1").mkdir(parents=True, exist_ok=True)  # an ensemble's (empty) version directory
    model_path = repo / "detector" / "1" / "model.onnx"
    samples = repo / "detect_classify" / "samples"
    sample_files = [
        samples / f"scene_{i}.{ext}" for i in range(make_detect.SCENES) for ext in ("png", "json")
    ]
    build_model = force or not model_path.is_file()
    build_samples = force or not all(p.is_file() for p in sample_files)
    if not (build_model or build_samples):
        print("detector: up to date")
        return
    if build_model:
        make_detect.build_detector(model_path, _save_model, _make_model)
    if build_samples:
        _, x_test, _, y_test = digits_data()
        sess = _session(repo / "digits" / "1" / "model.onnx")

        def classify(x: np.ndarray) -> np.ndarray:
            return sess.run(["probabilities"], {"image": x})[0]

        make_detect.write_scenes(samples, classify, x_test, y_test, _atomic_write)
    print(
        "detector: "
        + " + ".join(w for w, b in (("model", build_model), ("samples", build_samples)) if b)
        + " built"
    )


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Build whatever of the example repository is missing (everything with --force)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--repository", type=Path, default=HERE, help="model repository to fill (default: %(default)s)"
    )
    parser.add_argument("--force", action="store_true", help="rebuild and recopy everything")
    args = parser.parse_args(argv)
    return make(args.repository, force=args.force)


def make(repo: Path, *, force: bool = False) -> int:
    """Fill ``repo`` with the example models (what is missing, or everything with ``force``)."""
    t0 = time.perf_counter()
    repo.mkdir(parents=True, exist_ok=True)
    copy_static(repo, force)
    make_identity(repo, force)
    make_digits(repo, force)
    make_detect_example(repo, force)
    make_cnn(repo, force)
    print(f"model repository {repo} ready in {time.perf_counter() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
