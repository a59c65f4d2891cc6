"""Triton Python-backend model (BLS): detect, then classify every detection.

The fixed part runs as the ``detect`` ensemble (letterbox, detector, NMS and crops); the variable
part, one classification per detected object, goes to the classifier as one request holding every
crop of the frame (split at the classifier's ``max_batch_size``).  The classifier's dynamic batcher
joins those requests with the crops of other frames and other cameras.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        self.class_names = params["class_names"].split(",")
        self.classifier = params["classifier"]
        self.timeout_us = int(params.get("timeout_us", "0"))
        self.chunk = 8  # the classifier's max_batch_size

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _call(self, model, inputs, outputs):
        response = pb_utils.InferenceRequest(
            model_name=model, inputs=inputs, requested_output_names=outputs, timeout=self.timeout_us
        ).exec()
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in outputs}

    def _one(self, request):
        image = pb_utils.get_input_tensor_by_name(request, "image")
        try:
            found = self._call("detect", [image], ["boxes", "scores", "classes", "crops"])
            crops = found["crops"]
            probabilities = [
                self._call(
                    self.classifier, [pb_utils.Tensor("image", crops[i : i + self.chunk])], ["probabilities"]
                )["probabilities"]
                for i in range(0, len(crops), self.chunk)
            ]
        except pb_utils.TritonModelException as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
        probs = np.concatenate(probabilities) if probabilities else np.zeros((0, 10), np.float32)
        digits = probs.argmax(axis=1).astype(np.int32)
        classes = found["classes"]
        labels = np.array(
            [f"{self.class_names[c]} {d}".encode() for c, d in zip(classes, digits)], dtype=np.object_
        )
        return pb_utils.InferenceResponse(
            [
                pb_utils.Tensor("boxes", found["boxes"]),
                pb_utils.Tensor("scores", found["scores"]),
                pb_utils.Tensor("classes", classes),
                pb_utils.Tensor("labels", labels),
                pb_utils.Tensor("digits", digits),
                pb_utils.Tensor("digit_scores", probs.max(axis=1, initial=0.0).astype(np.float32)),
            ]
        )
