"""Triton Python-backend model: a grayscale uint8 image of any size -> the digits model's input.

Input ``raw`` (TYPE_UINT8, [H, W]) is resized to 8x8 with area interpolation, scaled to [0, 1] and
returned as ``image`` (TYPE_FP32, [1, 8, 8]).  A bad request (empty or not 2-D) gets an error
response of its own; the other requests of the same call are still answered.
"""

import json

import cv2
import numpy as np
import triton_python_backend_utils as pb_utils

SIZE = 8


class TritonPythonModel:
    def initialize(self, args):
        """Read the output dtype from the config, as Triton's own examples do."""
        model_config = json.loads(args["model_config"])
        image_config = pb_utils.get_output_config_by_name(model_config, "image")
        self.image_dtype = pb_utils.triton_string_to_numpy(image_config["data_type"])

    def execute(self, requests):
        """One response per request, in order; errors are per request, never for the whole batch."""
        responses = []
        for request in requests:
            raw = pb_utils.get_input_tensor_by_name(request, "raw")
            if raw is None:
                responses.append(self._error("input 'raw' is missing"))
                continue
            pixels = raw.as_numpy()
            if pixels.ndim != 2:
                responses.append(
                    self._error(f"input 'raw' must be 2-D [H, W], got shape {list(pixels.shape)}")
                )
                continue
            if pixels.size == 0:
                responses.append(self._error(f"input 'raw' is empty (shape {list(pixels.shape)})"))
                continue
            pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
            small = cv2.resize(pixels, (SIZE, SIZE), interpolation=cv2.INTER_AREA)
            image = (small.astype(np.float32) / 255.0).reshape(1, SIZE, SIZE).astype(self.image_dtype)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("image", image)]))
        return responses

    def finalize(self):
        """Nothing to release; present because Triton calls it on unload."""

    @staticmethod
    def _error(message):
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message))
