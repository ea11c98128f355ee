"""Convergence-rate experiment: time to ε-suboptimality against log(1/ε), regularised vs not.

Seed ``004_…``, Thm. 3.3: for a Villani loss the SDE reaches ``E[V] ≤ min V +
ε`` in ``O(log 1/ε)`` time (down to the floor set by the temperature).

Set-up: the small attention (or LoRA) regression of
:mod:`flowgeom.langevin.losses`; ``chains`` independent Langevin chains (one
``(chains, D)`` tensor, the loss ``vmap``-ed over chains) all start at
radius ``start_radius`` on random rays, where the unregularised loss is on a
saturated plateau. Each arm (``none``, ``log``, ``power``) runs the same
chains with the same noise. We record the chain-mean *unregularised* loss
``E[V₀(θ_t)]`` and the first time ``τ(ε)`` (in SDE time ``t = k·lr``) at
which ``E[V₀] − L* ≤ ε``, with ``L*`` the best of ``restarts`` Adam runs.
A linear ``τ`` against ``log(1/ε)`` is the ``O(log 1/ε)`` law; ``None``
means never reached within ``steps``.

Each arm is one :func:`~flowgeom.experiments.training.train_loop` (ticks
``0 … steps``, the mean recorded every ``record_every``); a chain that blows
up ends the experiment with the loop's divergence message as a
:class:`FlowgeomError` (there is no run folder to keep).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import vmap

from flowgeom.errors import FlowgeomError, choice_error, finite_number, positive_int
from flowgeom.experiments.presets import scales
from flowgeom.experiments.training import Diverged, Step, Tick, train_loop
from flowgeom.langevin import Langevin, Regularizer, objective
from flowgeom.langevin.optimizer import check_hyper
from flowgeom.langevin.rate import hitting_times
from flowgeom.langevin.regularizers import KINDS


@dataclass(frozen=True)
class RateConfig:
    loss: str = "attention"  # attention or lora
    chains: int = 128  # independent chains per arm
    start_radius: float = 30.0  # ‖θ_0‖ of every chain
    lr: float = 0.02  # Langevin step size
    temperature: float = 0.01  # Langevin temperature s
    steps: int = 3000  # steps per arm
    regs: tuple[str, ...] = ("none", "log", "power")  # arms
    lam: float = 0.01  # regulariser λ
    eps: float = 0.5  # power regulariser ε
    record_every: int = 10  # steps between recorded means
    restarts: int = 16  # Adam restarts for L*
    restart_steps: int = 1500  # Adam steps per restart
    seed: int = 0

    def __post_init__(self) -> None:
        if self.loss not in ("attention", "lora"):
            raise choice_error("loss", self.loss, ("attention", "lora"))
        object.__setattr__(self, "regs", tuple(self.regs))
        for reg in self.regs:
            if reg not in KINDS:
                raise choice_error("regulariser", reg, KINDS)
            if reg != "none":
                Regularizer(reg, lam=self.lam, eps=self.eps)
        check_hyper(self.lr, self.temperature)
        finite_number(self.start_radius, "start_radius", positive=True, fix="start the chains at a finite ‖θ_0‖")
        for name in ("chains", "steps", "record_every", "restarts", "restart_steps"):
            positive_int(getattr(self, name), name)


# One scale: every arm of the rate experiment takes seconds of CPU (~20 s a loss) and the seed states the
# O(log 1/ε) law without a larger protocol, so quick, cpu and full are the same configuration (the defaults).
# It has no reproduce claim; `flowgeom langevin rate` trains it (its flag defaults are these fields).
QUICK = CPU = FULL = RateConfig()
PRESETS = scales(quick=QUICK, cpu=CPU, full=FULL)


def best_loss(obj, *, restarts: int, seed: int, steps: int = 1500) -> float:
    """``L*``: the lowest unregularised loss over ``restarts`` Adam runs (vmapped)."""
    g = torch.Generator().manual_seed(seed + 10)
    theta = torch.randn(restarts, obj.dim, generator=g, dtype=torch.float64).requires_grad_()
    opt = torch.optim.Adam([theta], lr=0.02)
    batched = vmap(obj.flat)
    for _ in range(steps):
        opt.zero_grad()
        batched(theta).sum().backward()
        opt.step()
    with torch.no_grad():
        return float(batched(theta).min())


def run_rate(cfg: RateConfig) -> dict[str, Any]:
    """Run every arm; return curves, the ε grid, ``τ(ε)`` per arm and the fitted slopes."""
    base = objective(cfg.loss, seed=cfg.seed)
    l_star = best_loss(base, restarts=cfg.restarts, seed=cfg.seed, steps=cfg.restart_steps)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    start = torch.randn(cfg.chains, base.dim, generator=g, dtype=torch.float64)  # (C, D)
    start = cfg.start_radius * start / start.norm(dim=1, keepdim=True)
    measure = vmap(base.flat)
    curves: dict[str, list[float]] = {}
    for reg in cfg.regs:
        obj = base if reg == "none" else base.with_regularizer(Regularizer(reg, lam=cfg.lam, eps=cfg.eps))
        energy = vmap(obj.flat)
        theta = torch.nn.Parameter(start.clone())
        opt = Langevin([theta], lr=cfg.lr, temperature=cfg.temperature, seed=cfg.seed + 2)
        curve: list[float] = []
        end = train_loop(Step(update=functools.partial(_update, opt, energy, theta)), steps=cfg.steps,
                         log=functools.partial(_keep, curve, cfg.record_every),
                         log_every=cfg.record_every,
                         hooks=(functools.partial(_suboptimality, measure, theta, l_star),))
        if end.status == "diverged":  # no run folder to mark: the message (with its fix) is the error
            raise FlowgeomError(end.message)
        curves[reg] = curve
    times = [k * cfg.lr for k in range(0, cfg.steps + 1, cfg.record_every)]
    table = hitting_times({reg: (times, curve) for reg, curve in curves.items()}, floor_ratio=1e-4)
    return {"config": cfg.__dict__, "l_star": l_star, "time": times, "suboptimality": curves, **table}


def _update(opt: Langevin, energy, theta: torch.nn.Parameter, k: int) -> None:
    """One Langevin step of every chain on the summed (regularised) energy."""
    opt.zero_grad()
    energy(theta).sum().backward()
    try:
        opt.step()
    except FlowgeomError as exc:  # a chain blew up (non-finite parameter)
        raise Diverged(str(exc)) from exc


def _keep(curve: list[float], every: int, line: dict[str, Any]) -> None:
    """Append a metrics line's mean to ``curve`` on the ``every`` grid only (the loop also logs the last tick)."""
    if "suboptimality" in line and line["step"] % every == 0:
        curve.append(line["suboptimality"])


