"""Triton's gRPC messages (the generated modules tritonclient ships) to and from the data plane.

Inputs come from ``raw_input_contents`` (consumed in input order by the inputs that have neither typed
``contents`` nor a shared-memory region), from the typed ``contents`` fields, or from a region.  Outputs
always go back as ``raw_output_contents`` (one entry per output, empty for an output written to shared
memory, so that indices stay aligned as tritonclient reads them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from edge_server.errors import InvalidArgument, TensorSizeMismatch, shorten
from edge_server.kserve import codec
from edge_server.kserve.service import TRITON_GRPC_PARAMETERS, KServeService, OutputWant, shm_reference
from edge_server.kserve.shm import InputBudget, Peer
from edge_server.request import InferRequest, response_parameters

MAX_TENSORS = 1024
# datatype -> the typed contents field that carries it
_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def parameter_value(param: Any) -> bool | int | str | float | bytes:
    """The Python value of an ``InferParameter`` / ``ModelRepositoryParameter`` oneof."""
    kind = param.WhichOneof("parameter_choice")
    if kind is None:
        raise InvalidArgument("a parameter has no value")
    return getattr(param, kind)  # type: ignore[no-any-return]


def parameters(params: Mapping[str, Any]) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in params.items()}


def decode(
    service: KServeService,
    request: service_pb2.ModelInferRequest,
    peer: Peer,
    raw_contents: Sequence[bytes | memoryview] | None = None,
) -> tuple[InferRequest, list[OutputWant] | None]:
    """``raw_contents``: the request's ``raw_input_contents`` when they were kept out of it (grpc_wire)."""
    if len(request.inputs) > MAX_TENSORS or len(request.outputs) > MAX_TENSORS:  # none: all optional
        raise InvalidArgument(f"a request takes at most {MAX_TENSORS} inputs and {MAX_TENSORS} outputs")
    raw = request.raw_input_contents if raw_contents is None else raw_contents
    next_raw = 0
    inputs: dict[str, np.ndarray] = {}
    budget: InputBudget | None = None  # inputs read from shared memory, all together
    bytes_error: codec.BytesCountMismatch | None = None
    for tensor in request.inputs:
        name = tensor.name
        if name in inputs:
            raise InvalidArgument(f"input {shorten(name)} is given twice")
        datatype = codec.check_datatype(tensor.datatype, name)
        shape = codec.check_shape(list(tensor.shape), name, datatype)
        ref = shm_reference(parameters(tensor.parameters))
        try:
            if ref is not None:
                if budget is None:
                    budget = service.input_budget()
                inputs[name] = service.read_input(
                    ref, datatype, shape, name, peer, budget, request.model_name
                )
            elif tensor.HasField("contents"):
                inputs[name] = _from_contents(tensor.contents, datatype, shape, name)
            else:
                if next_raw >= len(raw):
                    raise InvalidArgument(
                        f"input {shorten(name)} has no contents and no raw_input_contents entry"
                    )
                next_raw += 1
                inputs[name] = codec.from_raw(raw[next_raw - 1], datatype, shape, name, request.model_name)
        except codec.BytesCountMismatch as exc:
            bytes_error = exc  # the last one is reported, as Triton does (see BytesCountMismatch)
    if next_raw != len(raw):
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries, but only {next_raw} inputs take raw contents"
        )
    if bytes_error is not None:
        raise bytes_error
    wants = None
    if request.outputs:
        wants = []
        for out in request.outputs:
            params = parameters(out.parameters)
            classes = 0
            if "classification" in out.parameters:  # Triton's checks and texts
                if out.parameters["classification"].WhichOneof("parameter_choice") != "int64_param":
                    raise InvalidArgument(
                        "invalid value type for 'classification' parameter, expected int64_param"
                    )
                classes = params["classification"]
                if classes <= 0:
                    raise InvalidArgument("invalid value for 'classification' parameter, expected >= 0")
            wants.append(OutputWant(out.name, True, shm_reference(params), classes=classes))
    infer = service.build_request(
        model=request.model_name,
        version=request.model_version,
        request_id=request.id,
        inputs=inputs,
        outputs=wants,
        parameters=parameters(request.parameters),
        peer=peer,
        triton_allowed=TRITON_GRPC_PARAMETERS,
    )
    for want in wants or ():
        service.check_output(want, peer)
    return infer, wants


def _from_contents(contents: Any, datatype: str, shape: tuple[int, ...], name: str) -> np.ndarray:
    field = _CONTENTS.get(datatype)
    if field is None:
        raise InvalidArgument(f"input {shorten(name)}: {datatype} travels only in raw_input_contents")
    values = getattr(contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise TensorSizeMismatch(
            f"input {shorten(name)}: shape {list(shape)} needs {count} values, got {len(values)}"
        )
    if datatype == "BYTES":
        items = np.empty(count, dtype=np.object_)
        items[:] = list(values)
        return items.reshape(shape)
    if datatype in ("INT8", "INT16", "UINT8", "UINT16"):
        # int_contents and uint_contents are 32-bit: check them as int64 before narrowing (numpy
        # raises OverflowError for a Python int out of the target's range).
        wide = np.array(values, dtype=np.int64)
        info = np.iinfo(codec.NUMPY[datatype])
        # np.min, not wide.min(): numpy 2.5's stubs (Python >= 3.12) read as 3.10 lack the no-argument form
        low, high = (int(np.min(wide)), int(np.max(wide))) if count else (0, 0)
        if low < info.min or high > info.max:
            raise InvalidArgument(
                f"input {shorten(name)}: a value is out of range for {datatype} "
                f"([{info.min}, {info.max}], got {low}..{high})"
            )
        return wide.astype(codec.NUMPY[datatype]).reshape(shape)
    array = np.array(values, dtype=codec.NUMPY[datatype].newbyteorder("="))
    return array.reshape(shape)


def encode(
    service: KServeService,
    request: InferRequest,
    wants: list[OutputWant] | None,
    outputs: dict[str, np.ndarray],
    peer: Peer,
) -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(
        model_name=request.model,
        model_version="" if request.routed_version is None else str(request.routed_version),
        id=request.request_id,
    )
    for key, value in response_parameters(outputs).items():
        _set_param(response.parameters[key], value)
    for want in wants or [OutputWant(name, True) for name in outputs]:
        array = outputs[want.name]
        datatype = codec.wire_datatype(array)
        tensor = response.outputs.add(name=want.name, datatype=datatype, shape=array.shape)
        raw = codec.to_raw(array, datatype)
        if want.shm is not None:
            for key, value in service.write_output(want, raw, peer).items():
                _set_param(tensor.parameters[key], value)
            response.raw_output_contents.append(b"")
        else:
            response.raw_output_contents.append(raw)
    return response


def _set_param(param: Any, value: object) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    else:
        param.string_param = str(value)


def model_config(config: dict[str, Any]) -> model_config_pb2.ModelConfig:
    return json_format.ParseDict(config, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)


def statistics(stats: dict[str, Any]) -> service_pb2.ModelStatisticsResponse:
    return json_format.ParseDict(stats, service_pb2.ModelStatisticsResponse(), ignore_unknown_fields=True)
