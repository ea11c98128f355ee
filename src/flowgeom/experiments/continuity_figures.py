"""Figures of the continuity experiments (matplotlib, Agg), read from run folders' records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowgeom.continuity.dynamics import series
from flowgeom.runs import atomic_write_bytes


def _figure(figsize: tuple[float, float]):
    """A bare :class:`matplotlib.figure.Figure` (object API: no pyplot, no global backend switch)."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize)


def _save(fig, path: str | Path) -> Path:
    import io

    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".") or "png", dpi=120, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())
    return path


def _positive(values: list[float]) -> list[float]:
    """Values for a log axis: non-positive ones (ΔW = 0 at step 0) become NaN gaps."""
    return [v if v > 0 else float("nan") for v in values]


def plot_ablation_curves(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, *,
                         role: str = "hidden") -> Path:
    """Weight v1, gradient v1 and ||ΔW||/||W(0)|| against steps, one line per variant.

    ``runs`` maps a variant name to its metrics.jsonl records.
    """
    fig = _figure((15, 4))
    axes = fig.subplots(1, 3)
    panels = (("weight", "v1", "weight continuity |cos v1|"), ("grad", "v1", "gradient continuity |cos v1|"),
              (None, "dw_ratio", "||ΔW|| / ||W(0)||"))
    baseline = None
    for name, records in runs.items():
        for ax, (kind, metric, title) in zip(axes, panels):
            steps, values = series(records, role, kind, metric)
            ax.plot(steps, _positive(values) if kind is None else values, label=name)
            ax.set_title(title)
            ax.set_xlabel("step")
        recs = [r for r in records if "continuity" in r]
        if recs:
            baseline = recs[-1]["continuity"][role]["v1_baseline"]
    if baseline is not None:
        for ax in axes[:2]:
            ax.axhline(baseline, color="grey", ls=":", label="chance")
            ax.set_ylim(0, 1.02)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle("Residual-MLP ablations on MNIST: where continuity comes from")
    path = _save(fig, path)
    return path


def plot_roles(records: Sequence[Mapping[str, Any]], path: str | Path, *, roles: Sequence[str] | None = None) -> Path:
    """Per role: weight v1/u1, gradient v1/u1 and ||ΔW||/||W(0)|| against steps (LM runs)."""
    recs = [r for r in records if "continuity" in r]
    roles = list(roles or (recs[0]["continuity"] if recs else []))
    panels = (("weight", "v1", "weight v1 (input space)"), ("weight", "u1", "weight u1 (output space)"),
              ("grad", "v1", "gradient v1"), ("grad", "u1", "gradient u1"), (None, "dw_ratio", "||ΔW|| / ||W(0)||"))
    fig = _figure((4 * len(panels), 4))
    axes = fig.subplots(1, len(panels))
    for role in roles:
        for ax, (kind, metric, title) in zip(axes, panels):
            steps, values = series(recs, role, kind, metric)
            ax.plot(steps, _positive(values) if kind is None else values, label=role)
            ax.set_title(title)
            ax.set_xlabel("step")
    for ax in axes[:4]:
        ax.set_ylim(0, 1.02)
    axes[-1].set_yscale("log")
    axes[-1].axhline(1.0, color="grey", ls=":")
    axes[0].legend(fontsize=8)
    path = _save(fig, path)
    return path
