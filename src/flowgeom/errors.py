"""The one exception type users see.

Library code raises :class:`FlowgeomError` for bad input (never a bare
``assert``): the message names the offending value, lists the valid options
where there are some, and says the fix. The CLI turns it into one line on
stderr and exit code 2.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Iterable


class FlowgeomError(ValueError):
    """Bad input or an unusable state, with a message fit for the user."""


class RefusedInput(FlowgeomError):
    """A file or path refused before anything read it or wrote through it: a FIFO, device or folder where a
    file belongs, a dangling or looping link, a link out of the folder flowgeom writes in.

    The input is at fault, not a computation: a sweep whose only failures are these exits 2, not 1.
    """


class InputError(FlowgeomError):
    """A problem whose fix depends on where the user is: an argument in Python, a flag on the CLI.

    ``str(exc)`` names the Python fix (``input_shape=(4, 8)``); the CLI re-raises
    :meth:`for_cli`, which names the flag (``--input-shape 4,8``) instead.
    """

    def __init__(self, problem: str, *, python_fix: str, cli_fix: str):
        super().__init__(f"{problem}; {python_fix}")
        self.problem, self.cli_fix = problem, cli_fix

    def for_cli(self) -> FlowgeomError:
        return FlowgeomError(f"{self.problem}; {self.cli_fix}")


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


def positive_int(value: object, name: str, *, maximum: int | None = None, fix: str = "") -> int:
    """``value`` as an int ``>= 1`` (and ``<= maximum``), else one :class:`FlowgeomError`.

    The one check for counts (steps, widths, heads, workers, ranks): in library
    configs and arguments, and on the CLI through the argparse type
    :func:`flowgeom.cli._common.positive_int` (which passes ``name=""``). One
    wording everywhere: ``"{name} must be a whole number >= 1, got 0; {fix}"``
    (``between 1 and {maximum}`` when capped). Python and numpy/torch integers
    are accepted (``operator.index``); bools, floats (even ``2.0``), strings
    and ``None`` are refused by name.
    """
    bound = ">= 1" if maximum is None else f"between 1 and {maximum}"
    head = f"{name} must" if name else "must"
    tail = f"; {fix}" if fix else ""
    try:
        if isinstance(value, bool):  # True is an int to Python, never a count
            raise TypeError
        number = operator.index(value)  # type: ignore[call-overload]
    except (TypeError, RuntimeError):  # floats, strings, None, float or multi-element tensors
        shown_value = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise FlowgeomError(f"{head} be a whole number {bound}, got {type(value).__name__} {shown_value}{tail}") \
            from None
    if number < 1 or (maximum is not None and number > maximum):
        raise FlowgeomError(f"{head} be a whole number {bound}, got {number}{tail}")
    return number
