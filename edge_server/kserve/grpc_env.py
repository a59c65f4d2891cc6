"""grpc core's one setting that edge-server changes, which grpc reads from the environment at import.

grpc 1.5x+ serves a port's connections on its EventEngine threads (the ``event_engine_listener``
experiment, on by default): every call then hops from the thread that read it to the thread that polls
the completion queue, and back for the answer.  With the experiment off, the thread that polls the queue
reads the connection itself, and the ``ModelInfer`` queue (edge_server.kserve.grpc_infer) answers a call
with no hand-off at all: a bare server's tiny call fell from 399 to 332 µs and from 182 to 118 µs of its
CPU (bench/bench_kserve_floor.py's ``bare grpcio`` rows and docs/benchmarks.md).

A ``GRPC_EXPERIMENTS`` that names the experiment is the user's choice and is kept.  A grpc without the
experiment prints ``Unknown experiment`` once and serves as it always does.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

VARIABLE = "GRPC_EXPERIMENTS"
EXPERIMENT = "event_engine_listener"


def poll_connections_on_the_queue(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Turn the experiment off unless the user chose; False when grpc was imported already (too late)."""
    current = environ.get(VARIABLE, "")
    if EXPERIMENT in current:
        return True
    if "grpc" in sys.modules:
        log.info("gRPC: grpc was imported before the frontend (by a model?); its %s stays on", EXPERIMENT)
        return False
    environ[VARIABLE] = ",".join(part for part in (current, "-" + EXPERIMENT) if part)
    return True
