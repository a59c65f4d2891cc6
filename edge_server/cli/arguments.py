"""What the commands share: the error a command line that cannot work raises, and repeated flags.

Value types of flags (boolean, positive, seconds) are :mod:`edge_server.flag_types`.
"""

from __future__ import annotations

import argparse
from typing import Any


class UsageError(Exception):
    """A command line that cannot work as given: printed with the usage line, exit status 2."""


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
