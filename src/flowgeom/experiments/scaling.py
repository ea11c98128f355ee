"""The O(τ²k) law of discrete gradient descent, measured (seed 000).

For a quadratic conservation law h and one GD step θ' = θ − τg with
⟨∇h(θ), g⟩ = 0, h(θ') − h(θ) = τ²·q(g) exactly (q the quadratic form of h),
so after k steps ε(k) = O(τ²k); a non-conserved control moves at first order,
O(τk). This experiment trains the LM on KJV with full-batch GD in float64 for
several step sizes τ and fits, with ordinary least squares on log-log axes,

- at fixed k = ``steps``: slope of ε against τ per law family (≈ 2) and per
  control (≈ 1);
- at fixed τ (``k_tau``): slope of ε(k) against k (≈ 1);
- τ_k = τ_0/(k+1): Σ τ_k² < ∞ keeps ε bounded (slope against k over the
  second half ≈ 0, against ≈ 1 for the constant τ_0);
- the normalised-sigmoid MoE router sum Σ_e W_e drifts at first order
  (slope ≈ 1), while the softmax one is a linear law, conserved by every GD
  step to round-off — the measured confirmation of the catalogue's finding.

Each fit is printed with a 95% confidence interval: slope ± t_{0.975, n−2}·SE
(``scipy.stats.linregress`` standard error). Every training run is one run
folder under ``out/ARCH/…``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flowgeom.errors import FlowgeomError
from flowgeom.experiments.conservation import ARCHS, ConservationConfig, run_conservation
from flowgeom.experiments.presets import preset as resolve
from flowgeom.experiments.presets import scales
from flowgeom.runs import RunFolder, atomic_write_figure, atomic_write_json, out_folder

ROUNDOFF = 1e-12  # ε below this is float64 round-off: no slope is fitted


@dataclass(frozen=True)
class Fit:
    """log y = slope · log x + b, with a 95% t-interval on the slope."""

    slope: float
    stderr: float
    low: float
    high: float
    n: int
    r2: float

    def __str__(self) -> str:
        return f"{self.slope:.3f} [{self.low:.3f}, {self.high:.3f}] (n={self.n}, r²={self.r2:.4f})"


def loglog_fit(x: Sequence[float], y: Sequence[float], *, confidence: float = 0.95) -> Fit | None:
    """OLS slope of log y on log x with its t-interval; ``None`` when y is at round-off or < 3 points."""
    from scipy import stats

    pts = [(a, b) for a, b in zip(x, y) if a > 0 and b > ROUNDOFF and math.isfinite(b)]
    if len(pts) < 3:
        return None
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    res = stats.linregress(lx, ly)
    half = float(stats.t.ppf(0.5 + confidence / 2, len(pts) - 2)) * float(res.stderr)
    return Fit(float(res.slope), float(res.stderr), float(res.slope) - half, float(res.slope) + half, len(pts),
               float(res.rvalue) ** 2)


@dataclass(frozen=True)
class ScalingConfig:
    archs: tuple[str, ...] = ("mha-rope-swiglu", "moe-dense-softmax", "moe-dense-sigmoid")
    taus: tuple[float, ...] = (0.04, 0.02, 0.01, 0.005, 0.0025)  # step sizes τ
    steps: int = 40              # k at which the τ-slope is fitted
    k_tau: float | None = None   # τ of the k-slope (default: the middle τ)
    decay_steps: int = 80        # length of the constant-vs-inverse schedule runs (τ_0 = max τ); ≥ 4
    data: str = "default"        # kjv | text path
    corpus_chars: int = 50_000
    d_model: int = 16
    n_layers: int = 1
    heads: int = 2
    d_k: int = 8
    d_hidden: int = 32
    experts: int = 3
    seq_len: int = 16
    batch: int = 16
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self):
        unknown = [a for a in self.archs if a not in ARCHS or ARCHS[a]["task"] != "lm"]
        if unknown or not self.archs:
            raise FlowgeomError(f"scaling archs must be LM architectures, got {unknown or 'none'}; "
                                f"choose from {', '.join(a for a in ARCHS if a != 'vit')}")
        if len(self.taus) < 3 or min(self.taus) <= 0:
            raise FlowgeomError(f"need at least 3 positive step sizes for a slope, got {self.taus}")
        if self.steps < 3 or self.decay_steps < 4:
            raise FlowgeomError(f"steps (≥3) and decay_steps (≥4) too small: {self.steps}, {self.decay_steps}")

    def run_config(self, arch: str, **changes: Any) -> ConservationConfig:
        base = dict(steps=self.steps, checkpoint_every=10_000)
        return ConservationConfig.for_arch(
            arch, data=self.data, corpus_chars=self.corpus_chars, d_model=self.d_model, n_layers=self.n_layers,
            heads=self.heads, d_k=self.d_k, d_hidden=self.d_hidden, experts=self.experts, seq_len=self.seq_len,
            batch=self.batch, seed=self.seed, device=self.device, full_batch=True, dtype="float64", log_every=1,
            **{**base, **changes})


# quick (the defaults): three LM architectures at k = 40 on a 16-wide model (under a minute on 2 cores).
# decay_steps 80 is what the quick claim (`reproduce --quick`) and `make demo` have always trained; the 160 this
# preset once had was never what a claim ran.
QUICK = ScalingConfig()
# full: every LM architecture, 7 step sizes, k = 200 on a 4-layer 128-wide model over the whole corpus.
FULL = ScalingConfig(archs=tuple(a for a in ARCHS if a != "vit"), taus=(0.16, 0.08, 0.04, 0.02, 0.01, 0.005, 0.0025),
                     steps=200, decay_steps=2000, corpus_chars=0, d_model=128, n_layers=4, heads=4, d_k=32,
                     d_hidden=256, experts=4, seq_len=64, batch=256)
# cpu = quick: the slopes need short runs only (k = 40), and the quick model already resolves them on 2 cores in
# under a minute; the full model is a GPU job. The claims have no cpu grid for the fit (`reproduce --cpu` leaves
# them out).
CPU = QUICK
PRESETS = scales(quick=QUICK, cpu=CPU, full=FULL)


def _groups(metrics: Sequence[Mapping[str, Any]]) -> list[str]:
    return sorted(k for k in metrics[-1] if "/" in k and "@" not in k and not k.startswith("wd/"))


def _law_mean(record: Mapping[str, Any]) -> float:
    vals = [v for k, v in record.items() if k.startswith("eps/") and "@" not in k and k != "eps/moe.router_sum"]
    return float(np.mean(vals))


DIVERGED_EPS = 1.0  # a law's relative error ≥ 1: the quantity left its conserved value, no O(τ²k) regime left


def _refuse_diverged(arch: str, curves: Mapping[float, Sequence[Mapping[str, Any]]]) -> None:
    """The divergence policy of the experiment: a diverged τ-run ends the experiment with one FlowgeomError.

    A run diverged when a law's relative error ε reaches :data:`DIVERGED_EPS` or any recorded ε is not finite
    (a non-finite loss already raised in :func:`run_conservation`). Fitting slopes through such runs gives
    numbers without meaning, so none are returned.
    """
    for tau, metrics in curves.items():
        for m in metrics:
            bad = {k: v for k, v in m.items() if "/" in k and isinstance(v, float) and not math.isfinite(v)}
            bad |= {k: v for k, v in m.items() if k.startswith("eps/") and isinstance(v, float) and v >= DIVERGED_EPS}
            if bad:
                key = sorted(bad)[0]
                raise FlowgeomError(f"scaling run {arch} τ={tau:g} diverged at step {m['step']}: {key} = "
                                    f"{bad[key]:.3g} (a law's relative error ≥ {DIVERGED_EPS:g} leaves the O(τ²k) "
                                    "regime, so no slope is fitted); give smaller step sizes (--tau)")


def run_scaling(cfg: ScalingConfig, out: str | Path, *, resume: bool = False,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every run of the experiment, the fits and the figure; written to ``out/scaling.json``."""
    out = Path(out)
    result: dict[str, Any] = {"config": dataclasses.asdict(cfg), "archs": {}}
    k_tau = cfg.k_tau or sorted(cfg.taus)[len(cfg.taus) // 2]
    for arch in cfg.archs:
        curves = {}
        for tau in sorted(set(cfg.taus) | {k_tau}):
            if progress:
                progress(f"{arch} τ={tau:g}")
            path = out_folder(out, out / arch / f"tau={tau:g}", "run folder")  # a planted link: refused
            run_conservation(cfg.run_config(arch, lr=tau), path, resume=resume)
            curves[tau] = RunFolder(path).metrics()
            _refuse_diverged(arch, {tau: curves[tau]})  # before spending time on the other step sizes
        final = {tau: curves[tau][-1] for tau in cfg.taus}
        fits_tau = {g: loglog_fit(cfg.taus, [final[t][g] for t in cfg.taus]) for g in _groups(curves[cfg.taus[0]])}
        fits_tau["eps/all laws"] = loglog_fit(cfg.taus, [_law_mean(final[t]) for t in cfg.taus])
        ks = [m["step"] for m in curves[k_tau] if m["step"] >= 2]
        fits_k = {g: loglog_fit(ks, [m[g] for m in curves[k_tau] if m["step"] >= 2]) for g in _groups(curves[k_tau])}
        result["archs"][arch] = {
            "tau_fits": {g: _as_dict(f) for g, f in fits_tau.items()},
            "k_fits": {g: _as_dict(f) for g, f in fits_k.items()},
            "final": {f"{t:g}": {g: final[t][g] for g in _groups(curves[cfg.taus[0]])} for t in cfg.taus},
            "curve_k": [{"step": m["step"], "eps": _law_mean(m)} for m in curves[k_tau]],
        }
    result["k_tau"] = k_tau
    result["schedules"] = _schedules(cfg, out, resume=resume, progress=progress)
    result["router"] = _router_summary(result)
    figures = out_folder(out, out / "figures", "figures folder")
    result["figure"] = str(plot_scaling(result, cfg, figures / "scaling.png"))
    atomic_write_json(out / "scaling.json", result, root=out)
    return result


def _schedules(cfg: ScalingConfig, out: Path, *, resume: bool, progress) -> dict[str, Any]:
    """Constant τ_0 against τ_k = τ_0/(k+1) on the first architecture."""
    arch, tau0 = cfg.archs[0], max(cfg.taus)
    curves = {}
    for schedule in ("constant", "inverse"):
        if progress:
            progress(f"{arch} schedule {schedule} τ0={tau0:g}")
        path = out_folder(out, out / arch / f"schedule={schedule}", "run folder")
        run_conservation(cfg.run_config(arch, lr=tau0, schedule=schedule, steps=cfg.decay_steps), path, resume=resume)
        curves[schedule] = [(m["step"], _law_mean(m)) for m in RunFolder(path).metrics()]
    half = cfg.decay_steps // 2
    summary = {}
    for schedule, curve in curves.items():
        tail = [(k, e) for k, e in curve if k >= half]
        fit = loglog_fit([k for k, _ in tail], [e for _, e in tail])
        summary[schedule] = {"eps_half": dict(curve)[half], "eps_end": curve[-1][1], "k_fit_second_half": _as_dict(fit),
                             "curve": [{"step": k, "eps": e} for k, e in curve]}
    summary["tau0"], summary["arch"] = tau0, arch
    return summary


def _router_summary(result: Mapping[str, Any]) -> dict[str, Any]:
    """The gate quantity Σ_e W_e: τ-slope for sigmoid (refuted law), size for softmax (a law)."""
    rows = {}
    for arch, r in result["archs"].items():
        for key in ("refuted/moe.router_sum", "eps/moe.router_sum"):
            vals = [v[key] for v in r["final"].values() if key in v]
            if vals:
                rows[arch] = {"key": key, "tau_fit": r["tau_fits"].get(key), "max_eps": max(vals)}
    return rows


def _as_dict(fit: Fit | None) -> dict[str, float] | None:
    return dataclasses.asdict(fit) if fit is not None else None


def plot_scaling(result: Mapping[str, Any], cfg: ScalingConfig, path: Path) -> Path:
    """Four panels: ε vs τ at fixed k, ε vs k at fixed τ, constant vs inverse schedule, router sums vs τ."""
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend switch

    fig = Figure(figsize=(10, 7.5))
    axes = fig.subplots(2, 2)
    taus = sorted(cfg.taus)
    first = result["archs"][cfg.archs[0]]
    ax = axes[0, 0]
    for g, fit in first["tau_fits"].items():
        if fit is None or g == "eps/all laws":
            continue
        ys = [first["final"][f"{t:g}"][g] for t in taus]
        ax.loglog(taus, ys, "o" + ("--" if g.startswith("control/") else "-"), label=f"{g}: {fit['slope']:.2f}")
    ax.set(xlabel="step size τ", ylabel=f"ε at k={cfg.steps}", title=f"{cfg.archs[0]}: slope in τ")
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    for arch, r in result["archs"].items():
        c = [m for m in r["curve_k"] if m["step"] >= 1]
        ax.loglog([m["step"] for m in c], [m["eps"] for m in c], label=arch)
    ax.set(xlabel="step k", ylabel="mean ε over law families", title=f"fixed τ={result['k_tau']:g}: slope in k")
    ax.legend(fontsize=7)
    ax = axes[1, 0]
    for schedule in ("constant", "inverse"):
        c = [m for m in result["schedules"][schedule]["curve"] if m["step"] >= 1]
        ax.loglog([m["step"] for m in c], [m["eps"] for m in c], label=f"{schedule} (τ0={result['schedules']['tau0']:g})")
    ax.set(xlabel="step k", ylabel="mean ε over law families", title="τ_k = τ0/(k+1) keeps ε bounded")
    ax.legend(fontsize=7)
    ax = axes[1, 1]
    for arch, row in result["router"].items():
        ys = [max(result["archs"][arch]["final"][f"{t:g}"][row["key"]], 1e-17) for t in taus]
        fit = row["tau_fit"]
        ax.loglog(taus, ys, "o-", label=f"{arch} {row['key']}" + (f": {fit['slope']:.2f}" if fit else " (round-off)"))
    ax.set(xlabel="step size τ", ylabel=f"ε at k={cfg.steps}", title="router sum Σ_e W_e: sigmoid vs softmax")
    if result["router"]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no MoE architecture in this run", ha="center", transform=ax.transAxes)
    from matplotlib.ticker import NullFormatter

    for ax in axes.flat:
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor log ticks overlap on short τ ranges
    fig.tight_layout()
    return atomic_write_figure(path, fig, dpi=110)


def quick_demo(out_dir: str | Path, *, threads: int | None = 1,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The quick experiment on one architecture (for ``make demo``).

    Returns the fitted τ-slope of the laws (≈ 2) and of the ‖W_Q‖² control
    (≈ 1), the scaling figure and one run's ε(k) drift figure. ``threads``
    sets torch's CPU threads for the call (restored after; 1 is fastest for
    these small models); finished runs under ``out_dir`` are reused.
    """
    import torch

    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        cfg = resolve(PRESETS, "quick", archs=("mha-rope-swiglu",))
        result = run_scaling(cfg, out_dir, resume=True, progress=progress)
    finally:
        torch.set_num_threads(saved)
    fits = result["archs"]["mha-rope-swiglu"]["tau_fits"]
    drift = Path(out_dir) / "mha-rope-swiglu" / f"tau={result['k_tau']:g}" / "figures" / "drift.png"
    return {"tau_slope": fits["eps/all laws"], "control_slope": fits.get("control/norm.q_proj"),
            "figure": result["figure"], "drift_figure": str(drift), "out": str(out_dir)}
