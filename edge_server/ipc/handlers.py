"""Turning protocol messages into data-plane calls and results back into messages.

Nothing here touches a socket: the frontend hands in decoded headers and frames, and gets back header
maps and frames to send.  That keeps every rule about a message testable without ZeroMQ.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_server import classification
from edge_server.errors import (
    InvalidArgument,
    MalformedMessage,
    ShmOutOfBounds,
    ShmUnavailable,
    TensorSizeMismatch,
    UnknownOperation,
    shorten,
)
from edge_server.ipc import protocol
from edge_server.ipc.handoff import FdHandoff
from edge_server.request import InferRequest, OutputBuffer, response_parameters
from edge_server.shm import ClientRegions, Lease, Owner, Region, Registry, check_name
from edge_server.status_index import index_row
from edge_server.versions import parse_version

if TYPE_CHECKING:
    from edge_server.server import Server

#: Control operations that may take long (they drain or load models): run beside the frontend thread.
SLOW_OPS = frozenset({"load", "reload", "unload"})


@dataclass(slots=True)
class InferContext:
    """What the reply to one infer request needs once its outputs exist."""

    rid: int | str | None
    order: list[str] | None  # requested output names in request order; None: as the model returns them
    shm_outputs: dict[str, tuple[Region, int, int]] = field(default_factory=dict)
    #: the views of mapped output spans handed to the request (its instance may fill them)
    destinations: dict[str, OutputBuffer] | None = None
    #: the output regions, held registered until the reply is written (they go with this context)
    leases: list[Lease] = field(default_factory=list)


def decode_infer(
    header: Mapping[str, Any], frames: Sequence[Any], registry: ClientRegions | None
) -> tuple[InferRequest, InferContext]:
    """Build the data-plane request; tensors stay views over the frames or the shared memory.

    Every message pays for this, so the common field types are tested directly and the precise error
    (``protocol.field``) is only asked for when one is off.
    """
    rid = protocol.request_id(header)
    model = header.get("model")
    if type(model) is not str:
        model = protocol.field(header, "model", str)
    version = header.get("version")
    if version is not None:
        version = parse_version(version)
    priority = header.get("priority", 0)
    if type(priority) is not int:
        priority = protocol.field(header, "priority", int, required=False) or 0
    timeout_us = header.get("timeout_us")
    if timeout_us is not None and type(timeout_us) is not int:
        timeout_us = protocol.field(header, "timeout_us", int)
    if priority < 0 or (timeout_us is not None and timeout_us < 0):
        raise MalformedMessage("'priority' and 'timeout_us' must be non-negative")
    descs = header.get("inputs")
    if type(descs) is not list:
        descs = protocol.field(header, "inputs", list)
    inputs: dict[str, np.ndarray] = {}
    used = [False] * len(frames)
    for index, desc in enumerate(descs):
        name = desc.get("name") if type(desc) is dict else None
        if type(name) is not str:
            raise MalformedMessage(f"inputs[{index}] must be a map with a string 'name'")
        if name in inputs:
            raise MalformedMessage(f"input {shorten(name)} appears twice in 'inputs'")
        if "shm" in desc:
            inputs[name] = _shm_input(desc, name, registry)
            continue
        slot = desc.get("frame")
        if type(slot) is not int or not 0 <= slot < len(frames) or used[slot]:
            _bad_slot(name, slot, len(frames))
        used[slot] = True
        inputs[name] = protocol.tensor_array(desc, frames[slot], "input", name)
    if not all(used):
        raise MalformedMessage(
            f"the message has {len(frames)} tensor frames but the header refers to {sum(used)} of them"
        )
    outputs = header.get("outputs")
    leases: list[Lease] = []
    order, shm_outputs = (None, {}) if outputs is None else _decode_outputs(outputs, registry, leases)
    destinations = _destinations(shm_outputs) if shm_outputs else None
    request = InferRequest(
        model=model,
        inputs=inputs,
        version=version,
        outputs=order,
        priority=priority,
        timeout_us=timeout_us,
        request_id=str(rid) if rid is not None else "",
        output_buffers=destinations,
    )
    if not _RARE_FIELDS.isdisjoint(header):
        _optional_fields(header, request)
        if request.classification and not shm_outputs.keys().isdisjoint(request.classification):
            raise InvalidArgument(classification.SHM_CONFLICT)
    return request, InferContext(rid, order, shm_outputs, destinations, leases)


def _destinations(shm_outputs: Mapping[str, tuple[Region, int, int]]) -> dict[str, OutputBuffer] | None:
    """Writable views of the (already bounds-checked) output spans in mapped regions.

    Two outputs whose spans overlap get none: an instance writing both could not keep them apart, so
    the frontend writes them in order, as it would without views.
    """
    found: dict[str, OutputBuffer] = {}
    clash: set[str] = set()
    last: tuple[str, int, str] | None = None  # (region, furthest end so far, its output)
    for region_name, start, end, name in sorted(
        (region.name, offset, offset + size, name) for name, (region, offset, size) in shm_outputs.items()
    ):
        if last is not None and last[0] == region_name and start < last[1]:
            clash.update((name, last[2]))
        if last is None or last[0] != region_name or end > last[1]:
            last = (region_name, end, name)
    for name, (region, offset, size) in shm_outputs.items():
        if name not in clash:
            destination = region.destination(offset, size)
            if destination is not None:
                found[name] = destination
    return found or None


_RARE_FIELDS = frozenset({"parameters", "sequence_id", "sequence_start", "sequence_end", "classification"})


def _optional_fields(header: Mapping[str, Any], request: InferRequest) -> None:
    parameters = protocol.field(header, "parameters", dict, required=False)
    if parameters is not None:
        request.parameters = parameters  # checked by the data plane's validator, for every frontend
    sequence_id = protocol.field(header, "sequence_id", (int, str), required=False)
    if sequence_id is not None:
        if isinstance(sequence_id, int) and not 0 <= sequence_id < 2**64:
            raise MalformedMessage(f"'sequence_id' must be an unsigned 64-bit integer, got {sequence_id}")
        if isinstance(sequence_id, str) and len(sequence_id) > 256:
            raise MalformedMessage("'sequence_id' strings may have at most 256 characters")
        request.correlation_id = sequence_id
    request.sequence_start = bool(protocol.field(header, "sequence_start", bool, required=False))
    request.sequence_end = bool(protocol.field(header, "sequence_end", bool, required=False))
    counts = protocol.field(header, "classification", dict, required=False)
    if counts:  # output name -> top classes; the data plane checks names and counts for every frontend
        if not all(type(k) is str and type(v) is int for k, v in counts.items()):
            raise MalformedMessage("'classification' must map output names to integers")
        request.classification = counts


def _shm_input(desc: Mapping[str, Any], name: str, registry: ClientRegions | None) -> np.ndarray:
    where = f"input {shorten(name)}"
    datatype, dtype = protocol.tensor_dtype(desc, where)
    shape = protocol.tensor_shape(desc, where)
    region_name, offset, byte_size = protocol.shm_ref(desc["shm"], where)
    region = _registry(registry).get(region_name, where)
    if datatype != "BYTES":  # compared before a byte is read: never read more than the tensor needs
        want = protocol.expected_nbytes(dtype, shape)
        if byte_size != want:
            raise_size(where, datatype, shape, want, byte_size)
    view = region.read(offset, byte_size, where)  # in place (sealed) or copied; bounds checked
    array = protocol.to_array(view, datatype, dtype, shape, where)
    if array.flags.writeable:
        array.flags.writeable = False  # the client's memory: a model must not scribble on it
    return array


def _bad_slot(name: str, slot: Any, count: int) -> None:
    where = f"input {shorten(name)}"
    if isinstance(slot, bool) or not isinstance(slot, int) or slot < 0:
        raise MalformedMessage(f"{where}: needs 'frame' (a frame index) or 'shm' (a reference)")
    if slot >= count:
        raise MalformedMessage(
            f"{where} refers to tensor frame {slot} but the message has {count} tensor frames "
            "(truncated message?)"
        )
    raise MalformedMessage(f"{where}: tensor frame {slot} is already used by another input")


def raise_size(where: str, datatype: str, shape: tuple[int, ...], want: int, got: int) -> None:
    raise TensorSizeMismatch(
        f"{where}: {datatype} {list(shape)} needs {want} bytes, the reference holds {got}"
    )


def _registry(registry: ClientRegions | None) -> ClientRegions:
    # None (a client without state yet): an empty registry, whose lookup raises the precise error.
    return registry if registry is not None else Registry().client(Owner(-1))


def _decode_outputs(
    descs: Any, registry: ClientRegions | None, leases: list[Lease]
) -> tuple[list[str], dict[str, tuple[Region, int, int]]]:
    if not isinstance(descs, list):
        raise MalformedMessage("field 'outputs' must be an array of maps")
    order: list[str] = []
    shm: dict[str, tuple[Region, int, int]] = {}
    for index, desc in enumerate(descs):
        if not isinstance(desc, dict) or not isinstance(desc.get("name"), str):
            raise MalformedMessage(f"outputs[{index}] must be a map with a string 'name'")
        name = desc["name"]
        if name in order:
            raise MalformedMessage(f"output {shorten(name)} appears twice in 'outputs'")
        order.append(name)
        if desc.get("shm") is not None:
            where = f"output {shorten(name)}"
            region_name, offset, byte_size = protocol.shm_ref(desc["shm"], where)
            lease = _registry(registry).hold(region_name, offset, byte_size, where)
            leases.append(lease)
            shm[name] = (lease.region, offset, byte_size)
    return order, shm


def encode_result(
    ctx: InferContext,
    outputs: Mapping[str, np.ndarray],
    pack: protocol.Pack = protocol.pack,
    final: bool | None = None,
) -> list[Any]:
    """Reply frames for a finished request: inline outputs as raw frames, shm outputs written in place.

    ``pack``: the header packer (one thread's own :func:`protocol.packer` is faster).  ``final``: set
    on the responses of a stream (``op: stream``), whether it is the last one.
    """
    names = ctx.order if ctx.order is not None else list(outputs)
    descs: list[dict[str, Any]] = []
    frames: list[Any] = [b""]
    for name in names:
        array = outputs[name]
        datatype, shape, data = protocol.to_buffer(array)
        desc: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        target = ctx.shm_outputs.get(name)
        if target is None:
            desc["frame"] = len(frames) - 1
            frames.append(data)
        else:
            region, offset, capacity = target
            nbytes = len(data) if isinstance(data, bytes) else data.nbytes
            if nbytes > capacity:
                raise ShmOutOfBounds(
                    f"output {shorten(name)} ({datatype} {shape}) needs {nbytes} bytes but its shared-memory "
                    f"reference holds {capacity}"
                )
            destination = ctx.destinations.get(name) if ctx.destinations is not None else None
            if (
                destination is not None
                and destination.filled
                and isinstance(data, np.ndarray)
                and destination.holds(data)
            ):
                region.count_output(destination.filled)  # the instance put it there: nothing to copy
            else:
                region.write(offset, data, f"output {shorten(name)}")  # checks the segment's size again
                region.count_output("frontend")
            desc["shm"] = {"region": region.name, "offset": offset, "byte_size": nbytes}
        descs.append(desc)
    header: dict[str, Any] = {"v": protocol.PROTOCOL_VERSION, "id": ctx.rid, "ok": True, "outputs": descs}
    parameters = response_parameters(outputs)
    if parameters:
        header["parameters"] = dict(parameters)
    if final is not None:
        header["final"] = final
    frames[0] = pack(header)
    return frames


def model_ready(server: Server, header: Mapping[str, Any]) -> Future[bool]:
    """A model's readiness, which its own ``is_ready`` may take seconds to answer (never on the loop)."""
    return server.model_ready(protocol.field(header, "model", str), parse_version(header.get("version")))


def control(
    server: Server,
    registry: ClientRegions,
    op: str,
    header: Mapping[str, Any],
    handoff: FdHandoff | None = None,
) -> dict[str, Any]:
    """Answer a control operation; returns the reply header's payload fields."""
    model = protocol.field(header, "model", str, required=op in ("metadata", "config", *SLOW_OPS))
    version = parse_version(header.get("version"))
    if op == "ready":  # the server's own (a model's is asked through model_ready)
        return {"ready": server.is_ready(model, version)}
    if op == "models":  # the index of every frontend: never-loaded models by name alone
        return {"models": [index_row(s) for s in server.repository_index()]}
    if op == "metadata":
        return {"metadata": server.model_metadata(model, version)}
    if op == "config":
        return {"config": server.model_config(model, version).to_triton_dict()}
    if op == "status":
        return {"status": server.status()}
    if op == "stats":
        return {"stats": server.statistics(model, version)}
    if op in ("load", "reload"):
        return {"models": [index_row(s) for s in server.load_model(model)]}
    if op == "unload":
        server.unload_model(model)
        return {}
    if op == "shm_register":
        token = protocol.field(header, "token", str, required=False)
        if token is None or handoff is None:
            raise ShmUnavailable(
                "register shared memory by handing its file descriptor to the daemon first (the socket "
                "beside the IPC socket, '<path>.shm'; see docs/protocol.md) and sending the token it "
                "returns; segments are never opened by name"
                + ("" if handoff is not None else " (this daemon listens on TCP: no descriptor passing)")
            )
        # Claimed first: a registration refused for any reason gives its descriptor back at once.
        segment = handoff.claim(token, uid=registry.owner.uid)
        try:
            name = check_name(protocol.field(header, "name", str))
            byte_size = protocol.field(header, "byte_size", int, required=False)
        except BaseException:
            os.close(segment.fd)
            raise
        region = registry.register(name, segment, byte_size)  # closes the descriptor if refused
        return {"region": {"name": region.name, "byte_size": region.byte_size, "zero_copy": region.zero_copy}}
    if op == "shm_unregister":
        return {"unregistered": registry.unregister(protocol.field(header, "name", str, required=False))}
    if op == "shm_status":
        return {"regions": registry.status(protocol.field(header, "name", str, required=False))}
    if op in protocol.OPS:  # live, ipc_status, bye, infer: the frontend answers those itself
        raise InvalidArgument(f"operation {op!r} is not handled here")
    raise UnknownOperation(
        f"unknown operation {op!r}; protocol {protocol.PROTOCOL_VERSION} has {sorted(protocol.OPS)}"
    )
