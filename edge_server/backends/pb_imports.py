"""Where a Python model's own imports come from: the ``.py`` files beside its ``model.py``.

Triton appends the version folder and the model folder to ``sys.path`` of each model's stub process,
so ``from model_common import Helper`` in ``model.py`` finds ``<version>/model_common.py`` (or
``<model>/model_common.py``), after anything installed of the same name.  Here the Python models of a
daemon share one interpreter (one thread per instance), so appending to the global ``sys.path`` would
hand the first model's ``model_common`` to every other model that ships one.  Instead each instance
gets an :class:`ImportScope`: a package of its own in ``sys.modules`` (``_edge_server_model_<n>``)
holding ``model.py`` and every sibling module the model imports, and an ``__import__`` of its own,
installed in the ``__builtins__`` of those modules only, that maps a top-level name found beside the
model (and not installed globally, as Triton's order has it) to the module of the same name inside the
scope.  Relative imports inside a helper package resolve within the scope too.  Everything else goes
to the interpreter's own import unchanged.

No bytecode is read or written: the repository may be read-only or another user's, and its content
hash decides whether a version changed (issue #22), so every file is compiled from source.

Triton imports ``model.py`` itself as the top-level module ``model`` of its stub, and its QA models
run ``unittest.main("model")``, which imports ``model`` through the interpreter's own import.  Unless
something installed is named ``model``, ``sys.modules["model"]`` here is a stand-in that answers with
the ``model.py`` of whichever model's code is on the calling stack.

Not covered: ``importlib.import_module("model_common")`` (it bypasses ``__import__``) finds only what
the global ``sys.path`` holds.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import importlib.util
import itertools
import re
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import CodeType, FrameType, ModuleType
from typing import Any

_builtin_import = builtins.__import__
# A fresh package per instance and per reload, so no state leaks between them (next() is atomic).
_scope_numbers = itertools.count(1)
_UNSAFE = re.compile(r"[^A-Za-z0-9_]")
_PACKAGE_PREFIX = "_edge_server_model_"


class SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """Compiles a model's file from its source on every import: no bytecode is read or written."""

    def get_code(self, fullname: str) -> CodeType:
        return compile(self.get_data(self.path), self.path, "exec", dont_inherit=True)


def _find(name: str, dirs: Sequence[str]) -> tuple[Path, bool] | None:
    """``name``'s file (or package folder) in the first of ``dirs`` holding it; True for a folder."""
    for folder in dirs:
        base = Path(folder, name)
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py"), False
        if base.is_dir():
            return base, True
    return None


def _installed(name: str) -> bool:
    """Whether the interpreter's own import would find top-level ``name`` (which Triton's order prefers)."""
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class _CallingModel(ModuleType):
    """``model``: the ``model.py`` module of the model whose code is calling (found on the stack)."""

    def _target(self) -> ModuleType:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None:
            package = str(frame.f_globals.get("__name__", "")).partition(".")[0]
            module = sys.modules.get(package + ".model") if package.startswith(_PACKAGE_PREFIX) else None
            if module is not None:
                return module
            frame = frame.f_back
        raise AttributeError("module 'model' is a Python model's model.py; no model's code is calling")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __dir__(self) -> list[str]:
        return dir(self._target())


def _install_model_alias() -> None:
    """``import model`` from anywhere finds the calling model's ``model.py``, as in Triton's stub."""
    if "model" not in sys.modules and not _installed("model"):
        sys.modules["model"] = _CallingModel("model", _CallingModel.__doc__)


