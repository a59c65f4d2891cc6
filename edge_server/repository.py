"""Reading Triton-style model repositories from disk: which models, which versions, which files.

``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/<version>/<file>``.  Hidden entries (``.name``),
temporary files and non-numeric version folders are ignored, as in Triton.  A server may read several
repositories (Triton's repeated ``--model-repository``): :class:`Repositories` makes them one namespace
in which a model name found in two of them is refused, as Triton refuses it.  Content hashes let the
lifecycle decide whether a version really changed (a copy that keeps timestamps is still noticed; a
touched but identical file is not).

Hashing a large TensorRT plan on every rescan would cost seconds on a Jetson, so file hashes are cached
by ``(device, inode, size, mtime, ctime)``.  The cache cannot be fooled by a copy that preserves
timestamps: the kernel sets ``ctime`` on every write and no user call can set it back.  Like git's
"racily clean" index entries, a file whose ctime is within :data:`RACY_WINDOW_NS` of now is never
cached, because a second write inside the same timestamp tick would leave every stat field unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from edge_server.errors import ConfigError, InvalidArgument, shorten

log = logging.getLogger(__name__)

CONFIG_FILENAME = "config.pbtxt"
#: A model name is one directory entry of the repository: at most NAME_MAX bytes.
MAX_MODEL_NAME_BYTES = 255
# Version directories: plain decimal numbers that fit a signed 64-bit integer (Triton's int64 version),
# without leading zeros: Triton ignores '003' (L0_lifecycle), so that '3' and '003' are never one version.
_VERSION_DIR = re.compile(r"0|[1-9][0-9]{0,17}")
_ZERO_PREFIXED = re.compile(r"0[0-9]{1,17}")
_TEMP_SUFFIXES = (".tmp", ".part", ".partial", ".swp", "~", ".crdownload", ".dpkg-new", ".rsync-tmp")

#: Files changed this recently are hashed again on every call instead of being cached.
RACY_WINDOW_NS = 2_000_000_000
_CACHE_LIMIT = 4096

# One stat row: (relative name, device, inode, size, mtime_ns, ctime_ns).
StatRow = tuple[str, int, int, int, int, int]


def check_model_name(name: object) -> str:
    """``name`` if it is a plain directory name of the repository, else InvalidArgument.

    Every API that takes a model name (IPC, HTTP, gRPC, in-process, BLS) goes through here before a
    name is joined to the repository path: no separators, no ``.``/``..``, no NUL, no hidden names,
    at most 255 bytes.  So no request can make the daemon load a directory outside the repository.
    """
    if isinstance(name, str) and not name.strip():
        raise InvalidArgument("Model name cannot be empty. Please enter a valid name to deploy.")
    if isinstance(name, str) and ("/" in name or name.strip() == ".."):
        raise InvalidArgument(
            f"invalid model name {shorten(name)}, model name must not contain path traversal characters"
        )
    if (
        not isinstance(name, str)
        or "\\" in name
        or "\0" in name
        or name.startswith(".")
        or len(name.encode("utf-8", "surrogateescape")) > MAX_MODEL_NAME_BYTES
    ):
        raise InvalidArgument(
            f"model name {shorten(name)} is not a plain directory name of the repository (1-255 bytes, "
            "no '/', '\\' or NUL, not starting with '.')"
        )
    return name


def is_ignored(name: str) -> bool:
    """Hidden and temporary files, and Python's bytecode caches, never count as part of a model.

    The daemon writes no bytecode into the repository (model files are compiled from source, and the
    daemon and its Python stubs run with bytecode writing off), but a ``__pycache__`` left by anyone
    else (a developer running ``model.py`` by hand, an in-process application) must not look like a
    new version either.
    """
    return name.startswith(".") or name.endswith(_TEMP_SUFFIXES) or _is_bytecode(name)


def _is_bytecode(name: str) -> bool:
    return name == "__pycache__" or name.endswith(".pyc")


@dataclass(frozen=True)
class ModelSource:
    """One model directory as found on disk."""

    name: str
    path: Path
    versions: dict[int, Path]
    config_override: str | None = None  # a JSON config given at load time (Triton's load API)

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILENAME

    def config_files(self) -> list[Path]:
        """config.pbtxt and the model directory's other loose files (labels, ...), sorted."""
        try:
            entries = sorted(self.path.iterdir())
        except OSError:
            return []
        return [e for e in entries if e.is_file() and not is_ignored(e.name)]

    def version_files(self, version: int) -> list[Path]:
        """Every file under a version directory (hidden and temporary ones left out), sorted."""
        root = self.versions[version]
        try:
            found = sorted(root.rglob("*"))
        except OSError:  # removed while we looked: the watcher brings the next state
            return []
        return [
            path
            for path in found
            if not any(is_ignored(part) for part in path.relative_to(root).parts) and path.is_file()
        ]

    def config_hash(self) -> str:
        """Hash of config.pbtxt and the model directory's loose files (and of a load-time override)."""
        files = _hash_files(self.path, self.config_files())
        if self.config_override is None:
            return files
        return hashlib.sha256(f"{files}\0{self.config_override}".encode()).hexdigest()

    def version_hash(self, version: int) -> str:
        """Hash of every file under a version directory, names included."""
        return _hash_files(self.versions[version], self.version_files(version))

    def config_signature(self) -> tuple[StatRow, ...]:
        """Stat rows of the model directory's loose files; see :meth:`version_signature`."""
        return _stat_rows(self.path, self.config_files())

    def version_signature(self, version: int) -> tuple[StatRow, ...]:
        """Stat rows of every file of ``version``, to tell whether it changed while it loaded.

        Equal before hashing and after loading means the bytes that were hashed are the bytes that
        were loaded (every write moves ``ctime``).
        """
        return _stat_rows(self.path, self.version_files(version))


