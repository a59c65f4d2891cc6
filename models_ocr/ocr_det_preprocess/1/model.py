"""Triton Python-backend model: a BGR frame into the PP-OCR text detector's input.

A port of what rapidocr_onnxruntime 1.4 does before its detector runs (``RapidOCR.preprocess``,
``maybe_add_letterbox`` and ``DetPreProcess``), operation for operation, so that the boxes equal the
package's: the same resizes, the same rounding, the same float64 normalisation cast to float32.
"""

import json

import cv2
import numpy as np
import triton_python_backend_utils as pb_utils


def _resize_to_32(img, ratio):
    """Scale by ``ratio`` and round both sides to multiples of 32 (None when a side would be 0)."""
    h, w = img.shape[:2]
    resize_h = int(round(int(h * ratio) / 32) * 32)
    resize_w = int(round(int(w * ratio) / 32) * 32)
    if resize_w <= 0 or resize_h <= 0:
        return None
    return cv2.resize(img, (resize_w, resize_h))


def _side_ratio(h, w, side, *, longer):
    """The package's ratio that brings the longer (or shorter) side to ``side``."""
    if longer:
        return float(side) / h if h > w else float(side) / w
    return float(side) / h if h < w else float(side) / w


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.limit_side_len = int(params["limit_side_len"])
        self.limit_type = params["limit_type"]  # "min": the shorter side up to it; "max": the longer down
        self.max_side_len = int(params["max_side_len"])
        self.min_side_len = int(params["min_side_len"])
        self.min_height = int(params["min_height"])
        self.width_height_ratio = float(params["width_height_ratio"])
        self.mean = np.array([0.5, 0.5, 0.5])
        self.std = np.array([0.5, 0.5, 0.5])

    def execute(self, requests):
        return [self._one(pb_utils.get_input_tensor_by_name(r, "frame").as_numpy()) for r in requests]

    def _one(self, frame):
        raw_h, raw_w = frame.shape[:2]
        image, ratio_h, ratio_w = frame, 1.0, 1.0
        if max(raw_h, raw_w) > self.max_side_len:
            image, ratio_h, ratio_w = self._rescale(image, self.max_side_len, longer=True)
        h, w = image.shape[:2]
        if min(h, w) < self.min_side_len:
            image, ratio_h, ratio_w = self._rescale(image, self.min_side_len, longer=False)
        image, top = self._band(image)
        x = self._detector_input(image)
        transform = np.array([ratio_h, ratio_w, top, 0, raw_h, raw_w], dtype=np.float32)
        return pb_utils.InferenceResponse(
            [pb_utils.Tensor("x", x), pb_utils.Tensor("image", image), pb_utils.Tensor("transform", transform)]
        )

    def _rescale(self, image, side, *, longer):
        h, w = image.shape[:2]
        ratio = 1.0
        if (max(h, w) > side) if longer else (min(h, w) < side):
            ratio = _side_ratio(h, w, side, longer=longer)
        resized = _resize_to_32(image, ratio)
        if resized is None:
            raise pb_utils.TritonModelException(f"a {w}x{h} frame cannot be resized for the detector")
        return resized, h / resized.shape[0], w / resized.shape[1]

    def _band(self, image):
        """Black bands above and below a low or very wide image (the package's round letterbox)."""
        h, w = image.shape[:2]
        too_wide = self.width_height_ratio != -1 and w / h > self.width_height_ratio
        if h > self.min_height and not too_wide:
            return image, 0
        new_h = max(int(w / self.width_height_ratio), self.min_height) * 2
        top = int(abs(new_h - h) / 2)
        return cv2.copyMakeBorder(image, top, top, 0, 0, cv2.BORDER_CONSTANT, value=(0, 0, 0)), top

    def _detector_input(self, image):
        h, w = image.shape[:2]
        if self.limit_type == "max":
            ratio = _side_ratio(h, w, self.limit_side_len, longer=True) if max(h, w) > self.limit_side_len else 1.0
        else:
            ratio = _side_ratio(h, w, self.limit_side_len, longer=False) if min(h, w) < self.limit_side_len else 1.0
        resized = _resize_to_32(image, ratio)
        if resized is None:
            raise pb_utils.TritonModelException(f"a {w}x{h} image cannot be resized for the detector")
        normalised = (resized.astype("float32") * (1 / 255.0) - self.mean) / self.std  # float64, as theirs
        return np.expand_dims(normalised.transpose((2, 0, 1)), axis=0).astype(np.float32)
