"""The tensors ``edge-server perf`` sends: random or zero data, perf_analyzer's JSON, or raw files.

Data is made once, before the first request, so that the load generators only send.  Each source
gives one or more *steps* (a name -> array dict each); requests cycle through them.  A JSON file or a
directory holds one sample per input, without the batch axis; it is repeated ``--batch-size`` times
for a batching model, as perf_analyzer does.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edge_server import dtypes
from edge_server.perf.options import PerfUsageError

Step = dict[str, np.ndarray]


def _numpy_dtype(wire: str, name: str) -> np.dtype:
    try:
        return dtypes.to_numpy(dtypes.from_wire(wire))
    except Exception:
        raise PerfUsageError(f"input {name}: data type {wire} is not supported") from None


def sample_shapes(
    metadata: Mapping[str, Any], batched: bool, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Each input's shape without the batch axis; variable dims must come from ``--shape``."""
    names = [spec["name"] for spec in metadata["inputs"]]
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise PerfUsageError(f"--shape names {', '.join(unknown)}; the model's inputs are {', '.join(names)}")
    out: dict[str, tuple[int, ...]] = {}
    for spec in metadata["inputs"]:
        dims = [int(d) for d in spec["shape"]]
        dims = dims[1:] if batched else dims
        given = shapes.get(spec["name"])
        if given is not None:
            if len(given) != len(dims) or any(d >= 0 and d != g for d, g in zip(dims, given, strict=True)):
                raise PerfUsageError(
                    f"--shape {spec['name']}:{','.join(map(str, given))} does not fit the model's "
                    f"shape {dims} (without the batch axis)"
                )
            out[spec["name"]] = tuple(given)
        elif any(d < 0 for d in dims):
            example = ",".join("1" if d < 0 else str(d) for d in dims)
            raise PerfUsageError(
                f"input {spec['name']} has the variable shape {dims}: give --shape {spec['name']}:{example}"
            )
        else:
            out[spec["name"]] = tuple(dims)
    return out


def make_steps(
    source: str,
    metadata: Mapping[str, Any],
    *,
    batched: bool,
    batch_size: int,
    shapes: Mapping[str, tuple[int, ...]],
) -> list[Step]:
    """The request data for ``--input-data SOURCE``, batched to ``batch_size`` where the model batches."""
    dtypes_by_name = {s["name"]: _numpy_dtype(s["datatype"], s["name"]) for s in metadata["inputs"]}
    if source in ("random", "zero"):
        sample = sample_shapes(metadata, batched, shapes)
        rng = np.random.default_rng(0)
        step = {
            name: _synthetic(rng, dtypes_by_name[name], shape, zero=source == "zero")
            for name, shape in sample.items()
        }
        samples = [step]
    elif Path(source).is_dir():
        sample = sample_shapes(metadata, batched, shapes)
        samples = [_from_directory(Path(source), sample, dtypes_by_name)]
    else:
        samples = _from_json(Path(source), metadata, batched, shapes, dtypes_by_name)
    if not batched:
        return samples
    return [{k: np.repeat(v[None], batch_size, axis=0) for k, v in s.items()} for s in samples]


def _synthetic(
    rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...], *, zero: bool
) -> np.ndarray:
    if dtype == np.dtype(object):
        fill = b"0" * 16 if zero else None
        values = [
            fill or bytes(rng.integers(97, 123, 16, dtype=np.uint8)) for _ in range(int(np.prod(shape)))
        ]
        array = np.empty(len(values), dtype=object)
        array[:] = values
        return array.reshape(shape)
    if zero:
        return np.zeros(shape, dtype)
    if dtype == np.dtype(bool):
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0, 10, shape).astype(dtype)  # small values: safe as indices or counts
    return rng.random(shape).astype(dtype)


