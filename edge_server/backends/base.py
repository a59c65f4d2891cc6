"""The one interface every backend implements.

A backend instance is one loaded copy of a model version on one device (an ONNX Runtime session, a
TensorRT execution context, a Python model object).  The scheduler owns instances and hands each a
batch: a list of already-validated requests.  Backends that run one stacked tensor batch (ONNX
Runtime, TensorRT) derive from :class:`TensorBackend`, which does the stacking and scattering; a
backend that wants the individual requests (Python models) implements :meth:`Backend.execute` itself.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_server.backends.ragged import RaggedPlan
from edge_server.config.model import ModelConfig
from edge_server.errors import InstanceFailed, ModelExecutionError
from edge_server.model_readiness import ReadinessProbe
from edge_server.request import BatchItem, ModelAccess, OutputBuffer, Result, Timing

__all__ = [
    "Backend",
    "BatchItem",
    "InstanceSpec",
    "LoadContext",
    "OutputBuffer",
    "Result",
    "TensorBackend",
    "Timing",
    "fill_destinations",
    "scatter",
]


@dataclass(frozen=True)
class InstanceSpec:
    """Where and how one instance runs; resolved from ``instance_group`` by the model loader."""

    name: str  # e.g. "digits_0_1"
    kind: str  # "KIND_CPU", "KIND_GPU", "KIND_DLA" (resolved, never KIND_AUTO)
    device_id: int = 0
    threads: int = 1  # intra-op threads this instance may use without oversubscribing the cores
    cpu_count: int = 1  # the cores the loader split among the model's CPU instances
    #: CPU instances sharing those cores: this model's, plus (ONNX Runtime) every other loaded
    #: version's CPU ONNX Runtime instances; 0 where the loader did not count (tools, tests)
    box_instances: int = 0
    #: the daemon's ``--onnxruntime-thread-policy`` (auto, default, split)
    thread_policy: str = "auto"


#: ``--onnxruntime-thread-policy``: ``auto`` gives ONNX Runtime's default threads to the only CPU ONNX
#: Runtime instance on the box and splits the cores otherwise; ``default`` and ``split`` force one.
ONNXRUNTIME_THREAD_POLICIES = ("auto", "default", "split")


@dataclass(frozen=True)
class LoadContext:
    """Everything a backend needs to load one instance."""

    config: ModelConfig
    version: int
    version_dir: Path
    model_path: Path
    instance: InstanceSpec
    #: other models, through the data plane (BLS calls); None where nothing can be called (tools)
    models: ModelAccess | None = None


class Backend(abc.ABC):
    """One loaded instance of a model version.  Construction loads; :meth:`close` frees everything."""

    #: an explicit opt-in: whether the scheduler may run a request on the caller's (frontend) thread
    #: when it has measured the model as cheap for requests of that size.  Off unless a backend says
    #: so (ONNX Runtime on the CPU and in-thread Python models do); GPU/DLA backends never do: a
    #: device call can block.
    allows_inline: bool = False

    #: whether the model may call other models (BLS): the scheduler never runs such a request on a
    #: worker that holds an instance of its own (see ``scheduler.inline.delivering``)
    calls_models: bool = False

    #: device label for status and metrics: "cpu", "cuda:0", "dla:1"
    device: str = "cpu"

    #: the thread settings the instance was built with, for status (ONNX Runtime); None elsewhere
    thread_settings: dict[str, Any] | None = None

    #: the instance's own say in its readiness (a Python model's ``is_ready``), asked by every
    #: model-ready probe (:mod:`edge_server.model_readiness`); None: ready while it serves
    readiness_probe: ReadinessProbe | None = None

    @classmethod
    def gpu_available(cls) -> bool:
        """Whether this backend can place instances on a GPU on this machine (decides KIND_AUTO)."""
        return False

    #: whether this backend's CPU instances take part in the box-wide thread rule (ONNX Runtime's,
    #: ``--onnxruntime-thread-policy``): the loader then counts the other models' such instances into
    #: :attr:`InstanceSpec.box_instances`, and the lifecycle counts this model's for theirs
    shares_cores: bool = False

    @classmethod
    def planned_cpu_sessions(cls, config: ModelConfig) -> int:
        """How many CPU sessions that share the cores a model of this config will open (before loading).

        The lifecycle counts them for the models a rescan brings in, so that a thread rule (ONNX
        Runtime's) is decided from the whole repository at the first load, never by rebuilding a
        serving model later.  0: this backend's instances do not take part in such a rule.
        """
        return 0

    @classmethod
    @abc.abstractmethod
    def complete_config(cls, config: ModelConfig, model_path: Path) -> ModelConfig:
        """Check ``config`` against the model file and fill what it leaves out (Triton's auto-complete).

        Raises :class:`~edge_server.errors.ConfigError` when they disagree.
        """

    @abc.abstractmethod
    def __init__(self, ctx: LoadContext) -> None: ...

    @classmethod
    def create(cls, ctx: LoadContext) -> Backend:
        """Load one instance; the loader calls this rather than the class.

        So a backend may pick the class of an instance from its config (the Python backend runs a
        model in the daemon's thread or, with ``isolation: process``, in a process of its own).
        """
        return cls(ctx)

    def watch(self, report: Callable[[InstanceFailed], None]) -> None:
        """Called once by the scheduler that owns the instance, before it runs anything.

        A backend that can find out about an unrecoverable fault while it is idle (its process was
        killed between batches) calls ``report`` with it, from any thread, so that the instance is
        replaced before a request is sent to it.  Faults found by :meth:`execute` are raised there.
        """
        return None  # by default faults are found only by execute()

    @abc.abstractmethod
    def execute(self, batch: Sequence[BatchItem], timing: Timing) -> list[Result]:
        """Run one batch; return one result per item, in order.

        An error that belongs to one request is returned in its slot; an exception raised from here fails
        the whole batch.  The instance is kept, unless the exception is
        :class:`~edge_server.errors.InstanceFailed`: then the instance can never serve again (its
        process died, its device context is lost) and the scheduler replaces it.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release sessions, contexts, threads and buffers; the instance is unusable afterwards."""


class TensorBackend(Backend):
    """A backend that runs the whole batch as one set of stacked tensors."""

    @abc.abstractmethod
    def run(self, inputs: dict[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        """Run the stacked batch and return the named outputs."""

    #: all output names of the model, in config order; set by subclasses at load
    output_names: tuple[str, ...] = ()
    #: whether tensors carry a leading batch axis (max_batch_size > 0)
    batched: bool = True
    #: ragged inputs, batch inputs and batch outputs (``RaggedPlan.of(config)``); set by subclasses
    ragged: RaggedPlan | None = None

    def run_into(
        self,
        inputs: dict[str, np.ndarray],
        output_names: Sequence[str],
        destinations: Mapping[str, OutputBuffer],
    ) -> dict[str, np.ndarray]:
        """:meth:`run` for one request whose client named shared memory for some outputs.

        A backend whose runtime can write an output straight into its destination does so, marks it
        ``filled = OutputBuffer.DIRECT`` and returns the view over it (ONNX Runtime's IOBinding,
        TensorRT's tensor addresses); whatever it leaves is copied in after the run by
        :func:`fill_destinations`.  The default writes nothing in place.
        """
        return self.run(inputs, output_names)

    def execute(self, batch: Sequence[BatchItem], timing: Timing) -> list[Result]:
        plan = self.ragged
        if len(batch) == 1 and plan is None:  # nothing to stack or split: the outputs are this request's
            item = batch[0]
            t0 = time.perf_counter_ns()
            destinations = item.destinations
            if destinations is None:
                outputs = self.run(item.inputs, item.requested_outputs)
                timing.compute_infer_ns += time.perf_counter_ns() - t0
                return [outputs]
            outputs = self.run_into(item.inputs, item.requested_outputs, destinations)
            t1 = time.perf_counter_ns()
            fill_destinations(outputs, destinations)
            timing.compute_infer_ns += t1 - t0
            timing.compute_output_ns += time.perf_counter_ns() - t1
            return [outputs]
        t0 = time.perf_counter_ns()
        if plan is None:
            inputs = {
                name: np.concatenate([item.inputs[name] for item in batch], axis=0)
                for name in batch[0].inputs
            }
        else:  # ragged batching's settings: one request or many, gathered by the plan
            inputs = plan.gather(batch)
        t1 = time.perf_counter_ns()
        outputs = self.run(inputs, _union_outputs(batch, self.output_names))
        t2 = time.perf_counter_ns()
        results = scatter(
            outputs, batch, batched=self.batched, by_shape=None if plan is None else plan.by_shape
        )
        # A batch of several requests runs into the backend's own buffers; then each request's rows are
        # copied into its own client's destinations (never one client's rows into another's region).
        for item, result in zip(batch, results, strict=True):
            if item.destinations is not None and not isinstance(result, Exception):
                fill_destinations(result, item.destinations)
        t3 = time.perf_counter_ns()
        timing.compute_input_ns += t1 - t0
        timing.compute_infer_ns += t2 - t1
        timing.compute_output_ns += t3 - t2
        return results


def fill_destinations(outputs: dict[str, np.ndarray], destinations: Mapping[str, OutputBuffer]) -> None:
    """Copy each output that has a destination and is not in it yet into it, on the instance's thread.

    The output is replaced by the view over the destination, so the frontend sees it in place and
    sends only the header (its thread serves every client; the copy belongs on the instance's).  An
    output that does not fit (or is a BYTES tensor) is left for the frontend, which reports the error
    or serializes it.
    """
    for name, destination in destinations.items():
        array = outputs.get(name)
        if array is None or destination.filled:
            continue
        view = destination.view(array.dtype, array.shape)
        if view is None:
            continue
        np.copyto(view, array, casting="no")
        outputs[name] = view
        destination.filled = OutputBuffer.COPIED


def _union_outputs(batch: Sequence[BatchItem], all_outputs: tuple[str, ...]) -> Sequence[str]:
    wanted = {name for item in batch for name in item.requested_outputs}
    return [name for name in all_outputs if name in wanted]


def scatter(
    outputs: dict[str, np.ndarray],
    batch: Sequence[BatchItem],
    *,
    batched: bool,
    by_shape: Mapping[str, str] | None = None,
) -> list[Result]:
    """Split stacked outputs back into each request's rows, after checking the row count.

    ``by_shape`` (ragged batching's ``batch_output``): output -> input; each request takes as many of
    that output's elements as its input has, in its input's shape.
    """
    if len(batch) == 1 and not by_shape:
        item = batch[0]
        return [{name: outputs[name] for name in item.requested_outputs}]
    by_shape = by_shape or {}
    total = sum(item.batch_size for item in batch)
    for name, array in outputs.items():
        source = by_shape.get(name)
        if source is not None:
            need = sum(item.inputs[source].size for item in batch if source in item.inputs)
            if array.size != need:
                raise ModelExecutionError(
                    f"output {name!r} has {array.size} elements; expected {need}, the elements of input "
                    f"{source!r} of the batch's requests (batch_output)"
                )
        elif not batched or array.ndim == 0 or array.shape[0] != total:
            raise ModelExecutionError(
                f"output {name!r} has shape {list(array.shape)}; expected {total} rows for a batch of "
                f"{len(batch)} requests"
            )
    results: list[Result] = []
    start = 0
    offsets = dict.fromkeys(by_shape.values(), 0)  # where each source input's elements start
    for item in batch:
        stop = start + item.batch_size
        result: dict[str, np.ndarray] = {}
        for name in item.requested_outputs:
            source = by_shape.get(name)
            if source is None:
                result[name] = outputs[name][start:stop]
            else:
                shape = item.inputs[source].shape
                first = offsets[source]
                result[name] = outputs[name].reshape(-1)[first : first + math.prod(shape)].reshape(shape)
        results.append(result)
        for source in offsets:
            if source in item.inputs:
                offsets[source] += item.inputs[source].size
        start = stop
    return results
