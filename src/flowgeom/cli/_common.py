"""Small helpers shared by the CLI areas: parsers with examples, --json, output."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from flowgeom import errors
from flowgeom.errors import FlowgeomError
from flowgeom.runs import to_json


def area(sub: Any, name: str, help: str) -> Any:
    """Add an area parser (``flowgeom NAME``) and return its verb sub-parsers."""
    parser = sub.add_parser(name, help=help, description=help)
    parser.set_defaults(_area_parser=parser)
    return parser.add_subparsers(dest="verb", metavar="VERB")


def command(sub: Any, name: str, *, help: str, example: str, func: Callable[[argparse.Namespace], int | None]) -> argparse.ArgumentParser:
    """Add one verb with an example in its ``--help`` and its handler."""
    parser = sub.add_parser(
        name,
        help=help,
        description=help,
        epilog="example:\n  " + example.strip().replace("\n", "\n  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(func=func)
    return parser


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")


def add_seed(parser: argparse.ArgumentParser, default: int | None = 0, *, help: str | None = None) -> None:
    shown = "0" if default is None else default
    parser.add_argument("--seed", type=seed, default=default,
                        help=help or f"random seed, 0 <= seed < 2**63 (default {shown})")


def add_scale(parser: argparse.ArgumentParser, helps: dict[str, str], *, default: str = "quick",
              preset_alias: bool = False) -> None:
    """Mutually exclusive ``--quick``/``--cpu``/``--full`` (the keys of ``helps``) into ``args.scale``.

    One builder so that a scale name means the same preset in every command;
    ``preset_alias`` also accepts the older ``--preset NAME`` spelling.
    """
    group = parser.add_mutually_exclusive_group()
    for name, text in helps.items():
        group.add_argument(f"--{name}", dest="scale", action="store_const", const=name,
                           help=f"{text} (default)" if name == default else text)
    if preset_alias:
        group.add_argument("--preset", dest="scale", choices=tuple(helps), help="same as --" + "/--".join(helps))
    parser.set_defaults(scale=default)


THREADS_HELP = ("CPU threads for torch and BLAS while this command runs, 1..{cpus} (default: torch's own count, "
                "all cores unless OMP_NUM_THREADS says otherwise)")


def add_threads(parser: argparse.ArgumentParser, *, also: str = "") -> None:
    """``--threads N``, one meaning on every command (applied by :func:`threads_for` around the command).

    Default None: torch's own thread count, untouched. ``N`` (``1 <= N <= CPUs``, checked when parsed):
    torch and scipy's BLAS use ``N`` threads while the command runs, and what was set before is restored.
    Every ``--help`` shows :data:`THREADS_HELP`; ``also`` adds what the count changes in this command.
    """
    text = THREADS_HELP.format(cpus=_cpus()) + (f"; {also}" if also else "")
    parser.add_argument("--threads", type=threads, default=None, metavar="N", help=text)


def add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def resolve_device(name: str):
    import torch

    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise FlowgeomError(f"unknown --device {name!r}; choose cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise FlowgeomError("--device cuda asked for, but no CUDA GPU is visible; use --device cpu")
    index = name.partition(":")[2]
    if index and not (index.isdigit() and int(index) < torch.cuda.device_count()):
        raise FlowgeomError(f"unknown --device {name!r}; this machine has cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return torch.device(name)


def _finite_or_none(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite_or_none(v) for v in obj]
    return obj


def _refuse_constant(name: str):
    raise ValueError(f"non-finite {name}")


def print_json(payload: Any) -> None:
    """``payload`` as strict JSON on stdout: NaN and ±inf become ``null`` (no parser accepts them)."""
    import json

    text = to_json(payload, indent=2)
    try:
        json.loads(text, parse_constant=_refuse_constant)
    except ValueError:  # NaN/Infinity somewhere: null them (Python's json reads them back as floats)
        text = json.dumps(_finite_or_none(json.loads(text)), indent=2, allow_nan=False)
    sys.stdout.write(text + "\n")


def console():
    """A rich console on stdout (plain text when not a terminal)."""
    import sys

    from rich.console import Console

    # Piped output (CI logs, `| less`) would otherwise wrap tables at 80 columns.
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


@contextmanager
def threads_for(n: int | None) -> Iterator[None]:
    """The one meaning of ``--threads``: inside the block torch and scipy's BLAS use ``n`` threads, after it
    whatever was set before; ``None`` (the flag's default) changes nothing. ``cli.main`` wraps every command."""
    if n is None:
        yield
        return
    if not 1 <= n <= _cpus():
        raise FlowgeomError(f"--threads must be between 1 and {_cpus()} (the CPUs of this machine), got {n}")
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with threadpool_limits(limits=n, user_api="blas"):  # scipy's bundled OpenBLAS (syrk, gemm, ?sytrd)
            yield
    finally:
        torch.set_num_threads(before)


# --- argparse types: every flag value checked where it is parsed -------------------------------------------
# A value argparse refuses is a usage error: one line ``flowgeom ...: error: argument --x: <why>``, exit 2.

SEED_LIMIT = 2**63  # torch.Generator.manual_seed refuses seeds outside [-2**63, 2**64) with a RuntimeError


def _cpus() -> int:
    return os.cpu_count() or 1


def _as_int(text: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _as_float(text: str) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def bounded_int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """argparse type: a whole number in ``[lo, hi]`` (``hi`` None: no upper bound)."""

    def parse(text: str) -> int:
        value = _as_int(text)
        if value < lo or (hi is not None and value > hi):
            span = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise argparse.ArgumentTypeError(f"must be a whole number {span}, got {value}")
        return value

    parse.__name__ = f"int in [{lo}, {'inf' if hi is None else hi}]"
    return parse


def positive_int(text: str | None = None, *, maximum: int | None = None):
    """argparse type: a whole number >= 1; ``positive_int(maximum=M)`` returns the type capped at ``M``.

    ``type=positive_int`` and ``type=positive_int(maximum=10**6)`` both work. The check and its wording are
    :func:`flowgeom.errors.positive_int`'s, the one the library's configs use.
    """

    def parse(text: str) -> int:
        try:
            return errors.positive_int(_as_int(text), "", maximum=maximum)
        except FlowgeomError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "positive int"
    return parse if text is None else parse(text)


def nonneg_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    return bounded_int(0)(text)


def boolean(text: str) -> bool:
    """argparse type: true/false (also yes/no, on/off, 1/0; any case): :func:`flowgeom.options.boolean`."""
    from flowgeom.options import boolean as read_boolean

    try:
        return read_boolean(text)
    except FlowgeomError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seed(text: str) -> int:
    """argparse type: a random seed, ``0 <= seed < 2**63`` (what every torch.Generator accepts)."""
    value = _as_int(text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"a seed must be a whole number in [0, 2**63), got {value}")
    return value


def threads(text: str) -> int:
    """argparse type: CPU threads, ``1 <= n <= os.cpu_count()`` (torch crashes on absurd counts)."""
    value = _as_int(text)
    if not 1 <= value <= _cpus():
        raise argparse.ArgumentTypeError(f"must be between 1 and {_cpus()} (the CPUs of this machine), got {value}")
    return value


def finite_float(lo: float = -math.inf, hi: float = math.inf, *, lo_open: bool = False,
                 hi_open: bool = False) -> Callable[[str], float]:
    """argparse type: a finite number in ``[lo, hi]`` (``lo_open``/``hi_open`` exclude the end points)."""

    def parse(text: str) -> float:
        value = _as_float(text)
        low_ok = value > lo if lo_open else value >= lo
        high_ok = value < hi if hi_open else value <= hi
        if not (low_ok and high_ok):
            left = "(" if lo_open else "["
            right = ")" if hi_open else "]"
            raise argparse.ArgumentTypeError(f"must be a finite number in {left}{lo:g}, {hi:g}{right}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (usage error, exit 2, otherwise)."""
    value = _as_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


MAX_STEP_SIZE = 1e6  # larger learning rates overflow float32 updates before they can even diverge visibly


def step_size(text: str) -> float:
    """argparse type: a learning rate / step size in ``(0, 1e6]``."""
    return finite_float(0.0, MAX_STEP_SIZE, lo_open=True)(text)


def nonneg_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _as_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


class AppendDistinct(argparse.Action):
    """``action="append"`` that refuses a value given twice (``--tau 0.1 --tau 0.1``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        if values in items:
            raise argparse.ArgumentError(self, f"{values!r} given twice; each value must be distinct")
        items.append(values)
        setattr(namespace, self.dest, items)


def comma_list(choices: Sequence[str], *, what: str) -> Callable[[str], tuple[str, ...]]:
    """argparse type: a comma-separated list of distinct names among ``choices`` (at least one)."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in str(text).split(",") if x.strip())
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what} among {', '.join(choices)}")
        unknown = [x for x in items if x not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown[0]!r}; choose among {', '.join(choices)}")
        twice = sorted({x for x in items if items.count(x) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"{what} {twice[0]!r} given twice; list each once")
        return items

    parse.__name__ = what
    return parse


def figure_path(text: str) -> str:
    """argparse type: a figure file name whose extension matplotlib can write (checked before any work)."""
    from flowgeom.report.figures import check_figure_path

    try:
        check_figure_path(text)
    except FlowgeomError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line ``PROG: error: MSG; see PROG --help`` (exit 2)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        message = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")
