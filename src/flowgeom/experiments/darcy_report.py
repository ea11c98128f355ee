"""Summary, convergence-rate table and figures of a Darcy run (reads only its metrics)."""

from __future__ import annotations

import math
from typing import Any

from flowgeom.langevin.rate import hitting_times
from flowgeom.runs import RunFolder, atomic_write_figure

KEYS = ("train_rmse", "test_rmse", "test_rel_l2", "train_rel_l2", "gap", "wq_norm", "wk_norm")


def _series(metrics: list[dict[str, Any]], reg: str, key: str) -> tuple[list[int], list[float]]:
    rows = [m for m in metrics if m.get("reg") == reg and key in m]
    return [m["step"] for m in rows], [m[key] for m in rows]


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    mean = sum(xs) / len(xs)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / max(1, len(xs) - 1))


def summarise(cfg, metrics: list[dict[str, Any]], results: dict[str, Any]) -> dict[str, Any]:
    """Final numbers per arm, plus norm growth and the gap's mean/std over the second half of phase 2."""
    pre = [m for m in metrics if m.get("phase") == "pretrain"]
    summary: dict[str, Any] = {"pretrain": {k: pre[-1][k] for k in (*KEYS, "train_mse_norm")} if pre else {}}
    arms = {}
    for reg in cfg.regs:
        rows = [m for m in metrics if m.get("reg") == reg and "test_rmse" in m]
        arm: dict[str, Any] = dict(results.get(reg, {"status": "missing"}))
        if rows:
            last = rows[-1]
            arm.update({k: last[k] for k in KEYS})
            half = [m["gap"] for m in rows[len(rows) // 2 :]]
            arm["gap_mean_2nd_half"], arm["gap_std_2nd_half"] = _mean_std(half)
            arm["gap_drift"] = rows[-1]["gap"] - rows[len(rows) // 2]["gap"]
            for key in ("wq_norm", "wk_norm"):
                arm[f"{key}_start"] = rows[0][key]
                arm[f"{key}_max"] = max(m[key] for m in rows)
        arms[reg] = arm
    summary["arms"] = arms
    return summary


def convergence_rate(cfg, metrics: list[dict[str, Any]], l_star: float) -> dict[str, Any]:
    """Steps for the normalised train MSE to first reach ``L* + ε`` (``L*``: the pretrained model's train MSE).

    See :func:`flowgeom.langevin.rate.hitting_times` for the ε grid and the slope.
    """
    series = {}
    for reg in cfg.regs:
        steps, vals = _series(metrics, reg, "train_mse_norm")
        series[reg] = (steps, [v - l_star for v in vals])
    table = hitting_times(series)
    return {"l_star": l_star, **table, "steps": table["tau"]}


def figures(folder: RunFolder, summary: dict[str, Any]) -> list[str]:
    """``figures/darcy_norms.png``, ``darcy_errors.png``, ``darcy_rate.png``; returns their paths."""
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend switch

    metrics = folder.metrics()
    figures = folder.figures  # created; a planted link there is refused
    regs = list(summary["arms"])
    paths = []

    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    for reg in regs:
        for ax, key, name in ((axes[0], "wq_norm", "‖W_Q‖_F"), (axes[1], "wk_norm", "‖W_K‖_F")):
            ax.plot(*_series(metrics, reg, key), label=reg)
            ax.set_xlabel("Langevin step")
            ax.set_ylabel(name)
    axes[0].legend()
    fig.suptitle("Darcy: attention weight norms during Langevin training")
    paths.append(_save(fig, figures / "darcy_norms.png"))

    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 2)
    for reg in regs:
        axes[0].plot(*_series(metrics, reg, "test_rmse"), label=reg)
        axes[1].plot(*_series(metrics, reg, "gap"), label=reg)
    axes[0].set_ylabel("test RMSE")
    axes[1].set_ylabel("gap = test RMSE − train RMSE")
    for ax in axes:
        ax.set_xlabel("Langevin step")
        ax.legend()
    paths.append(_save(fig, figures / "darcy_errors.png"))

    rate = summary.get("rate") or {}
    if rate.get("eps"):
        fig = Figure(figsize=(5, 4))
        ax = fig.subplots()
        for reg, hits in rate["steps"].items():
            pts = [(x, h) for x, h in zip(rate["log_inv_eps"], hits) if h is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=reg)
        ax.set_xlabel("log(1/ε)")
        ax.set_ylabel("steps to train MSE ≤ L* + ε")
        ax.legend()
        paths.append(_save(fig, figures / "darcy_rate.png"))
    return paths


def _save(fig, path) -> str:
    fig.tight_layout()
    return str(atomic_write_figure(path, fig, dpi=100))
