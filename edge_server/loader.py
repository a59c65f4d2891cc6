"""Turning one version directory into a running model: config, backend instances, scheduler, warmup.

Everything here happens beside serving (the lifecycle calls it), never on the request path.  A version
is returned only after every instance has loaded and run its warmup, so a version that is handed to
the router can take traffic.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edge_server.backends import backend_class, guess_backend
from edge_server.backends.base import Backend, InstanceSpec, LoadContext
from edge_server.backends.tensorrt.fallback import choose as choose_runtime
from edge_server.backends.tensorrt.rebuild import EngineRebuilder
from edge_server.classification import read_labels
from edge_server.config import ModelConfig, load_config_file, parse_config_json, validate_config
from edge_server.config.model import InstanceGroup
from edge_server.errors import BackendUnavailable, ConfigError, EdgeServerError
from edge_server.paths import inside
from edge_server.pipeline.ensemble import EnsembleScheduler
from edge_server.pipeline.graph import build_graph, declares_ensemble, parse_steps, producer_labels
from edge_server.platform.gpus import gpu_ids
from edge_server.repository import ModelSource
from edge_server.request import ModelAccess
from edge_server.scheduler.interface import RequestScheduler
from edge_server.scheduler.pool import restart_backoff
from edge_server.scheduler.scheduler import ModelScheduler
from edge_server.scheduler.sequence import SequenceScheduler
from edge_server.scheduler.stats import ModelStats
from edge_server.scheduler.summaries import SummaryOptions
from edge_server.validation import RequestValidator
from edge_server.warmup import warm_up

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadEnvironment:
    """What every load (and every instance restart) gets from the server, fixed at start-up.

    Built once by the composition root (``server.py``) and handed to the lifecycle at construction:
    nothing is set on it afterwards.
    """

    #: other models, through the data plane (ensembles, BLS calls); None where nothing can be called
    access: ModelAccess | None = None
    #: ``--engine-build on-load``: stale TensorRT plans are rebuilt while their ONNX serves
    rebuilder: EngineRebuilder | None = None
    #: ``--onnxruntime-thread-policy``: auto, default or split
    thread_policy: str = "auto"
    #: ``--metrics-config summary_latencies=true``: versions keep latency quantiles
    summaries: SummaryOptions | None = None
    #: the cores the loader splits among CPU instances (None: the machine's)
    cpu_count: int | None = None


@dataclass
class LoadedVersion:
    """A version that is ready for traffic: its config, its scheduler and its statistics."""

    name: str
    version: int
    config: ModelConfig
    scheduler: RequestScheduler
    stats: ModelStats
    content_hash: str
    devices: tuple[str, ...]
    validator: RequestValidator
    #: an ensemble's members (name, version or None: latest); it is ready only while they are
    members: tuple[tuple[str, int | None], ...] = ()
    note: str = ""  # shown in the model list while READY, e.g. "serving model.onnx through onnxruntime: ..."
    #: ONNX Runtime: the thread settings its first instance was built with (status shows them)
    thread_settings: dict[str, Any] | None = None
    #: CPU instances taking part in the box-wide thread rule (``Backend.shares_cores``)
    cpu_sessions: int = 0
    #: each output's class names from its label_filename (the classification extension)
    labels: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def retire(self, deadline: float, *, finish_sequences: bool = False) -> None:
        """Let queued and running requests finish (until ``deadline``, monotonic), then free everything.

        ``finish_sequences`` (a reload with a successor): a sequence model also waits for its live
        sequences to end or idle out, so that they finish on the version they started on.
        """
        self.scheduler.close_intake(finish_sequences=finish_sequences)
        if not self.scheduler.drain(deadline):
            log.warning(
                "%s v%d: drain deadline passed; failing what is still queued", self.name, self.version
            )
        # Workers get a short grace past the shared deadline, never more: one stop, one budget.
        self.scheduler.stop(grace=max(0.1, min(STOP_GRACE_S, deadline + STOP_GRACE_S - time.monotonic())))


#: How long past the drain deadline a worker may take to notice it must stop (a stuck one is left).
STOP_GRACE_S = 2.0


def read_config(source: ModelSource) -> tuple[ModelConfig, list[str]]:
    """The model's config as written, with the backend decided (from the files when the config is silent)."""
    if source.config_override is not None:
        config, warnings = parse_config_json(
            source.config_override, source=f"{source.path} (config given at load)", default_name=source.name
        )
    elif source.config_path.is_file():
        config, warnings = load_config_file(source.config_path, default_name=source.name)
    else:
        config, warnings = ModelConfig(name=source.name, backend="", source=str(source.config_path)), []
    if not config.backend:
        backend = guess_backend([source.versions[v] for v in sorted(source.versions, reverse=True)])
        if backend is None:
            raise ConfigError(
                f"{source.path}: no config.pbtxt naming a backend or platform, and no model.onnx, model.plan "
                "or model.py in any version directory"
            )
        config = config.replace(backend=backend)
    if config.backend != "ensemble" and config.model_filename:
        # Here, not only at load: a config that names a file outside its directories is refused
        # whole, before anything reads it, and the version that served goes on serving.
        for version_dir in source.versions.values():
            inside(version_dir, config.model_filename, "default_model_filename")
    for output in config.outputs:  # read by the model or a client, from the model's directory
        if output.label_filename:
            inside(source.path, output.label_filename, f"output {output.name!r} label_filename")
    return config, warnings


