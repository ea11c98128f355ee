"""The drift grid of seed 000's experiment: regime × architecture × step size × seed, one run folder each.

``flowgeom conserve run`` is :func:`run_drift_grid` at one scale
(:data:`flowgeom.experiments.conservation.PRESETS`); the ``conservation.drift``
claim of ``flowgeom reproduce`` trains the same runs one at a time with
:func:`drift_row`, their configs from the same
:meth:`~flowgeom.experiments.conservation.ConservationPreset.run_config`.
Layout: ``OUT/REGIME/ARCH/lr=τ/seed=S/`` per run, ``OUT/figures/drift_REGIME.png``
per regime. A run that diverges is kept as a row flagged ``diverged`` with its
message; the others still run.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.experiments import conservation
from flowgeom.experiments.conservation import ARCHS, ConservationConfig, ConservationPreset, with_arch
from flowgeom.laws.locate import FlowgeomWarning
from flowgeom.runs import RunFolder, atomic_write_figure, out_folder


def drift_row(cfg: ConservationConfig, path: str | Path, *, resume: bool = False) -> dict[str, Any]:
    """Train one run into ``path`` (:func:`~flowgeom.experiments.conservation.run_conservation`) as a table row.

    The row holds the final ε per family and control (no per-block keys), the
    run's flags and ``uncovered`` (``[{block, reason}]``: blocks no law
    covers, not measured); a run that diverged is ``{"diverged": True,
    "message": …}`` instead.
    """
    row: dict[str, Any] = {"path": str(path)}
    try:
        summary = conservation.run_conservation(cfg, path, resume=resume)
        row.update({k: v for k, v in summary["final"].items() if "@" not in k})
        row["uncovered"] = summary.get("uncovered", [])
    except FlowgeomError as exc:
        if "diverged" not in str(exc):
            raise
        row.update({"diverged": True, "message": str(exc)})
    return row


def run_grid(base: ConservationConfig, out: str | Path, *, archs: Sequence[str], lrs: Sequence[float],
             seeds: Sequence[int], resume: bool = False,
             progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """architecture × lr × seed around ``base``, one run folder each: ``out/ARCH/lr=τ/seed=S``.

    Returns one row per run: arch, lr, seed, path, then :func:`drift_row`'s keys.
    """
    rows = []
    for arch in archs:
        for lr in lrs:
            for seed in seeds:
                cfg = with_arch(base, arch, lr=lr, seed=seed)
                # a link planted on the way (an unfinished grid from someone else) is refused, not followed
                path = out_folder(out, Path(out) / arch / f"lr={lr:g}" / f"seed={seed}", "run folder")
                if progress:
                    progress(f"{arch} lr={lr:g} seed={seed}")
                rows.append({"arch": arch, "lr": lr, "seed": seed, **drift_row(cfg, path, resume=resume)})
    return rows


def run_drift_grid(preset: ConservationPreset, out: str | Path, *, archs: Sequence[str],
                   lrs: Sequence[float] | None = None, seeds: Sequence[int] | None = None,
                   regimes: Sequence[str] | None = None, text: str | None = None, images: str | None = None,
                   resume: bool = False, progress: Callable[[str], None] | None = None,
                   **changes: Any) -> dict[str, Any]:
    """Every run of one scale's grid, the figure of each regime and the verdict per law family.

    ``lrs``, ``seeds`` (the seeds themselves) and ``regimes`` default to the
    preset's (``range(preset.seeds)``); ``changes`` are
    :class:`~flowgeom.experiments.conservation.ConservationConfig` fields for
    every run (``steps`` defaults to the preset's); ``text`` / ``images`` the LM /
    ViT data (``None``: KJV / MNIST). The FlowgeomWarnings of blocks no law
    covers are held back per run and returned once, under ``uncovered``.

    Returns ``{"out", "config", "runs", "figures", "uncovered", "verdict"}``
    (the payload of ``flowgeom conserve run --json``); runs that diverged are
    rows with ``diverged`` and their message.
    """
    unknown = [a for a in archs if a not in ARCHS]
    if unknown or not archs:
        raise choice_error("architecture", unknown[0] if unknown else "(none)", ARCHS)
    lrs = list(preset.lrs if lrs is None else lrs)
    seeds = list(range(preset.seeds) if seeds is None else seeds)
    regimes = list(preset.regimes if regimes is None else regimes)
    base = preset.base(regime="sgd", **changes)
    out = Path(out)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowgeomWarning)
        for regime in regimes:
            for arch in archs:
                data = images if ARCHS[arch]["task"] == "vit" else text
                cfg = preset.base(regime=regime, **changes, data=data or "default")
                for row in run_grid(cfg, out_folder(out, out / regime, "run folder"), archs=[arch], lrs=lrs,
                                    seeds=seeds, resume=resume,
                                    progress=None if progress is None else lambda m, r=regime: progress(f"{r} {m}")):
                    rows.append({"regime": regime, **row})
    figures, folder = {}, out_folder(out, out / "figures", "figures folder")
    for regime in regimes:
        what = "full-batch GD" if regime == "gd" else "mini-batch SGD"
        figures[regime] = str(plot_grid([r for r in rows if r["regime"] == regime],
                                        folder / f"drift_{regime}.png", title=f"{what}, {base.optimizer}"))
    return {"out": str(out), "config": dataclasses.asdict(base), "runs": rows, "figures": figures,
            "uncovered": uncovered(rows), "verdict": grid_verdict(rows, base)}


def uncovered(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The distinct ``[{block, reason}]`` of every run (blocks no law covers: not measured)."""
    seen: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows:
        for u in r.get("uncovered", []):
            seen.setdefault((u["block"], u["reason"]), u)
    return list(seen.values())


def grid_verdict(rows: Sequence[dict[str, Any]], base: ConservationConfig) -> dict[str, Any]:
    """Held / broken per law family at each run's last step (added to each row as ``verdicts``), and one line
    with the optimiser's expected behaviour: ``{"optimizer", "line"}``."""
    from flowgeom.laws.verdict import family_verdicts, info_of_kind, summary_line

    kind = {"sgd": "sgd+wd" if base.weight_decay else "sgd", "momentum": "momentum", "adam": "adam"}[base.optimizer]
    info = info_of_kind(kind, lr=None)
    verdicts = []
    for r in rows:
        if not r.get("diverged"):
            r["verdicts"] = [v.as_dict() for v in family_verdicts(r)]
            verdicts += family_verdicts(r)
    line = summary_line(verdicts, info).replace("flowgeom: ", f"flowgeom: {len(rows)} run(s), per run and family: ", 1)
    return {"optimizer": info.as_dict(), "line": line}


def mean_of(record: Mapping[str, Any], kind: str) -> float:
    """Mean over the families of one kind (``eps``, ``control``, ``refuted``) of a record; NaN if it has none."""
    vals = [v for k, v in record.items() if k.startswith(kind + "/") and "@" not in k]
    return sum(vals) / len(vals) if vals else float("nan")


def plot_grid(rows: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """One panel per architecture: mean ε over law families (solid) and controls (dashed), one colour per lr."""
    from matplotlib import rcParams
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend switch

    archs = list(dict.fromkeys(r["arch"] for r in rows))
    lrs = sorted({r["lr"] for r in rows})
    cols = min(4, len(archs))
    n_rows = -(-len(archs) // cols)
    fig = Figure(figsize=(3.6 * cols, 2.9 * n_rows))
    axes = fig.subplots(n_rows, cols, squeeze=False)
    colours = rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, arch in zip(axes.flat, archs):
        for i, lr in enumerate(lrs):
            for r in (r for r in rows if r["arch"] == arch and r["lr"] == lr and not r.get("diverged")):
                ms = [m for m in RunFolder(r["path"]).metrics() if m["step"] > 0 and "diverged" not in m]
                steps = [m["step"] for m in ms]
                ax.plot(steps, [mean_of(m, "eps") for m in ms], "-", color=colours[i % len(colours)], lw=1,
                        label=f"laws τ={lr:g}" if r["seed"] == rows[0]["seed"] else None)
                ax.plot(steps, [mean_of(m, "control") for m in ms], "--", color=colours[i % len(colours)], lw=1,
                        label=f"controls τ={lr:g}" if r["seed"] == rows[0]["seed"] else None)
        ax.set_yscale("log")
        ax.set_title(arch, fontsize=9)
        ax.set_xlabel("step k", fontsize=8)
    for ax in list(axes.flat)[len(archs):]:
        ax.axis("off")
    axes.flat[0].set_ylabel("ε(k)")
    if axes.flat[0].get_legend_handles_labels()[0]:
        axes.flat[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return atomic_write_figure(path, fig, dpi=100)
