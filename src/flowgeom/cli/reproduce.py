"""``flowgeom reproduce [AREA] [--quick|--full] ...``: the papers' claims, one command.

Parses the arguments, calls the pipeline (:func:`flowgeom.reproduce.pipeline.run`:
plan → sweep → verdict → report) and prints its summary. Exit code 0 when
every run finished, 1 when some run failed (the report is still written,
naming them), 2 for bad input: unwritable ``--out``, an ``--out`` that
already holds runs without ``--resume``, unknown area/claim, and a sweep whose
every failure is a refused input (a FIFO ``metrics.jsonl``, a linked
``rejected/`` or run folder; one error line after the summary).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowgeom.cli._common import AppendDistinct, add_json, add_scale, command, positive_int, print_json
from flowgeom.reproduce.pipeline import DEFAULT_ROOT

AREA_CHOICES = ("laws", "conservation", "continuity", "langevin", "all")
MAX_JOBS = 1024  # a sanity bound; a local pool larger than the CPUs only adds contention


def print_summary(report: dict[str, Any]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from flowgeom.cli._common import console
    from flowgeom.report.render import COLOURS

    table = Table(title=report["title"])
    for col in ("claim", "verdict", "measured"):
        table.add_column(col)
    for c in report["claims"]:
        v = c["verdict"]
        table.add_row(c["id"], f"[{COLOURS[v['verdict']]}]{v['verdict']}[/]", escape(v["measured"]))
    out = console()
    out.print(table)
    sweep = report["sweep"]
    out.print(f"{sweep['finished']} runs finished, {sweep['skipped']} kept from before, {sweep['failed']} failed "
              f"in {report['seconds']:.1f} s")
    for f in report["failures"]:
        out.print(f"[red]failed[/red] {escape(f['run'])}: {escape(f['error'])}", markup=True)
    out.print(f"report: {report['paths']['html']}  (markdown: {report['paths']['markdown']})", markup=False)


def run_reproduce(args: argparse.Namespace, *, claims: Sequence[Any] | None = None) -> int:
    """The CLI handler; ``claims`` overrides the registry (tests)."""
    from flowgeom.reproduce.export import check_export, export_results
    from flowgeom.reproduce.pipeline import run

    if args.export and args.out:
        check_export(args.out, args.export)
    report = run(args.area, scale=args.scale, out=args.out, backend=args.backend,
                 jobs=args.jobs, resume=args.resume, only=args.only, show_progress=not args.json, claims=claims)
    if args.json:
        print_json({"report": report["paths"], "sweep": report["sweep"], "seconds": report["seconds"],
                    "claims": [{"id": c["id"], "area": c["area"], **c["verdict"]} for c in report["claims"]]})
    else:
        print_summary(report)
    if args.export:
        exported = export_results(Path(report["paths"]["markdown"]).parent, args.export)
        print(f"exported {len(exported['copied'])} files to {args.export} ({len(exported['left'])} left behind: "
              "checkpoints and large files, listed in EXPORT.json)", file=sys.stderr)
    return exit_code(report)


def exit_code(report: dict[str, Any]) -> int:
    """0 when every run finished, 1 when some run failed (the report still names them).

    When every failure is a refused input, the input is at fault, not a run: :class:`FlowgeomError` (one line,
    exit 2) naming the first.
    """
    sweep = report["sweep"]
    if not sweep["failed"]:
        return 0
    refused = [r for r in sweep["runs"] if r["status"] == "failed" and r.get("refused")]
    if len(refused) < sweep["failed"]:
        return 1
    from flowgeom.errors import FlowgeomError

    first = refused[0]
    raise FlowgeomError(f"{len(refused)} run(s) refused their inputs, and no run failed otherwise; first, "
                        f"{first['run']}: {first['error']}; fix that, then rerun with --resume")


def register(sub) -> None:
    p = command(
        sub, "reproduce", help="reproduce the seeds' claims as resumable sweeps and write an HTML/Markdown report",
        example="flowgeom reproduce laws --quick\nflowgeom reproduce all --quick --out runs/demo\n"
                "flowgeom reproduce all --cpu --jobs 2 --out runs/cpu --resume --export results/full\n"
                "flowgeom reproduce all --full --out /shared/runs --backend ray --resume",
        func=run_reproduce,
    )
    p.add_argument("area", nargs="?", default="all", choices=AREA_CHOICES, metavar="AREA",
                   help="laws, conservation, continuity, langevin or all (default all)")
    add_scale(p, {"quick": "laptop-scale grids",
                  "cpu": "the paper-scale protocols cut to what 2 CPU cores train in about two hours "
                         "(the claims that have such a grid; results/full/ holds their outputs)",
                  "full": "paper-scale grids (the seeds' own configurations)"})
    p.add_argument("--out", default=None, help=f"sweep folder (default {DEFAULT_ROOT}/<scale>-<UTC time>; "
                   "with --resume and no --out, the latest one)")
    p.add_argument("--backend", default="local", choices=("local", "ray"),
                   help="local (this machine) or ray (one Ray task per run; RAY_ADDRESS selects a cluster)")
    p.add_argument("--jobs", type=positive_int(maximum=MAX_JOBS), default=1,
                   help=f"runs in parallel: local process pool size / Ray CPUs, 1..{MAX_JOBS} (default 1)")
    p.add_argument("--resume", action="store_true", help="skip finished runs, continue interrupted ones from "
                   "their checkpoints")
    p.add_argument("--export", metavar="DIR", default=None,
                   help="afterwards copy the report and each run's config/summary/metrics/figures (no checkpoints) "
                        "to DIR, e.g. results/full")
    p.add_argument("--only", action=AppendDistinct, metavar="CLAIM", help="run only this claim id (repeatable, distinct)")
    add_json(p)