def load_version(
    source: ModelSource,
    version: int,
    config: ModelConfig,
    *,
    content_hash: str,
    env: LoadEnvironment,
    sharing: int = 0,
) -> LoadedVersion:
    """Load, complete, instantiate and warm up one version; raises ConfigError or BackendUnavailable.

    ``sharing``: CPU sessions of the other loaded versions that take part in the thread rule
    (``Backend.shares_cores``), which this model's CPU instances share the cores with.
    """
    access = env.access
    if config.backend == "ensemble":
        return _load_ensemble(source, version, config, content_hash=content_hash, env=env)
    version_dir = source.versions[version]
    # A TensorRT model whose plan cannot run here serves the ONNX beside it (backends/tensorrt/fallback.py).
    choice = choose_runtime(config, version_dir, rebuilder=env.rebuilder)
    config = choice.config
    model_path = version_dir / config.model_filename
    if config.model_filename:  # checked again: the runtime's choice may have named another file
        model_path = inside(version_dir, config.model_filename, "default_model_filename")
    if not model_path.exists():
        raise ConfigError(
            f"{source.name} v{version}: model file {config.model_filename!r} is missing from {version_dir}"
        )
    backend_cls = backend_class(config.backend)
    config = backend_cls.complete_config(config, model_path)
    validate_config(config)  # what the backend filled in obeys the same rules as what was written
    _check_io(config)
    restart_backoff(config)  # a bad value fails the load by name before any instance is started
    labels = read_labels(config, source.path)  # before any instance exists: a missing file fails the load
    config = config.replace(instance_groups=named_instance_groups(config))
    warn_missing_gpus(config, gpu_ids())
    specs = instance_specs(
        config,
        backend_cls,
        cpu_count=env.cpu_count or os.cpu_count() or 1,
        sharing=sharing if backend_cls.shares_cores else 0,
        thread_policy=env.thread_policy,
    )

    def build(spec: InstanceSpec) -> Backend:
        """One instance, loaded and warmed up: at load and for every restart alike (one context build)."""
        ctx = LoadContext(
            config=config,
            version=version,
            version_dir=version_dir,
            model_path=model_path,
            instance=spec,
            models=access,
        )
        backend = backend_cls.create(ctx)
        try:
            warm_up(config, backend, version_dir, instance_name=spec.name)
        except BaseException:
            backend.close()
            raise
        return backend

    instances: list[tuple[str, Backend]] = []
    try:
        for spec in specs:
            instances.append((spec.name, build(spec)))
    except BaseException:
        for _, backend in instances:
            backend.close()
        raise
    stats = ModelStats(source.name, version)
    if env.summaries is not None:
        stats.enable_summaries(env.summaries)

    def restart(index: int) -> Backend:
        """A fresh instance in place of instance ``index`` after an unrecoverable fault.

        Called by the failed instance's worker.  By index, not name: the copies of a group on several
        GPUs or DLA cores share one name.
        """
        return build(specs[index])

    scheduler: ModelScheduler | SequenceScheduler
    try:
        if config.sequence_batching is not None:
            scheduler = SequenceScheduler(config, instances, stats, source.path, restart=restart)
        else:
            scheduler = ModelScheduler(config, instances, stats, restart=restart)
    except BaseException:  # nothing serves them: close what was started (an isolated model's process)
        for _, backend in instances:
            backend.close()
        raise
    return LoadedVersion(
        name=source.name,
        version=version,
        config=config,
        scheduler=scheduler,
        stats=stats,
        content_hash=content_hash,
        devices=tuple(backend.device for _, backend in instances),
        validator=RequestValidator(config),
        note=choice.note,
        thread_settings=next((b.thread_settings for _, b in instances if b.thread_settings), None),
        cpu_sessions=sum(1 for _, b in instances if b.shares_cores and b.device == "cpu"),
        labels=labels,
    )


