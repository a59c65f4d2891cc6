"""Typed model configuration, mirroring the parts of Triton's ``ModelConfig`` that edge-server acts on.

These objects are built once by :mod:`edge_server.config.parser` from ``config.pbtxt`` (and completed
from the model file by the backend), validated, and then only read.  Field names follow Triton's proto
so that a Triton user recognises every one of them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from edge_server.config.ragged import BatchInput, BatchOutput
from edge_server.config.sequence import SequenceBatching
from edge_server.config.triton_json import default_dict
from edge_server.errors import ConfigError

BackendName = Literal["onnxruntime", "tensorrt", "python", "ensemble"]

# platform -> backend, as Triton resolves them.
PLATFORM_TO_BACKEND: dict[str, BackendName] = {
    "onnxruntime_onnx": "onnxruntime",
    "tensorrt_plan": "tensorrt",
    "ensemble": "ensemble",
}
BACKEND_TO_PLATFORM: dict[str, str] = {v: k for k, v in PLATFORM_TO_BACKEND.items()}

# Triton's platforms that edge-server does not serve, with the Triton backend each stands for.
OTHER_TRITON_PLATFORMS: dict[str, str] = {
    "tensorflow_graphdef": "tensorflow",
    "tensorflow_savedmodel": "tensorflow",
    "pytorch_libtorch": "pytorch",
}

# What a user of a Triton backend edge-server lacks can do instead.
_ALTERNATIVES: dict[str, str] = {
    "pytorch": "export the model to ONNX (torch.onnx.export) and serve it with onnxruntime",
    "tensorflow": "convert the model to ONNX (tf2onnx) and serve it with onnxruntime",
    "openvino": "serve the ONNX model with onnxruntime (or build a TensorRT engine for the Jetson)",
    "vllm": "LLM serving is not part of edge-server",
    "tensorrtllm": "LLM serving is not part of edge-server",
    "fil": "convert the tree model to ONNX (e.g. with hummingbird or skl2onnx)",
    "dali": "do the pre-processing in a Python model",
}


def unsupported_backend_message(backend: str, *, platform: str = "") -> str:
    """Why a Triton backend edge-server does not have cannot load, and what to do instead."""
    supported = ", ".join(get_args(BackendName))
    what = f"platform {platform!r} (Triton's {backend} backend)" if platform else f"backend {backend!r}"
    alternative = _ALTERNATIVES.get(backend)
    advice = f"; {alternative}" if alternative else ""
    return f"{what} is not supported by edge-server, which serves {supported} models{advice}"


# Triton's default model file name per backend.
DEFAULT_MODEL_FILENAME: dict[str, str] = {
    "onnxruntime": "model.onnx",
    "tensorrt": "model.plan",
    "python": "model.py",
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output.  ``dims`` excludes the batch dimension when max_batch_size > 0; -1 is variable."""

    name: str
    data_type: str  # Triton name, e.g. "TYPE_FP32"
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False
    format: str = "FORMAT_NONE"
    label_filename: str = ""
    #: inputs only: requests that differ in this input's shape still batch (see config.ragged)
    allow_ragged_batch: bool = False


@dataclass(frozen=True)
class SecondaryDevice:
    kind: str  # "KIND_NVDLA"
    device_id: int


@dataclass(frozen=True)
class InstanceGroup:
    """``count`` instances of one kind.  KIND_AUTO resolves to GPU where the backend can use one."""

    name: str = ""
    kind: str = "KIND_AUTO"  # KIND_AUTO, KIND_CPU, KIND_GPU, KIND_MODEL
    count: int = 1
    gpus: tuple[int, ...] = ()
    secondary_devices: tuple[SecondaryDevice, ...] = ()
    passive: bool = False


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ``ModelQueuePolicy``.  0 means "no timeout" and "unbounded queue", as in Triton."""

    timeout_action: Literal["REJECT", "DELAY"] = "REJECT"
    default_timeout_microseconds: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0


@dataclass(frozen=True)
class DynamicBatching:
    preferred_batch_size: tuple[int, ...] = ()
    max_queue_delay_microseconds: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy = field(default_factory=QueuePolicy)
    priority_queue_policy: dict[int, QueuePolicy] = field(default_factory=dict)

    def queue_policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policy.get(level, self.default_queue_policy)


@dataclass(frozen=True)
class VersionPolicy:
    """Which version directories are served: the latest N, all, or specific ones."""

    kind: Literal["latest", "all", "specific"] = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve out of those on disk, highest first."""
        ordered = sorted(available, reverse=True)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[: self.num_versions]


@dataclass(frozen=True)
class WarmupInput:
    data_type: str
    dims: tuple[int, ...]
    source: Literal["zero_data", "random_data", "input_data_file"] = "zero_data"
    input_data_file: str = ""


@dataclass(frozen=True)
class Warmup:
    name: str
    batch_size: int = 1
    inputs: dict[str, WarmupInput] = field(default_factory=dict)
    count: int = 1


