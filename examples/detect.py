"""Run the detect-then-classify example on an image through the running daemon.

    .venv/bin/python examples/detect.py models/detect_classify/samples/scene_0.png
    .venv/bin/python examples/detect.py scene.png --ipc ipc://PATH --annotate out.png
    .venv/bin/python examples/detect.py scene.png --local

The frame goes through shared memory (one registered region, as a camera loop would use); the
``detect_classify`` model answers with boxes in frame pixels, the detector's class and the
classifier's digit for every box.  The daemon is found as ``edge-server status`` finds it, or at
``--ipc ADDRESS``; with ``--local`` the repository is loaded in this process instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import cv2
import numpy as np


def detect(frame: np.ndarray, ipc: str | None, repository: Path, model: str) -> dict[str, Any]:
    """The model's outputs for one BGR frame, through the daemon (shared memory) or in-process."""
    if ipc is None:  # --local
        from edge_server import Server

        with Server(repository) as server:
            return server.infer(model, {"image": frame})
    from edge_server.client import Client

    with Client(ipc) as client:
        region = client.create_shm_region(frame.nbytes)
        try:
            return client.infer(model, {"image": region.write(frame)})
        finally:
            client.release_shm(region)


def annotate(frame: np.ndarray, outputs: dict[str, Any]) -> np.ndarray:
    image = frame.copy()
    for box, label in zip(outputs["boxes"], outputs["labels"], strict=True):
        x1, y1, x2, y2 = (int(round(v)) for v in box)
        cv2.rectangle(image, (x1, y1), (x2, y2), (255, 255, 255), 1)
        cv2.putText(
            image, label.decode(), (x1, max(10, y1 - 3)), cv2.FONT_HERSHEY_SIMPLEX, 0.35, (255, 255, 255), 1
        )
    return image


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("image", type=Path, help="an image file OpenCV reads (BGR)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--ipc", metavar="ADDRESS", help="the daemon (default: as `status` finds it)")
    where.add_argument("--local", action="store_true", help="load --model-repository here, with no daemon")
    parser.add_argument(
        "--model-repository", type=Path, default=Path(__file__).resolve().parents[1] / "models"
    )
    parser.add_argument("--model", default="detect_classify")
    parser.add_argument("--annotate", type=Path, metavar="OUT", help="write the image with boxes and labels")
    args = parser.parse_args(argv)
    frame = cv2.imread(str(args.image), cv2.IMREAD_COLOR)
    if frame is None:
        parser.error(f"{args.image}: not an image OpenCV can read")
    if args.local:
        ipc = None
    else:
        from edge_server.errors import DaemonNotRunning
        from edge_server.ipc.addresses import find_daemon

        try:
            ipc = find_daemon(args.ipc)
        except DaemonNotRunning as error:  # --local needs no daemon: say so beside the addresses tried
            parser.exit(1, f"{error}\n(--local runs the pipeline in this process)\n")
    outputs = detect(frame, ipc, args.model_repository, args.model)
    print(f"{len(outputs['boxes'])} detections in {args.image} ({frame.shape[1]}x{frame.shape[0]})")
    for box, label, score, digit_score in zip(
        outputs["boxes"], outputs["labels"], outputs["scores"], outputs["digit_scores"], strict=True
    ):
        x1, y1, x2, y2 = (float(v) for v in box)
        print(
            f"  {label.decode():<8} box ({x1:6.1f}, {y1:6.1f}, {x2:6.1f}, {y2:6.1f})"
            f"  detector {float(score):.2f}  classifier {float(digit_score):.2f}"
        )
    if args.annotate is not None:
        if not cv2.imwrite(str(args.annotate), annotate(frame, outputs)):
            print(f"cannot write {args.annotate}", file=sys.stderr)
            return 1
        print(f"annotated image written to {args.annotate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