def _load_ensemble(
    source: ModelSource, version: int, config: ModelConfig, *, content_hash: str, env: LoadEnvironment
) -> LoadedVersion:
    """An ensemble: its graph validated against the members serving now; no instances of its own."""
    access = env.access
    if access is None:
        raise BackendUnavailable(f"{source.name}: ensembles need a server to reach their members")
    validate_config(config)
    _check_io(config)
    if config.instance_groups or config.dynamic_batching is not None:
        log.warning(
            "%s: instance_group and dynamic_batching do not apply to an ensemble (its members batch)",
            source.name,
        )
    graph = build_graph(config, access.model_config)
    if graph.decoupled and not config.decoupled:  # its responses are its decoupled steps' responses
        config = dataclasses.replace(config, decoupled=True)
    stats = ModelStats(source.name, version)
    if env.summaries is not None:
        stats.enable_summaries(env.summaries)
    labels = {**producer_labels(graph, access.labels), **read_labels(config, source.path)}
    return LoadedVersion(
        name=source.name,
        version=version,
        config=config,
        scheduler=EnsembleScheduler(config, graph, access, stats),
        stats=stats,
        content_hash=content_hash,
        devices=(),
        validator=RequestValidator(config),
        members=graph.members,
        labels=labels,
    )


def _check_io(config: ModelConfig) -> None:
    if not config.inputs and config.backend != "python":
        raise ConfigError(f"{config.source}: model {config.name!r} declares no inputs")
    if not config.outputs:
        raise ConfigError(f"{config.source}: model {config.name!r} declares no outputs")


def warn_missing_gpus(config: ModelConfig, present: tuple[int, ...]) -> None:
    """Warn (where Triton fails) about GPU ids this machine lacks.

    The repository may be meant for another device, and a KIND_AUTO group falls back to the CPU here.
    """
    for index, group in enumerate(config.instance_groups):
        missing = sorted(set(group.gpus) - set(present))
        if missing:
            log.warning(
                "%s: instance_group[%d] (%s) names GPU ids %s that do not exist on this machine "
                "(GPUs here: %s)",
                config.source or config.name,
                index,
                group.name,
                missing,
                list(present) or "none",
            )


def named_instance_groups(config: ModelConfig) -> tuple[InstanceGroup, ...]:
    """The instance groups with Triton's default names: ``<model>_<group index>``.

    A config without ``instance_group`` gets one group named after the model, as in Triton.
    """
    if not config.instance_groups:
        return (InstanceGroup(name=config.name),)
    return tuple(
        group if group.name else dataclasses.replace(group, name=f"{config.name}_{index}")
        for index, group in enumerate(config.instance_groups)
    )


def instance_specs(
    config: ModelConfig,
    backend_cls: type[Backend],
    *,
    cpu_count: int,
    sharing: int = 0,
    thread_policy: str = "auto",
) -> list[InstanceSpec]:
    """Resolve ``instance_group`` into concrete instances; CPU threads are split among CPU instances.

    ``sharing``: CPU instances of other models that share the cores (the ONNX Runtime thread rule).

    Instance ``c`` of a group is named ``<group name>_<c>``, as Triton names them (a group spread over
    several GPUs or DLA cores gives each device's copy the same name, as in Triton).
    """
    groups = named_instance_groups(config)
    gpu = backend_cls.gpu_available()
    resolved: list[tuple[str, str, int]] = []
    for group in groups:
        if group.passive:
            log.warning(
                "%s: passive instance group %r takes traffic like any other here", config.name, group.name
            )
        kind = group.kind
        if kind in ("KIND_AUTO", "KIND_MODEL"):
            kind = "KIND_GPU" if gpu and kind == "KIND_AUTO" else "KIND_CPU"
        for copy in range(group.count):
            name = f"{group.name}_{copy}"
            if group.secondary_devices:
                resolved.extend((name, "KIND_DLA", d.device_id) for d in group.secondary_devices)
            elif kind == "KIND_GPU":
                resolved.extend((name, "KIND_GPU", g) for g in (group.gpus or (0,)))
            else:
                resolved.append((name, "KIND_CPU", 0))
    cpu_instances = sum(1 for _, kind, _ in resolved if kind == "KIND_CPU")
    box = cpu_instances + sharing
    threads = max(1, cpu_count // max(box, 1))
    return [
        InstanceSpec(
            name=name,
            kind=kind,
            device_id=device,
            threads=threads,
            cpu_count=cpu_count,
            box_instances=box,
            thread_policy=thread_policy,
        )
        for name, kind, device in resolved
    ]


def planned_cpu_sessions(source: ModelSource | None) -> int:
    """CPU sessions ``source`` would share the cores with, read from its config before it loads.

    The backend's own hook decides (ONNX Runtime counts its CPU instances); 0 where the config cannot
    be read or the backend is not installed: its load reports that.
    """
    if source is None:
        return 0
    try:
        config, _ = read_config(source)
        return backend_class(config.backend).planned_cpu_sessions(config)
    except (EdgeServerError, ImportError):
        return 0


def ensemble_members(source: ModelSource | None) -> list[str]:
    """The models an ensemble's steps call, from its config (none when it cannot be read)."""
    if source is None:
        return []
    try:
        config, _ = read_config(source)
    except EdgeServerError:
        return []
    steps, _ = parse_steps(config)
    return [step.model_name for step in steps]


def is_ensemble(source: ModelSource | None) -> bool:
    return source is not None and declares_ensemble(source.config_path)
