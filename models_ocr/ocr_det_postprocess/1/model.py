"""Triton Python-backend model: the PP-OCR detector's probability map into ordered text boxes.

A port of rapidocr_onnxruntime 1.4's ``DBPostProcess``, ``TextDetector.filter_tag_det_res``,
``RapidOCR.sorted_boxes`` and ``RapidOCR._get_origin_points``, operation for operation (the same
OpenCV calls, the same pyclipper offset, the same integer rounding), so that the boxes equal the
package's.
"""

import json

import cv2
import numpy as np
import pyclipper
import triton_python_backend_utils as pb_utils
from shapely.geometry import Polygon


def _mini_box(contour):
    """The minimum-area rectangle's corners, clockwise from the top left, and its shorter side."""
    rect = cv2.minAreaRect(contour)
    points = sorted(list(cv2.boxPoints(rect)), key=lambda x: x[0])
    i1, i4 = (0, 1) if points[1][1] > points[0][1] else (1, 0)
    i2, i3 = (2, 3) if points[3][1] > points[2][1] else (3, 2)
    return np.array([points[i1], points[i2], points[i3], points[i4]]), min(rect[1])


def _score_fast(bitmap, box):
    """Mean probability inside the box (the package's ``box_score_fast``)."""
    h, w = bitmap.shape[:2]
    box = box.copy()
    xmin = np.clip(np.floor(box[:, 0].min()).astype(np.int32), 0, w - 1)
    xmax = np.clip(np.ceil(box[:, 0].max()).astype(np.int32), 0, w - 1)
    ymin = np.clip(np.floor(box[:, 1].min()).astype(np.int32), 0, h - 1)
    ymax = np.clip(np.ceil(box[:, 1].max()).astype(np.int32), 0, h - 1)
    mask = np.zeros((ymax - ymin + 1, xmax - xmin + 1), dtype=np.uint8)
    box[:, 0] = box[:, 0] - xmin
    box[:, 1] = box[:, 1] - ymin
    cv2.fillPoly(mask, box.reshape(1, -1, 2).astype(np.int32), 1)
    return cv2.mean(bitmap[ymin : ymax + 1, xmin : xmax + 1], mask)[0]


def _score_slow(bitmap, contour):
    """Mean probability inside the contour itself (``score_mode: slow``)."""
    h, w = bitmap.shape[:2]
    contour = np.reshape(contour.copy(), (-1, 2))
    xmin = np.clip(np.min(contour[:, 0]), 0, w - 1)
    xmax = np.clip(np.max(contour[:, 0]), 0, w - 1)
    ymin = np.clip(np.min(contour[:, 1]), 0, h - 1)
    ymax = np.clip(np.max(contour[:, 1]), 0, h - 1)
    mask = np.zeros((ymax - ymin + 1, xmax - xmin + 1), dtype=np.uint8)
    contour[:, 0] = contour[:, 0] - xmin
    contour[:, 1] = contour[:, 1] - ymin
    cv2.fillPoly(mask, contour.reshape(1, -1, 2).astype(np.int32), 1)
    return cv2.mean(bitmap[ymin : ymax + 1, xmin : xmax + 1], mask)[0]


def _clockwise(pts):
    """Top-left, top-right, bottom-right, bottom-left (the package's ``order_points_clockwise``)."""
    by_x = pts[np.argsort(pts[:, 0]), :]
    left, right = by_x[:2, :], by_x[2:, :]
    tl, bl = left[np.argsort(left[:, 1]), :]
    tr, br = right[np.argsort(right[:, 1]), :]
    return np.array([tl, tr, br, bl], dtype="float32")


