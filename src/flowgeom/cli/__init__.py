"""The ``flowgeom`` command: ``flowgeom <area> <verb> ...``.

Each area lives in its own module with a ``register(subparsers)`` function;
this module only wires them together and turns :class:`FlowgeomError` into
one line on stderr and exit code 2 (never a traceback).

Anything else that escapes a command is a bug: the last-resort guard prints
one line ``flowgeom: internal error: <Type>: <msg> — rerun with --debug for
the traceback`` and exits 1; ``flowgeom --debug ...`` or ``FLOWGEOM_DEBUG=1``
prints the traceback too. Ctrl-C exits 130; argparse's own exits (``--help``
0, usage errors 2) pass through unchanged.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence

from flowgeom import __version__
from flowgeom.cli._common import OneLineParser, threads_for
from flowgeom.errors import FlowgeomError

# (module, area) in the order `flowgeom --help` lists them.
AREAS = ("laws", "conserve", "continuity", "compress", "langevin", "reproduce", "demo")


def build_parser(areas: Sequence[str] = AREAS) -> argparse.ArgumentParser:
    """The ``flowgeom`` parser with the sub-commands of ``areas`` (default: all)."""
    parser = OneLineParser(
        prog="flowgeom",
        description="Geometry of training dynamics: conservation laws, cross-layer continuity, "
        "convergent Langevin training.",
        epilog="example:\n  flowgeom laws list\n  flowgeom laws show mha --heads 2 --d-k 4 --positions rope",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"flowgeom {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an unexpected error (also FLOWGEOM_DEBUG=1)")
    sub = parser.add_subparsers(dest="area", metavar="AREA")
    for area in areas:
        module = importlib.import_module(f"flowgeom.cli.{area}")
        module.register(sub)
    return parser


def _areas_needed(argv: Sequence[str]) -> tuple[str, ...]:
    """Only the named area's module when ``argv`` names one (lazy imports: a command does
    not pay for the other areas' imports); every area for top-level help, version, or a
    mistyped area (so the error lists the valid ones)."""
    for token in argv:
        if token in ("-h", "--help"):
            return AREAS
        if not token.startswith("-"):
            return (token,) if token in AREAS else AREAS
    return AREAS


INTERNAL_ERROR = "internal error"  # the guard's marker; tests/hostile assert it never appears


def _debug_wanted(argv: Sequence[str]) -> bool:
    env = os.environ.get("FLOWGEOM_DEBUG", "").strip().lower()
    return env not in ("", "0", "false", "no", "off") or "--debug" in argv[:1]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_wanted(argv)
    try:
        parser = build_parser(_areas_needed(argv))
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            # `flowgeom` or `flowgeom AREA` alone: show the relevant help.
            target = getattr(args, "_area_parser", parser)
            target.print_help()
            return 2
        with threads_for(getattr(args, "threads", None)):  # --threads means one thing on every command
            return int(args.func(args) or 0)
    except FlowgeomError as exc:
        if debug:
            traceback.print_exc()
        print(f"flowgeom: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flowgeom: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the last-resort guard: one line, never a raw traceback
        if debug:
            traceback.print_exc()
            print(f"flowgeom: {INTERNAL_ERROR}: {_one_line(exc)}", file=sys.stderr)
        else:
            print(f"flowgeom: {INTERNAL_ERROR}: {_one_line(exc)} — rerun with --debug for the traceback",
                  file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
