"""Figures of the continuity experiments (matplotlib, Agg), read from run folders' records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flowgeom.continuity.dynamics import series
from flowgeom.report.figures import new_figure
from flowgeom.runs import atomic_write_figure


def _save(fig, path: str | Path) -> Path:
    return atomic_write_figure(path, fig, dpi=120, bbox_inches="tight")


def _positive(values: list[float]) -> list[float]:
    """Values for a log axis: non-positive ones (ΔW = 0 at step 0) become NaN gaps."""
    return [v if v > 0 else float("nan") for v in values]


def plot_ablation_curves(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, *,
                         role: str = "hidden") -> Path:
    """Weight v1, gradient v1 and ||ΔW||/||W(0)|| against steps, one line per variant.

    ``runs`` maps a variant name to its metrics.jsonl records.
    """
    fig = new_figure((15, 4))
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
    fig = new_figure((4 * len(panels), 4))
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


def _colours(names: Sequence[str]) -> dict[str, Any]:
    """One colour per name, in order of first appearance: tab20's ten dark shades first, then its light ones
    (enough for the 13 ablation variants)."""
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    order = list(range(0, 20, 2)) + list(range(1, 20, 2))
    return {name: cmap(order[i % 20]) for i, name in enumerate(dict.fromkeys(names))}


def draw_trajectories(runs: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], *, role: str = "hidden",
                      tail: float = 0.25):
    """Figure: weight ``v1`` (left) and gradient ``v1`` (right) against step, one line per run, chance dotted.

    ``runs`` is a list of ``(variant, metrics records)``; runs of one variant
    (seeds) share a colour and a legend entry. The shaded band on the weight
    panel is the last ``tail`` fraction of the steps, over which the plateau is
    judged.
    """
    fig = new_figure((13, 4.6))
    ax_w, ax_g = fig.subplots(1, 2, sharey=True)
    colours = _colours([name for name, _ in runs])
    labelled: set[str] = set()
    chance, last = None, None
    for name, records in runs:
        recs = [r for r in records if role in (r.get("continuity") or {})]
        if not recs:
            continue
        label = None if name in labelled else name
        labelled.add(name)
        for ax, kind in ((ax_w, "weight"), (ax_g, "grad")):
            steps, values = series(recs, role, kind, "v1")
            ax.plot(steps, values, color=colours[name], ls="-" if kind == "weight" else "--", lw=1.4, label=label)
        chance = recs[-1]["continuity"][role]["v1_baseline"]
        first, end = int(recs[0]["step"]), int(recs[-1]["step"])
        last = (first, end) if last is None else (min(last[0], first), max(last[1], end))
    for ax, title in ((ax_w, "weight continuity |cos v1| (solid)"), (ax_g, "gradient continuity |cos v1| (dashed)")):
        if chance is not None:
            ax.axhline(chance, color="grey", ls=":", lw=1.2, label=f"chance {chance:.3f}" if ax is ax_w else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylim(0, 1.02)
    if last is not None:
        ax_w.axvspan(last[1] - tail * (last[1] - last[0]), last[1], color="grey", alpha=0.12,
                     label=f"last {tail:.0%}: plateau window")
    ax_w.set_ylabel("|cos| adjacent layers (mean over pairs)")
    ax_w.legend(fontsize=7, ncol=2)
    fig.suptitle("Residual-MLP ablations on MNIST: continuity trajectories (seed 001)")
    return fig


def plot_trajectories(runs: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], path: str | Path, *,
                      role: str = "hidden", tail: float = 0.25) -> Path:
    """:func:`draw_trajectories` written to ``path`` (PNG, atomic)."""
    return _save(draw_trajectories(runs, role=role, tail=tail), path)


TRANSFER_CAPTION = ("crossing: first logged step where mean_l ||ΔW_l||/||W_l(0)|| >= 1; onset: first logged step "
                    "from which weight v1 stays >= chance + (final - chance)/2 (none if final < 1.5 × chance)")


def draw_transfer(rows: Sequence[Mapping[str, Any]]):
    """Figure of the gradient → weight transfer (seed 001, "Dinámicas de transferencia").

    ``rows`` have ``variant``, ``seed``, ``last_step``, ``dW>W0_step`` (the
    crossing, None: never) and ``w_onset_step`` (None: no onset). Left:
    onset against crossing for the runs that have both, with the line
    ``onset = crossing`` (points above it: weight continuity sets in after
    ``||ΔW||`` overtakes ``||W(0)||``). Right: one timeline per run over its
    logged steps, ▲ at the crossing, ● at the onset, and the runs without one
    named as such.
    """
    fig = new_figure((13, 0.42 * max(len(rows), 4) + 2.2))
    ax_s, ax_t = fig.subplots(1, 2, gridspec_kw={"width_ratios": (1, 1.4)})
    colours = _colours([r["variant"] for r in rows])
    both = [r for r in rows if r["dW>W0_step"] is not None and r["w_onset_step"] is not None]
    for r in both:
        ax_s.scatter([r["dW>W0_step"]], [r["w_onset_step"]], color=colours[r["variant"]], s=40, zorder=3)
        ax_s.annotate(r["variant"], (r["dW>W0_step"], r["w_onset_step"]), fontsize=7, xytext=(4, 3),
                      textcoords="offset points")
    top = max([r["last_step"] or 0 for r in rows] + [1])
    ax_s.plot([0, top], [0, top], color="grey", ls="--", lw=1, label="onset = crossing")
    ax_s.set_xlim(0, top * 1.05)
    ax_s.set_ylim(0, top * 1.05)
    ax_s.set_xlabel("step where ||ΔW|| overtakes ||W(0)||")
    ax_s.set_ylabel("onset of weight continuity (step)")
    ax_s.set_title("onset vs crossing (runs with both)", fontsize=10)
    ax_s.legend(fontsize=7, loc="upper left")
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        ax_t.plot([0, r["last_step"] or 0], [y, y], color=colours[r["variant"]], lw=2, alpha=0.5)
        if r["dW>W0_step"] is not None:
            ax_t.plot([r["dW>W0_step"]], [y], marker="^", color="k", ms=7, ls="none")
        if r["w_onset_step"] is not None:
            ax_t.plot([r["w_onset_step"]], [y], marker="o", color=colours[r["variant"]], mec="k", ms=7, ls="none")
        missing = [text for key, text in (("dW>W0_step", "||ΔW|| never > ||W(0)||"), ("w_onset_step", "no onset"))
                   if r[key] is None]
        if missing:
            ax_t.text(top * 1.02, y, "; ".join(missing), fontsize=7, va="center")
    ax_t.set_yticks(range(len(rows)))
    ax_t.set_yticklabels([f"{r['variant']} (seed {r['seed']})" for r in reversed(rows)], fontsize=7)
    ax_t.set_xlim(0, top * 1.45)
    ax_t.set_xlabel("step")
    ax_t.set_title("per run: ▲ ||ΔW|| overtakes ||W(0)||, ● onset of weight continuity", fontsize=10)
    fig.suptitle("Gradient → weight transfer (seed 001)")
    fig.text(0.5, -0.02, TRANSFER_CAPTION, ha="center", va="top", fontsize=7, wrap=True)
    return fig


def plot_transfer(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """:func:`draw_transfer` written to ``path`` (PNG, atomic)."""
    return _save(draw_transfer(rows), path)
