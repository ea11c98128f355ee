"""The end-of-training figure: ε against step per law family, its controls, and the predicted drift.

Laws are solid lines, controls (‖W‖²_F of the matrices the laws read) thin
and dashed, Kunin et al.'s predicted drift (when there is one) dotted in its law's
colour; log scale, since laws and controls differ by orders of magnitude.
:func:`drift_series` returns the numbers drawn, so a test checks the data
behind the figure, not the file's size.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

Series = dict[str, tuple[list[int], list[float]]]


def drift_series(history: Sequence[Mapping[str, Any]]) -> dict[str, Series]:
    """``{"eps"|"control"|"pred": {family: (steps, values)}}`` of the per-family keys in ``history``."""
    out: dict[str, Series] = {"eps": {}, "control": {}, "pred": {}}
    for rec in history:
        step = rec.get("step")
        for key, v in rec.items():
            kind, _, family = key.partition("/")
            if kind in out and family and "@" not in family and isinstance(v, (int, float)) and math.isfinite(v):
                xs, ys = out[kind].setdefault(family, ([], []))
                xs.append(int(step))
                ys.append(float(v))
    return out


def plot_drift(history: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, title: str,
               inputs: Sequence[str | os.PathLike] = ()) -> dict[str, Series]:
    """Write the figure of ``history`` (per-family records) to ``path`` (PNG, PDF, SVG…, atomic); returns what it drew.

    ``path`` is refused when it is, or lies inside, one of ``inputs`` (the checkpoints read).
    """
    from flowgeom.report.figures import new_figure, check_figure_path
    from flowgeom.runs import atomic_write_figure

    path = check_figure_path(path)
    series = drift_series(history)
    fig = new_figure((6.4, 3.9))
    ax = fig.subplots()
    colours = {}
    for i, (fam, (x, y)) in enumerate(sorted(series["eps"].items())):
        pos = [(a, b) for a, b in zip(x, y) if b > 0]  # log axis: ε = 0 at step 0 is not drawn
        line, = ax.plot([a for a, _ in pos], [b for _, b in pos], lw=1.6, label=f"law {fam}")
        colours[fam] = line.get_color()
    for j, (fam, (x, y)) in enumerate(sorted(series["control"].items())):
        pos = [(a, b) for a, b in zip(x, y) if b > 0]
        # the colours after the laws' (a control is per matrix, not per law family), thin and dashed
        ax.plot([a for a, _ in pos], [b for _, b in pos], ls="--", lw=1.0, color=f"C{(len(colours) + j) % 10}",
                alpha=0.8, label=f"control {fam}")
    for fam, (x, y) in sorted(series["pred"].items()):
        pos = [(a, b) for a, b in zip(x, y) if b > 0]
        ax.plot([a for a, _ in pos], [b for _, b in pos], ls=":", lw=2.0, color=colours.get(fam, "k"),
                label=f"predicted {fam}")
    if any(b > 0 for kind in series.values() for _, ys in kind.values() for b in ys):
        ax.set_yscale("log")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("ε (relative change since θ_0)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    # in the format the extension names (report.figures.save writes PNG whatever the name)
    atomic_write_figure(path, fig, inputs=inputs, dpi=110, bbox_inches="tight")
    return series