def _reading_order(boxes):
    """Top to bottom, then left to right within 10 pixels of height (the package's ``sorted_boxes``)."""
    ordered = list(sorted(boxes, key=lambda x: (x[0][1], x[0][0])))
    for i in range(len(ordered) - 1):
        for j in range(i, -1, -1):
            if abs(ordered[j + 1][0][1] - ordered[j][0][1]) < 10 and ordered[j + 1][0][0] < ordered[j][0][0]:
                ordered[j], ordered[j + 1] = ordered[j + 1], ordered[j]
            else:
                break
    return ordered


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.thresh = float(params["thresh"])
        self.box_thresh = float(params["box_thresh"])
        self.max_candidates = int(params["max_candidates"])
        self.unclip_ratio = float(params["unclip_ratio"])
        self.dilation = np.array([[1, 1], [1, 1]]) if params["use_dilation"] == "true" else None
        self.score_mode = params["score_mode"]
        self.min_size = 3

    def execute(self, requests):
        responses = []
        for request in requests:
            pred = pb_utils.get_input_tensor_by_name(request, "sigmoid_0.tmp_0").as_numpy()
            image = pb_utils.get_input_tensor_by_name(request, "image").as_numpy()
            transform = pb_utils.get_input_tensor_by_name(request, "transform").as_numpy()
            boxes = self._boxes(pred, image.shape[:2])
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("boxes", boxes),
                        pb_utils.Tensor("frame_boxes", self._in_frame(boxes, transform)),
                    ]
                )
            )
        return responses

    def _boxes(self, pred, shape):
        """Boxes in the image's pixels, in reading order, float32 [N, 4, 2]."""
        height, width = shape
        candidates = self._from_bitmap(pred[:, 0, :, :][0], height, width)
        kept = []
        for box in candidates:
            box = _clockwise(box)
            for p in range(box.shape[0]):
                box[p, 0] = int(min(max(box[p, 0], 0), width - 1))
                box[p, 1] = int(min(max(box[p, 1], 0), height - 1))
            if int(np.linalg.norm(box[0] - box[1])) <= 3 or int(np.linalg.norm(box[0] - box[3])) <= 3:
                continue
            kept.append(box)
        if not kept:
            return np.zeros((0, 4, 2), np.float32)
        return np.array(_reading_order(np.array(kept)), dtype=np.float32)

    def _from_bitmap(self, pred, dest_height, dest_width):
        segmentation = pred > self.thresh
        mask = segmentation
        if self.dilation is not None:
            mask = cv2.dilate(np.array(segmentation).astype(np.uint8), self.dilation)
        height, width = mask.shape
        contours = cv2.findContours((mask * 255).astype(np.uint8), cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)[-2]
        boxes = []
        for contour in contours[: self.max_candidates]:
            points, sside = _mini_box(contour)
            if sside < self.min_size:
                continue
            if self.score_mode == "fast":
                score = _score_fast(pred, points.reshape(-1, 2))
            else:
                score = _score_slow(pred, contour)
            if self.box_thresh > score:
                continue
            box, sside = _mini_box(self._unclip(points))
            if sside < self.min_size + 2:
                continue
            box[:, 0] = np.clip(np.round(box[:, 0] / width * dest_width), 0, dest_width)
            box[:, 1] = np.clip(np.round(box[:, 1] / height * dest_height), 0, dest_height)
            boxes.append(box.astype(np.int32))
        return np.array(boxes, dtype=np.int32)

    def _unclip(self, box):
        poly = Polygon(box)
        distance = poly.area * self.unclip_ratio / poly.length
        offset = pyclipper.PyclipperOffset()
        offset.AddPath(box, pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
        return np.array(offset.Execute(distance)).reshape((-1, 1, 2))

    @staticmethod
    def _in_frame(boxes, transform):
        """Undo the band, then the resize, and clip to the frame (``_get_origin_points``)."""
        ratio_h, ratio_w, top, left, raw_h, raw_w = (float(v) for v in transform)
        out = boxes.astype(np.float32).copy()
        out[:, :, 0] -= left
        out[:, :, 1] -= top
        out[:, :, 0] *= ratio_w
        out[:, :, 1] *= ratio_h
        out = np.where(out < 0, 0, out)
        out[..., 0] = np.where(out[..., 0] > raw_w, raw_w, out[..., 0])
        out[..., 1] = np.where(out[..., 1] > raw_h, raw_h, out[..., 1])
        return out.astype(np.float32)
