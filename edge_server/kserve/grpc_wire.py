"""``ModelInferRequest`` off the wire without copying its tensors: ``raw_input_contents`` as views.

protobuf's Python runtime copies a message's bytes fields twice, once when it parses the message and
again each time a ``bytes`` item is read, so a 1080p frame sent as ``raw_input_contents`` (6.2 MB) was
copied three times before the model saw it (the third copy is grpc's own, from its buffers into the
``bytes`` object handed to the deserializer, and stays).  Here the top-level fields are walked once:
the ``raw_input_contents`` entries become ``memoryview`` slices of the received bytes (the arrays the
codec builds over them are read-only, as before), and everything else, a few hundred bytes of names,
shapes and parameters, is parsed by protobuf as usual.

Small messages go to protobuf directly (walking costs more than copying a few kilobytes), and so does
anything the walk does not understand (groups, truncated fields): protobuf then parses it, or refuses
it, exactly as it would have.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonclient.grpc import service_pb2

RAW_FIELD = 7  # ModelInferRequest.raw_input_contents
VIEW_FROM_BYTES = 64 << 10  # below this, protobuf's copies cost less than the walk


@dataclass(slots=True)
class WireRequest:
    """A parsed request whose ``raw_input_contents`` were left out of ``message`` and kept as views."""

    message: service_pb2.ModelInferRequest
    raw: list[memoryview] | None  # None: they are in message.raw_input_contents


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise ValueError("truncated varint")


def _split(data: bytes) -> tuple[bytes, list[memoryview]] | None:
    """(the message without its raw contents, the raw contents as views), or None to let protobuf do it."""
    view = memoryview(data)
    end = len(data)
    pos = kept_from = 0
    kept: list[bytes] = []
    raw: list[memoryview] = []
    try:
        while pos < end:
            start = pos
            tag, pos = _varint(data, pos, end)
            wire_type = tag & 7
            if wire_type == 0:
                _, pos = _varint(data, pos, end)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _varint(data, pos, end)
                if tag >> 3 == RAW_FIELD and pos + length <= end:
                    kept.append(data[kept_from:start])
                    raw.append(view[pos : pos + length])
                    kept_from = pos + length
                pos += length
            else:
                return None  # groups: protobuf's to parse (or refuse)
            if pos > end:
                return None  # truncated: protobuf refuses it with its own error
    except ValueError:
        return None
    kept.append(data[kept_from:])
    return b"".join(kept), raw


def parse_infer_request(data: bytes) -> WireRequest:
    """The request deserializer for ``ModelInfer`` and ``ModelStreamInfer``."""
    if len(data) >= VIEW_FROM_BYTES:
        split = _split(data)
        if split is not None:
            head, raw = split
            return WireRequest(service_pb2.ModelInferRequest.FromString(head), raw)
    return WireRequest(service_pb2.ModelInferRequest.FromString(data), None)
