"""One preset per scale, read one way.

Every experiment module owns one frozen dataclass of its knobs and one
read-only table ``PRESETS = scales(quick=…, cpu=…, full=…)``:

- ``quick``: laptop minutes; what ``make demo`` and the quick claims train;
- ``cpu``: the paper-scale protocol cut to what 2 CPU cores train in about
  two hours (the seed's model where it fits, else the largest that does);
- ``full``: the seeds' own configurations (a GPU or a cluster).

Where two scales coincide the experiment's module says why next to its
presets. The CLI (``--quick``/``--cpu``/``--full``) and the reproduce claims
(:mod:`flowgeom.reproduce`) both resolve a scale with :func:`preset`, so a
scale trains the same configuration everywhere and no number is written
twice (``tests/experiments/test_presets.py`` compares the two).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from flowgeom.errors import FlowgeomError, choice_error

SCALES = ("quick", "cpu", "full")

T = TypeVar("T")


def scales(*, quick: T, cpu: T, full: T) -> Mapping[str, T]:
    """An experiment's ``PRESETS``: a read-only mapping with keys exactly :data:`SCALES`, one frozen dataclass type."""
    table = {"quick": quick, "cpu": cpu, "full": full}
    kinds = {type(p) for p in table.values()}
    if len(kinds) != 1:
        raise TypeError(f"the presets of one experiment must share one type, got {sorted(k.__name__ for k in kinds)}")
    if not dataclasses.is_dataclass(quick) or not type(quick).__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"a preset must be a frozen dataclass, got {type(quick).__name__}")
    return MappingProxyType(table)


def preset(presets: Mapping[str, T], scale: str, *, what: str | None = None, **overrides: Any) -> T:
    """``presets[scale]`` with ``overrides`` (field names of its dataclass), checked once.

    An unknown scale lists the valid ones; unknown fields are refused with the
    list of valid fields (``what`` names them in the message, e.g. ``"MLP run
    option(s)"``; default ``"<Type> field(s)"``).
    """
    if scale not in presets:
        raise choice_error("preset", scale, presets)
    base = presets[scale]
    if not overrides:
        return base
    known = [f.name for f in dataclasses.fields(base)]  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise FlowgeomError(f"unknown {what or type(base).__name__ + ' field(s)'} {unknown}; valid: {', '.join(known)}")
    return dataclasses.replace(base, **overrides)  # type: ignore[type-var]
