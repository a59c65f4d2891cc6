"""``--metrics-config KEY=VALUE``: Triton's flag and keys for what the metrics report.

Known keys, as Triton names them: ``summary_latencies`` (true: the ``nv_inference_*_summary_us``
quantile summaries; default false), ``summary_quantiles`` (``"0.5:0.05,0.9:0.01,..."``; Triton's
defaults otherwise), ``counter_latencies`` (true only: the cumulative ``*_duration_us`` counters are
always reported).  Other Triton keys are refused by name rather than silently ignored.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from edge_server.errors import InvalidArgument
from edge_server.scheduler.summaries import SummaryOptions, parse_quantiles

KNOWN_KEYS = ("summary_latencies", "summary_quantiles", "counter_latencies")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def metrics_config_item(text: str) -> tuple[str, str]:
    """An argparse ``type``: one ``KEY=VALUE`` with a known key (a bad one is a usage error)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if key not in KNOWN_KEYS:
        raise argparse.ArgumentTypeError(f"unknown metrics setting {key!r}; known: {', '.join(KNOWN_KEYS)}")
    value = value.strip()
    try:
        _check(key, value)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return key, value


def summary_options(items: Iterable[tuple[str, str]]) -> SummaryOptions | None:
    """The summaries asked for by ``--metrics-config`` items (the last of a key wins), or None when off."""
    settings = dict(items)
    for key, value in settings.items():
        _check(key, value)
    if settings.get("summary_latencies", "false").lower() not in _TRUE:
        return None
    quantiles = settings.get("summary_quantiles")
    return SummaryOptions() if quantiles is None else SummaryOptions(quantiles=parse_quantiles(quantiles))


def _check(key: str, value: str) -> None:
    if key in ("summary_latencies", "counter_latencies") and value.lower() not in _TRUE + _FALSE:
        raise InvalidArgument(f"{key}={value!r}: expected true or false")
    if key == "counter_latencies" and value.lower() in _FALSE:
        raise InvalidArgument("counter_latencies=false is not supported: the latency counters are always on")
    if key == "summary_quantiles":
        parse_quantiles(value)
