"""``edge-server infer --image``: an image file as the tensor a model's input asks for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.errors import EdgeServerError, InvalidArgument

CHANNEL_ORDERS = ("bgr", "rgb")


def image_tensor(
    path: Path,
    spec: dict[str, Any],
    *,
    channel_order: str = "bgr",
    batched: bool | None = None,
    layout: str = "",
) -> tuple[np.ndarray, str]:
    """Load an image as the tensor a KServe input spec asks for: CHW or HWC, 1 or 3 channels, resized.

    Float inputs are scaled to [0, 1]; integer inputs keep 0..255.  A leading -1 in the shape is the
    batch axis and becomes 1 (``batched``: the model's ``max_batch_size`` is above 0; None: guessed
    from the shape); ``layout`` is the input's config ``format`` (``FORMAT_NCHW``, ``FORMAT_NHWC``),
    which says where the channels are when the dims cannot.  Colour channels stay in OpenCV's BGR
    order unless ``channel_order`` is ``rgb``: a model cannot say which it expects (Triton's
    ``format`` is the layout only), and camera pipelines built on OpenCV feed BGR.  Returns the array
    and a line that says what was sent.
    """
    if channel_order not in CHANNEL_ORDERS:
        raise InvalidArgument(f"--channel-order is {channel_order!r}; expected one of {list(CHANNEL_ORDERS)}")
    try:
        import cv2
    except ImportError:
        raise InvalidArgument(
            "--image needs OpenCV: pip install 'edge-server[image]' (on a Jetson, JetPack's python3-opencv)"
        ) from None

    shape = list(spec["shape"])
    if batched is None:
        batched = len(shape) == 4 or (len(shape) == 3 and shape[0] == -1 and shape[-1] not in (1, 3))
    dims = shape[1:] if batched else shape
    if len(dims) == 2:
        channels, chw, (height, width) = 1, False, dims
    elif layout == "FORMAT_NHWC" and dims[-1] in (1, 3):
        channels, chw, height, width = dims[-1], False, dims[0], dims[1]
    elif dims[0] in (1, 3):
        channels, chw, height, width = dims[0], True, dims[1], dims[2]
    elif dims[-1] in (1, 3):
        channels, chw, height, width = dims[-1], False, dims[0], dims[1]
    else:
        raise EdgeServerError(f"--image: cannot tell the channel axis of input shape {shape}")
    image = cv2.imread(str(path), cv2.IMREAD_GRAYSCALE if channels == 1 else cv2.IMREAD_COLOR)
    if image is None:
        raise InvalidArgument(f"--image: cannot read {path} as an image")
    if channels == 3 and channel_order == "rgb":
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB)
    if height > 0 and width > 0:
        image = cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA)
    dtype = dtypes.to_numpy(dtypes.from_wire(spec["datatype"]))
    array = image.astype(dtype) / 255.0 if dtype.kind == "f" else image.astype(dtype)
    if channels == 1 and len(dims) == 3:
        array = array[None] if chw else array[..., None]
    elif chw:
        array = array.transpose(2, 0, 1)
    array = np.ascontiguousarray(array, dtype=dtype)
    array = array[None] if batched else array
    order = channel_order.upper() if channels == 3 else "grayscale"
    scale = " scaled to [0, 1]" if dtype.kind == "f" else ""
    return array, f"{order} {array.dtype} {list(array.shape)}{scale}"
