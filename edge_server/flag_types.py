"""Value types of ``serve``'s flags, for every module that adds some (cli, limits, kserve, metrics).

One parser per kind, so that a flag means the same whichever module declares it and a settings file
(``--settings``, parsed by the same types) is read the same way.
"""

from __future__ import annotations

import argparse


def boolean(text: str) -> bool:
    """Triton's boolean flag values: ``--exit-on-error false``."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def positive(text: str) -> int:
    """A limit: a whole number of at least 1 (0 would refuse everything)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A timeout: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value
