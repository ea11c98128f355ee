"""``flowgeom demo``: the quick tour that ``make demo`` runs.

1. the law catalogue with its float64 check (seconds);
2. catalogue count vs the numeric engine's count for every zoo row (a line per row,
   a heartbeat while one runs);
3. ``flowgeom reproduce all --quick``: every seed claim as a resumable sweep
   (conservation drift and the fitted τ-slope, the SmolLM2 continuity table and
   heatmap, the residual-MLP ablation table, the Villani verdicts and the Darcy
   norm-growth plot), with a progress line per run and a heartbeat at least
   every 10 s (runs done / total, the current run, elapsed, ETA).

It ends with where the report is and how long the tour took here against the
figure the README states (:data:`README_TOUR_SECONDS`; ``tests/cli/test_demo.py``
keeps the two in step).
"""

from __future__ import annotations

import argparse
import time

from flowgeom.cli._common import command, console, positive_int

# What the README says the tour takes (measured with `make demo`, docs/benchmarks.md).
README_TOUR_SECONDS = 2 * 60 + 23
README_TOUR = "2 min 23 s on 2 idle cores"  # `flowgeom demo --out DIR` on a fresh DIR, the machine otherwise idle


def run_demo(args: argparse.Namespace) -> int:
    from flowgeom.cli.laws import print_catalogue_table
    from flowgeom.cli.laws_engine import print_count_table
    from flowgeom.laws.describe import count_rows
    from flowgeom.cli.reproduce import exit_code, print_summary
    from flowgeom.reproduce.pipeline import run

    t0 = time.monotonic()
    out = console()
    out.rule("1/3  conservation-law catalogue (closed forms, checked by autograd in float64)")
    print_catalogue_table()
    out.rule("2/3  catalogue count vs numeric count D − dim Lie(W)(θ)")

    from flowgeom.laws.catalogue import VARIANTS
    from flowgeom.reproduce.progress import Ticker

    labels = [v.label for v in VARIANTS]
    ticker = Ticker(len(labels), lambda line: out.print("count " + line, markup=False, highlight=False))

    def row_done(i: int, total: int, row: dict) -> None:  # the same lines as the sweep's, heartbeat included
        ticker.done(str(i), f"{row['label']}: {row['numeric']} laws", "finished", row["seconds"])
        if i < total:
            ticker.start(str(i + 1), labels[i])

    ticker.start("1", labels[0])
    with ticker:
        rows = count_rows(on_row=row_done)
    print_count_table(rows)
    if args.skip_reproduce:
        return 0
    out.rule("3/3  every seed claim: flowgeom reproduce all --quick")
    # resume=True: a second `make demo` reuses the finished runs instead of refusing the folder. One run per core,
    # each at one thread: the tour's models are tiny, and threads of one run that wait for each other at every
    # op are what made the tour collapse under load (reproduce/sweep.py, docs/benchmarks.md).
    from flowgeom.reproduce.sweep import available_cores

    report = run("all", scale="quick", out=args.out, resume=True, skip_heavy=True,
                 jobs=args.jobs or available_cores())
    print_summary(report)
    _print_left_out(out)
    out.print(tour_line(time.monotonic() - t0, kept=report["sweep"]["skipped"]), markup=False, highlight=False)
    out.print(f"report: {report['paths']['html']}", markup=False, highlight=False)
    return exit_code(report)


def tour_line(seconds: float, *, kept: int = 0) -> str:
    """How long the tour took here, against the README's figure (and why a rerun is faster)."""
    from flowgeom.reproduce.progress import duration

    ratio = seconds / README_TOUR_SECONDS
    line = f"tour: {duration(seconds)} on this machine; the README states {README_TOUR} ({ratio:.1f}× that)"
    if kept:
        line += f"; {kept} runs were kept from an earlier tour (delete the --out folder to time a full one)"
    return line


def _print_left_out(out) -> None:
    from flowgeom.reproduce.registry import AREAS, load_claims

    for claim in load_claims(list(AREAS)):
        if claim.heavy:
            out.print(f"left out of the tour: {claim.id} ({claim.heavy}); run it with "
                      f"`{claim.command('quick')}`", markup=False)


def register(sub) -> None:
    p = command(sub, "demo", help="run the quick tour (what `make demo` runs)",
                example="flowgeom demo\nflowgeom demo --out runs/demo --skip-reproduce", func=run_demo)
    p.add_argument("--out", default="runs/demo", help="sweep folder of the reproduce step (default runs/demo; rerunning resumes it)")
    p.add_argument("--skip-reproduce", action="store_true", help="only the two law tables (seconds)")
    p.add_argument("--jobs", type=positive_int(maximum=1024), default=None,
                   help="runs in parallel (default: the cores this process may use, one thread per run; never "
                        "more runs × threads than those cores)")
