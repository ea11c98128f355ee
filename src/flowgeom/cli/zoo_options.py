"""Zoo size options as CLI flags (``--d-model``, ``--heads``, ``--positions`` ...).

Flags are generated from the zoo's config dataclasses, so a new size option
appears on every command that builds zoo architectures. Only the flags the
user actually set are passed on, so an option foreign to the chosen
architecture gives a clear error instead of being silently ignored.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

from flowgeom.cli._common import boolean
from flowgeom.nn.zoo import option_fields

_PREFIX = "zoo_"


def _base_type(annotation: Any) -> type:
    hint = eval(annotation, {}) if isinstance(annotation, str) else annotation  # "int | None" -> int | None
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint




def add_size_options(parser: argparse.ArgumentParser) -> None:
    """Add one flag per zoo size option (defaults come from the architecture)."""
    group = parser.add_argument_group("size options (each architecture uses its own subset; see `flowgeom laws list`)")
    for name, f in option_fields().items():
        kind = _base_type(f.type)
        flag = "--" + name.replace("_", "-")
        meta = f.metadata
        if kind is bool:
            group.add_argument(flag, dest=_PREFIX + name, nargs="?", const=True, type=boolean,
                               default=argparse.SUPPRESS, help=meta.get("help"))
        else:
            group.add_argument(flag, dest=_PREFIX + name, type=kind, default=argparse.SUPPRESS,
                               choices=meta.get("choices"), help=meta.get("help"))


def size_options(args: argparse.Namespace) -> dict[str, Any]:
    """The zoo options the user set on the command line."""
    return {k.removeprefix(_PREFIX): v for k, v in vars(args).items() if k.startswith(_PREFIX)}
