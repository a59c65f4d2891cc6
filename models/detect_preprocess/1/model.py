"""Triton Python-backend model: letterbox a BGR frame into a YOLO-style detector's input.

The frame keeps its aspect ratio: it is scaled to fit ``input_size`` and padded with grey (114, as
the YOLO family pads), converted to RGB, CHW, [0, 1].  ``letterbox`` (scale, pad_x, pad_y) lets the
post-processing map boxes back: detector pixel = frame pixel * scale + pad.
"""

import json

import cv2
import numpy as np
import triton_python_backend_utils as pb_utils

PAD_VALUE = 114


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.size = int(config["parameters"]["input_size"]["string_value"])

    def execute(self, requests):
        responses = []
        for request in requests:
            frame = pb_utils.get_input_tensor_by_name(request, "image").as_numpy()
            height, width = frame.shape[:2]
            if height == 0 or width == 0:
                error = pb_utils.TritonError(
                    f"image is empty: shape {list(frame.shape)}", pb_utils.TritonError.INVALID_ARG
                )
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            scale = min(self.size / width, self.size / height)
            new_w, new_h = max(1, round(width * scale)), max(1, round(height * scale))
            resized = cv2.resize(np.ascontiguousarray(frame), (new_w, new_h), interpolation=cv2.INTER_LINEAR)
            pad_x, pad_y = (self.size - new_w) // 2, (self.size - new_h) // 2
            canvas = np.full((self.size, self.size, 3), PAD_VALUE, np.uint8)
            canvas[pad_y : pad_y + new_h, pad_x : pad_x + new_w] = resized
            rgb = canvas[:, :, ::-1].transpose(2, 0, 1)[None].astype(np.float32) / 255.0
            letterbox = np.array([scale, pad_x, pad_y], np.float32)
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("images", np.ascontiguousarray(rgb)),
                        pb_utils.Tensor("letterbox", letterbox),
                    ]
                )
            )
        return responses
