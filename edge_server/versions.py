"""The one parser of a model version a client names, for every frontend.

IPC sends a number or a string, KServe HTTP a path segment, gRPC a string field, the in-process API an
int: all come through :func:`parse_version`, so that all accept and refuse the same values and say so
the same way.  A version is what a version directory may be named (:mod:`edge_server.repository`): a
decimal number below 2^63 (Triton's int64), at most 19 digits, so that a 5,000-digit string is refused
by its length before Python is asked to convert it.
"""

from __future__ import annotations

import re

from edge_server.errors import InvalidArgument, shorten

MAX_VERSION = 2**63 - 1
_DIGITS = re.compile(r"[0-9]{1,19}")


def parse_version(value: object) -> int | None:
    """The version ``value`` names, or None (``None`` or ``""``: the latest serving version)."""
    if value is None or value == "":
        return None
    if type(value) is int:
        if 0 <= value <= MAX_VERSION:
            return value
    elif isinstance(value, str) and _DIGITS.fullmatch(value):
        number = int(value)
        if number <= MAX_VERSION:
            return number
    raise InvalidArgument(
        f"model version must be a non-negative integer below 2^63 (a number or its decimal digits), "
        f"got {shorten(value)}"
    )
