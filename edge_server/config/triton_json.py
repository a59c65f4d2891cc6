"""A parsed ``ModelConfig`` message as the JSON object Triton hands to models and clients.

Triton renders a model's config (``args["model_config"]`` of a Python model, the config endpoint) with
every scalar, repeated and map field present, defaults included; enums by name; and 64-bit integers
as JSON numbers (protobuf's own JSON mapping would make them strings, which Triton undoes).  Message
fields appear only when set.  This module produces that shape from any message of our schema.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from edge_server.config import schema

Proto = Any  # messages of our run-time schema


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_to_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum_value = field.enum_type.values_by_number.get(value)  # type: ignore[union-attr]
        return enum_value.name if enum_value is not None else value
    return value


def _is_map(field: FieldDescriptor) -> bool:
    entry = field.message_type
    return entry is not None and entry.GetOptions().map_entry


def message_to_dict(message: Proto) -> dict[str, Any]:
    """Every field of ``message`` the way Triton's JSON has it (see the module docstring)."""
    descriptor: Descriptor = message.DESCRIPTOR
    out: dict[str, Any] = {}
    for field in descriptor.fields:
        value = getattr(message, field.name)
        if _is_map(field):
            value_field = field.message_type.fields_by_name["value"]  # type: ignore[union-attr]
            out[field.name] = {str(k): _value(value_field, v) for k, v in sorted(value.items())}
        elif field.is_repeated:
            out[field.name] = [_value(field, item) for item in value]
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if message.HasField(field.name):
                out[field.name] = message_to_dict(value)
        elif field.containing_oneof is None or message.HasField(field.name):
            out[field.name] = _value(field, value)
    return out


def default_dict(message_name: str) -> dict[str, Any]:
    """An empty message of our schema (``"ModelInput"``) with its defaults, as :func:`message_to_dict`."""
    descriptor = schema.model_config_descriptor().file.pool.FindMessageTypeByName(
        f"{schema.PACKAGE}.{message_name}"
    )
    return message_to_dict(message_factory.GetMessageClass(descriptor)())
