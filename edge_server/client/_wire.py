"""Building request messages and reading replies, shared by the sync and asyncio clients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_server.errors import MalformedMessage, ShmNotRegistered
from edge_server.ipc import protocol
from edge_server.request import Outputs as ResponseOutputs


@dataclass(frozen=True)
class ShmTensor:
    """An input tensor that already lies in a registered shared-memory region."""

    region: str
    offset: int
    byte_size: int
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShmRef:
    """Where the daemon should write an output: ``byte_size`` is the room there, not the exact size."""

    region: str
    offset: int
    byte_size: int


InputValue = np.ndarray | ShmTensor
Outputs = Sequence[str] | Mapping[str, ShmRef | None] | None


def infer_message(
    rid: int,
    model: str,
    inputs: Mapping[str, Any],
    *,
    version: int | None,
    outputs: Outputs,
    priority: int,
    timeout_us: int | None,
    pack: protocol.Pack = protocol.pack,
    op: str = "infer",
    extra: Mapping[str, Any] | None = None,
) -> tuple[list[Any], int]:
    """Frames of an infer (or ``stream``) request and their total size; array bytes are not copied.

    ``timeout_us`` is the queue timeout the daemon is asked to apply (None: the model's own policy).
    ``pack``: the header packer (the calling thread's own :func:`protocol.packer` is faster).
    ``extra``: further header fields (parameters, sequence fields), sent as given.
    """
    descs: list[dict[str, Any]] = []
    frames: list[Any] = [b""]
    total = 0
    for name, value in inputs.items():
        if isinstance(value, ShmTensor):
            shm = {"region": value.region, "offset": value.offset, "byte_size": value.byte_size}
            descs.append({"name": name, "datatype": value.datatype, "shape": list(value.shape), "shm": shm})
            continue
        datatype, shape, data = protocol.to_buffer(np.asarray(value))
        descs.append({"name": name, "datatype": datatype, "shape": shape, "frame": len(frames) - 1})
        frames.append(data)
        total += len(data) if isinstance(data, bytes) else data.nbytes
    header: dict[str, Any] = {"v": protocol.PROTOCOL_VERSION, "id": rid, "op": op, "model": model}
    header["inputs"] = descs
    if version is not None:
        header["version"] = version
    if outputs is not None:
        header["outputs"] = _output_descs(outputs)
    if priority:
        header["priority"] = priority
    if timeout_us is not None:
        header["timeout_us"] = timeout_us
    if extra:
        header.update(extra)
    frames[0] = pack(header)
    return frames, total + len(frames[0])


def _output_descs(outputs: Sequence[str] | Mapping[str, ShmRef | None]) -> list[dict[str, Any]]:
    if isinstance(outputs, str):
        outputs = [outputs]
    if not isinstance(outputs, Mapping):
        return [{"name": name} for name in outputs]
    descs: list[dict[str, Any]] = []
    for name, ref in outputs.items():
        desc: dict[str, Any] = {"name": name}
        if ref is not None:
            desc["shm"] = {"region": ref.region, "offset": ref.offset, "byte_size": ref.byte_size}
        descs.append(desc)
    return descs


def control_message(rid: int, op: str, **fields: Any) -> list[Any]:
    header = {"v": protocol.PROTOCOL_VERSION, "id": rid, "op": op}
    header.update({k: v for k, v in fields.items() if v is not None})
    return [protocol.pack(header)]


def infer_outputs(
    header: Mapping[str, Any], frames: Sequence[Any], regions: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """The output arrays of a successful infer reply: views over the frames or over our own regions."""
    descs = header.get("outputs")
    if not isinstance(descs, list):
        raise MalformedMessage("the infer reply has no 'outputs' array")
    result: dict[str, np.ndarray] = {}
    for desc in descs:
        name = desc.get("name") if type(desc) is dict else None
        if type(name) is not str:
            raise MalformedMessage(f"the infer reply has a bad output descriptor {desc!r}")
        if "shm" in desc:
            result[name] = _shm_output(desc, name, regions)
            continue
        slot = desc.get("frame")
        if type(slot) is not int or not 0 <= slot < len(frames):
            raise MalformedMessage(f"output {name!r} refers to frame {slot!r}; the reply has {len(frames)}")
        result[name] = protocol.tensor_array(desc, frames[slot], "output", name)
    parameters = header.get("parameters")
    if isinstance(parameters, dict) and parameters:  # the model's response parameters
        return ResponseOutputs(result, parameters)
    return result


def _shm_output(desc: Mapping[str, Any], name: str, regions: Mapping[str, Any]) -> np.ndarray:
    where = f"output {name!r}"
    datatype, dtype = protocol.tensor_dtype(desc, where)
    shape = protocol.tensor_shape(desc, where)
    region_name, offset, byte_size = protocol.shm_ref(desc["shm"], where)
    region = regions.get(region_name)
    if region is None:
        raise ShmNotRegistered(f"{where} was written to region {region_name!r}, unknown to this client")
    return region.view_as(datatype, dtype, shape, offset, byte_size, where)  # type: ignore[no-any-return]
