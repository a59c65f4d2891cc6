"""The KServe v2 operations, transport-free: what the HTTP and gRPC frontends both answer.

A frontend decodes its wire format into arrays (with :mod:`~edge_server.kserve.codec`), builds an
:class:`~edge_server.request.InferRequest` here, runs it through the one data plane, and encodes the
outputs.  Request-level parameters that Triton reserves (``priority``, ``timeout``, ``sequence_*``,
``binary_data_output``) become request fields; the rest reach the model.  Errors map to HTTP and
gRPC status codes in one place (:func:`error_status`), from each error's own ``http_status``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

import edge_server
from edge_server import classification
from edge_server.authorization import ControlPolicy
from edge_server.errors import (
    ConfigError,
    EdgeServerError,
    InvalidArgument,
    ModelNotReady,
    Unsupported,
    shorten,
)
from edge_server.kserve import codec
from edge_server.kserve.settings import RuntimeSettings
from edge_server.kserve.shm import InputBudget, Peer, SystemSharedMemory, known_uid
from edge_server.load_files import file_overrides
from edge_server.repository import DuplicateModel
from edge_server.request import NO_PARAMETERS, InferRequest, client_key
from edge_server.scheduler import inline
from edge_server.shm import Lease
from edge_server.status_index import ModelState, NotLoaded
from edge_server.validation import check_parameters
from edge_server.versions import parse_version

if TYPE_CHECKING:
    from edge_server.server import Server

log = logging.getLogger(__name__)

EXTENSIONS = [
    "classification",
    "binary_tensor_data",
    "model_repository",
    "schedule_policy",
    "statistics",
    "system_shared_memory",
    "parameters",
]
_RESERVED = (
    "priority",
    "timeout",
    "sequence_id",
    "sequence_start",
    "sequence_end",
    "binary_data_output",
)
NO_CUDA_SHM = "CUDA shared memory is not supported by edge-server; use system shared memory"
# The one ``triton_`` request parameter a client may send, over gRPC (streams); the rest are Triton's.
TRITON_GRPC_PARAMETERS = ("triton_enable_empty_final_response",)
_SHM_KEYS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")
# HTTP status -> gRPC status code name; the one mapping for both transports.
_GRPC_CODES = {
    400: "INVALID_ARGUMENT",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def error_status(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, gRPC status code name, message) for any exception a handler let through.

    The message is the error's own text with nothing before it, as Triton sends it: Triton's clients
    and tools match its texts with ``startswith`` and ``==``.  Our stable code travels beside it
    (:func:`error_code`: the HTTP body's ``code``), not inside it.
    """
    if isinstance(exc, EdgeServerError):
        grpc_code = exc.grpc_status or _GRPC_CODES.get(exc.http_status, "INTERNAL")
        return exc.http_status, grpc_code, exc.message
    log.exception("unexpected error in a KServe handler", exc_info=exc)
    return 500, "INTERNAL", f"{type(exc).__name__}: {exc}"


def error_code(exc: BaseException) -> str:
    """The stable edge-server code of an error (errors.py), the one IPC sends: INTERNAL when unplanned."""
    return exc.code if isinstance(exc, EdgeServerError) else "INTERNAL"


@dataclass(slots=True)
class OutputWant:
    """A requested output and how to return it: inline (HTTP: JSON or binary) or into shared memory."""

    name: str
    binary: bool = False
    shm: tuple[object, object, object] | None = None  # region, offset, byte_size (checked on use)
    lease: Lease | None = None  # the region it is written into, held until the request is done
    classes: int = 0  # the classification extension: the top N classes instead of the values (0: off)

    def __post_init__(self) -> None:
        if self.classes and self.shm is not None:
            raise InvalidArgument(classification.SHM_CONFLICT)


def classification_of(outputs: list[OutputWant] | None) -> dict[str, int] | None:
    """The request's classification (output -> class count) from its requested outputs; None: none."""
    counts = {want.name: want.classes for want in outputs or () if want.classes}
    return counts or None


def shm_reference(params: Mapping[str, Any]) -> tuple[object, object, object] | None:
    if "shared_memory_region" not in params:
        return None
    return (
        params["shared_memory_region"],
        params.get("shared_memory_offset", 0),
        params.get("shared_memory_byte_size"),
    )


