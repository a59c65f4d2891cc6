"""Triton Python-backend model: decode a YOLO-style detector's output, NMS, crops for a classifier.

Layouts (parameter ``layout``):

* ``yolov8``: ``[1, 4 + classes, anchors]``, as YOLOv8 and YOLO11 export it: per anchor the box
  centre x, y, width and height in detector input pixels, then one score per class (no objectness);
* ``yolov8_transposed``: ``[1, anchors, 4 + classes]``, the same transposed (some exporters).

Boxes scoring at least ``score_threshold`` go through OpenCV's class-aware non-maximum suppression
(``iou_threshold``), are mapped back to frame pixels through the letterbox and clipped to the frame.
Each kept box is cut from the original frame (a square of the box's mean side, around its centre)
and turned into the classifier's input: the darkest
channel (white strokes stay bright, coloured backgrounds go dark), stretched to [0, 1], resized to
``crop_size`` x ``crop_size`` with area interpolation: ``crops`` [N, 1, crop_size, crop_size].
"""

import json

import cv2
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.layout = params.get("layout", "yolov8")
        if self.layout not in ("yolov8", "yolov8_transposed"):
            raise pb_utils.TritonModelException(
                f"unknown layout {self.layout!r}; use yolov8 or yolov8_transposed"
            )
        self.classes = len(params["class_names"].split(","))
        self.score_threshold = float(params.get("score_threshold", "0.5"))
        self.iou_threshold = float(params.get("iou_threshold", "0.45"))
        self.max_detections = int(params.get("max_detections", "100"))
        self.crop_size = int(params.get("crop_size", "8"))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except ValueError as exc:
                error = pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
        return responses

    def _one(self, request):
        raw = pb_utils.get_input_tensor_by_name(request, "output0").as_numpy()[0]
        scale, pad_x, pad_y = pb_utils.get_input_tensor_by_name(request, "letterbox").as_numpy()
        frame = pb_utils.get_input_tensor_by_name(request, "image").as_numpy()
        if self.layout == "yolov8":
            raw = raw.T  # [anchors, 4 + classes]
        if raw.shape[1] != 4 + self.classes:
            raise ValueError(
                f"detector output has {raw.shape[1]} values per anchor, expected 4 + {self.classes}"
            )
        scores_all = raw[:, 4:]
        classes = scores_all.argmax(axis=1)
        scores = scores_all[np.arange(len(raw)), classes]
        keep = scores >= self.score_threshold
        centre_boxes, scores, classes = raw[keep, :4], scores[keep], classes[keep]
        # to frame pixels: undo the letterbox, then x1, y1, x2, y2 clipped to the frame
        cx, cy, w, h = (
            (centre_boxes[:, 0] - pad_x) / scale,
            (centre_boxes[:, 1] - pad_y) / scale,
            centre_boxes[:, 2] / scale,
            centre_boxes[:, 3] / scale,
        )
        height, width = frame.shape[:2]
        boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
        boxes = np.clip(boxes, 0, [width, height, width, height]).astype(np.float32)
        if len(boxes):
            xywh = [[float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])] for b in boxes]
            kept = cv2.dnn.NMSBoxesBatched(
                xywh, scores.tolist(), classes.tolist(), self.score_threshold, self.iou_threshold
            )
            kept = np.asarray(kept, dtype=np.int64).reshape(-1)[: self.max_detections]
            boxes, scores, classes = boxes[kept], scores[kept], classes[kept]
        crops = (
            np.stack([self._crop(frame, box) for box in boxes])
            if len(boxes)
            else np.zeros((0, 1, self.crop_size, self.crop_size), np.float32)
        )
        return pb_utils.InferenceResponse(
            [
                pb_utils.Tensor("boxes", boxes.reshape(-1, 4).astype(np.float32)),
                pb_utils.Tensor("scores", scores.astype(np.float32)),
                pb_utils.Tensor("classes", classes.astype(np.int32)),
                pb_utils.Tensor("crops", crops),
            ]
        )

    def _crop(self, frame, box):
        # a square around the box centre: the classifier takes square inputs, and the mean of width
        # and height halves the error a blurred (letterboxed) edge puts into either
        side = max(1, int(round((box[2] - box[0] + box[3] - box[1]) / 2)))
        x1 = max(0, int(round((box[0] + box[2] - side) / 2)))
        y1 = max(0, int(round((box[1] + box[3] - side) / 2)))
        patch = frame[y1 : y1 + side, x1 : x1 + side]
        if patch.size == 0:
            return np.zeros((1, self.crop_size, self.crop_size), np.float32)
        gray = patch.min(axis=2).astype(np.float32)
        low, high = float(gray.min()), float(gray.max())
        gray = (gray - low) / (high - low) if high > low else np.zeros_like(gray)
        small = cv2.resize(gray, (self.crop_size, self.crop_size), interpolation=cv2.INTER_AREA)
        return small[None].astype(np.float32)
