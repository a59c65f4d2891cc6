"""An ensemble's steps as a validated graph: Triton's ``ensemble_scheduling``, checked once at load.

Every tensor of an ensemble has exactly one producer (an ensemble input or one step's output) and may
have many consumers (steps, or the ensemble's outputs).  With one producer per tensor, the steps form a
graph whose edges are tensors; :func:`build_graph` rejects everything that would make a request fail
or hang later, each error naming the step and the tensor: unknown or unready members, batching members whose
``max_batch_size`` is smaller than the ensemble's (Triton's rule), member tensors
that do not exist, required member inputs left unmapped, tensors consumed but never produced, tensors
produced twice, ensemble inputs no step uses, cycles, and dtype or shape disagreements between the
producer and the consumer of a tensor.

Shapes follow Triton's rule: a producer and a consumer agree when their dims agree without the batch
axis, or when their full shapes (the batch axis first where the model batches) do.  So a
non-batching ensemble may feed ``[16]`` to a batching member of dims ``[-1]``, and a batching
ensemble may hold a non-batching member of dims ``[-1, 4]``; ``steps.fit_batch_axis`` adds or drops
the batch axis on the way, as Triton's ensemble scheduler does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edge_server.config.model import ModelConfig, TensorSpec
from edge_server.errors import ConfigError, EdgeServerError


@dataclass(frozen=True)
class Step:
    """One ``step``: run ``model_name`` with its inputs taken from, and outputs put into, ensemble tensors."""

    index: int
    model_name: str
    model_version: int | None  # None: the latest serving version (Triton's -1)
    input_map: Mapping[str, str]  # member input name -> ensemble tensor
    output_map: Mapping[str, str]  # member output name -> ensemble tensor

    def describe(self) -> str:
        return f"step {self.index} (model {self.model_name!r})"


@dataclass(frozen=True)
class Consumer:
    """Where a tensor goes: the dims the consumer's config states and whether it batches."""

    dims: tuple[int, ...]
    batches: bool


@dataclass(frozen=True)
class EnsembleGraph:
    """The validated steps, in an order where every step comes after the producers of its inputs."""

    steps: tuple[Step, ...]
    #: ensemble tensor -> indices of the steps that consume it
    consumers: Mapping[str, tuple[int, ...]]
    max_inflight_requests: int  # 0: no limit
    #: steps whose member is decoupled (zero or many responses): each response flows on alone
    decoupled: frozenset[int] = frozenset()
    #: which steps a path of the walk runs: key None for the request's own path, a decoupled step's
    #: index for the path each of its responses starts (see :func:`decoupled_scopes`)
    scopes: Mapping[int | None, frozenset[int]] | None = None
    #: ensemble tensor -> whether its producer batches (its first axis is the batch)
    batched: Mapping[str, bool] = field(default_factory=dict)
    #: (step index, member input) -> what the member takes there: its dims and whether it batches
    takes: Mapping[tuple[int, str], Consumer] = field(default_factory=dict)
    #: ensemble output -> what the ensemble's answer takes there
    answers: Mapping[str, Consumer] = field(default_factory=dict)
    #: ensemble output with a ``reshape`` -> the dims its answer is given back in
    restore: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def members(self) -> tuple[tuple[str, int | None], ...]:
        return tuple(dict.fromkeys((s.model_name, s.model_version) for s in self.steps))


MemberConfig = Callable[[str, int | None], ModelConfig]

_ENSEMBLE = re.compile(rb'\b(platform|backend)\s*:\s*"ensemble"')


def declares_ensemble(config_path: Path) -> bool:
    """Whether a ``config.pbtxt`` declares an ensemble: a cheap look before parsing, to order loads."""
    try:
        return bool(_ENSEMBLE.search(config_path.read_bytes()))
    except OSError:
        return False


def parse_steps(config: ModelConfig) -> tuple[list[Step], int]:
    """The steps and ``max_inflight_requests`` as written (Triton's JSON form, ``config.written``)."""
    scheduling: dict[str, Any] = config.written.get("ensemble_scheduling") or {}
    steps = []
    for index, step in enumerate(scheduling.get("step", [])):
        version = int(step.get("model_version", -1))
        steps.append(
            Step(
                index=index,
                model_name=str(step.get("model_name", "")),
                model_version=version if version >= 0 else None,
                input_map=dict(step.get("input_map", {})),
                output_map=dict(step.get("output_map", {})),
            )
        )
    return steps, int(scheduling.get("max_inflight_requests", 0))


def _fail(config: ModelConfig, message: str) -> ConfigError:
    return ConfigError(f"{config.source or config.name}: ensemble {config.name!r}: {message}")


