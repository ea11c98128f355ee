"""Every figure of a finished sweep's report, redrawn and checked for overlapping or cut labels.

    python benchmarks/figure_labels.py runs/demo      # the folder of `make demo` (or any quick sweep)

Calls each claim's verdict on the sweep's finished runs, as the report does,
writing its figures to a temporary folder, with ``Figure.savefig`` wrapped so
that each figure is first checked by :func:`flowgeom.report.layout.label_problems`
at the dpi and bbox it is saved with. Prints one line per figure; exit 1 if
any has a problem. ``tests/report/test_figure_labels.py`` checks the same on
data of the tour's ranges without a sweep.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from matplotlib.figure import Figure

from flowgeom.report.layout import label_problems
from flowgeom.reproduce.registry import AREAS, RunRecord, load_claims
from flowgeom.reproduce.sweep import plan
from flowgeom.runs import RunFolder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="a finished sweep folder")
    ap.add_argument("--scale", default="quick")
    args = ap.parse_args()

    found: list[tuple[str, list[str]]] = []
    current = {"claim": ""}
    original = Figure.savefig

    def savefig(self, fname, *a, **k):
        title = " / ".join(filter(None, [ax.get_title() for ax in self.axes])) or "(untitled)"
        found.append((f"{current['claim']}: {title}",
                      label_problems(self, dpi=k.get("dpi"), tight=k.get("bbox_inches") == "tight")))
        return original(self, fname, *a, **k)

    Figure.savefig = savefig
    claims = [c for c in load_claims(list(AREAS)) if not c.unavailable]
    specs = plan(claims, scale=args.scale, out=args.sweep)
    with tempfile.TemporaryDirectory() as tmp:
        for claim in claims:
            records = [RunRecord(s.run_id, s.config, RunFolder(s.path).summary(), s.path) for s in specs
                       if s.claim_id == claim.id and RunFolder(s.path).finished]
            if records:
                current["claim"] = claim.id
                claim.verdict(records, Path(tmp) / claim.id)
    for name, problems in found:
        print(f"{'ok  ' if not problems else 'BAD '} {name}")
        for p in problems:
            print(f"       {p}")
    bad = sum(bool(p) for _, p in found)
    print(f"{len(found)} figures, {bad} with overlapping or cut labels")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