def _from_directory(
    folder: Path, sample: Mapping[str, tuple[int, ...]], kinds: Mapping[str, np.dtype]
) -> Step:
    """perf_analyzer's directory form: one file per input, named after it.

    Each file holds the raw bytes in the input's data type (BYTES inputs: one string per line).
    """
    step: Step = {}
    for name, shape in sample.items():
        path = folder / name
        if not path.is_file():
            raise PerfUsageError(f"--input-data {folder}: no file {name} for input {name}")
        count = int(np.prod(shape))
        if kinds[name] == np.dtype(object):
            lines = path.read_bytes().splitlines()
            if len(lines) != count:
                raise PerfUsageError(
                    f"{path}: {len(lines)} lines, input {name} of shape {list(shape)} needs {count}"
                )
            array = np.empty(count, dtype=object)
            array[:] = lines
            step[name] = array.reshape(shape)
            continue
        raw = path.read_bytes()
        want = count * kinds[name].itemsize
        if len(raw) != want:
            raise PerfUsageError(
                f"{path}: {len(raw)} bytes, input {name} ({kinds[name]}, shape {list(shape)}) needs {want}"
            )
        step[name] = np.frombuffer(raw, kinds[name]).reshape(shape).copy()
    return step


def _from_json(
    path: Path,
    metadata: Mapping[str, Any],
    batched: bool,
    shapes: Mapping[str, tuple[int, ...]],
    kinds: Mapping[str, np.dtype],
) -> list[Step]:
    """perf_analyzer's JSON file, one step per entry of ``data``.

    ``{"data": [{"NAME": [values] | {"content": [...], "shape": [...]} | {"b64": "..."}}, ...]}``;
    sequence streams (a list of lists) are flattened into one list of steps.
    """
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PerfUsageError(f"--input-data {path}: not readable as JSON ({exc})") from None
    entries = document.get("data") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise PerfUsageError(f'--input-data {path}: expected {{"data": [{{INPUT: values}}, ...]}}')
    if all(isinstance(e, list) for e in entries):
        entries = [step for stream in entries for step in stream]
    steps = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise PerfUsageError(f"--input-data {path}: data[{index}] is not an object")
        step: Step = {}
        for spec in metadata["inputs"]:
            name = spec["name"]
            if name not in entry:
                raise PerfUsageError(f"--input-data {path}: data[{index}] has no input {name}")
            step[name] = _json_tensor(
                entry[name], name, spec, batched, shapes, kinds[name], f"{path}: data[{index}]"
            )
        steps.append(step)
    return steps


def _json_tensor(
    value: Any,
    name: str,
    spec: Mapping[str, Any],
    batched: bool,
    shapes: Mapping[str, tuple[int, ...]],
    dtype: np.dtype,
    where: str,
) -> np.ndarray:
    shape: tuple[int, ...] | None = shapes.get(name)
    if isinstance(value, dict) and "b64" in value:
        raw = base64.b64decode(value["b64"])
        flat: np.ndarray = np.frombuffer(raw, dtype).copy()
    else:
        if isinstance(value, dict):
            if "shape" in value:
                shape = tuple(int(d) for d in value["shape"])
            value = value.get("content")
        try:
            flat = np.asarray(value, dtype=dtype if dtype != np.dtype(object) else None).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise PerfUsageError(f"{where}: input {name}: {exc}") from None
        if dtype == np.dtype(object):
            flat = np.array([str(v).encode() for v in flat], dtype=object)
    if shape is None:
        dims = [int(d) for d in spec["shape"]][1 if batched else 0 :]
        shape = tuple(dims) if all(d >= 0 for d in dims) else (flat.size,) if len(dims) == 1 else None
    if shape is None or int(np.prod(shape)) != flat.size:
        raise PerfUsageError(f"{where}: input {name}: {flat.size} values do not fill shape {shape}")
    return flat.reshape(shape)


def output_sizes(
    metadata: Mapping[str, Any], *, batched: bool, batch_size: int, default_size: int
) -> dict[str, int]:
    """The room each output needs in shared memory, as perf_analyzer sizes it.

    A fixed-shape numeric output needs exactly its bytes at ``--batch-size``; one with variable dims,
    or a BYTES output, gets ``--output-shared-memory-size`` bytes (perf_analyzer's flag and default),
    and the daemon refuses a request whose output does not fit.
    """
    sizes: dict[str, int] = {}
    for spec in metadata.get("outputs") or []:
        dims = [int(d) for d in spec["shape"]]
        dims = [batch_size, *dims[1:]] if batched else dims
        wire = str(spec["datatype"])
        if wire == "BYTES" or any(d < 0 for d in dims):
            sizes[spec["name"]] = default_size
            continue
        itemsize = _numpy_dtype(wire, spec["name"]).itemsize
        sizes[spec["name"]] = max(1, itemsize * int(np.prod(dims, dtype=np.int64)))
    return sizes
