"""The end-of-training figure: ε against step per law family, its controls, and the predicted drift.

Laws are solid lines, controls (‖W‖²_F of the matrices the laws read) thin
and dashed, Kunin et al.'s predicted drift (when there is one) dotted in its law's
colour; log scale, since laws and controls differ by orders of magnitude.
:func:`drift_series` returns the numbers drawn, so a test checks the data
behind the figure, not the file's size.

The title is whole and inside the saved image: it is the figure's
``suptitle``, re-wrapped until its rendered width fits the figure, under a
constrained layout that makes room for its height; the figure is saved at its
own size (no tight bounding box that would change it), so what is laid out is
what is written (:func:`drift_figure` returns the figure for that check).
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


FIGSIZE = (6.4, 3.9)  # inches
DPI = 110
TITLE_SIZE = 9  # points


def fit_title(fig, title: str, *, fontsize: float = TITLE_SIZE, margin: float = 0.96):
    """Set ``title`` as ``fig``'s suptitle, re-wrapped (never cut) until it is at most ``margin`` of the figure's width."""
    import textwrap

    lines = title.split("\n")
    width = max(len(line) for line in lines)
    while True:
        text = "\n".join(w for line in lines for w in (textwrap.wrap(line, width) or [""]))
        artist = fig.suptitle(text, fontsize=fontsize)
        if artist.get_window_extent().width <= margin * fig.bbox.width or width <= 16:
            return artist
        width = max(16, int(width * 0.85))


def drift_figure(history: Sequence[Mapping[str, Any]], *, title: str):
    """``(figure, series)``: the figure of ``history`` (per-family records), laid out at its saved size."""
    from flowgeom.report.figures import new_figure

    series = drift_series(history)
    fig = new_figure(FIGSIZE)
    fig.set_dpi(DPI)
    fig.set_layout_engine("constrained")
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
    fit_title(fig, title)
    ax.legend(fontsize=6, ncol=2)
    return fig, series


def plot_drift(history: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, title: str,
               inputs: Sequence[str | os.PathLike] = ()) -> dict[str, Series]:
    """Write the figure of ``history`` (per-family records) to ``path`` (PNG, PDF, SVG…, atomic); returns what it drew.

    ``path`` is refused when it is, or lies inside, one of ``inputs`` (the checkpoints read).
    """
    from flowgeom.report.figures import check_figure_path
    from flowgeom.runs import atomic_write_figure

    path = check_figure_path(path)
    fig, series = drift_figure(history, title=title)
    # in the format the extension names, at the figure's own size (the layout above is what is written)
    atomic_write_figure(path, fig, inputs=inputs, dpi=DPI)
    return series
