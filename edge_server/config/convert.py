"""Turn a parsed ``inference.ModelConfig`` message into the typed dataclasses of :mod:`.model`.

Conversion fills in Triton's defaults (name from the directory, backend from platform and back,
instance count 1, latest-1 version policy) and keeps every value, valid or not, so that
:func:`edge_server.config.parser.validate_config` judges the finished dataclasses in one place.  It
raises only for what a dataclass cannot hold: an enum number that names no value, or a warmup
input that does not say where its data comes from.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from edge_server.config import ragged, sequence
from edge_server.config.model import (
    BACKEND_TO_PLATFORM,
    PLATFORM_TO_BACKEND,
    Accelerator,
    DynamicBatching,
    InstanceGroup,
    ModelConfig,
    QueuePolicy,
    SecondaryDevice,
    TensorSpec,
    VersionPolicy,
    Warmup,
    WarmupInput,
)
from edge_server.config.triton_json import message_to_dict
from edge_server.errors import ConfigError

# Parsed protobuf messages are made at run time, so mypy cannot see their fields.
Proto = Any


class _Converter:
    """Holds the file name for error messages and collects warnings while converting."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.warnings: list[str] = []

    def enum_name(self, message: Proto, field: str, path: str) -> str:
        # proto3 enums are open: text format accepts "data_type: 42", so check the number here.
        number = getattr(message, field)
        enum_type = message.DESCRIPTOR.fields_by_name[field].enum_type
        value = enum_type.values_by_number.get(number)
        if value is None:
            allowed = ", ".join(v.name for v in enum_type.values)
            raise ConfigError(
                f"{self.source}: field '{path}': {number} is not a {enum_type.name} value; "
                f"expected one of {allowed}"
            )
        return str(value.name)

    def model_config(self, msg: Proto, *, default_name: str) -> ModelConfig:
        platform, backend = msg.platform, msg.backend
        # Triton fills whichever of the two is missing; unknown names are left for validation.
        if platform and not backend:
            backend = PLATFORM_TO_BACKEND.get(platform, "")
        if backend and not platform:
            platform = BACKEND_TO_PLATFORM.get(backend, "")

        dynamic_batching = None
        if msg.HasField("dynamic_batching"):
            if msg.max_batch_size == 0:
                self.warnings.append(
                    f"{self.source}: field 'dynamic_batching' is ignored because max_batch_size is 0 "
                    "(the model does not batch), as Triton does"
                )
            else:
                dynamic_batching = self.dynamic_batching(msg.dynamic_batching)

        sequence_batching = None
        if msg.HasField("sequence_batching"):
            if dynamic_batching is not None:
                raise ConfigError(
                    f"{self.source}: field 'sequence_batching': a model has one scheduler; set either "
                    "dynamic_batching or sequence_batching, as in Triton"
                )
            try:
                sequence_batching = sequence.convert(msg.sequence_batching, self.enum_name)
            except sequence.ConversionError as exc:
                raise ConfigError(f"{self.source}: field '{exc.field}': {exc.problem}") from None

        accelerators = msg.optimization.execution_accelerators
        return ModelConfig(
            name=msg.name or default_name,
            backend=backend,
            platform=platform,
            max_batch_size=msg.max_batch_size,
            inputs=tuple(self.tensor(t, f"input[{i}]", is_input=True) for i, t in enumerate(msg.input)),
            outputs=tuple(self.tensor(t, f"output[{i}]", is_input=False) for i, t in enumerate(msg.output)),
            instance_groups=tuple(
                self.instance_group(g, f"instance_group[{i}]") for i, g in enumerate(msg.instance_group)
            ),
            dynamic_batching=dynamic_batching,
            sequence_batching=sequence_batching,
            batch_inputs=ragged.convert_inputs(msg.batch_input, self.enum_name),
            batch_outputs=ragged.convert_outputs(msg.batch_output, self.enum_name),
            version_policy=self.version_policy(msg),
            parameters={key: p.string_value for key, p in sorted(msg.parameters.items())},
            model_warmup=self.warmups(msg.model_warmup),
            default_model_filename=msg.default_model_filename,
            decoupled=msg.model_transaction_policy.decoupled,
            gpu_accelerators=tuple(_accelerator(a) for a in accelerators.gpu_execution_accelerator),
            cpu_accelerators=tuple(_accelerator(a) for a in accelerators.cpu_execution_accelerator),
            source=self.source,
            written=message_to_dict(msg),
        )

    def tensor(self, msg: Proto, path: str, *, is_input: bool) -> TensorSpec:
        return TensorSpec(
            name=msg.name,
            data_type=self.enum_name(msg, "data_type", f"{path}.data_type"),
            dims=tuple(msg.dims),
            # Presence matters: "reshape { shape: [ ] }" means a scalar, no reshape means None.
            reshape=tuple(msg.reshape.shape) if msg.HasField("reshape") else None,
            optional=msg.optional if is_input else False,
            allow_ragged_batch=msg.allow_ragged_batch if is_input else False,
            format=self.enum_name(msg, "format", f"{path}.format") if is_input else "FORMAT_NONE",
            label_filename="" if is_input else msg.label_filename,
        )

    def instance_group(self, msg: Proto, path: str) -> InstanceGroup:
        return InstanceGroup(
            name=msg.name,
            kind=self.enum_name(msg, "kind", f"{path}.kind"),
            count=1 if msg.count == 0 else msg.count,  # Triton's default; negative fails validation
            gpus=tuple(msg.gpus),
            secondary_devices=tuple(
                SecondaryDevice(self.enum_name(d, "kind", f"{path}.secondary_devices[{i}].kind"), d.device_id)
                for i, d in enumerate(msg.secondary_devices)
            ),
            passive=msg.passive,
        )

    def queue_policy(self, msg: Proto, path: str) -> QueuePolicy:
        action = self.enum_name(msg, "timeout_action", f"{path}.timeout_action")
        return QueuePolicy(
            timeout_action=cast(Literal["REJECT", "DELAY"], action),
            default_timeout_microseconds=msg.default_timeout_microseconds,
            allow_timeout_override=msg.allow_timeout_override,
            max_queue_size=msg.max_queue_size,
        )

    def dynamic_batching(self, msg: Proto) -> DynamicBatching:
        path = "dynamic_batching"
        return DynamicBatching(
            preferred_batch_size=tuple(msg.preferred_batch_size),
            max_queue_delay_microseconds=msg.max_queue_delay_microseconds,
            preserve_ordering=msg.preserve_ordering,
            priority_levels=msg.priority_levels,
            default_priority_level=msg.default_priority_level,
            default_queue_policy=self.queue_policy(msg.default_queue_policy, f"{path}.default_queue_policy"),
            priority_queue_policy={
                int(level): self.queue_policy(policy, f"{path}.priority_queue_policy[{level}]")
                for level, policy in sorted(msg.priority_queue_policy.items())
            },
        )

    def version_policy(self, msg: Proto) -> VersionPolicy:
        choice = msg.version_policy.WhichOneof("policy_choice")
        if choice == "all":
            return VersionPolicy(kind="all")
        if choice == "specific":
            return VersionPolicy(kind="specific", versions=tuple(msg.version_policy.specific.versions))
        if choice == "latest":
            return VersionPolicy(kind="latest", num_versions=msg.version_policy.latest.num_versions)
        return VersionPolicy()  # Triton's default: the latest single version

    def warmups(self, samples: Proto) -> tuple[Warmup, ...]:
        out = []
        for i, sample in enumerate(samples):
            path = f"model_warmup[{i}]"
            if sample.batch_size == 0:
                # Triton skips these samples at load; say so instead of doing it silently.
                self.warnings.append(
                    f"{self.source}: field '{path}.batch_size': sample {sample.name!r} has batch_size 0 "
                    "and is skipped, as Triton does"
                )
                continue
            inputs = {}
            for key, spec in sorted(sample.inputs.items()):
                where = f"{path}.inputs[{key!r}]"
                data_source = spec.WhichOneof("input_data_type")
                if data_source is None:
                    raise ConfigError(
                        f"{self.source}: field '{where}': set one of zero_data, random_data or "
                        "input_data_file to say where the warmup data comes from"
                    )
                inputs[key] = WarmupInput(
                    data_type=self.enum_name(spec, "data_type", f"{where}.data_type"),
                    dims=tuple(spec.dims),
                    source=data_source,
                    input_data_file=spec.input_data_file,
                )
            # count 0 means "once" in Triton.
            out.append(Warmup(sample.name, sample.batch_size, inputs, max(1, sample.count)))
        return tuple(out)


def _accelerator(msg: Proto) -> Accelerator:
    return Accelerator(name=msg.name, parameters=dict(sorted(msg.parameters.items())))


def to_model_config(message: Proto, *, source: str, default_name: str) -> tuple[ModelConfig, list[str]]:
    """The dataclass form of a parsed ``inference.ModelConfig``, and warnings about what was dropped."""
    converter = _Converter(source)
    config = converter.model_config(message, default_name=default_name)
    return config, converter.warnings
