"""Reading a Triton-style model repository from disk: which models, which versions, which files.

``<repo>/<model>/config.pbtxt`` and ``<repo>/<model>/<version>/<file>``.  Hidden entries (``.name``),
temporary files and non-numeric version folders are ignored, as in Triton.  Content hashes let the
lifecycle decide whether a version really changed (a copy that keeps timestamps is still noticed; a
touched but identical file is not).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILENAME = "config.pbtxt"
_TEMP_SUFFIXES = (".tmp", ".part", ".partial", ".swp", "~", ".crdownload")


def is_ignored(name: str) -> bool:
    """Hidden and temporary files never count as part of a model."""
    return name.startswith(".") or name.endswith(_TEMP_SUFFIXES)


@dataclass(frozen=True)
class ModelSource:
    """One model directory as found on disk."""

    name: str
    path: Path
    versions: dict[int, Path]

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILENAME

    def config_hash(self) -> str:
        """Hash of config.pbtxt and the model directory's loose files (labels, ...)."""
        digest = hashlib.sha256()
        if self.path.is_dir():
            for entry in sorted(self.path.iterdir()):
                if entry.is_file() and not is_ignored(entry.name):
                    digest.update(entry.name.encode())
                    digest.update(_file_hash(entry))
        return digest.hexdigest()

    def version_hash(self, version: int) -> str:
        """Hash of every file under a version directory, names included."""
        digest = hashlib.sha256()
        root = self.versions[version]
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root)
            if path.is_file() and not any(is_ignored(part) for part in rel.parts):
                digest.update(str(rel).encode())
                digest.update(_file_hash(path))
        return digest.hexdigest()


def _file_hash(path: Path) -> bytes:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.digest()


def scan_model(repository: Path, name: str) -> ModelSource | None:
    """The model directory ``name``, or None when it does not exist (any more)."""
    path = repository / name
    if is_ignored(name) or not path.is_dir():
        return None
    versions: dict[int, Path] = {}
    for entry in path.iterdir():
        if entry.is_dir() and entry.name.isdigit() and not is_ignored(entry.name):
            versions[int(entry.name)] = entry
    return ModelSource(name=name, path=path, versions=versions)


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
