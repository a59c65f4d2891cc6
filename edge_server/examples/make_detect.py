"""The detect-then-classify example: a hand-built detector in YOLOv8's layout and sample scenes.

Called by ``make_models.py`` (after the digits classifier exists).  Nothing is downloaded: the scenes
are drawn from scikit-learn's bundled digits.

**The scenes** (``detect_classify/samples/scene_<i>.png`` + ``.json`` with the truth): a dark, noisy
256x192 BGR canvas with up to six square tiles (40, 48 or 56 px) in red, green or blue, each showing
one held-out digit in white strokes.

**The detector** (``detector/1/model.onnx``) has the interface of an exported YOLOv8/YOLO11 model:
input ``images`` [1, 3, 128, 128] RGB in [0, 1] (letterboxed), output ``output0`` [1, 4 + 3, 1024]:
for each of 32x32 anchors (stride 4, row-major) the box centre, width and height in input pixels and
one score per class (red, green, blue).  It is a fixed graph, not a trained one: a bright-pixel mask
(any channel above 0.5), and per anchor, over a 40x40 window, the mask's mass, mean and variance in x
and y (a solid rectangle of width w has variance w**2 / 12) and its mean colour.  Objectness is the
mask at the anchor centre times (mass in the window / mass in a 48x48 window) ** 8, which is 1 only
where the window holds a whole tile and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

DET_SIZE = 128
STRIDE = 4
INNER = 40  # window for the box moments
OUTER = 48  # window whose extra mass lowers the score of anchors that see a tile only in part
CLASSES = ("red", "green", "blue")
COLORS_BGR = {"red": (40, 40, 230), "green": (50, 200, 50), "blue": (230, 90, 40)}
SCENE_W, SCENE_H = 256, 192
TILE_SIZES = (40, 48, 56)  # multiples of 8: the 8x8 digit comes back exactly from a crop
GRID = (3, 2)  # cells of the canvas; one tile at most per cell keeps tiles apart
SCENES = 4
SEED = 11


def build_detector(
    path: Path, save: Callable[[object, Path], None], make_model: Callable[[object], object]
) -> None:
    """Write the detector graph (see the module doc) with ``save``/``make_model`` from make_models."""
    from onnx import TensorProto, helper, numpy_helper

    def const(name: str, array: np.ndarray) -> object:
        return numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name)

    grid = np.arange(DET_SIZE, dtype=np.float32) + 0.5  # pixel centres
    xs = np.broadcast_to(grid[None, :], (DET_SIZE, DET_SIZE))[None, None]
    ys = np.broadcast_to(grid[:, None], (DET_SIZE, DET_SIZE))[None, None]
    anchors = DET_SIZE // STRIDE
    inits: list[Any] = [
        const("half", np.array(0.5)),
        const("steep", np.array(200.0)),
        const("X", xs),
        const("Y", ys),
        const("inner_w", np.ones((8, 1, INNER, INNER))),
        const("outer_w", np.ones((1, 1, OUTER, OUTER))),
        const("eps", np.array(1e-3)),
        const("twelve", np.array(12.0)),
        const("power", np.array(8.0)),
        const("gain", np.array(20.0)),
        const("one_half", np.array(1.5)),
        const("margin", np.array(0.3)),
        numpy_helper.from_array(np.array([2, 2], np.int64), "sl_start"),
        numpy_helper.from_array(np.array([DET_SIZE, DET_SIZE], np.int64), "sl_end"),
        numpy_helper.from_array(np.array([2, 3], np.int64), "sl_axes"),
        numpy_helper.from_array(np.array([STRIDE, STRIDE], np.int64), "sl_steps"),
        numpy_helper.from_array(np.array([1, 1, 1, 1, 1, 3], np.int64), "split"),
        numpy_helper.from_array(np.array([1, 4 + len(CLASSES), anchors * anchors], np.int64), "out_shape"),
    ]
    n = helper.make_node
    pad_in, pad_out = (INNER - STRIDE) // 2, (OUTER - STRIDE) // 2
    nodes = [
        n("ReduceMax", ["images"], ["brightest"], axes=[1], keepdims=1),
        n("Sub", ["brightest", "half"], ["b0"]),
        n("Mul", ["b0", "steep"], ["b1"]),
        n("Sigmoid", ["b1"], ["m"]),
        n("Mul", ["m", "X"], ["mX"]),
        n("Mul", ["m", "Y"], ["mY"]),
        n("Mul", ["mX", "X"], ["mXX"]),
        n("Mul", ["mY", "Y"], ["mYY"]),
        n("Mul", ["images", "m"], ["mC"]),
        n("Concat", ["m", "mX", "mY", "mXX", "mYY", "mC"], ["moments_in"], axis=1),
        n(
            "Conv",
            ["moments_in", "inner_w"],
            ["moments"],
            group=8,
            strides=[STRIDE, STRIDE],
            pads=[pad_in] * 4,
        ),
        n("Conv", ["m", "outer_w"], ["outer"], strides=[STRIDE, STRIDE], pads=[pad_out] * 4),
        n("Slice", ["m", "sl_start", "sl_end", "sl_axes", "sl_steps"], ["centre"]),
        n("Split", ["moments", "split"], ["s0", "sx", "sy", "sxx", "syy", "sc"], axis=1),
        n("Add", ["s0", "eps"], ["mass"]),
        n("Div", ["sx", "mass"], ["cx"]),
        n("Div", ["sy", "mass"], ["cy"]),
        n("Div", ["sxx", "mass"], ["ex2"]),
        n("Div", ["syy", "mass"], ["ey2"]),
        n("Mul", ["cx", "cx"], ["cx2"]),
        n("Mul", ["cy", "cy"], ["cy2"]),
        n("Sub", ["ex2", "cx2"], ["varx0"]),
        n("Sub", ["ey2", "cy2"], ["vary0"]),
        n("Relu", ["varx0"], ["varx"]),
        n("Relu", ["vary0"], ["vary"]),
        n("Mul", ["varx", "twelve"], ["w2"]),
        n("Mul", ["vary", "twelve"], ["h2"]),
        n("Sqrt", ["w2"], ["w"]),
        n("Sqrt", ["h2"], ["h"]),
        n("Add", ["outer", "eps"], ["outer_mass"]),
        n("Div", ["s0", "outer_mass"], ["ratio"]),
        n("Pow", ["ratio", "power"], ["whole"]),
        n("Mul", ["centre", "whole"], ["objectness"]),
        n("Div", ["sc", "mass"], ["colour"]),  # mean R, G, B of the bright pixels
        n("ReduceSum", ["colour", "sum_axis"], ["colour_sum"], keepdims=1),
        n("Mul", ["colour", "one_half"], ["c0"]),
        n("Mul", ["colour_sum", "half"], ["c1"]),
        n("Sub", ["c0", "c1"], ["dominance"]),  # own channel minus the mean of the other two
        n("Sub", ["dominance", "margin"], ["c2"]),
        n("Mul", ["c2", "gain"], ["c3"]),
        n("Sigmoid", ["c3"], ["colour_score"]),
        n("Mul", ["colour_score", "objectness"], ["scores"]),
        n("Concat", ["cx", "cy", "w", "h", "scores"], ["grid_out"], axis=1),
        n("Reshape", ["grid_out", "out_shape"], ["output0"]),
    ]
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "sum_axis"))
    graph = helper.make_graph(
        nodes,
        "detector",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, DET_SIZE, DET_SIZE])],
        [
            helper.make_tensor_value_info(
                "output0", TensorProto.FLOAT, [1, 4 + len(CLASSES), anchors * anchors]
            )
        ],
        initializer=inits,
    )
    save(make_model(graph), path)


def crop_input(patch: np.ndarray, size: int = 8) -> np.ndarray:
    """The classifier input detect_postprocess makes of a crop (darkest channel, stretched, resized)."""
    import cv2

    gray = patch.min(axis=2).astype(np.float32)
    low, high = float(np.min(gray)), float(np.max(gray))
    gray = (gray - low) / (high - low) if high > low else np.zeros_like(gray)
    return cv2.resize(gray, (size, size), interpolation=cv2.INTER_AREA)[None].astype(np.float32)


def _tile(digit: np.ndarray, size: int, colour: str) -> np.ndarray:
    import cv2

    strokes = cv2.resize(digit.astype(np.float32), (size, size), interpolation=cv2.INTER_NEAREST)[..., None]
    tile = np.array(COLORS_BGR[colour], np.float32) * (1 - strokes) + 255.0 * strokes
    return np.rint(tile).astype(np.uint8)


def _robust(classify: Callable[[np.ndarray], np.ndarray], digit: np.ndarray, label: int) -> bool:
    """Whether crops off by a pixel (position or side, any tile size) still classify as ``label``."""
    crops = []
    for size in TILE_SIZES:
        canvas = np.full((size + 4, size + 4, 3), 30, np.uint8)
        canvas[2 : 2 + size, 2 : 2 + size] = _tile(digit, size, "red")
        for dx in (-1, 0, 1):
            for dy in (-1, 0, 1):
                for dside in (-1, 0, 1):
                    side = size + dside
                    crops.append(crop_input(canvas[2 + dy : 2 + dy + side, 2 + dx : 2 + dx + side]))
    return bool((classify(np.stack(crops)).argmax(axis=1) == label).all())


def pick_digits(
    classify: Callable[[np.ndarray], np.ndarray], x_test: np.ndarray, y_test: np.ndarray, count: int
) -> list[tuple[np.ndarray, int]]:
    """Held-out digits the classifier gets right even from crops a pixel off, cycling through labels.

    The detector's boxes are within about a pixel of the tiles; picking digits that survive such an
    error keeps the example's answer checkable (a digit it misreads would test the classifier, not
    the pipeline).
    """
    probs = classify(x_test)
    confident = (probs.argmax(axis=1) == y_test) & (probs.max(axis=1) > 0.9)
    picked: list[tuple[np.ndarray, int]] = []
    by_label = {label: list(np.flatnonzero(confident & (y_test == label))) for label in range(10)}
    label = 0
    while len(picked) < count:
        while by_label[label]:
            index = by_label[label].pop(0)
            if _robust(classify, x_test[index, 0], label):
                picked.append((x_test[index, 0], label))
                break
        label = (label + 7) % 10  # 0, 7, 4, 1, 8, ...: neighbours in a scene differ
        if not any(by_label.values()):
            raise SystemExit("detector samples: not enough robustly classified digits")
    return picked


def draw_scene(
    rng: np.random.Generator, digits: list[tuple[np.ndarray, int]]
) -> tuple[np.ndarray, list[dict]]:
    """One canvas and its truth: a tile per digit, in distinct cells of the grid."""
    image = rng.integers(0, 60, size=(SCENE_H, SCENE_W, 3), dtype=np.uint8)
    cells = rng.permutation(GRID[0] * GRID[1])[: len(digits)]
    cell_w, cell_h = SCENE_W // GRID[0], SCENE_H // GRID[1]
    truth = []
    for (digit, label), cell in zip(digits, cells, strict=True):
        size = int(rng.choice(TILE_SIZES))
        col, row = int(cell) % GRID[0], int(cell) // GRID[0]
        cx = col * cell_w + cell_w // 2 + int(rng.integers(-6, 7))
        cy = row * cell_h + cell_h // 2 + int(rng.integers(-6, 7))
        x1, y1 = cx - size // 2, cy - size // 2
        colour = CLASSES[int(rng.integers(len(CLASSES)))]
        image[y1 : y1 + size, x1 : x1 + size] = _tile(digit, size, colour)
        truth.append({"box": [x1, y1, x1 + size, y1 + size], "class": colour, "digit": label})
    return image, truth


def write_scenes(
    samples: Path,
    classify: Callable[[np.ndarray], np.ndarray],
    x_test: np.ndarray,
    y_test: np.ndarray,
    write: Callable[[Path, Callable[[Path], object]], None],
) -> None:
    """``scene_<i>.png`` and ``scene_<i>.json`` (the truth: boxes as x1, y1, x2, y2, class, digit)."""
    import cv2

    rng = np.random.default_rng(SEED)
    counts = [3, 4, 5, 6][:SCENES]
    digits = pick_digits(classify, x_test, y_test, sum(counts))
    start = 0
    for i, count in enumerate(counts):
        image, truth = draw_scene(rng, digits[start : start + count])
        start += count

        def write_png(p: Path, img: np.ndarray = image) -> None:
            if not cv2.imwrite(str(p), img):
                raise OSError(f"cv2.imwrite failed for {p}")

        write(samples / f"scene_{i}.png", write_png)
        text = json.dumps({"objects": truth}, indent=1)
        write(samples / f"scene_{i}.json", lambda p, t=text: p.write_text(t))  # type: ignore[misc]
