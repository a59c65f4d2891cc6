"""ONNX Runtime backend: one InferenceSession per instance (the config auto-complete: onnxruntime_config).

Execution providers are picked from what this onnxruntime build offers and what the instance group and
``optimization.execution_accelerators`` ask for (TensorRT EP, then CUDA EP, then CPU), as Triton's
onnxruntime backend does.  Thread counts are set per instance so that the CPU ONNX Runtime instances of
every loaded model share the cores instead of each spawning a pool as large as the machine; the only one
on the box keeps ONNX Runtime's own thread settings (see :func:`thread_policy`).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edge_server import dtypes
from edge_server.backends.base import (
    ONNXRUNTIME_THREAD_POLICIES,
    InstanceSpec,
    LoadContext,
    OutputBuffer,
    TensorBackend,
)
from edge_server.backends.onnxruntime_config import complete_from_graph
from edge_server.backends.ragged import RaggedPlan
from edge_server.config.model import ModelConfig
from edge_server.errors import BackendUnavailable, ConfigError, ModelExecutionError, ShmOutOfBounds
from edge_server.memory import DeferredTrim

log = logging.getLogger(__name__)

_BF16 = dtypes.to_numpy("TYPE_BF16")
_ONNX_BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16

#: the ``rule`` of thread settings that ``auto`` chose because the instance was alone on the box
AUTO_ALONE_RULE = "auto: the only CPU ONNX Runtime instance"

#: ``parameters { key: "thread_policy" }`` values; see :func:`session_options`.
THREAD_POLICIES = ("default", "split")


def thread_policy(params: dict[str, str], instance: InstanceSpec, *, source: str) -> tuple[str, str]:
    """Which thread rule an instance's session follows, and why (docs/batching.md, "ONNX Runtime threads").

    ``default``: ONNX Runtime's own settings (one intra-op thread per core, workers spinning briefly
    between runs), the fastest for one model with one instance: spinning saves the wake-up of every
    worker on every run, 15-20% of a 9 ms CNN call on a 2-core box.  ``split``: the cores divided
    among every CPU ONNX Runtime instance on the box and spinning off, so that several instances or
    models, and the rest of a camera pipeline, keep their cores (spinning workers of two sessions
    steal each other's cores: 2-5x slower on a loaded 2-core box).  Per-model
    ``parameters { key: "thread_policy" }`` wins, then the daemon's ``--onnxruntime-thread-policy``;
    its ``auto`` gives ``default`` only to the one CPU ONNX Runtime instance on the box at load time.
    """
    policy = params.get("thread_policy")
    if policy is not None:
        if policy not in THREAD_POLICIES:
            raise ConfigError(
                f"{source}: parameters thread_policy is {policy!r}; expected one of {list(THREAD_POLICIES)}"
            )
        return policy, "the model's thread_policy parameter"
    daemon = instance.thread_policy
    if daemon not in ONNXRUNTIME_THREAD_POLICIES:
        raise ConfigError(
            f"onnxruntime thread policy is {daemon!r}; expected one of {list(ONNXRUNTIME_THREAD_POLICIES)}"
        )
    if daemon != "auto":
        return daemon, "--onnxruntime-thread-policy"
    # 0: nobody counted (a tool loading one model): the model's own instances, as the loader split them.
    sharing = instance.box_instances or (instance.cpu_count // max(instance.threads, 1))
    if sharing <= 1:
        return "default", AUTO_ALONE_RULE
    return "split", f"auto: {sharing} CPU ONNX Runtime instances share {instance.cpu_count} cores"


def session_options(params: dict[str, str], instance: InstanceSpec, *, source: str) -> ort.SessionOptions:
    """SessionOptions for one instance: the thread policy, then Triton's explicit parameters win."""
    return _session_options(params, instance, source=source)[0]


def _session_options(
    params: dict[str, str], instance: InstanceSpec, *, source: str
) -> tuple[ort.SessionOptions, dict[str, Any]]:
    """SessionOptions and what they say about threads (ORT cannot read them back from a session)."""
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    policy, why = thread_policy(params, instance, source=source)
    if policy == "split":
        options.intra_op_num_threads = instance.threads
        options.inter_op_num_threads = 1
        spinning = "0"
    else:
        spinning = "1"  # ONNX Runtime's default, written out so that the rule reads in one place
    try:
        if "intra_op_thread_count" in params:
            options.intra_op_num_threads = int(params["intra_op_thread_count"])
        if "inter_op_thread_count" in params:
            options.inter_op_num_threads = int(params["inter_op_thread_count"])
    except ValueError as exc:
        raise ConfigError(
            f"{source}: parameters intra/inter_op_thread_count must be integers: {exc}"
        ) from exc
    spinning = params.get("session.intra_op.allow_spinning", spinning)
    options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    explicit = sorted(
        k
        for k in ("intra_op_thread_count", "inter_op_thread_count", "session.intra_op.allow_spinning")
        if k in params
    )
    settings = {
        "policy": policy,
        "rule": why + (f"; explicit {', '.join(explicit)}" if explicit else ""),
        "intra_op_threads": options.intra_op_num_threads,  # 0: ONNX Runtime's, one per core
        "inter_op_threads": options.inter_op_num_threads,
        "spinning": spinning != "0",
    }
    return options, settings


#: Inputs of this many bytes or more make a run hand its arena's free memory back afterwards ...
SHRINK_AFTER_BYTES = 1 << 20
#: ... at most once in this many seconds: a shrink makes the next run fault its buffers in again, which
#: cost a batch of eight 224x224 images a quarter of its throughput when every such run shrank
#: (bench/bench_baselines.py, dynamic batching row: 0.71-0.77x of the minimal server against 0.91-0.96x).
SHRINK_INTERVAL_S = 0.5
_SHRINKAGE = "memory.enable_memory_arena_shrinkage"


def _arena_shrinkage(params: dict[str, str]) -> tuple[ort.RunOptions, int]:
    """RunOptions that shrink the arena after a run, and the input size from which runs use them.

    ONNX Runtime's arena keeps the peak of every run for the session's life: 300 requests of 1-8 MiB
    from a client that then went away (or was cut off for not reading) left +80 to +110 MiB resident in
    the ``identity`` example, with the heap trimmed.  So a run whose inputs are
    :data:`SHRINK_AFTER_BYTES` or more gives the arena's free memory back after it (small runs, the hot
    path, keep their arena), at most once every :data:`SHRINK_INTERVAL_S`, so that a steady stream of
    large frames keeps its buffers; what a burst left behind goes at the model's next run, and out of
    glibc's heap a moment after (a trim: the daemon's own, after a client went, may be long past).  Triton's
    model parameter of the same name (``cpu:0;gpu:0``) makes every run shrink those devices instead.
    """
    options = ort.RunOptions()
    explicit = params.get(_SHRINKAGE)
    options.add_run_config_entry(_SHRINKAGE, explicit or "cpu:0")  # the GPU arena: only when asked
    return options, 1 if explicit else SHRINK_AFTER_BYTES


class OnnxRuntimeBackend(TensorBackend):
    # A CPU session's cost follows its input size, which the scheduler checks before lending it to a
    # caller's thread; a CUDA session's instance sets this back to False at load.
    allows_inline = True

    @classmethod
    def gpu_available(cls) -> bool:
        return "CUDAExecutionProvider" in ort.get_available_providers()

    shares_cores = True  # the thread rule (see thread_policy) counts every CPU session on the box

    @classmethod
    def planned_cpu_sessions(cls, config: ModelConfig) -> int:
        """The CPU instances ``instance_group`` asks for (one, without it): the thread rule counts them."""
        if not config.instance_groups:
            return 0 if cls.gpu_available() else 1
        gpu = cls.gpu_available()
        count = 0
        for group in config.instance_groups:
            on_cpu = group.kind in ("KIND_CPU", "KIND_MODEL") or (group.kind == "KIND_AUTO" and not gpu)
            if on_cpu and not group.secondary_devices:
                count += group.count
        return count

    @classmethod
    def complete_config(cls, config: ModelConfig, model_path: Path) -> ModelConfig:
        return complete_from_graph(config, model_path)

    def __init__(self, ctx: LoadContext) -> None:
        config = ctx.config
        options, threads = _session_options(config.parameters, ctx.instance, source=config.source)
        options.log_severity_level = 3
        providers = self._providers(ctx)
        try:
            self._session = ort.InferenceSession(str(ctx.model_path), options, providers=providers)
        except Exception as exc:
            raise ConfigError(f"{ctx.model_path}: onnxruntime failed to load the model: {exc}") from exc
        used = self._session.get_providers()[0]
        self.device = "cpu" if used == "CPUExecutionProvider" else f"cuda:{ctx.instance.device_id}"
        self.allows_inline = self.device == "cpu"
        self.thread_settings = threads
        self.output_names = tuple(t.name for t in config.outputs) + config.state_outputs()
        self.batched = config.max_batch_size > 0
        self.ragged = RaggedPlan.of(config)
        strings = [t.name for t in config.inputs if t.data_type == "TYPE_STRING"]
        string_outputs = [t.name for t in config.outputs if t.data_type == "TYPE_STRING"]
        if config.sequence_batching is not None:  # a string CONTROL_SEQUENCE_CORRID, string states
            seq = config.sequence_batching
            strings += [c.name for c in seq.control_inputs if c.control.tensor_type == "TYPE_STRING"]
            strings += [s.input_name for s in seq.states if s.data_type == "TYPE_STRING"]
            string_outputs += [s.output_name for s in seq.states if s.data_type == "TYPE_STRING"]
        self._string_inputs = frozenset(strings)
        self._string_outputs = frozenset(string_outputs)
        self._bf16 = any(t.data_type == "TYPE_BF16" for t in config.inputs + config.outputs)
        self._bindable = _bindable_outputs(config)
        self._shrink, self._shrink_after = _arena_shrinkage(config.parameters)
        self._shrunk_at = -SHRINK_INTERVAL_S
        self._shrink_pending = False
        #: a shrink hands the arena's free memory to glibc, which keeps it in its heap unless trimmed: the
        #: daemon's own trims after a client goes may have passed before the model's next (shrinking) run
        self._trim = DeferredTrim((0.25,))
        log.debug("%s: onnxruntime session on %s (%s)", ctx.instance.name, self.device, providers)

    @staticmethod
    def _providers(ctx: LoadContext) -> list[Any]:
        available = set(ort.get_available_providers())
        for accel in ctx.config.cpu_accelerators:
            log.warning(
                "%s: cpu_execution_accelerator %r is not supported; running on onnxruntime's CPU provider",
                ctx.instance.name,
                accel.name,
            )
        if ctx.instance.kind == "KIND_CPU":
            for accel in ctx.config.gpu_accelerators:
                log.warning(
                    "%s: gpu_execution_accelerator %r ignored: the instance is KIND_CPU",
                    ctx.instance.name,
                    accel.name,
                )
            return ["CPUExecutionProvider"]
        if "CUDAExecutionProvider" not in available:
            raise BackendUnavailable(
                f"{ctx.instance.name}: instance kind {ctx.instance.kind} needs onnxruntime's CUDA execution "
                f"provider, which this onnxruntime build lacks (has {sorted(available)}); install the "
                "'gpu' extra or use KIND_CPU"
            )
        device = {"device_id": str(ctx.instance.device_id)}
        providers: list[Any] = []
        for accel in ctx.config.gpu_accelerators:
            if accel.name != "tensorrt" or "TensorrtExecutionProvider" not in available:
                log.warning(
                    "%s: gpu_execution_accelerator %r is not available here (providers: %s); using CUDA",
                    ctx.instance.name,
                    accel.name,
                    sorted(available),
                )
                continue
            trt = dict(device)
            if accel.parameters.get("precision_mode") == "FP16":
                trt["trt_fp16_enable"] = "True"
            if "max_workspace_size_bytes" in accel.parameters:
                trt["trt_max_workspace_size"] = accel.parameters["max_workspace_size_bytes"]
            providers.append(("TensorrtExecutionProvider", trt))
        providers.append(("CUDAExecutionProvider", device))
        providers.append("CPUExecutionProvider")
        return providers

    def _shrink_due(self, inputs: dict[str, np.ndarray]) -> bool:
        """Whether this run shrinks the arena after it (see :func:`_arena_shrinkage`).

        A large run leaves a shrink pending, even one that shrinks: its outputs are numpy arrays over
        the arena's memory (ONNX Runtime hands them out without a copy), which goes back to the arena
        only when the reply is gone, after the run.  The next run past the interval does it, large or
        not: what a burst of large requests left behind goes back at the model's next request.
        """
        if self._shrink_after == 1:  # the model asked for every run
            return sum(a.nbytes for a in inputs.values()) >= 1
        large = sum(a.nbytes for a in inputs.values()) >= self._shrink_after
        if not large and not self._shrink_pending:
            return False
        now = time.monotonic()
        due = now - self._shrunk_at >= SHRINK_INTERVAL_S
        self._shrink_pending = large or (self._shrink_pending and not due)
        if due:
            self._shrunk_at = now
        return due

    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        feed: dict[str, Any] = inputs
        if self._string_inputs:  # bytes in, str for onnxruntime (see dtypes.as_str_array)
            feed = dict(inputs)
            for name in self._string_inputs.intersection(inputs):
                feed[name] = dtypes.as_str_array(inputs[name], where=f"input {name!r}")
        try:
            if self._bf16:
                values = self._run_bf16(feed, output_names)
            elif self._shrink_after and self._shrink_due(inputs):
                values = self._session.run(list(output_names), feed, self._shrink)
                self._trim.request()
            else:
                values = self._session.run(list(output_names), feed)
        except Exception as exc:
            raise ModelExecutionError(f"onnxruntime failed: {exc}") from exc
        outputs = dict(zip(output_names, values, strict=True))
        for name in self._string_outputs.intersection(outputs):
            outputs[name] = dtypes.as_bytes_array(outputs[name], where=f"output {name!r}")
        return outputs

    def _run_bf16(self, feed: dict[str, Any], output_names: Sequence[str]) -> list[np.ndarray]:
        """Run through OrtValues: ONNX Runtime's Python API neither takes nor returns bfloat16 arrays.

        BF16 inputs go in as their uint16 bits tagged with ONNX's BFLOAT16 element type; BF16 outputs
        are copied out of ONNX Runtime's (CPU) buffer by address and viewed as ml_dtypes.bfloat16.
        """
        values = {
            name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                np.ascontiguousarray(array).view(np.uint16), _ONNX_BFLOAT16
            )
            if array.dtype == _BF16
            else ort.OrtValue.ortvalue_from_numpy(array)
            for name, array in feed.items()
        }
        results = self._session.run_with_ort_values(list(output_names), values)
        arrays = []
        for value in results:
            if value.data_type() != "tensor(bfloat16)":
                arrays.append(value.numpy())
                continue
            shape = tuple(value.shape())
            count = int(np.prod(shape))
            bits = np.zeros(count, dtype=np.uint16)
            if count:
                ctypes.memmove(bits.ctypes.data, value.data_ptr(), 2 * count)
            arrays.append(bits.view(_BF16).reshape(shape))
        return arrays

    def run_into(
        self,
        inputs: dict[str, np.ndarray],
        output_names: Sequence[str],
        destinations: Mapping[str, OutputBuffer],
    ) -> dict[str, np.ndarray]:
        """Bind outputs whose shape is known before the run to the client's memory (IOBinding).

        Only on the CPU provider (ONNX Runtime's CPU kernels then write into the bound buffer), only
        for outputs of fixed config dims (the shape must be bound before the run) and never for a
        destination that overlaps one of the request's own inputs (the model would read what it
        writes).  The others come back as usual and are copied after the run.
        """
        if self.device != "cpu" or self._string_inputs or self._bf16:
            return self.run(inputs, output_names)
        rows = next(iter(inputs.values())).shape[0] if self.batched and inputs else 1
        placed: dict[str, np.ndarray] = {}
        for name in output_names:
            destination, spec = destinations.get(name), self._bindable.get(name)
            if destination is None or spec is None:
                continue
            dtype, dims = spec
            shape = (rows, *dims) if self.batched else dims
            view = destination.view(dtype, shape)
            if view is None:  # the shape is known: refuse the short span before running anything
                need = dtype.itemsize * int(np.prod(shape))
                raise ShmOutOfBounds(
                    f"output {name!r} ({dtype} {list(shape)}) needs {need} bytes but its shared-memory "
                    f"reference holds {destination.array.nbytes}"
                )
            if view is not None and not any(np.may_share_memory(view, a) for a in inputs.values()):
                placed[name] = view
        if not placed:
            return self.run(inputs, output_names)
        binding = self._session.io_binding()
        try:
            for name, array in inputs.items():
                binding.bind_cpu_input(name, np.ascontiguousarray(array))
            for name in output_names:
                view = placed.get(name)
                if view is None:
                    binding.bind_output(name, "cpu")
                else:
                    binding.bind_output(
                        name, "cpu", 0, view.dtype.type, view.shape, view.__array_interface__["data"][0]
                    )
            self._session.run_with_iobinding(binding)
            values = binding.get_outputs()
        except Exception as exc:
            raise ModelExecutionError(f"onnxruntime failed: {exc}") from exc
        outputs: dict[str, np.ndarray] = {}
        for name, value in zip(output_names, values, strict=True):
            view = placed.get(name)
            if view is None:
                outputs[name] = value.numpy()
            else:
                outputs[name] = view
                destinations[name].filled = OutputBuffer.DIRECT
        return outputs

    def close(self) -> None:
        self._trim.cancel()
        self._session = None  # type: ignore[assignment]


def _bindable_outputs(config: ModelConfig) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The outputs that may be bound to a client's memory, with their dtype and dims.

    Those whose shape is known before a run (fixed dims, no reshape) and whose dtype ONNX Runtime
    writes as numpy has it.
    """
    found = {}
    for spec in config.outputs:
        if spec.reshape is not None or -1 in spec.dims or spec.data_type in ("TYPE_STRING", "TYPE_BF16"):
            continue
        found[spec.name] = (dtypes.to_numpy(spec.data_type), tuple(spec.dims))
    return found