@torch.no_grad()
def _suboptimality(measure, theta: torch.Tensor, l_star: float, tick: Tick) -> dict[str, float]:
    """``E[V₀(θ_k)] − L*`` over the chains (the unregularised loss)."""
    return {"suboptimality": float(measure(theta).mean()) - l_star}


def plot_rate(result: dict[str, Any], path) -> None:
    """Left: ``E[V₀] − L*`` against time (log scale); right: ``τ(ε)`` against ``log(1/ε)``."""
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend switch

    from flowgeom.runs import atomic_write_figure

    fig = Figure(figsize=(10, 4))
    ax_c, ax_t = fig.subplots(1, 2)
    for reg, curve in result["suboptimality"].items():
        ax_c.plot(result["time"], [max(v, 1e-12) for v in curve], label=reg)
        pts = [(x, h) for x, h in zip(result["log_inv_eps"], result["tau"][reg]) if h is not None]
        if pts:
            ax_t.plot(*zip(*pts), marker="o", label=reg)
    ax_c.set_yscale("log")
    ax_c.set_xlabel("SDE time t")
    ax_c.set_ylabel("E[V₀(θ_t)] − L*")
    ax_t.set_xlabel("log(1/ε)")
    ax_t.set_ylabel("τ(ε)")
    for ax in (ax_c, ax_t):
        ax.legend()
    fig.tight_layout()
    atomic_write_figure(path, fig, dpi=100)
