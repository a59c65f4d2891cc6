"""Read the text in camera frames through the running daemon: the OCR example (``models_ocr/``).

    ./run serve                                                     # in one terminal (models/, models_ocr/)
    .venv/bin/python examples/ocr.py models_ocr/ocr/samples         # a folder of images
    .venv/bin/python examples/ocr.py clip.mp4 --every 10 --annotate out/   # every 10th frame of a video

SOURCE is an image file, a folder of images (read in name order) or a video file (anything
``cv2.VideoCapture`` opens).  Each frame goes to the daemon through one registered shared-memory
region, as a camera loop would send it (the request carries only a reference, whatever the frame
size); the ``ocr`` model answers with one box (four corners in frame pixels), string and score per
line of text.  ``--annotate DIR`` writes each frame with its boxes and strings drawn.  The daemon is
found as ``edge-server status`` finds it, or at ``--ipc ADDRESS``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp"}


def frames(source: Path, every: int = 1) -> Iterator[tuple[str, np.ndarray]]:
    """(name, BGR frame) from an image, a folder of images or a video, every ``every``-th frame."""
    if source.is_dir():
        paths = sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    elif source.suffix.lower() in IMAGE_SUFFIXES:
        paths = [source]
    else:
        capture = cv2.VideoCapture(str(source))
        if not capture.isOpened():
            raise SystemExit(f"{source}: not an image, a folder of images or a video OpenCV can open")
        try:
            index = 0
            while True:
                ok, frame = capture.read()
                if not ok:
                    return
                if index % every == 0:
                    yield f"{source.name}#{index}", frame
                index += 1
        finally:
            capture.release()
    for i, path in enumerate(paths):
        frame = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if frame is None:
            print(f"{path}: skipped, not an image OpenCV reads", file=sys.stderr)
        elif i % every == 0:
            yield path.name, frame


def annotate(frame: np.ndarray, outputs: dict[str, Any]) -> np.ndarray:
    """The frame with each line's box and string (characters OpenCV's font lacks are drawn as '?')."""
    image = frame.copy()
    for box, text in zip(outputs["boxes"], outputs["texts"], strict=True):
        corners = np.round(box).astype(np.int32).reshape(-1, 1, 2)
        cv2.polylines(image, [corners], True, (0, 0, 255), 1)
        label = "".join(c if c.isascii() else "?" for c in text.decode())
        x, y = int(box[0][0]), max(10, int(box[0][1]) - 3)
        cv2.putText(image, label, (x, y), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 255), 1, cv2.LINE_AA)
    return image


def describe(name: str, frame: np.ndarray, outputs: dict[str, Any], seconds: float) -> str:
    count = len(outputs["texts"])
    plural = "" if count == 1 else "s"
    lines = [f"{name} ({frame.shape[1]}x{frame.shape[0]}): {count} line{plural} in {seconds:.2f} s"]
    for box, text, score in zip(outputs["boxes"], outputs["texts"], outputs["scores"], strict=True):
        corners = " ".join(f"({x:.0f},{y:.0f})" for x, y in box)
        lines.append(f"  {text.decode()!r:<24} {float(score):.3f}  {corners}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from edge_server.client import Client
    from edge_server.ipc.addresses import find_daemon

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("source", type=Path, help="an image, a folder of images or a video file")
    parser.add_argument("--ipc", default=None, metavar="ADDRESS", help="the daemon's address")
    parser.add_argument("--model", default="ocr")
    parser.add_argument("--every", type=int, default=1, metavar="N", help="read every N-th frame")
    parser.add_argument("--annotate", type=Path, metavar="DIR", help="write annotated frames here")
    args = parser.parse_args(argv)
    if args.annotate is not None:
        args.annotate.mkdir(parents=True, exist_ok=True)
    region = None
    with Client(find_daemon(args.ipc), timeout=120) as client:
        try:
            for name, frame in frames(args.source, max(1, args.every)):
                if region is None or region.byte_size < frame.nbytes:  # a larger frame: a larger region
                    if region is not None:
                        client.release_shm(region)
                    region = client.create_shm_region(frame.nbytes)
                began = time.perf_counter()
                outputs = client.infer(args.model, {"image": region.write(frame)})
                print(describe(name, frame, outputs, time.perf_counter() - began), flush=True)
                if args.annotate is not None:
                    out = args.annotate / f"{Path(name.replace('#', '_')).stem}.png"
                    cv2.imwrite(str(out), annotate(frame, outputs))
        finally:
            if region is not None:
                client.release_shm(region)
    if args.annotate is not None:
        print(f"annotated frames written to {args.annotate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
