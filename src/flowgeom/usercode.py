"""Loading a user's own code named as ``path/to/file.py:NAME`` or ``package.module:NAME``.

One loader for every command that takes the user's code (``laws count
FILE.py:NAME``, ``langevin villani FILE.py:NAME``): the file is checked to be
a regular file before it is imported (a FIFO would block the import), an
import that raises or calls ``sys.exit`` becomes one :class:`FlowgeomError`
naming the file, a missing NAME lists the candidates, and a zero-argument
factory is called with the same care. What NAME must return (an
``nn.Module``, a loss) is the caller's business.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowgeom.errors import FlowgeomError
from flowgeom.files import regular_file

USAGE = "path/to/file.py:NAME or package.module:NAME"


def split_target(target: str) -> tuple[str, str]:
    """``"dir/f.py:make"`` -> ``("dir/f.py", "make")``; FlowgeomError when either part is empty."""
    spec, _, name = target.rpartition(":")
    if not spec or not name:
        raise FlowgeomError(f"malformed target {target!r}; expected {USAGE}")
    return spec, name


def load_module(spec: str) -> Any:
    """Import ``path/to/file.py`` or ``package.module``; FlowgeomError on failure."""
    if spec.endswith(".py") or "/" in spec or "\\" in spec:
        path = Path(spec)
        if not os.path.lexists(path):
            raise FlowgeomError(f"no such file {spec!r}; give path/to/file.py:NAME")
        regular_file(path, "target file", fix="give path/to/file.py:NAME")  # a FIFO would block the import
        name = f"_flowgeom_target_{abs(hash(str(path.resolve())))}"
        loader = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(loader)
        sys.modules[name] = mod
        try:
            loader.loader.exec_module(mod)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit at import must not end the CLI in silence
            sys.modules.pop(name, None)
            raise FlowgeomError(f"could not import {spec!r}: {describe(exc)}; "
                                "the file must define the module without exiting or raising") from None
        return mod
    try:
        return importlib.import_module(spec)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - as above
        raise FlowgeomError(f"could not import module {spec!r}: {describe(exc)}; "
                            "check the name or give path/to/file.py:NAME") from None


def describe(exc: BaseException) -> str:
    """``Type: first line`` of an exception; ``SystemExit(7)`` reads as a call to sys.exit(7)."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def functions(mod: Any) -> list[str]:
    """Public functions defined in ``mod`` itself (the usual candidates for NAME)."""
    return sorted(n for n, v in vars(mod).items()
                  if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == mod.__name__)


def attribute(target: str, *, candidates: Callable[[Any], list[str]] = functions) -> Any:
    """The object NAME of ``target`` (``FILE.py:NAME`` / ``package.module:NAME``), its module imported.

    A missing NAME is an error listing ``candidates(module)``.
    """
    spec, name = split_target(target)
    mod = load_module(spec)
    if not hasattr(mod, name):
        raise FlowgeomError(f"{spec!r} has no attribute {name!r}; candidates: {', '.join(candidates(mod)) or '(none)'}")
    return getattr(mod, name)


def call_factory(factory: Any, where: str, *, fix: str = "wrap it in a zero-argument factory function") -> Any:
    """``factory()`` with its failures as one FlowgeomError naming ``where``.

    A factory that needs arguments (TypeError at the call) is refused with
    ``fix``; any other exception, ``SystemExit`` included, is named.
    """
    if not callable(factory):
        raise FlowgeomError(f"{where} is a {type(factory).__name__}, not a zero-argument factory; {fix}")
    try:
        return factory()
    except TypeError as exc:
        raise FlowgeomError(f"{where} cannot be built without arguments ({exc}); {fix}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - a factory may call sys.exit too
        raise FlowgeomError(f"building {where} failed: {describe(exc)}") from None