def full_shape(spec: TensorSpec, max_batch_size: int) -> tuple[int, ...]:
    """The shape a request carries for ``spec``: the batch axis (-1) first when the model batches."""
    return ((-1,) if max_batch_size > 0 else ()) + spec.dims


def as_reshaped(spec: TensorSpec) -> TensorSpec:
    """An ensemble's own tensor as its steps see it: Triton applies its ``reshape`` at the boundary."""
    return spec if spec.reshape is None else replace(spec, dims=spec.reshape, reshape=None)


def shapes_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b, strict=True))


def build_graph(config: ModelConfig, member_config: MemberConfig) -> EnsembleGraph:
    """Validate ``config``'s ``ensemble_scheduling`` against its members' configs; raise ConfigError."""
    steps, max_inflight = parse_steps(config)
    if not steps:
        raise _fail(config, "ensemble_scheduling has no step")
    # tensor -> (description of its producer, its spec, the producer's max_batch_size)
    produced: dict[str, tuple[str, TensorSpec, int]] = {
        t.name: ("the ensemble input", as_reshaped(t), config.max_batch_size) for t in config.inputs
    }
    members: dict[int, ModelConfig] = {}
    for step in steps:
        if not step.model_name:
            raise _fail(config, f"step {step.index} names no model_name")
        try:
            member = member_config(step.model_name, step.model_version)
        except EdgeServerError as exc:
            raise _fail(config, f"{step.describe()}: {exc.message}") from None
        members[step.index] = member
        if 0 < member.max_batch_size < config.max_batch_size:
            # Triton's rule and words: a request the ensemble accepts must fit every batching step's
            # model.  (A non-batching member takes the batch whole when its full shape agrees.)
            raise ConfigError(
                f"{config.source or config.name}: ensemble {config.name} allows maximum batch size "
                f"{config.max_batch_size}, but it contains model {step.model_name} which only allows "
                f"maximum batch size to be {member.max_batch_size}"
            )
        if not step.output_map:
            raise _fail(config, f"{step.describe()}: output_map is empty; the step would produce nothing")
        for name in step.input_map:
            if member.input(name) is None:
                known = [t.name for t in member.inputs]
                raise _fail(config, f"{step.describe()}: input_map names input {name!r}, model has {known}")
        for spec in member.inputs:
            if spec.name not in step.input_map and not spec.optional:
                raise _fail(config, f"{step.describe()}: required input {spec.name!r} is not in input_map")
        for name, tensor in step.output_map.items():
            output = member.output(name)
            if output is None:
                known = [t.name for t in member.outputs]
                raise _fail(config, f"{step.describe()}: output_map names output {name!r}, model has {known}")
            if tensor in produced:
                raise _fail(
                    config,
                    f"{step.describe()}: tensor {tensor!r} is already produced by {produced[tensor][0]}",
                )
            produced[tensor] = (step.describe(), output, member.max_batch_size)

    consumers: dict[str, list[int]] = {}
    takes: dict[tuple[int, str], Consumer] = {}
    for step in steps:
        member = members[step.index]
        for name, tensor in step.input_map.items():
            if tensor not in produced:
                raise _fail(
                    config,
                    f"{step.describe()}: input {name!r} reads tensor {tensor!r}, which nothing produces",
                )
            readers = consumers.setdefault(tensor, [])
            if step.index not in readers:  # a step reading a tensor twice waits for it once
                readers.append(step.index)
            wanted = member.input(name)
            assert wanted is not None  # checked above
            takes[(step.index, name)] = Consumer(wanted.dims, member.max_batch_size > 0)
            reader = f"{step.describe()} input {name!r}"
            _check_match(config, tensor, produced[tensor], reader, wanted, member.max_batch_size)
    for spec in config.outputs:
        if spec.name not in produced:
            raise _fail(config, f"ensemble output {spec.name!r} is produced by no step")
        producer = produced[spec.name]
        _check_match(
            config, spec.name, producer, "the ensemble output", as_reshaped(spec), config.max_batch_size
        )
    for spec in config.inputs:
        if spec.name not in consumers:
            raise _fail(config, f"ensemble input {spec.name!r} is used by no step")
    order = _topological(config, steps)
    decoupled = frozenset(step.index for step in steps if members[step.index].decoupled)
    return EnsembleGraph(
        steps=tuple(order),
        consumers={tensor: tuple(indices) for tensor, indices in consumers.items()},
        max_inflight_requests=max_inflight,
        decoupled=decoupled,
        scopes=decoupled_scopes(config, steps, decoupled) if decoupled else None,
        batched={tensor: batch > 0 for tensor, (_, _, batch) in produced.items()},
        takes=takes,
        answers={
            spec.name: Consumer(as_reshaped(spec).dims, config.max_batch_size > 0) for spec in config.outputs
        },
        restore={spec.name: spec.dims for spec in config.outputs if spec.reshape is not None},
    )


