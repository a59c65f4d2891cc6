"""``edge-server perf MODEL``: measure a model the way Triton's perf_analyzer does.

The package is split by job: :mod:`.options` (flags, validated once), :mod:`.inputs` (the tensors
sent), :mod:`.targets` and :mod:`.kserve_targets` (IPC, in-process, HTTP and gRPC), :mod:`.load`
(concurrency and request-rate generators), :mod:`.measure` (windows and the stability rule),
:mod:`.server_stats` (the daemon's statistics, as deltas), :mod:`.report` (table, CSV, plot) and
:mod:`.command` (the glue the CLI calls).
"""

from __future__ import annotations
