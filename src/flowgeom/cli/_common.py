"""Small helpers shared by the CLI areas: parsers with examples, --json, output."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

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


def add_seed(parser: argparse.ArgumentParser, default: int = 0) -> None:
    parser.add_argument("--seed", type=int, default=default, help=f"random seed (default {default})")


def add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def resolve_device(name: str):
    import torch

    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise FlowgeomError(f"unknown --device {name!r}; choose cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise FlowgeomError("--device cuda asked for, but no CUDA GPU is visible; use --device cpu")
    return torch.device(name)


def print_json(payload: Any) -> None:
    sys.stdout.write(to_json(payload, indent=2) + "\n")


def console():
    """A rich console on stdout (plain text when not a terminal)."""
    import sys

    from rich.console import Console

    # Piped output (CI logs, `| less`) would otherwise wrap tables at 80 columns.
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (usage error, exit 2, otherwise)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def apply_threads(n: int | None) -> None:
    """Set the CPU threads of torch and of scipy's BLAS from ``--threads`` (None keeps the defaults)."""
    if n is None:
        return
    if n < 1:
        raise FlowgeomError(f"--threads must be >= 1, got {n}")
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(n)
    threadpool_limits(limits=n, user_api="blas")  # process-wide: scipy's bundled OpenBLAS (syrk, ?syevr)