class KServeService:
    """One per daemon; shared by the HTTP and gRPC frontends."""

    def __init__(
        self,
        server: Server,
        *,
        shm: SystemSharedMemory | None = None,
        control_policy: ControlPolicy | None = None,
        settings: RuntimeSettings | None = None,
    ) -> None:
        self.server = server
        self.dataplane = server.dataplane
        self.shm = shm
        self.control_policy = control_policy or ControlPolicy()
        # the frontends' log and trace settings, one for both
        self.settings = settings if settings is not None else RuntimeSettings()

    def authorize_control(self, peer: Peer, what: str) -> None:
        """Control (load, unload, log and trace settings): :class:`ControlPolicy`, as over IPC.

        The caller's uid comes from the kernel's socket table (see :mod:`edge_server.kserve.shm`); a
        caller that is not on this host may not change what is served.
        """
        self.control_policy.authorize(known_uid(peer), what)

    # -- health and metadata ------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.server.is_ready()

    def model_ready(self, name: str, version: str | int | None = None) -> Future[bool]:
        """Done within ``READY_TIMEOUT_S`` (a model's own ``is_ready`` may take that long): await it."""
        return self.server.model_ready(name, parse_version(version))

    def server_metadata(self) -> dict[str, Any]:
        extensions = [e for e in EXTENSIONS if e != "system_shared_memory" or self.shm is not None]
        return {"name": "edge-server", "version": edge_server.__version__, "extensions": extensions}

    def model_metadata(self, name: str, version: str | int | None = None) -> dict[str, Any]:
        return self.dataplane.metadata(name, parse_version(version))

    def model_config(self, name: str, version: str | int | None = None) -> dict[str, Any]:
        return self.dataplane.config(name, parse_version(version)).to_triton_dict()

    def statistics(self, name: str = "", version: str | int | None = None) -> dict[str, Any]:
        stats = self.dataplane.statistics(name or None, parse_version(version) if name else None)
        return {"model_stats": stats}

    # -- repository ------------------------------------------------------------------------------

    def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Every model the server knows, a row per version, and the repositories' other models by name."""
        rows = []
        for status in self.server.repository_index():
            if isinstance(status, NotLoaded):
                if not ready_only:
                    rows.append({"name": status.name})
                continue
            if ready_only and status.state is not ModelState.READY:
                continue
            row: dict[str, Any] = {"name": status.name, "state": status.state.value}
            if status.version is not None:
                row["version"] = str(status.version)
            if status.reason:
                row["reason"] = status.reason
            rows.append(row)
        return rows

    def load(self, name: str, parameters: Mapping[str, Any]) -> None:
        """Load or reload ``name`` (blocks for the load), with Triton's load-time overrides.

        ``config`` (JSON) and ``file:<path>`` (the model's files, staged outside the repository:
        edge_server.load_files).
        """
        files = file_overrides(name, parameters)
        config = parameters.get("config")
        if config is not None and not isinstance(config, str):
            raise InvalidArgument("parameter 'config' must be the model config as a JSON string")
        try:
            self.server.load_model(name, config_override=config or None, files=files or None)
        except DuplicateModel:
            raise  # already in Triton's words for a name it cannot poll
        except (ConfigError, ModelNotReady) as exc:  # the model's own failure, not the request's
            raise exc.restated(f"load failed for model {shorten(name)}: {exc.message}") from exc

    def unload(self, name: str, parameters: Mapping[str, Any]) -> None:
        """Drain and unload every version of ``name`` (blocks until done).

        Triton's ``unload_dependents``: an ensemble's members go too (and theirs, for nested ones).
        """
        if not any(s.name == name for s in self.server.models()):
            return  # Triton: unloading a model it does not know succeeds and changes nothing
        dependents = self._members(name) if parameters.get("unload_dependents") is True else []
        self.server.unload_model(name)
        serving = self.server.routing.serving()
        for member in dependents:
            if member in serving:
                self.server.unload_model(member)

    def _members(self, name: str) -> list[str]:
        """The models ensemble ``name`` reaches, directly or through nested ensembles, each once."""
        found: dict[str, None] = {}
        todo = [name]
        while todo:
            for loaded in self.server.routing.serving().get(todo.pop(), {}).values():
                for member, _version in loaded.members:
                    if member != name and member not in found:
                        found[member] = None
                        todo.append(member)
        return list(found)

    # -- inference ------------------------------------------------------------------------------

    def build_request(
        self,
        *,
        model: str,
        version: str | int | None,
        request_id: str,
        inputs: dict[str, np.ndarray],
        outputs: list[OutputWant] | None,
        parameters: Mapping[str, Any],
        peer: Peer | None = None,
        triton_allowed: tuple[str, ...] = (),
    ) -> InferRequest:
        """The data plane's request; reserved parameters become its fields, the others reach the model.

        A sequence's request carries the ``peer``'s uid as its owner (see scheduler.sequence); every
        request carries the ``peer`` as its client, for its turn in the queue (scheduler.queue).
        Parameters named ``triton_*`` are refused, as Triton does, but those in ``triton_allowed``.
        """
        client = None if peer is None else client_key(peer.uid, (peer.host, peer.port))
        if not parameters:
            return InferRequest(
                model=model,
                version=parse_version(version),
                inputs=inputs,
                outputs=None if outputs is None else [o.name for o in outputs],
                request_id=request_id,
                classification=classification_of(outputs),
                client=client,
            )
        for key in parameters:
            if key.startswith("triton_") and key not in triton_allowed:
                raise InvalidArgument(
                    "parameter keys starting with 'triton_' are reserved for Triton usage and should not "
                    f"be specified (got {shorten(key)})"
                )
        user = {k: v for k, v in parameters.items() if k not in _RESERVED}
        priority = _int_param(parameters, "priority", 0)
        timeout = _int_param(parameters, "timeout", 0)
        sequence_id = parameters.get("sequence_id", 0)
        if not isinstance(sequence_id, (int, str)) or isinstance(sequence_id, bool):
            raise InvalidArgument("parameter 'sequence_id' must be an integer or a string")
        return InferRequest(
            model=model,
            version=parse_version(version),
            inputs=inputs,
            outputs=None if outputs is None else [o.name for o in outputs],
            priority=priority,
            timeout_us=timeout or None,
            request_id=request_id,
            parameters=check_parameters(user) if user else NO_PARAMETERS,
            correlation_id=sequence_id,
            sequence_start=_bool_param(parameters, "sequence_start"),
            sequence_end=_bool_param(parameters, "sequence_end"),
            owner=self._owner(peer) if sequence_id else None,
            classification=classification_of(outputs),
            client=client,
        )

    @staticmethod
    def _owner(peer: Peer | None) -> int:
        """The uid of the client on the other end of ``peer`` (-1: not on this host, or not known)."""
        uid = None if peer is None else known_uid(peer)
        return -1 if uid is None else uid

    def submit(self, request: InferRequest) -> Future[dict[str, np.ndarray]]:
        """Run ``request``; a cheap model runs inline, in this thread, and its future is done on return."""
        return self.dataplane.run_here(request, inline.FRONTEND)

    # -- system shared memory -------------------------------------------------------------------

    def registry(self) -> SystemSharedMemory:
        if self.shm is None:
            raise Unsupported(
                "system shared memory is disabled on this server; start it with --allow-client-shm=true"
            )
        return self.shm

    def read_input(
        self,
        ref: tuple[object, object, object],
        datatype: str,
        shape: tuple[int, ...],
        name: str,
        peer: Peer,
        budget: InputBudget | None = None,
        model: str = "",
    ) -> np.ndarray:
        """An input from shared memory; ``budget``: what the request's inputs may still read."""
        region, offset, byte_size = ref
        want = codec.wire_size(datatype, shape)  # compared before a byte is read; None: strings
        where = f"input {shorten(name)}" + (f" for model {shorten(model)}" if model else "")
        data = self.registry().read(region, offset, byte_size, want, peer, where, budget)
        return codec.from_raw(data, datatype, shape, name, model)

    def input_budget(self) -> InputBudget | None:
        """One request's budget for inputs read from shared memory (None while it is off)."""
        return None if self.shm is None else self.shm.budget()

    def shm_status(self, name: str, peer: Peer) -> list[dict[str, Any]]:
        """The caller's own regions; an empty list while client shared memory is off (as Triton)."""
        return [] if self.shm is None else self.shm.status(name, peer)

    def check_output(self, want: OutputWant, peer: Peer) -> None:
        """Refuse a bad output reference before the request runs; hold its region until it is written."""
        if want.shm is not None:
            want.lease = self.registry().check_output(*want.shm, peer, f"output {want.name!r}")

    def write_output(self, want: OutputWant, raw: bytes, peer: Peer) -> dict[str, Any]:
        """Write an output into its region; the parameters its response entry carries."""
        assert want.shm is not None
        region, offset, byte_size = want.shm
        self.registry().write(region, offset, byte_size, raw, peer, f"output {want.name!r}", want.lease)
        if want.lease is not None:
            want.lease.close()
        return {
            "shared_memory_region": region,
            "shared_memory_offset": offset or 0,
            "shared_memory_byte_size": len(raw),
        }


def _int_param(parameters: Mapping[str, Any], key: str, default: int) -> int:
    value = parameters.get(key, default)
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"parameter {key!r} must be a non-negative integer, got {value!r}")
    return value


def _bool_param(parameters: Mapping[str, Any], key: str) -> bool:
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"parameter {key!r} must be a boolean, got {value!r}")
    return value