class ImportScope:
    """One model instance's modules: ``model.py`` and the siblings it imports, under one package.

    ``close()`` drops them from ``sys.modules`` when the instance goes.  The scope's lock is
    re-entrant (a helper importing a helper loads on the same thread); lock order: this lock, then
    the interpreter's module locks (installed modules never import through a scope).
    """

    def __init__(self, model_path: Path, model_name: str) -> None:
        version_dir = model_path.parent
        self._dirs = (str(version_dir), str(version_dir.parent))  # Triton's order
        self.package = f"{_PACKAGE_PREFIX}{_UNSAFE.sub('_', model_name)}_{next(_scope_numbers)}"
        self._local: dict[str, bool] = {}  # top-level name -> found beside the model (not installed)
        self._lock = threading.RLock()
        self.builtins: dict[str, Any] = dict(builtins.__dict__)
        self.builtins["__import__"] = self._import
        root = ModuleType(self.package, "modules of one Python model instance (edge-server)")
        root.__path__ = []  # a package, so that pickle and ``import a.b`` find modules inside it
        root.__package__ = self.package
        sys.modules[self.package] = root
        _install_model_alias()

    def load_model(self, model_path: Path) -> ModuleType:
        """Execute ``model.py`` as ``<package>.model``, with this scope's imports."""
        name = f"{self.package}.model"
        return self._execute(name, model_path, package=False, parent=sys.modules[self.package])

    def close(self) -> None:
        """Forget every module of this scope (the objects live on while something references them)."""
        prefix = self.package + "."
        for name in [n for n in list(sys.modules) if n == self.package or n.startswith(prefix)]:
            sys.modules.pop(name, None)

    # -- the scope's __import__ -----------------------------------------------------------------

    def _import(
        self,
        name: str,
        globals: Mapping[str, Any] | None = None,
        locals: Mapping[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> ModuleType:
        if level == 0:
            top = name.partition(".")[0]
            if not self._is_local(top):
                return _builtin_import(name, globals, locals, fromlist or (), level)
            full = f"{self.package}.{name}"
        else:
            package = (globals or {}).get("__package__") or ""
            if package != self.package and not package.startswith(self.package + "."):
                return _builtin_import(name, globals, locals, fromlist or (), level)
            full = importlib.util.resolve_name("." * level + name, package)
        module = self._load(full)
        if fromlist:
            self._load_fromlist(module, fromlist)
            return module
        if level == 0:  # ``import a.b`` binds ``a``
            return sys.modules[f"{self.package}.{top}"]
        return module

    def _is_local(self, top: str) -> bool:
        found = self._local.get(top)
        if found is None:
            found = _find(top, self._dirs) is not None and not _installed(top)
            self._local[top] = found
        return found

    def _load_fromlist(self, module: ModuleType, fromlist: Sequence[str]) -> None:
        """``from package import sub``: load the submodules named that are not attributes yet."""
        if not hasattr(module, "__path__"):
            return
        names = list(fromlist)
        if "*" in names:
            names = [n for n in names if n != "*"] + list(getattr(module, "__all__", ()))
        for attr in names:
            if not hasattr(module, attr):
                try:
                    self._load(f"{module.__name__}.{attr}")
                except ModuleNotFoundError:
                    pass  # the import statement then raises its own "cannot import name"

    def _load(self, full: str) -> ModuleType:
        with self._lock:
            module = sys.modules.get(full)
            if module is not None:
                return module
            parent_name, _, child = full.rpartition(".")
            parent = self._load(parent_name)
            search = getattr(parent, "__path__", None)
            shown = full[len(self.package) + 1 :]  # the name as the model wrote it
            if search is None:
                raise ModuleNotFoundError(
                    f"No module named {shown!r}; {parent_name[len(self.package) + 1 :]!r} is not a package",
                    name=shown,
                )
            found = _find(child, search if parent_name != self.package else self._dirs)
            if found is None:
                raise ModuleNotFoundError(f"No module named {shown!r}", name=shown)
            path, is_package = found
            return self._execute(full, path, package=is_package, parent=parent)

    def _execute(self, full: str, path: Path, *, package: bool, parent: ModuleType) -> ModuleType:
        """Make, register and run one module of the scope (a folder without ``__init__.py``: empty)."""
        spec: importlib.machinery.ModuleSpec | None
        if package and not (path / "__init__.py").is_file():
            spec = importlib.machinery.ModuleSpec(full, None, is_package=True)
            spec.submodule_search_locations = [str(path)]
        else:
            source = path / "__init__.py" if package else path
            spec = importlib.util.spec_from_file_location(
                full,
                source,
                loader=SourceOnlyLoader(full, str(source)),
                submodule_search_locations=[str(path)] if package else None,
            )
        if spec is None:
            raise ImportError(f"{path}: cannot be imported as a Python module", name=full)
        module = importlib.util.module_from_spec(spec)
        module.__builtins__ = self.builtins  # type: ignore[attr-defined]
        sys.modules[full] = module
        try:
            if spec.loader is not None:
                spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(full, None)
            raise
        setattr(parent, full.rpartition(".")[2], module)
        return module
