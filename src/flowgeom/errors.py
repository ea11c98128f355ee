"""The one exception type users see.

Library code raises :class:`FlowgeomError` for bad input (never a bare
``assert``): the message names the offending value, lists the valid options
where there are some, and says the fix. The CLI turns it into one line on
stderr and exit code 2.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable


class FlowgeomError(ValueError):
    """Bad input or an unusable state, with a message fit for the user."""


def shown(text: object) -> str:
    """``text`` (a path or a name) as it may appear in a one-line message: escaped if not printable."""
    text = os.fspath(text) if isinstance(text, os.PathLike) else text
    text = text if isinstance(text, str) else str(text)
    return text if text.isprintable() else ascii(text)


def choice_error(what: str, value: object, options: Iterable[object]) -> FlowgeomError:
    """An error for ``value`` not among ``options``, listing the valid ones."""
    listed = ", ".join(str(o) for o in options)
    return FlowgeomError(f"unknown {what} {value!r}; choose one of: {listed}")


def require_choices(obj: object, **options: Iterable[object]) -> None:
    """Raise :func:`choice_error` for the first field ``name`` of ``obj`` not in ``options[name]``."""
    for name, allowed in options.items():
        value = getattr(obj, name)
        if value not in allowed:
            raise choice_error(name, value, allowed)


def require(condition: bool, message: str) -> None:
    """Raise :class:`FlowgeomError` with ``message`` unless ``condition``."""
    if not condition:
        raise FlowgeomError(message)


def finite_number(value: object, name: str, *, minimum: float | None = None, positive: bool = False,
                  fix: str = "pass a finite number") -> float:
    """``value`` as a finite float (``>= minimum``; ``> 0`` when ``positive``), else one :class:`FlowgeomError`.

    The one check for real hyper-parameters given to the API (``lr``,
    ``temperature``, ``weight_decay``): strings, bools, complex numbers,
    ``None``, NaN, ±inf and numbers too large for a float are refused by name.
    A 0-d real tensor or numpy scalar is accepted.
    """
    bound = "> 0" if positive else (f">= {minimum:g}" if minimum is not None else "")
    want = f"a finite real number{' ' + bound if bound else ''}"
    if isinstance(value, (str, bytes, bool, complex)) or value is None:
        raise FlowgeomError(f"{name} must be {want}, got {type(value).__name__} {value!r}; {fix}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError, RuntimeError):  # complex, objects, >1 element, int too large
        shown_value = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise FlowgeomError(f"{name} must be {want}, got {type(value).__name__} {shown_value}; {fix}") from None
    if not math.isfinite(number) or (positive and number <= 0) or (minimum is not None and number < minimum):
        raise FlowgeomError(f"{name} is {number!r}; it must be {want} ({fix})")
    return number
