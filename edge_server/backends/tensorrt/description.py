"""What a TensorRT engine declares, as plain data: I/O tensors, modes, types, shapes, profile ranges.

The engine layer (``engine.py``) produces an :class:`EngineDescription` from a deserialized engine;
everything above it (profile choice, buffer sizing, config check and auto-complete, placement) reads only
this, so it is tested here against recorded descriptions (``tests/data/tensorrt``) without a GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_server.errors import ConfigError

# TensorRT DataType member name -> Triton config type.  FP8/INT4/BF16 have no config type here.
TRT_TO_CONFIG: dict[str, str] = {
    "FLOAT": "TYPE_FP32",
    "HALF": "TYPE_FP16",
    "INT8": "TYPE_INT8",
    "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64",  # TensorRT 10 only
    "BOOL": "TYPE_BOOL",
    "UINT8": "TYPE_UINT8",
}

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ProfileRange:
    """One input's (min, opt, max) shapes in one optimization profile."""

    min: Shape
    opt: Shape
    max: Shape

    def fits(self, shape: Shape) -> bool:
        return len(shape) == len(self.min) and all(
            lo <= d <= hi for lo, d, hi in zip(self.min, shape, self.max, strict=True)
        )


@dataclass(frozen=True)
class TensorDescription:
    name: str
    mode: str  # "INPUT" or "OUTPUT"
    data_type: str  # Triton config type, "TYPE_FP32"
    shape: Shape  # -1 where the engine leaves a dimension to run time
    profiles: tuple[ProfileRange, ...] = ()  # inputs only: one range per optimization profile

    @property
    def is_input(self) -> bool:
        return self.mode == "INPUT"


@dataclass(frozen=True)
class EngineDescription:
    tensors: tuple[TensorDescription, ...]
    num_profiles: int
    source: str = ""  # the plan file, for messages

    @property
    def inputs(self) -> tuple[TensorDescription, ...]:
        return tuple(t for t in self.tensors if t.is_input)

    @property
    def outputs(self) -> tuple[TensorDescription, ...]:
        return tuple(t for t in self.tensors if not t.is_input)

    def tensor(self, name: str) -> TensorDescription | None:
        return next((t for t in self.tensors if t.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "num_profiles": self.num_profiles,
            "tensors": [
                {
                    "name": t.name,
                    "mode": t.mode,
                    "data_type": t.data_type,
                    "shape": list(t.shape),
                    "profiles": [[list(p.min), list(p.opt), list(p.max)] for p in t.profiles],
                }
                for t in self.tensors
            ],
        }


def description_from_json(data: dict[str, Any], *, source: str = "") -> EngineDescription:
    """Rebuild a description written by :meth:`EngineDescription.to_json` (recorded test data)."""
    try:
        tensors = tuple(
            TensorDescription(
                name=str(t["name"]),
                mode=str(t["mode"]),
                data_type=str(t["data_type"]),
                shape=tuple(int(d) for d in t["shape"]),
                profiles=tuple(
                    ProfileRange(tuple(lo), tuple(opt), tuple(hi)) for lo, opt, hi in t.get("profiles", [])
                ),
            )
            for t in data["tensors"]
        )
        description = EngineDescription(
            tensors=tensors, num_profiles=int(data["num_profiles"]), source=source
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: not an engine description: {exc!r}") from exc
    for tensor in description.inputs:
        if len(tensor.profiles) != description.num_profiles and -1 in tensor.shape:
            raise ConfigError(
                f"{source}: input {tensor.name!r} has {len(tensor.profiles)} profile ranges for "
                f"{description.num_profiles} profiles"
            )
    return description


def load_description(path: Path) -> EngineDescription:
    return description_from_json(json.loads(path.read_text()), source=str(path))
