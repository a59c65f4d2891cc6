"""``edge-server make-examples [--ocr] DIR``: an example model repository from an installed edge-server.

``--ocr`` makes the second one, real pretrained text reading (:mod:`edge_server.examples.make_ocr`:
the PP-OCR models copied from the ``rapidocr_onnxruntime`` wheel, installed with ``--no-deps`` beside the
``ocr`` extra: see pyproject.toml).

The same repository as a checkout's ``python models/make_models.py``: the generator and its hand-written
files ship in the package (:mod:`edge_server.examples`); the ONNX models are built here and need the
``models`` extra (onnx, scikit-learn, OpenCV), which is checked first with a clear message.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from edge_server.errors import InvalidArgument

NEEDED = {"onnx": "onnx", "sklearn": "scikit-learn", "cv2": "opencv-python-headless"}


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "make-examples", help="build the example model repository into DIR (needs the models extra)"
    )
    parser.add_argument("directory", type=Path, metavar="DIR", help="the repository to fill (created)")
    parser.add_argument("--force", action="store_true", help="rebuild and recopy everything")
    parser.add_argument(
        "--ocr",
        action="store_true",
        help="make the OCR example instead (the PP-OCR models of the rapidocr_onnxruntime package)",
    )
    parser.set_defaults(tool_run=run)


def missing_modules() -> list[str]:
    """The packages of the ``models`` extra that cannot be imported here."""
    return [package for module, package in NEEDED.items() if importlib.util.find_spec(module) is None]


def make_examples(directory: Path, *, force: bool = False, ocr: bool = False) -> None:
    missing = missing_modules()
    if missing:
        raise InvalidArgument(
            f"making the example models needs {', '.join(missing)}: "
            "pip install 'edge-server[models]' (into the same environment)"
        )
    if ocr:
        from edge_server.examples import make_ocr

        make_ocr.make(directory, force=force)
        return
    from edge_server.examples.make_models import make

    make(directory, force=force)


def run(args: Any) -> int:
    make_examples(args.directory, force=args.force, ocr=args.ocr)
    print(f"next: edge-server serve --model-repository {args.directory}")
    return 0
