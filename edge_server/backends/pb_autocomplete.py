"""``pb_utils.ModelConfig``: what a Python model's ``auto_complete_config`` receives and returns.

It behaves as Triton's: the model may set ``max_batch_size``, turn on dynamic batching, set the
transaction policy and add inputs and outputs, and each call refuses what would contradict the
config as written (a larger explicit ``max_batch_size``, another scheduler, a different dtype, dims,
``optional`` or ``decoupled`` for a tensor or policy the config already names).  Errors are
``ValueError``, as in Triton, and fail the load with the model's message.

One deliberate difference: when the config sets a *smaller* non-zero ``max_batch_size`` than the
model asks for, Triton lets the model's value replace it; here the explicit config value is kept
(a smaller batch is always valid for the model, and the operator's limit should hold).
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

_INPUT_KEYS = ("name", "data_type", "dims", "optional")
_OUTPUT_KEYS = ("name", "data_type", "dims")


class ModelConfig:
    """The model config during auto-complete, in Triton's JSON form (``as_dict()``)."""

    def __init__(self, model_config: str | dict[str, Any]) -> None:
        # Triton passes the JSON text; edge-server passes the dict it renders.
        self._model_config: dict[str, Any] = (
            json.loads(model_config) if isinstance(model_config, str) else model_config
        )
        self._model_config.setdefault("input", [])
        self._model_config.setdefault("output", [])
        self._model_config.setdefault("max_batch_size", 0)

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        configured = int(self._model_config.get("max_batch_size", 0))
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but in auto-complete-config "
                f"function for model '{self._name}' specified max_batch_size {max_batch_size}"
            )
        if configured and configured < max_batch_size:
            log.info(
                "model '%s': auto_complete_config asks for max_batch_size %d; the config's %d is kept",
                self._name,
                max_batch_size,
                configured,
            )
            return
        self._model_config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but auto-complete-config "
                    f"function for model '{self._name}' tries to set scheduling_choice as "
                    "'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(
                    f"model transaction property in auto-complete-config function for model "
                    f"'{self._name}' contains property other than 'decoupled'."
                )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" not in transaction_policy_dict:
            return
        wanted = bool(transaction_policy_dict["decoupled"])
        # The rendered config always holds "decoupled" (false by default): only an explicit true
        # in the file can be contradicted.
        if policy.get("decoupled") and not wanted:
            raise ValueError(
                f"trying to change decoupled property in auto-complete-config for model "
                f"'{self._name}', which is already set to 'True'."
            )
        policy["decoupled"] = wanted

    def add_input(self, input: dict[str, Any]) -> None:  # noqa: A002 (Triton's parameter name)
        self._add("input", input, _INPUT_KEYS)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output, _OUTPUT_KEYS)

    def _add(self, role: str, spec: dict[str, Any], allowed: tuple[str, ...]) -> None:
        if not isinstance(spec, dict):
            raise ValueError(
                f"{role} in auto-complete-config function for model '{self._name}' is not a dict"
            )
        name = spec.get("name")
        extra = [key for key in spec if key not in allowed]
        if extra:
            raise ValueError(
                f"{role} '{name}' in auto-complete-config function for model '{self._name}' contains "
                f"property {extra[0]!r}; allowed: {', '.join(allowed)}"
            )
        for key in ("name", "data_type", "dims"):
            if key not in spec:
                what = f"{role} '{name}'" if name is not None else role
                raise ValueError(
                    f"{what} in auto-complete-config function for model '{self._name}' is missing "
                    f"'{key}' property."
                )
        dims = [int(d) for d in spec["dims"]]
        for current in self._model_config[role]:
            if current.get("name") != name:
                continue
            configured_type = current.get("data_type", "TYPE_INVALID")
            if configured_type != "TYPE_INVALID" and configured_type != spec["data_type"]:
                raise ValueError(
                    f"unable to load model '{self._name}', configuration expects datatype "
                    f"{configured_type} for {role} '{name}', model provides {spec['data_type']}"
                )
            configured_dims = [int(d) for d in current.get("dims", [])]
            if configured_dims and configured_dims != dims:
                raise ValueError(
                    f"model '{self._name}', tensor '{name}': the model expects dims {dims} but the "
                    f"model configuration specifies dims {configured_dims}"
                )
            if "optional" in spec and current.get("optional", False) != bool(spec["optional"]):
                if current.get("optional"):  # the file said true; the model says false
                    raise ValueError(
                        f"model '{self._name}', tensor '{name}': the model expects optional "
                        f"{spec['optional']} but the model configuration specifies optional True"
                    )
            current["data_type"] = spec["data_type"]
            current["dims"] = dims
            if "optional" in spec:
                current["optional"] = bool(spec["optional"])
            return
        added = dict(spec)
        added["dims"] = dims
        self._model_config[role].append(added)
