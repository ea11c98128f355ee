"""``flowgeom demo``: the main job ``make demo`` runs."""

from __future__ import annotations

import argparse

from flowgeom.cli._common import command


def run_demo(args: argparse.Namespace) -> int:
    from flowgeom.cli.laws import print_catalogue_table

    print_catalogue_table()
    return 0


def register(sub) -> None:
    command(sub, "demo", help="run the quick tour (what `make demo` runs)", example="flowgeom demo", func=run_demo)
