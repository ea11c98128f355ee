"""``flowgeom demo``: the quick tour that ``make demo`` runs.

1. the law catalogue with its float64 check (seconds);
2. catalogue count vs the numeric engine's count for every zoo row (seconds);
3. ``flowgeom reproduce all --quick``: every seed claim as a resumable sweep
   (conservation drift and the fitted τ-slope, the SmolLM2 continuity table and
   heatmap, the residual-MLP ablation table, the Villani verdicts and the Darcy
   norm-growth plot), ending with the path of the HTML report (~2–3 min on 2 cores).
"""

from __future__ import annotations

import argparse

from flowgeom.cli._common import command, console


def run_demo(args: argparse.Namespace) -> int:
    from flowgeom.cli.laws import print_catalogue_table
    from flowgeom.cli.laws_engine import print_count_table
    from flowgeom.cli.reproduce import exit_code, print_summary
    from flowgeom.reproduce.pipeline import run

    out = console()
    out.rule("1/3  conservation-law catalogue (closed forms, checked by autograd in float64)")
    print_catalogue_table()
    out.rule("2/3  catalogue count vs numeric count D − dim Lie(W)(θ)")
    print_count_table()
    if args.skip_reproduce:
        return 0
    out.rule("3/3  every seed claim: flowgeom reproduce all --quick")
    # resume=True: a second `make demo` reuses the finished runs instead of refusing the folder.
    report = run("all", scale="quick", out=args.out, resume=True, skip_heavy=True)
    print_summary(report)
    _print_left_out(out)
    return exit_code(report)


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
