"""Model configuration: Triton's ``config.pbtxt`` parsed into typed, validated dataclasses."""

from __future__ import annotations

from edge_server.config.model import (
    BACKEND_TO_PLATFORM,
    DEFAULT_MODEL_FILENAME,
    PLATFORM_TO_BACKEND,
    Accelerator,
    BackendName,
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
from edge_server.config.parser import load_config_file, parse_config_json, parse_config_text, validate_config

__all__ = [
    "BACKEND_TO_PLATFORM",
    "DEFAULT_MODEL_FILENAME",
    "PLATFORM_TO_BACKEND",
    "Accelerator",
    "BackendName",
    "DynamicBatching",
    "InstanceGroup",
    "ModelConfig",
    "QueuePolicy",
    "SecondaryDevice",
    "TensorSpec",
    "VersionPolicy",
    "Warmup",
    "WarmupInput",
    "load_config_file",
    "parse_config_json",
    "parse_config_text",
    "validate_config",
]
