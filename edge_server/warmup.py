"""Warm-up as Triton does it: the config's ``model_warmup`` samples, run through every instance at load.

Nothing else is run: a made-up input cannot be right for every valid config (reshapes, strings,
optional inputs, variable dims, models that reject zeros), and Triton does not make one up either.
A sample names its inputs in the model's own terms (dims without the batch axis, ``batch_size``
rows); the input's ``reshape`` is applied as it is for a client's request.  A sample that fails
fails the load, with the sample's name in the message.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from edge_server import dtypes
from edge_server.backends.base import Backend
from edge_server.config.model import ModelConfig, TensorSpec, Warmup, WarmupInput
from edge_server.errors import ConfigError, EdgeServerError
from edge_server.paths import inside
from edge_server.request import REQUEST_FLAG_SEQUENCE_END, REQUEST_FLAG_SEQUENCE_START, BatchItem, Timing
from edge_server.scheduler.sequence_tensors import SequenceTensors


def _strings_from_file(raw: bytes, count: int, where: str) -> np.ndarray:
    """A TYPE_STRING sample file: Triton's serialisation, a little-endian uint32 length before each."""
    items: list[bytes] = []
    pos = 0
    while pos < len(raw) and len(items) < count:
        if pos + 4 > len(raw):
            raise ConfigError(f"{where}: string data ends inside a length prefix")
        (length,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + length > len(raw):
            raise ConfigError(f"{where}: string element {len(items)} runs past the end of the file")
        items.append(raw[pos : pos + length])
        pos += length
    if len(items) != count:
        raise ConfigError(f"{where}: holds {len(items)} strings, the sample needs {count}")
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


def _sample_array(given: WarmupInput, rows: int | None, data: Path | None, where: str) -> np.ndarray:
    dtype = dtypes.to_numpy(given.data_type)
    shape = given.dims if rows is None else (rows, *given.dims)
    count = int(np.prod(shape))
    if given.source == "input_data_file" and data is not None:
        try:
            raw = data.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read {data}: {exc.strerror}") from None
        if dtype.kind == "O":
            return _strings_from_file(raw, count, where).reshape(shape)
        if len(raw) < count * dtype.itemsize:
            needs = count * dtype.itemsize
            raise ConfigError(f"{where}: {data} has {len(raw)} bytes, the sample needs {needs}")
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape).copy()
    if dtype.kind == "O":  # zero and random string data are empty strings, as in Triton
        return np.full(shape, b"", dtype=object)
    if given.source == "random_data":
        return np.random.default_rng(0).random(shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def _sample_item(config: ModelConfig, sample: Warmup, version_dir: Path, where: str) -> BatchItem:
    batched = config.max_batch_size > 0
    specs: dict[str, TensorSpec | None] = {spec.name: spec for spec in config.inputs}
    specs.update(dict.fromkeys(config.server_inputs()))  # Triton's samples may give control tensors
    inputs: dict[str, np.ndarray] = {}
    for name, given in sample.inputs.items():
        if name not in specs:
            raise ConfigError(f"{where}: names input {name!r}, which the model does not have")
        spec = specs[name]
        data = (
            inside(version_dir / "warmup", given.input_data_file, f"{where} input {name!r} input_data_file")
            if given.input_data_file
            else None
        )
        rows = sample.batch_size if batched else None
        array = _sample_array(given, rows, data, f"{where} input {name!r}")
        if spec is not None and spec.reshape is not None:
            array = array.reshape((array.shape[0], *spec.reshape) if batched else spec.reshape)
        inputs[name] = array
    item = BatchItem(
        inputs=inputs,
        batch_size=sample.batch_size if batched else 1,
        requested_outputs=tuple(t.name for t in config.outputs),
    )
    if config.sequence_batching is not None:
        _add_sequence_inputs(config, item, version_dir)
    return item


def _add_sequence_inputs(config: ModelConfig, item: BatchItem, version_dir: Path) -> None:
    """Fill the control and state inputs a sample leaves out: a one-request sequence (START and END)."""
    tensors = SequenceTensors(config, version_dir.parent)
    flags = REQUEST_FLAG_SEQUENCE_START | REQUEST_FLAG_SEQUENCE_END
    full = tensors.row(BatchItem({}, 1, (), correlation_id=1, flags=flags), ready=True, state=None)
    for name, value in full.inputs.items():
        if name not in item.inputs:
            rows = item.batch_size if config.max_batch_size > 0 else 1
            item.inputs[name] = np.repeat(value, rows, axis=0) if rows > 1 else value


def warm_up(config: ModelConfig, backend: Backend, version_dir: Path, *, instance_name: str) -> None:
    """Run every ``model_warmup`` sample ``count`` times through one instance; raise if one fails."""
    for sample in config.model_warmup:
        where = f"{instance_name}: warmup {sample.name!r}"
        item = _sample_item(config, sample, version_dir, where)
        for _ in range(max(sample.count, 1)):
            try:
                (result,) = backend.execute([item], Timing())
            except EdgeServerError as exc:
                raise ConfigError(f"{where} failed: {exc.message}") from exc
            except Exception as exc:
                raise ConfigError(f"{where} failed: {exc!r}") from exc
            if isinstance(result, EdgeServerError):
                raise ConfigError(f"{where} failed: {result.message}")
