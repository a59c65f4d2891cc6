"""Files a model config names stay inside the model's own directory.

A config names files by relative paths: the model file (``default_model_filename``), warm-up data
(``input_data_file``), initial sequence state (``data_file``).  Whoever writes the config (the
repository's owner, or an operator's override over HTTP/gRPC) must not be able to make the daemon
load code or data from anywhere else, so every such path is resolved here before anything opens it.
"""

from __future__ import annotations

import os
from pathlib import Path

from edge_server.errors import ConfigError, shorten


def inside(base: Path, relative: str, what: str) -> Path:
    """``base / relative``, resolved, if it stays inside ``base``; else ConfigError naming ``what``.

    Every file a config names (the model file, warm-up data, initial state) is read through here:
    a config (an operator's override included) can make the daemon read only what the repository
    holds, never an absolute path, a ``..`` path or a symlink that leads out of ``base``.
    """
    if not relative or "\0" in relative or os.path.isabs(relative):
        raise ConfigError(
            f"{what} {shorten(relative)} must be a file name relative to {base}; an absolute or empty path "
            "would lead outside the model's directory"
        )
    root = base.resolve()
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise ConfigError(
            f"{what} {shorten(relative)} leads outside {base} (to {shorten(str(path))}): models load only "
            "files inside their own directory"
        )
    return path
