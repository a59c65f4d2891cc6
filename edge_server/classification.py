"""Triton's classification extension: an output returned as its top-N classes instead of its values.

A client asks for it per requested output (``InferRequestedOutput(name, class_count=N)`` in
tritonclient: the ``classification`` parameter over HTTP and gRPC; ``classification`` in an output
descriptor over IPC; ``InferRequest.classification`` in-process).  The output then comes back as a
BYTES tensor of ``"score:index"`` strings, or ``"score:index:label"`` where the output's
``label_filename`` has a line for that index, best first: shape ``[N]``, or ``[batch, N]`` for a
batching model (the top N of each row).  Scores are written as Triton writes them (C++
``std::to_string``: six decimals for floats, plain integers), ties keep the lower index first.

The data plane applies it to the outputs of every frontend alike, so that HTTP, gRPC, IPC and the
in-process API answer the same; the texts of its errors are Triton's, which its clients match.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from edge_server.config.model import ModelConfig
from edge_server.errors import ConfigError, EdgeServerError, InvalidArgument
from edge_server.request import Outputs, ResponseSink, response_parameters

#: Triton's text for an output requested into shared memory and classified (it refuses both at once)
SHM_CONFLICT = "Output can't set both 'shared_memory_region' and 'classification'"
#: Triton refuses to classify an output of more elements than this (per batch row)
MAX_ELEMENTS = 1_000_000

# config data type -> its KServe name, for the outputs that can be classified (Triton's list)
_SUPPORTED = {
    "TYPE_UINT8": "UINT8",
    "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64",
}
_NUMPY_NAMES = {"O": "BYTES", "S": "BYTES", "U": "BYTES", "b": "BOOL", "f": "FP16"}
_WIRE = {"TYPE_STRING": "BYTES", "TYPE_BOOL": "BOOL", "TYPE_FP16": "FP16", "TYPE_BF16": "BF16"}


def read_labels(config: ModelConfig, model_dir: Path) -> dict[str, tuple[str, ...]]:
    """Each output's class names, from its ``label_filename`` in the model's directory (read at load).

    One label per line, line endings removed; a file that cannot be read fails the load, naming it.
    """
    labels: dict[str, tuple[str, ...]] = {}
    for spec in config.outputs:
        if not spec.label_filename:
            continue
        path = model_dir / spec.label_filename
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ConfigError(
                f"{config.source or config.name}: output {spec.name!r}: cannot read its label_filename "
                f"{spec.label_filename!r}: {exc.strerror or exc}"
            ) from exc
        labels[spec.name] = tuple(text.splitlines())
    return labels


def check(config: ModelConfig, counts: Mapping[str, int], requested: Sequence[str] | None) -> None:
    """Refuse, before the request runs, a classification of an output it cannot be given for."""
    types = {spec.name: spec.data_type for spec in config.outputs}
    for name, count in counts.items():
        if type(count) is not int or count <= 0:
            raise InvalidArgument(
                f"invalid value for 'classification' parameter of output {name!r}, expected an integer > 0"
            )
        data_type = types.get(name)
        if data_type is None or (requested is not None and name not in requested):
            raise InvalidArgument(
                f"classification asked for output {name!r}, which is not a requested output of model "
                f"{config.name!r}"
            )
        if data_type not in _SUPPORTED:
            shown = _WIRE.get(data_type, data_type.removeprefix("TYPE_"))
            raise InvalidArgument(f"class result not available for output due to unsupported type '{shown}'")


Convert = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


class ClassifyingSink(ResponseSink):
    """A stream's sink that classifies each response on its way to the consumer's sink.

    Cancellation is the consumer's: reading or setting ``cancelled`` (and ``on_cancel``) here reads or
    sets it there, so a decoupled model sees its client go away through this sink as through any other,
    and the final response of a cancelled request still reaches the consumer's sink (which gives the
    request's body back then).
    """

    relays = True

    def __init__(self, inner: ResponseSink, convert: Convert) -> None:
        self._inner = inner
        self._convert = convert
        self.keeps_reading = inner.keeps_reading
        super().__init__()

    @property  # type: ignore[override]
    def cancelled(self) -> bool:
        return self._inner.cancelled

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        if value:
            self._inner.cancel()

    @property  # type: ignore[override]
    def on_cancel(self) -> Callable[[], None] | None:
        return self._inner.on_cancel

    @on_cancel.setter
    def on_cancel(self, callback: Callable[[], None] | None) -> None:  # the producer's, told by the consumer
        self._inner.on_cancel = callback

    def deliver(
        self, outputs: dict[str, np.ndarray] | None, error: EdgeServerError | None, final: bool
    ) -> None:
        if outputs is not None:
            try:
                outputs = self._convert(outputs)
            except EdgeServerError as exc:
                outputs, error = None, exc
        self._inner.put(outputs, error, final=final)


def apply(
    outputs: Mapping[str, np.ndarray],
    counts: Mapping[str, int],
    *,
    batched: bool,
    labels: Mapping[str, tuple[str, ...]],
) -> dict[str, np.ndarray]:
    """``outputs`` with each output named in ``counts`` replaced by its top classes (see the module)."""
    result = Outputs(outputs, response_parameters(outputs))
    for name, count in counts.items():
        array = result.get(name)
        if array is not None:
            result[name] = classify(array, count, batched=batched, labels=labels.get(name, ()))
    return result


def classify(array: np.ndarray, count: int, *, batched: bool, labels: tuple[str, ...] = ()) -> np.ndarray:
    """One output's top ``count`` classes, per batch row when ``batched`` (an object array of bytes)."""
    if not (array.dtype.kind in "iu" or (array.dtype.kind == "f" and array.dtype.itemsize >= 4)):
        shown = _NUMPY_NAMES.get(array.dtype.kind, str(array.dtype).upper())
        raise InvalidArgument(f"class result not available for output due to unsupported type '{shown}'")
    per_row = batched and array.ndim > 0
    rows = array.reshape(array.shape[0], math.prod(array.shape[1:])) if per_row else array.reshape(1, -1)
    if rows.shape[1] > MAX_ELEMENTS:
        raise InvalidArgument("classification output tensor too large")
    take = min(count, rows.shape[1])
    out = np.empty((rows.shape[0], take), dtype=np.object_)
    integer = array.dtype.kind in "iu"
    for r, row in enumerate(rows):
        # a stable descending order: ties keep the lower index first
        order = (row.size - 1) - np.argsort(row[::-1], kind="stable")[::-1]
        for k, index in enumerate(order[:take].tolist()):
            value = row[index]
            score = str(int(value)) if integer else _cpp_float(float(value))
            text = f"{score}:{index}"
            if index < len(labels) and labels[index]:  # Triton: no label, no third part
                text += f":{labels[index]}"
            out[r, k] = text.encode()
    return out if per_row else out.reshape(take)


def _cpp_float(value: float) -> str:
    """C++ ``std::to_string`` of a float: ``%f`` (six decimals), ``nan``/``inf`` as C prints them."""
    if math.isnan(value):
        return "-nan" if math.copysign(1.0, value) < 0 else "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:f}"
