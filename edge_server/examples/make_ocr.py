"""Build the OCR example repository: the PP-OCR models that ``rapidocr_onnxruntime`` ships in its wheel.

Usage::

    edge-server make-examples --ocr DIR [--force]             # from an installed edge-server
    python models_ocr/make_models.py [--repository DIR] [--force]   # in a checkout

The three ONNX models (text detector, orientation classifier, recogniser; Apache-2.0, from
PaddleOCR) are copied unchanged from the installed package (the ``models`` extra installs it):
nothing is downloaded at run time.  The recogniser's character list, which the package reads from
the ONNX file's metadata, is written to ``ocr/characters.txt`` for the ``ocr`` model's decoder.  The
sample frames in ``ocr/samples/`` are drawn with OpenCV's ``putText`` (deterministic, no fonts
needed).  Without ``--force`` only what is missing is made.

The hand-written files (``config.pbtxt``, the Python models) are committed in the checkout's
``models_ocr/``; the package sees them as ``edge_server/examples/ocr_repository`` (a link in a
checkout, real files in a wheel) and copies them into any other directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from edge_server.errors import InvalidArgument
from edge_server.examples.make_models import _atomic_write, copy_static

HERE = (Path(__file__).parent / "ocr_repository").resolve()
PACKAGE = "rapidocr_onnxruntime"

STATIC_FILES = (
    "text_detection/config.pbtxt",
    "text_classification/config.pbtxt",
    "text_recognition/config.pbtxt",
    "ocr_det_preprocess/config.pbtxt",
    "ocr_det_preprocess/1/model.py",
    "ocr_det_postprocess/config.pbtxt",
    "ocr_det_postprocess/1/model.py",
    "ocr_detect/config.pbtxt",
    "ocr/config.pbtxt",
    "ocr/1/model.py",
)

#: model directory -> the file of the package's models/ folder it serves unchanged
ONNX_FILES = {
    "text_detection": "ch_PP-OCRv4_det_infer.onnx",
    "text_classification": "ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "text_recognition": "ch_PP-OCRv4_rec_infer.onnx",
}

#: The sample frames: (width, height), background grey, then lines of (text, x, y, scale, upside down).
SAMPLES: tuple[tuple[tuple[int, int], int, tuple[tuple[str, int, int, float, bool], ...]], ...] = (
    ((320, 240), 235, (("KA 01 AB 1234", 20, 70, 0.9, False), ("EXIT 12", 20, 160, 1.2, False))),
    ((360, 200), 200, (("SPEED LIMIT 40", 18, 60, 0.9, False), ("Jetson Orin", 30, 150, 1.0, False))),
    ((320, 180), 250, (("Gate 7", 30, 160, 1.2, False), ("edge-server 2026", 20, 140, 0.8, True))),
)


def package_models() -> Path:
    """The installed package's models/ folder, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise InvalidArgument(
            f"the OCR example copies its models from the {PACKAGE} package: "
            "pip install 'edge-server[ocr]' and then pip install --no-deps 'rapidocr_onnxruntime>=1.4,<1.5' "
            "(into the same environment; Python < 3.13; --no-deps keeps its GUI OpenCV out)"
        )
    return Path(spec.origin).parent / "models"


def not_made(repo: Path) -> str | None:
    """Why ``repo`` cannot serve the OCR example yet, or None when its models are in place."""
    onnx = [f"{name}/1/model.onnx" for name in ONNX_FILES]
    absent = [path for path in onnx if not (repo / path).is_file()]
    if not (repo / "ocr" / "characters.txt").is_file():
        absent.append("ocr/characters.txt")
    if not absent:
        return None
    if importlib.util.find_spec(PACKAGE) is None:
        return (
            f"the {PACKAGE} package, whose wheel holds its models, is not installed (it needs Python < 3.13)"
        )
    return f"{', '.join(absent)} not made yet (python models_ocr/make_models.py makes them)"


def characters(recogniser: Path) -> list[str]:
    """The recogniser's characters, as the package reads them (``splitlines`` of its metadata)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(recogniser), sess_options=options, providers=["CPUExecutionProvider"])
    return str(session.get_modelmeta().custom_metadata_map["character"]).splitlines()


def draw_sample(size: tuple[int, int], grey: int, lines: tuple[tuple[str, int, int, float, bool], ...]):
    """A BGR frame with the lines written by ``cv2.putText`` (an upside-down line is drawn, then turned)."""
    import cv2

    width, height = size
    frame = np.full((height, width, 3), grey, np.uint8)
    for text, x, y, scale, upside_down in lines:
        if not upside_down:
            cv2.putText(frame, text, (x, y), cv2.FONT_HERSHEY_SIMPLEX, scale, (30, 30, 30), 2, cv2.LINE_AA)
            continue
        band = np.full((height, width, 3), grey, np.uint8)
        cv2.putText(band, text, (x, y), cv2.FONT_HERSHEY_SIMPLEX, scale, (30, 30, 30), 2, cv2.LINE_AA)
        turned = cv2.rotate(band, cv2.ROTATE_180)
        written = turned != grey
        frame[written] = turned[written]
    return frame


def samples(repo: Path) -> list[Path]:
    return [repo / "ocr" / "samples" / f"frame_{i}.png" for i in range(len(SAMPLES))]


def make(repo: Path, *, force: bool = False) -> int:
    """Fill ``repo`` with the OCR example (what is missing, or everything with ``force``)."""
    import cv2

    t0 = time.perf_counter()
    source = package_models()
    repo.mkdir(parents=True, exist_ok=True)
    copy_static(repo, force, here=HERE, files=STATIC_FILES)
    (repo / "ocr_detect" / "1").mkdir(parents=True, exist_ok=True)  # an ensemble's empty version
    for name, filename in ONNX_FILES.items():
        target = repo / name / "1" / "model.onnx"
        if force or not target.is_file():
            _atomic_write(target, lambda p, s=source / filename: shutil.copyfile(s, p))  # type: ignore[misc]
            print(f"{name}: copied {filename} from {PACKAGE}")
    keys = repo / "ocr" / "characters.txt"
    if force or not keys.is_file():
        text = "\n".join(characters(source / ONNX_FILES["text_recognition"]))
        _atomic_write(keys, lambda p: p.write_text(text, encoding="utf-8"))
        print("ocr: characters.txt written from the recogniser's metadata")
    for path, (size, grey, lines) in zip(samples(repo), SAMPLES, strict=True):
        if force or not path.is_file():
            image = draw_sample(size, grey, lines)
            _atomic_write(path, lambda p, img=image: cv2.imwrite(str(p), img))  # type: ignore[misc]
    print(f"OCR model repository {repo} ready in {time.perf_counter() - t0:.2f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--repository", type=Path, default=HERE, help="repository to fill (default: %(default)s)"
    )
    parser.add_argument("--force", action="store_true", help="copy and draw everything again")
    args = parser.parse_args(argv)
    try:
        return make(args.repository, force=args.force)
    except InvalidArgument as exc:
        print(exc.message, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
