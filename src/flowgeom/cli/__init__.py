"""The ``flowgeom`` command: ``flowgeom <area> <verb> ...``.

Each area lives in its own module with a ``register(subparsers)`` function;
this module only wires them together and turns :class:`FlowgeomError` into
one line on stderr and exit code 2 (never a traceback).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from flowgeom import __version__
from flowgeom.errors import FlowgeomError

# (module, area) in the order `flowgeom --help` lists them.
AREAS = ("laws", "conserve", "continuity", "langevin", "reproduce", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgeom",
        description="Geometry of training dynamics: conservation laws, cross-layer continuity, "
        "convergent Langevin training.",
        epilog="example:\n  flowgeom laws list\n  flowgeom laws show mha --heads 2 --d-k 4 --positions rope",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flowgeom {__version__}")
    sub = parser.add_subparsers(dest="area", metavar="AREA")
    for area in AREAS:
        module = importlib.import_module(f"flowgeom.cli.{area}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        # `flowgeom` or `flowgeom AREA` alone: show the relevant help.
        target = getattr(args, "_area_parser", parser)
        target.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except FlowgeomError as exc:
        print(f"flowgeom: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flowgeom: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
