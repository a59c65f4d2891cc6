"""Triton Python-backend model (BLS): read the text in a BGR frame with the PP-OCR models.

The fixed part (pre-processing, detector, boxes) runs as the ``ocr_detect`` ensemble; the variable
part, one crop per box, goes to ``text_classification`` and ``text_recognition`` in chunks of 6,
every chunk of a stage in flight at once, so that those models' dynamic batchers can join them with
each other and with the crops of other frames.  Crops, chunks, orientation and character decoding
are a port of rapidocr_onnxruntime 1.4 (``get_crop_img_list``, ``TextClassifier``,
``TextRecognizer``, ``CTCLabelDecode``, ``filter_result``), operation for operation, so that the
answer equals ``RapidOCR()(frame)``: the same boxes, strings and scores.
"""

import asyncio
import json
import math
from pathlib import Path

import cv2
import numpy as np
import triton_python_backend_utils as pb_utils

CLS_SHAPE = (3, 48, 192)
REC_SHAPE = (3, 48, 320)
CLS_LABELS = ("0", "180")


def _crop(image, points):
    """The box straightened into an upright image (the package's ``get_rotate_crop_image``)."""
    width = int(max(np.linalg.norm(points[0] - points[1]), np.linalg.norm(points[2] - points[3])))
    height = int(max(np.linalg.norm(points[0] - points[3]), np.linalg.norm(points[1] - points[2])))
    target = np.array([[0, 0], [width, 0], [width, height], [0, height]]).astype(np.float32)
    matrix = cv2.getPerspectiveTransform(points, target)
    crop = cv2.warpPerspective(
        image, matrix, (width, height), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC
    )
    if crop.shape[0] * 1.0 / crop.shape[1] >= 1.5:
        crop = np.rot90(crop)
    return crop


def _fit(image, channels, height, width):
    """The crop at the model's height, its width kept in proportion up to ``width``, then padded:
    the classifier's and the recogniser's input, as the package prepares both."""
    h, w = image.shape[:2]
    ratio = w / float(h)
    resized_w = width if math.ceil(height * ratio) > width else int(math.ceil(height * ratio))
    resized = cv2.resize(image, (resized_w, height)).astype("float32")
    resized = resized.transpose((2, 0, 1)) / 255
    resized -= 0.5
    resized /= 0.5
    padded = np.zeros((channels, height, width), dtype=np.float32)
    padded[:, :, :resized_w] = resized
    return padded


def _cls_input(image):
    return _fit(image, *CLS_SHAPE)


def _rec_input(image, max_wh_ratio):
    channels, height, _ = REC_SHAPE
    return _fit(image, channels, height, int(height * max_wh_ratio))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config["parameters"].items()}
        self.text_score = float(params["text_score"])
        self.cls_thresh = float(params["cls_thresh"])
        self.cls_batch = int(params["cls_batch_num"])
        self.rec_batch = int(params["rec_batch_num"])
        self.timeout_us = int(params.get("timeout_us", "0"))
        # The recogniser's characters (from its ONNX metadata, written by make_models), then CTC's
        # blank first and a space last, as the package arranges them.
        keys = Path(args["model_repository"]) / "characters.txt"
        self.characters = ["blank", *keys.read_text(encoding="utf-8").split("\n"), " "]

    async def execute(self, requests):
        return [await self._one(request) for request in requests]

    async def _call(self, model, array, output):
        response = await pb_utils.InferenceRequest(
            model_name=model,
            inputs=[pb_utils.Tensor("x", array)],
            requested_output_names=[output],
            timeout=self.timeout_us,
        ).async_exec()
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        return pb_utils.get_output_tensor_by_name(response, output).as_numpy()

    async def _one(self, request):
        frame = pb_utils.get_input_tensor_by_name(request, "image")
        try:
            found = pb_utils.InferenceRequest(
                model_name="ocr_detect",
                inputs=[pb_utils.Tensor("frame", frame.as_numpy())],
                requested_output_names=["boxes", "frame_boxes", "image"],
                timeout=self.timeout_us,
            )
            response = await found.async_exec()
            if response.has_error():
                raise pb_utils.TritonModelException(response.error().message())
            boxes, frame_boxes, image = (
                pb_utils.get_output_tensor_by_name(response, name).as_numpy()
                for name in ("boxes", "frame_boxes", "image")
            )
            crops = [_crop(image, box.copy()) for box in boxes]
            crops = await self._orient(crops)
            lines = await self._recognise(crops)
        except pb_utils.TritonModelException as exc:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
        keep = [i for i, (_, score) in enumerate(lines) if float(score) >= self.text_score]
        return pb_utils.InferenceResponse(
            [
                pb_utils.Tensor("boxes", frame_boxes[keep].reshape(-1, 4, 2).astype(np.float32)),
                pb_utils.Tensor("texts", np.array([lines[i][0].encode() for i in keep], dtype=np.object_)),
                pb_utils.Tensor("scores", np.array([lines[i][1] for i in keep], dtype=np.float64)),
            ]
        )

    def _chunks(self, crops, size):
        """Crop indices ordered by width / height, in chunks of ``size`` (as the package batches)."""
        order = np.argsort(np.array([c.shape[1] / float(c.shape[0]) for c in crops]))
        return [order[i : i + size] for i in range(0, len(crops), size)]

    async def _orient(self, crops):
        """Turn the crops the classifier finds upside down (180 degrees, score above cls_thresh)."""
        chunks = self._chunks(crops, self.cls_batch)
        batches = [np.concatenate([_cls_input(crops[i])[np.newaxis, :] for i in c]) for c in chunks]
        outputs = await asyncio.gather(
            *(self._call("text_classification", b.astype(np.float32), "save_infer_model/scale_0.tmp_1")
              for b in batches)
        )
        crops = list(crops)
        for chunk, probs in zip(chunks, outputs):
            for row, index in enumerate(chunk):
                label = CLS_LABELS[int(probs[row].argmax())]
                if "180" in label and probs[row, probs[row].argmax()] > self.cls_thresh:
                    crops[index] = cv2.rotate(crops[index], 1)
        return crops

    async def _recognise(self, crops):
        """(text, score) per crop: each chunk padded to its widest crop, then CTC decoding."""
        chunks = self._chunks(crops, self.rec_batch)
        batches = []
        for chunk in chunks:
            max_wh_ratio = REC_SHAPE[2] / REC_SHAPE[1]
            for i in chunk:
                h, w = crops[i].shape[0:2]
                max_wh_ratio = max(max_wh_ratio, w * 1.0 / h)
            batches.append(np.concatenate([_rec_input(crops[i], max_wh_ratio)[np.newaxis, :] for i in chunk]))
        outputs = await asyncio.gather(
            *(self._call("text_recognition", b.astype(np.float32), "softmax_11.tmp_0") for b in batches)
        )
        lines = [("", 0.0)] * len(crops)
        for chunk, preds in zip(chunks, outputs):
            for row, index in enumerate(chunk):
                lines[index] = self._decode(preds[row])
        return lines

    def _decode(self, pred):
        """Greedy CTC: best character per column, repeats merged, blanks dropped; mean probability."""
        index = pred.argmax(axis=1)
        prob = pred.max(axis=1)
        selection = np.ones(len(index), dtype=bool)
        selection[1:] = index[1:] != index[:-1]
        selection &= index != 0
        confidences = np.array(prob[selection]).tolist() or [0]
        text = "".join(self.characters[i] for i in index[selection])
        return text, np.mean(confidences).tolist()