@dataclass(frozen=True)
class Accelerator:
    """One entry of ``optimization { execution_accelerators { ... } }``."""

    name: str
    parameters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    """A validated model configuration.  ``source`` names the config file for error messages."""

    name: str
    backend: str
    platform: str = ""
    max_batch_size: int = 0
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    instance_groups: tuple[InstanceGroup, ...] = ()
    dynamic_batching: DynamicBatching | None = None
    sequence_batching: SequenceBatching | None = None
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    parameters: dict[str, str] = field(default_factory=dict)
    model_warmup: tuple[Warmup, ...] = ()
    default_model_filename: str = ""
    gpu_accelerators: tuple[Accelerator, ...] = ()
    cpu_accelerators: tuple[Accelerator, ...] = ()
    batch_inputs: tuple[BatchInput, ...] = ()  # ragged batching (config.ragged)
    batch_outputs: tuple[BatchOutput, ...] = ()
    decoupled: bool = False  # model_transaction_policy: responses are streamed, zero or many per request
    source: str = ""
    #: the whole config as written, in Triton's JSON form (config.triton_json): the fields edge-server
    #: does not model (sequence_batching, model_transaction_policy, ...) reach models from here
    written: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def model_filename(self) -> str:
        return self.default_model_filename or DEFAULT_MODEL_FILENAME.get(self.backend, "")

    def server_inputs(self) -> tuple[str, ...]:
        """Model inputs the server fills (sequence control and state inputs); never sent by a client."""
        return self.sequence_batching.server_inputs() if self.sequence_batching else ()

    def state_outputs(self) -> tuple[str, ...]:
        """State outputs the server keeps and never returns.

        Those the config does not also list in ``output``: a listed one is an output like any other,
        which a client may ask for, as in Triton.
        """
        if self.sequence_batching is None:
            return ()
        listed = {t.name for t in self.outputs}
        return tuple(name for name in self.sequence_batching.state_outputs() if name not in listed)

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_triton_dict(self) -> dict[str, Any]:
        """The config as Triton renders it in JSON (``args["model_config"]``, the metadata endpoints).

        Every field of Triton's ``ModelConfig`` is there, with defaults, as in Triton: what edge-server
        models comes from these dataclasses (completed and normalised), the rest as it was written.
        """
        written = self.written
        out = copy.deepcopy(written) if written else default_dict("ModelConfig")
        out.update(
            name=self.name,
            platform=self.platform,
            backend=self.backend,
            max_batch_size=self.max_batch_size,
            default_model_filename=self.default_model_filename,
            version_policy=_version_policy_dict(self.version_policy),
            parameters={k: {"string_value": v} for k, v in self.parameters.items()},
            model_transaction_policy={"decoupled": self.decoupled},
        )
        for side, message, tensors in (
            ("input", "ModelInput", self.inputs),
            ("output", "ModelOutput", self.outputs),
        ):
            as_written = {t.get("name"): t for t in written.get(side, [])}
            out[side] = [
                _tensor_dict(t, copy.deepcopy(as_written.get(t.name) or default_dict(message)))
                for t in tensors
            ]
        groups, group_message = written.get("instance_group", []), "ModelInstanceGroup"
        out["instance_group"] = [
            _group_dict(g, copy.deepcopy(groups[i]) if i < len(groups) else default_dict(group_message))
            for i, g in enumerate(self.instance_groups)
        ]
        if self.dynamic_batching is None:
            out.pop("dynamic_batching", None)
        else:
            db = self.dynamic_batching
            batching = copy.deepcopy(written.get("dynamic_batching")) or default_dict("ModelDynamicBatching")
            batching.update(
                preferred_batch_size=list(db.preferred_batch_size),
                max_queue_delay_microseconds=db.max_queue_delay_microseconds,
                preserve_ordering=db.preserve_ordering,
                priority_levels=db.priority_levels,
                default_priority_level=db.default_priority_level,
                default_queue_policy=dataclasses.asdict(db.default_queue_policy),
                priority_queue_policy={
                    str(k): dataclasses.asdict(v) for k, v in db.priority_queue_policy.items()
                },
            )
            out["dynamic_batching"] = batching
        return out


def _tensor_dict(t: TensorSpec, base: dict[str, Any]) -> dict[str, Any]:
    base.update(name=t.name, data_type=t.data_type, dims=list(t.dims))
    if t.reshape is not None:
        base["reshape"] = {"shape": list(t.reshape)}
    else:
        base.pop("reshape", None)
    if "optional" in base:  # inputs only
        base.update(optional=t.optional, format=t.format, allow_ragged_batch=t.allow_ragged_batch)
    if "label_filename" in base:  # outputs only
        base["label_filename"] = t.label_filename
    return base


def _group_dict(g: InstanceGroup, base: dict[str, Any]) -> dict[str, Any]:
    base.update(
        name=g.name,
        kind=g.kind,
        count=g.count,
        gpus=list(g.gpus),
        secondary_devices=[{"kind": s.kind, "device_id": s.device_id} for s in g.secondary_devices],
        passive=g.passive,
    )
    return base


def _version_policy_dict(policy: VersionPolicy) -> dict[str, Any]:
    if policy.kind == "all":
        return {"all": {}}
    if policy.kind == "specific":
        return {"specific": {"versions": list(policy.versions)}}
    return {"latest": {"num_versions": policy.num_versions}}


def seconds_parameter(
    config: ModelConfig, key: str, default: float | None, *, most: float | None = None
) -> float | None:
    """A ``parameters`` entry that holds seconds, ``default`` when absent; ConfigError naming it otherwise.

    Without ``most`` it must be positive and finite (a timeout); with it, from 0 to ``most`` (a wait).
    """
    raw = config.parameters.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")  # fails both checks below
    if most is not None:
        if not 0 <= value <= most:
            raise ConfigError(
                f"{config.source or config.name}: parameters {{ key: {key!r} }} must be a number of seconds "
                f"from 0 to {most:g}, got {raw!r}"
            )
    elif not 0 < value < float("inf"):
        raise ConfigError(
            f"{config.source or config.name}: parameters {{ key: {key!r} }} must be a positive number of "
            f"seconds, got {raw!r}"
        )
    return value
