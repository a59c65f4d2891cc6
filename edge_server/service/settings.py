"""The settings file ``edge-server serve`` reads: one TOML key per ``serve`` flag, flags override it.

A key is the flag's name without its dashes (``model-repository = "/var/lib/edge-server/models"``, or a
list for a repeated flag: ``model-repository = ["/var/lib/edge-server/models", "/opt/more-models"]``,
``exit-on-error = false``, ``load-model = ["detector", "classifier"]``); values go through the flag's
own parser, so a setting and a flag accept exactly the same things.  Unknown keys are errors naming
the file and the key.  Under systemd the file is ``$CONFIGURATION_DIRECTORY/edge-server.toml``
(``/etc/edge-server/edge-server.toml`` with the shipped unit); ``--settings FILE`` names another.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from edge_server.errors import InvalidArgument

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SETTINGS_NAME = "edge-server.toml"
_NOT_SETTINGS = {"help", "settings"}


def settings_path(explicit: Path | None) -> Path | None:
    """``--settings``, else systemd's configuration directory's file when it exists, else none."""
    if explicit is not None:
        return explicit
    directory = os.environ.get("CONFIGURATION_DIRECTORY")
    if directory:
        path = Path(directory.split(":")[0]) / SETTINGS_NAME
        if path.is_file():
            return path
    return None


def _keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    keys = {}
    for action in parser._actions:  # argparse has no public list of a parser's options
        long = [s for s in action.option_strings if s.startswith("--")]
        if long and action.dest not in _NOT_SETTINGS:
            keys[long[0][2:]] = action
    return keys


def apply_settings(parser: argparse.ArgumentParser, path: Path) -> None:
    """Make the settings in ``path`` the defaults of ``parser`` (so flags still win)."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise InvalidArgument(f"cannot read settings file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"settings file {path}: {exc}") from None
    keys = _keys(parser)
    defaults = {}
    for key, value in data.items():
        action = keys.get(key)
        if action is None:
            raise InvalidArgument(
                f"settings file {path}: unknown setting {key!r}; known: {', '.join(sorted(keys))}"
            )
        defaults[action.dest] = _convert(action, key, value, path)
    parser.set_defaults(**defaults)


def _convert(action: argparse.Action, key: str, value: Any, path: Path) -> Any:
    where = f"settings file {path}: {key} = {value!r}"
    if action.nargs == 0:  # a switch (--no-ipc): true or false
        if not isinstance(value, bool):
            raise InvalidArgument(f"{where}: expected true or false")
        return value if action.const is True or action.const is None else not value
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_one(action, item, where) for item in items]
    return _one(action, value, where)


def _one(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(value, (dict, list)):
        raise InvalidArgument(f"{where}: expected a single value")
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    convert = action.type if callable(action.type) else str
    try:
        result = convert(text)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    if action.choices is not None and result not in action.choices:
        raise InvalidArgument(f"{where}: expected one of {list(action.choices)}")
    return result


def render_settings(parser: argparse.ArgumentParser, chosen: dict[str, Any]) -> str:
    """A settings file: ``chosen`` keys set, every other key listed commented out with its default."""
    lines = [
        "# edge-server settings, read by `edge-server serve` (a flag on the command line wins over a key).",
        "# Every serve flag has a key: its name without the leading dashes.  `edge-server serve --help`",
        "# explains each one.  After a change: sudo systemctl restart edge-server",
        "",
    ]
    for key, action in _keys(parser).items():
        if action.help:
            lines.append(f"# {key}: {action.help}")
        if key in chosen:
            lines.append(f"{key} = {_toml(chosen[key])}")
        else:
            default = action.default
            shown = "(none)" if default is None or default == [] else _toml(default)
            lines.append(f"# {key} = {shown}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'
