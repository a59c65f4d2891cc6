"""The engine cache record: what a plan was built from and for, kept beside it as ``<plan>.json``.

A TensorRT plan only loads on the TensorRT version and the device it was built with, and is only
current while its ONNX is unchanged.  ``build-engine`` writes the record; at load the record is compared
with this machine and the ONNX beside the plan, and a mismatch is said plainly (and, with
``--engine-build on-load``, the plan is rebuilt from the ONNX while the ONNX serves).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from edge_server.errors import ConfigError


@dataclass(frozen=True)
class EngineKey:
    """What a plan is tied to."""

    device: str  # "Jetson AGX Orin 64GB" or the CUDA device name on other machines
    dla_core: int | None  # None: built for the GPU
    tensorrt: str  # TensorRT version, "10.3.0"
    onnx_sha256: str  # of the ONNX it was built from ("" when unknown)


def record_path(plan: Path) -> Path:
    return plan.with_name(plan.name + ".json")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_record(plan: Path, key: EngineKey) -> Path:
    """Write the record atomically (a watcher may be reading the directory)."""
    path = record_path(plan)
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps(asdict(key), indent=2) + "\n")
    os.replace(temp, path)
    return path


def read_record(plan: Path) -> EngineKey | None:
    """The plan's record, None when there is none (a plan built elsewhere), ConfigError when unreadable."""
    path = record_path(plan)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: unreadable engine record: {exc}") from exc
    try:
        dla = data["dla_core"]
        return EngineKey(
            device=str(data["device"]),
            dla_core=None if dla is None else int(dla),
            tensorrt=str(data["tensorrt"]),
            onnx_sha256=str(data.get("onnx_sha256", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: engine record lacks {exc}") from exc


def mismatches(key: EngineKey, *, device: str, tensorrt: str, onnx: Path | None) -> list[str]:
    """Why a plan with record ``key`` cannot serve here (empty when it can).

    TensorRT versions must agree on major.minor.patch (plans are not portable across releases);
    the ONNX beside the plan must be the one it was built from.
    """
    reasons = []
    if tensorrt and key.tensorrt and key.tensorrt.split(".")[:3] != tensorrt.split(".")[:3]:
        reasons.append(
            f"the plan was built with TensorRT {key.tensorrt}; this machine has TensorRT {tensorrt}"
        )
    if device and key.device and key.device != device:
        reasons.append(f"the plan was built on {key.device!r}; this device is {device!r}")
    if onnx is not None and key.onnx_sha256 and onnx.is_file() and sha256_file(onnx) != key.onnx_sha256:
        reasons.append(f"{onnx.name} changed since the plan was built from it")
    return reasons
