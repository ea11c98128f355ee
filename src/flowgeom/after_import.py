"""Post-import hooks: a function run right after a module finishes importing, whoever imports it and when.

:func:`when_imported` ``(module, target)`` calls ``target`` (``"package.module:function"``,
imported only then, called with no argument) as soon as the module's own code has
run: at once if it has already, else from a finder first on ``sys.meta_path``.
The finder answers for the watched names only; it takes the spec the other
finders give and wraps its loader, so the module is loaded exactly as it would
be, then the hooks run, once. Nothing here imports the watched module.

flowgeom uses it to register its factored folders with transformers' Auto
classes without importing transformers (:mod:`flowgeom.compress.auto`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings
from types import ModuleType

_PENDING: dict[str, list[str]] = {}  # module name -> targets still to call


def when_imported(module: str, target: str) -> None:
    """Call ``target`` (``"package.module:function"``) right after ``module`` is imported (now if it is)."""
    loaded = sys.modules.get(module)
    if loaded is not None and not getattr(getattr(loaded, "__spec__", None), "_initializing", False):
        _call(target, module)
        return
    _PENDING.setdefault(module, []).append(target)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _call(target: str, module: str) -> None:
    where, _, name = target.partition(":")
    try:
        getattr(importlib.import_module(where), name)()
    except Exception as exc:  # noqa: BLE001 - a hook must never break the import of someone else's module
        warnings.warn(f"flowgeom: {target} failed after {module} was imported ({type(exc).__name__}: "
                      f"{exc})", RuntimeWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the hooks."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module sees its own loader, not this one
        self.loader.exec_module(module)
        for target in _PENDING.pop(module.__name__, []):
            _call(target, module.__name__)
