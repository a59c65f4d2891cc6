"""Argument types shared by the commands, and the error a command line that cannot work raises."""

from __future__ import annotations

import argparse
from typing import Any


class UsageError(Exception):
    """A command line that cannot work as given: printed with the usage line, exit status 2."""


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
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


class RepeatedFlag(argparse._AppendAction):
    """A flag given several times (``--model-repository A --model-repository B``) makes a list.

    Unlike argparse's ``append``, the first use on the command line replaces the default instead of
    adding to it, so a list from the settings file (the parser's defaults) is replaced by the flags,
    as every other setting is.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, [*items, values])
