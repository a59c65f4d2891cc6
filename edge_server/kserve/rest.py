"""The HTTP/REST inference body to and from the data plane's request and outputs.

KServe v2 JSON with Triton's binary tensor data extension and system shared-memory parameters.

Inputs come from JSON ``data``, from the binary part of the body (``binary_data_size``, in input order),
or from a registered shared-memory region.  Outputs go back as JSON ``data``, as binary chunks after the
JSON (``binary_data`` per output, ``binary_data_output`` for all), or into a region.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_server.errors import InvalidArgument, shorten
from edge_server.kserve import codec, raw
from edge_server.kserve.service import KServeService, OutputWant, shm_reference
from edge_server.kserve.shm import InputBudget, Peer
from edge_server.request import InferRequest, response_parameters
from edge_server.versions import parse_version

MAX_TENSORS = 1024


class RestInfer:
    """One decoded HTTP inference request: the data plane's request and how to answer it."""

    __slots__ = ("request", "wants", "binary_default", "model", "version_text")

    def __init__(
        self, request: InferRequest, wants: list[OutputWant] | None, binary_default: bool, version: str
    ) -> None:
        self.request = request
        self.wants = wants
        self.binary_default = binary_default
        self.model = request.model
        self.version_text = version


def decode(
    service: KServeService, model: str, version: str, body: bytes, header_length: int | None, peer: Peer
) -> RestInfer:
    if header_length == 0:  # Triton's raw binary request: the body is the only input's data
        return _decode_raw(service, model, version, body)
    header, binary = codec.split_body(body, header_length)
    reader = codec.BinaryReader(binary)
    entries = header.get("inputs")
    # no inputs at all is a request too: a model's inputs may all be optional
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise InvalidArgument(f"'inputs' must be a list of at most {MAX_TENSORS} tensors")
    inputs: dict[str, np.ndarray] = {}
    budget: InputBudget | None = None  # inputs read from shared memory, all together
    bytes_error: codec.BytesCountMismatch | None = None
    for entry in entries:
        if not isinstance(entry, dict):
            raise InvalidArgument("each input must be a JSON object with name, shape, datatype and data")
        name = entry.get("name")
        if not isinstance(name, str):
            raise InvalidArgument("an input has no 'name' string")
        if name in inputs:
            raise InvalidArgument(f"input {shorten(name)} is given twice")
        datatype = codec.check_datatype(entry.get("datatype"), name)
        shape = codec.check_shape(entry.get("shape"), name, datatype)
        params = codec.parameters_of(entry, f"input {shorten(name)}")
        ref = shm_reference(params)
        try:
            if ref is not None:
                if budget is None:
                    budget = service.input_budget()
                inputs[name] = service.read_input(ref, datatype, shape, name, peer, budget, model)
            elif "binary_data_size" in params:
                chunk = reader.take(params["binary_data_size"], name)
                inputs[name] = codec.from_raw(chunk, datatype, shape, name, model)
            elif "data" in entry:
                inputs[name] = codec.from_json(entry["data"], datatype, shape, name)
            else:
                raise InvalidArgument(
                    f"input {shorten(name)} has no 'data', binary_data_size or shared-memory region"
                )
        except codec.BytesCountMismatch as exc:
            bytes_error = exc  # the last one is reported, as Triton does (see BytesCountMismatch)
    reader.check_consumed()
    if bytes_error is not None:
        raise bytes_error

    params = codec.parameters_of(header, "the request")
    binary_default = params.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidArgument("parameter 'binary_data_output' must be a boolean")
    wants = _outputs(header.get("outputs"), binary_default)
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("'id' must be a string")
    request = service.build_request(
        model=model,
        version=version,
        request_id=request_id,
        inputs=inputs,
        outputs=wants,
        parameters=params,
        peer=peer,
    )
    for want in wants or ():
        service.check_output(want, peer)
    return RestInfer(request, wants, binary_default, version)


def _decode_raw(service: KServeService, model: str, version: str, body: bytes) -> RestInfer:
    """A raw binary request (see kserve/raw.py): every output comes back binary."""
    config = service.server.model_config(model, parse_version(version))
    name, array = raw.raw_input(config, body, model)
    request = service.build_request(
        model=model, version=version, request_id="", inputs={name: array}, outputs=None, parameters={}
    )
    return RestInfer(request, None, True, version)


def _outputs(entries: object, binary_default: bool) -> list[OutputWant] | None:
    if entries is None:
        return None
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise InvalidArgument(f"'outputs' must be a list of at most {MAX_TENSORS} objects")
    wants = []
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InvalidArgument("each requested output must be a JSON object with a 'name' string")
        name = entry["name"]
        params = codec.parameters_of(entry, f"output {shorten(name)}")
        classes = params.get("classification", 0)
        if type(classes) is not int or classes < 0:  # Triton reads it as an unsigned integer; 0: off
            raise InvalidArgument(
                f"output {shorten(name)}: Unable to set 'classification': expected an unsigned integer"
            )
        binary = params.get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise InvalidArgument(f"output {shorten(name)}: binary_data must be a boolean")
        wants.append(OutputWant(name, binary, shm_reference(params), classes=classes))
    return wants


def encode(
    service: KServeService, decoded: RestInfer, outputs: dict[str, np.ndarray], peer: Peer
) -> tuple[bytes, int | None]:
    """The response body and, when it has binary chunks, the length of its JSON header."""
    wants = decoded.wants or [OutputWant(name, decoded.binary_default) for name in outputs]
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for want in wants:
        array = outputs[want.name]
        datatype = codec.wire_datatype(array)
        entry: dict[str, Any] = {"name": want.name, "datatype": datatype, "shape": list(array.shape)}
        if want.shm is not None:
            # No parameters on such an entry: Triton's C++ client reads every output's parameters as
            # binary data sizes (perf_analyzer fails on anything else); the client knows its region.
            service.write_output(want, codec.to_raw(array, datatype), peer)
        elif want.binary:
            raw = codec.to_raw(array, datatype)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = codec.to_json(array, datatype)
        entries.append(entry)
    request = decoded.request
    header: dict[str, Any] = {
        "model_name": decoded.model,
        "model_version": decoded.version_text or _version_text(request.routed_version),
    }
    if request.request_id:
        header["id"] = request.request_id
    parameters = response_parameters(outputs)
    if parameters:
        header["parameters"] = dict(parameters)
    header["outputs"] = entries
    return codec.encode_body(header, chunks)


def _version_text(version: int | None) -> str:
    return "" if version is None else str(version)
