"""Triton's load-time file overrides (``file:<path>`` load parameters), staged outside the repository.

Triton loads a model from a ``config`` and files sent with the load request, in a directory of its
own, until the model is loaded again without them.  Here likewise: the files are written into a
directory the daemon owns (mode 0700, one subdirectory per model name), never into the repository,
so no request can change what the repository's owner put there; the model then loads from that
directory by the repository's rules (it reads only files inside its own directory).  A load is
authorized before any of this (control is for the daemon's user, group and operators), and bounded:
at most :data:`MAX_FILES` files, their bytes within the request body's limit, and names that are
plain relative paths (no ``..``, no empty or hidden components, none over 255 bytes).
"""

from __future__ import annotations

import base64
import binascii
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from edge_server.errors import InvalidArgument, failed_to_poll, shorten

PREFIX = "file:"
MAX_FILES = 64
MAX_COMPONENT_BYTES = 255  # NAME_MAX
MAX_PATH_BYTES = 1024


def file_overrides(name: str, parameters: Mapping[str, Any]) -> dict[PurePosixPath, bytes]:
    """The ``file:<path>`` parameters of a load as {relative path: bytes}; InvalidArgument if unfit.

    Over HTTP a file's content is base64 text; over gRPC it is bytes.  Triton accepts a leading ``/``
    (``file:/1/model.py``): the path is relative to the model's directory either way.
    """
    files: dict[PurePosixPath, bytes] = {}
    for key, value in parameters.items():
        if not key.startswith(PREFIX):
            continue
        if len(files) >= MAX_FILES:
            raise InvalidArgument(f"a load may override at most {MAX_FILES} files")
        path = _relative_path(name, key[len(PREFIX) :])
        files[path] = _content(key, value)
    return files


def _relative_path(model: str, text: str) -> PurePosixPath:
    parts = text.lstrip("/").split("/")
    for part in parts:
        if len(part.encode("utf-8", "surrogateescape")) > MAX_COMPONENT_BYTES:
            # Triton's text for it (its QA matches it), then which rule
            raise InvalidArgument(
                failed_to_poll(model, f"a file override's path component is over {MAX_COMPONENT_BYTES} bytes")
            )
        if not part or part in (".", "..") or part.startswith(".") or "\0" in part or "\\" in part:
            raise InvalidArgument(
                failed_to_poll(
                    model,
                    f"file override {shorten(PREFIX + text)}: the path must be relative to the model's "
                    "directory, of plain names (no '..', empty or hidden components)",
                )
            )
    if len(text.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise InvalidArgument(f"file override {shorten(PREFIX + text)}: the path is too long")
    return PurePosixPath(*parts)


def _content(key: str, value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(f"file override {shorten(key)}: the content must be base64") from None
    raise InvalidArgument(f"file override {shorten(key)}: the content must be base64 text or bytes")


class StagedFiles:
    """The daemon's own directory of overridden models: ``<root>/<model>/...``, created on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._root: Path | None = None

    def stage(self, name: str, files: Mapping[PurePosixPath, bytes]) -> Path:
        """Write ``files`` as model ``name``'s whole directory (replacing earlier ones); the root."""
        with self._lock:
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="edge-server-overrides-"))  # mode 0700
            root = self._root
        target = root / name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(mode=0o700)
        for path, data in files.items():
            destination = target.joinpath(*path.parts)
            destination.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
        return root

    def drop(self, name: str) -> None:
        """Forget model ``name``'s files (it loads from the repository again)."""
        with self._lock:
            root = self._root
        if root is not None:
            shutil.rmtree(root / name, ignore_errors=True)

    def close(self) -> None:
        with self._lock:
            root, self._root = self._root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