def _stat_rows(root: Path, files: list[Path]) -> tuple[StatRow, ...]:
    rows = []
    for path in files:
        try:
            st = path.stat()
        except OSError:
            continue
        rows.append(
            (str(path.relative_to(root)), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        )
    return tuple(rows)


def _hash_files(root: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        try:
            content = _HASHES.file_hash(path)
        except OSError:  # vanished between listing and reading: a later event brings the new state
            continue
        digest.update(str(path.relative_to(root)).encode())
        digest.update(b"\0")
        digest.update(content)
    return digest.hexdigest()


class _HashCache:
    """SHA-256 of files, remembered while their stat fields stay the same (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[tuple[int, int, int, int, int], bytes]] = {}

    def file_hash(self, path: Path) -> bytes:
        with path.open("rb") as f:
            before = os.fstat(f.fileno())
            key = (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns)
            with self._lock:
                cached = self._entries.get(str(path))
            if cached is not None and cached[0] == key:
                return cached[1]
            digest = hashlib.sha256()
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
            after = os.fstat(f.fileno())
        value = digest.digest()
        settled = time.time_ns() - after.st_ctime_ns > RACY_WINDOW_NS
        if settled and after.st_ctime_ns == before.st_ctime_ns:
            with self._lock:
                if len(self._entries) >= _CACHE_LIMIT:
                    self._entries.clear()
                self._entries[str(path)] = (key, value)
        return value


_HASHES = _HashCache()


def scan_model(repository: Path, name: str) -> ModelSource | None:
    """The model directory ``name``, or None when it does not exist (any more).

    A model or version directory that is a symbolic link leading outside the repository is refused
    (logged, and left out): the repository's owner decides what is code, not whoever can make a link.
    """
    try:
        check_model_name(name)
    except InvalidArgument:
        return None  # names from the filesystem (hidden, odd ones) are skipped; APIs check first
    path = repository / name
    if is_ignored(name) or not path.is_dir() or not _inside(repository, path):
        return None
    versions: dict[int, Path] = {}
    try:
        entries = list(path.iterdir())
    except OSError:  # removed while we looked
        return None
    for entry in entries:
        if _VERSION_DIR.fullmatch(entry.name) and entry.is_dir() and _inside(repository, entry):
            versions[int(entry.name)] = entry
        elif _ZERO_PREFIXED.fullmatch(entry.name):
            log.warning(
                "model %s: ignore version directory %r which contains leading zeros in its directory name",
                name,
                entry.name,
            )
    return ModelSource(name=name, path=path, versions=versions)


def _inside(repository: Path, path: Path) -> bool:
    """Whether ``path`` (maybe a symlink) resolves to a place inside the repository."""
    if not path.is_symlink():
        return True
    try:
        path.resolve(strict=True).relative_to(repository.resolve(strict=True))
    except (OSError, ValueError):
        log.warning("%s is a symbolic link leading outside the repository %s: refused", path, repository)
        return False
    return True


def scan(repository: Path) -> dict[str, ModelSource]:
    """Every model directory in the repository, by name."""
    if not repository.is_dir():
        return {}
    models = {}
    for entry in sorted(repository.iterdir()):
        source = scan_model(repository, entry.name)
        if source is not None:
            models[source.name] = source
    return models


class DuplicateModel(ConfigError):
    """A model name found in more than one repository: neither copy may load (Triton's rule)."""

    def __init__(self, name: str, paths: list[Path]) -> None:
        super().__init__(
            f"model {shorten(name)} is in more than one model repository ({', '.join(map(str, paths))}); "
            "model names must be unique across repositories: remove or rename all but one"
        )


class Repositories:
    """The model repositories one server reads, as one namespace of model names.

    Triton accepts ``--model-repository`` several times and refuses a model whose name is in two of
    them ("not unique across all model repositories"); so do we, with both paths in the message.  A
    repository inside another, or one given twice, is refused at start: every model of the inner one
    would be a model directory of the outer one too.
    """

    def __init__(self, roots: Iterable[str | Path]) -> None:
        paths = tuple(Path(root) for root in roots)
        if not paths:
            raise InvalidArgument("no model repository given")
        for path in paths:
            if not path.is_dir():
                raise InvalidArgument(f"model repository {path} is not a directory")
        resolved = [path.resolve() for path in paths]
        for i, (path, real) in enumerate(zip(paths, resolved, strict=True)):
            for other, other_real in list(zip(paths, resolved, strict=True))[:i]:
                if real == other_real:
                    raise InvalidArgument(f"model repository {path} is given twice (as {other} before)")
                if real.is_relative_to(other_real) or other_real.is_relative_to(real):
                    inner, outer = (path, other) if real.is_relative_to(other_real) else (other, path)
                    raise InvalidArgument(
                        f"model repository {inner} is inside model repository {outer}: give folders "
                        "that do not contain each other"
                    )
        self.roots = paths

    def __str__(self) -> str:
        return ", ".join(map(str, self.roots))

    def locate(self, name: str) -> ModelSource | DuplicateModel | None:
        """The model directory ``name`` in whichever repository holds it; a DuplicateModel if several do."""
        found = [source for root in self.roots if (source := scan_model(root, name)) is not None]
        if len(found) > 1:
            return DuplicateModel(name, [source.path for source in found])
        return found[0] if found else None

    def find(self, name: str) -> ModelSource | None:
        """:meth:`locate`, raising the DuplicateModel."""
        found = self.locate(name)
        if isinstance(found, DuplicateModel):
            raise found
        return found

    def scan(self) -> dict[str, ModelSource | DuplicateModel]:
        """Every model directory of every repository, by name; a name in several is a DuplicateModel."""
        copies: dict[str, list[ModelSource]] = {}
        for root in self.roots:
            for name, source in scan(root).items():
                copies.setdefault(name, []).append(source)
        return {
            name: found[0] if len(found) == 1 else DuplicateModel(name, [s.path for s in found])
            for name, found in sorted(copies.items())
        }
