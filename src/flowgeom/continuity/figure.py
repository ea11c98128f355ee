"""Heatmap of cross-layer alignment: roles x layer pairs, v1 (input) and u1 (output).

Each cell is ``|cos|`` for one adjacent pair (first distance); the colour scale
is shared, and every row label carries the role's ratio to its random baseline.
Rendered with matplotlib's Agg backend to PNG/PDF/SVG bytes; the caller writes
them atomically (nothing is written if rendering fails).
"""

from __future__ import annotations

import io
from pathlib import Path

from flowgeom.errors import FlowgeomError

FORMATS = ("png", "pdf", "svg")


def heatmap_bytes(report: dict, *, fmt: str = "png") -> bytes:
    """The figure for an :func:`~flowgeom.continuity.analyze` report, as ``fmt`` bytes."""
    if fmt not in FORMATS:
        raise FlowgeomError(f"unknown figure format {fmt!r}; name the file .png, .pdf or .svg")
    import numpy as np
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend switch

    roles = list(report["roles"])
    first = report["config"]["distances"][0]
    width = max(len(r["layers"]) for r in report["roles"].values()) - first
    fig = Figure(figsize=(max(6.0, 0.25 * width + 3) * 2 / 1.6, 0.45 * len(roles) + 1.6), constrained_layout=True)
    axes = fig.subplots(1, 2)
    for ax, key, title in ((axes[0], "v1", "input space: |cos v1|"), (axes[1], "u1", "output space: |cos u1|")):
        grid = np.full((len(roles), width), np.nan)
        for i, role in enumerate(roles):
            pairs = [p for p in report["roles"][role]["pairs"] if p["distance"] == first]
            for j, p in enumerate(pairs[:width]):
                grid[i, j] = p[key]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", interpolation="nearest")
        labels = [f"{r} ({report['roles'][r][key + '_ratio']:.0f}x)" for r in roles]
        ax.set_yticks(range(len(roles)), labels)
        ax.set_xlabel(f"layer pair (l, l+{first})")
        ax.set_title(title)
    fig.colorbar(im, ax=axes, shrink=0.8, label="|cos|")
    fig.suptitle(f"{report['source']}: row labels give mean |cos| / random baseline")
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=120)
    return buf.getvalue()


def figure_format(path: str | Path) -> str:
    """Format from the file suffix, checked before any work is done."""
    fmt = Path(path).suffix.lstrip(".").lower()
    if fmt not in FORMATS:
        raise FlowgeomError(f"--figure {path}: unknown format {fmt or '(none)'!r}; use a .png, .pdf or .svg name")
    return fmt