def producer_labels(
    graph: EnsembleGraph, labels_of: Callable[[str, int | None], Mapping[str, tuple[str, ...]]]
) -> dict[str, tuple[str, ...]]:
    """Class names for the ensemble's outputs from the members that make them, as Triton looks them up.

    (An output's own ``label_filename`` in the ensemble's config takes precedence; the caller merges.)
    """
    found: dict[str, tuple[str, ...]] = {}
    for step in graph.steps:
        for output, tensor in step.output_map.items():
            if tensor in graph.answers:
                names = labels_of(step.model_name, step.model_version).get(output)
                if names:
                    found[tensor] = names
    return found


def decoupled_scopes(
    config: ModelConfig, steps: list[Step], decoupled: frozenset[int]
) -> dict[int | None, frozenset[int]]:
    """The steps each path of a walk through decoupled steps runs.

    Every response of a decoupled step D starts a path of its own that runs D's descendants with a
    copy of the tensors known when D ran, plus the response's outputs.  That copy is complete only if
    every step is an ancestor of D (finished before D ran), D, or a descendant of D: a step beside D
    could still be running when a response arrives.  So the decoupled steps must lie on one chain,
    and the paths nest: the request's own path runs everything up to the first decoupled step, that
    step's paths run everything after it up to the next one, and so on.
    """
    producer_of = {tensor: step.index for step in steps for tensor in step.output_map.values()}
    parents = {
        step.index: {producer_of[t] for t in step.input_map.values() if t in producer_of} for step in steps
    }
    children: dict[int, set[int]] = {step.index: set() for step in steps}
    for index, before in parents.items():
        for parent in before:
            children[parent].add(index)

    def reach(start: int, edges: Mapping[int, set[int]]) -> set[int]:
        seen: set[int] = set()
        todo = list(edges[start])
        while todo:
            index = todo.pop()
            if index not in seen:
                seen.add(index)
                todo += edges[index]
        return seen

    below = {index: reach(index, children) for index in decoupled}
    for index in decoupled:
        related = reach(index, parents) | below[index] | {index}
        beside = [step for step in steps if step.index not in related]
        if beside:
            raise _fail(
                config,
                f"{steps[index].describe()} is decoupled, so every other step must run before or after "
                f"it (each of its responses continues alone); {beside[0].describe()} runs beside it",
            )
    scopes: dict[int | None, frozenset[int]] = {}
    everything = {step.index for step in steps}
    for start in (None, *sorted(decoupled)):
        inside = everything if start is None else below[start]
        nested = [d for d in decoupled if d in inside]
        for d in nested:
            if not any(d in below[other] for other in nested if other != d):  # the next one down
                inside = inside - below[d]
        scopes[start] = frozenset(inside)
    return scopes


def _check_match(
    config: ModelConfig,
    tensor: str,
    producer: tuple[str, TensorSpec, int],
    consumer: str,
    spec: TensorSpec,
    consumer_batch: int,
) -> None:
    source, produced_spec, producer_batch = producer
    if produced_spec.data_type != spec.data_type:
        raise _fail(
            config,
            f"tensor {tensor!r}: {source} produces {produced_spec.data_type}, "
            f"{consumer} expects {spec.data_type}",
        )
    have, want = full_shape(produced_spec, producer_batch), full_shape(spec, consumer_batch)
    if not shapes_agree(produced_spec.dims, spec.dims) and not shapes_agree(have, want):
        raise _fail(
            config,
            f"tensor {tensor!r}: {source} produces shape {list(have)}, {consumer} expects {list(want)} "
            "(-1: any size, the batch axis included; shapes also agree without the batch axis)",
        )


def _topological(config: ModelConfig, steps: list[Step]) -> list[Step]:
    """The steps in dependency order; a cycle is an error naming the steps and tensors in it."""
    producer_of = {tensor: step.index for step in steps for tensor in step.output_map.values()}
    needs = {
        step.index: {producer_of[t] for t in step.input_map.values() if t in producer_of} for step in steps
    }
    order: list[Step] = []
    done: set[int] = set()
    remaining = {step.index: step for step in steps}
    while remaining:
        ready = [i for i in remaining if needs[i] <= done]
        if not ready:
            stuck = sorted(remaining)
            waits = "; ".join(
                f"{remaining[i].describe()} needs "
                + ", ".join(
                    repr(t) for t in remaining[i].input_map.values() if producer_of.get(t) in remaining
                )
                for i in stuck
            )
            raise _fail(config, f"the steps form a cycle: {waits}")
        for i in sorted(ready):
            order.append(remaining.pop(i))
            done.add(i)
    return order
