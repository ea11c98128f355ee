"""``flowgeom laws list|show`` (catalogue) and the engine's ``count|discover``."""

from __future__ import annotations

import argparse

from rich.markup import escape

from flowgeom.cli._common import add_json, add_seed, area, command, console, positive_int, print_json
from flowgeom.cli.zoo_options import add_size_options, size_options


def print_catalogue_table(rows: list[dict] | None = None) -> None:
    from rich.table import Table

    if rows is None:
        from flowgeom.laws.describe import catalogue_rows

        rows = catalogue_rows()
    table = Table(title="flowgeom law catalogue (default sizes; check in float64, tolerance 1e-10)")
    for col in ("architecture", "law families", "count", "at size", "D", "max violation", "control", "verdict"):
        table.add_column(col, justify="right" if col in ("at size", "D") else "left")
    for r in rows:
        verdict = "laws hold" if r["passed"] else "[red]FAILS[/red]"
        if r["refuted"]:
            verdict += f"; seed's router law refuted (violation {r['refuted'][0]['violation']:.1e})"
        control = f"{r['control_violation']:.1e}" if r["control_violation"] is not None else "-"
        table.add_row(r["label"], ", ".join(r["families"]) or "(none)", r["count_formula"], str(r["count"]),
                      str(r["parameters"]), f"{r['max_violation']:.1e}", control, verdict)
    console().print(table)


def _list(args: argparse.Namespace) -> int:
    from flowgeom.laws.describe import catalogue_rows

    rows = catalogue_rows(seed=args.seed)
    if args.json:
        print_json(rows)
    else:
        print_catalogue_table(rows)
    return 0


def _show(args: argparse.Namespace) -> int:
    from flowgeom.laws.describe import describe

    d = describe(args.arch, size_options(args), seed=args.seed, n_fields=args.fields)
    if args.json:
        print_json(d)
        return 0 if d["check"]["passed"] else 1
    out = console()
    opts = ", ".join(f"{k}={v}" for k, v in d["options"].items())
    out.print(f"[bold]{d['arch']}[/bold] ({opts}); D = {d['parameters']} parameters")
    out.print(f"{d['count']} independent conservation laws:")
    for law in d["laws"]:
        out.print(f"  {law['count']:>4}  " + escape(law["formula"]) + (f"  ({law['note']})" if law.get("note") else ""))
    if not d["laws"]:
        out.print("  (none: only constant functions are conserved)")
    chk = d["check"]
    out.print(f"check: {chk['fields']} random fields × {chk['points']} parameter points, {chk['dtype']}: "
              f"max relative violation {chk['max_violation']:.2e} (tolerance {chk['tolerance']:.0e}) -> "
              + ("[green]PASSED[/green]" if chk["passed"] else "[red]FAILED[/red]"))
    for c in d["controls"]:
        out.print(f"control {escape(c['name'])} (not conserved): violation {c['violation']:.2e}")
    for r in d["refuted"]:
        out.print(f"[yellow]refuted claim[/yellow] {escape(r['name'])}: violation {r['violation']:.2e} — {r['note']}")
    for note in d["notes"]:
        out.print(f"note: {note}")
    return 0 if chk["passed"] else 1


def register(sub) -> None:
    from flowgeom.nn.zoo import ARCHITECTURES

    verbs = area(sub, "laws", "conservation laws: catalogue, check, numeric count and discovery")
    p = command(verbs, "list", help="every zoo architecture with its laws, counts and check verdict",
                example="flowgeom laws list\nflowgeom laws list --json", func=_list)
    add_json(p)
    add_seed(p)
    p = command(verbs, "show", help="one architecture's laws, counts and the check's violation figure",
                example="flowgeom laws show swiglu --d-hidden 16\nflowgeom laws show mha --heads 2 --d-k 4 --positions rope --json",
                func=_show)
    p.add_argument("arch", metavar="ARCH", help="one of: " + ", ".join(ARCHITECTURES))
    p.add_argument("--fields", type=positive_int(), default=64,
                   help="random (input, output direction) pairs per point (default 64; more is refused with the "
                        "memory it would need)")
    add_size_options(p)
    add_json(p)
    add_seed(p)
    from flowgeom.cli.laws_engine import register_verbs  # an import bug fails loudly, never drops commands

    register_verbs(verbs)
