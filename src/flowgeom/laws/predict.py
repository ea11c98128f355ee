"""Predicted drift of the laws beyond gradient flow (Kunin et al., ICLR 2021, "Neural Mechanics").

Kunin et al. write SGD with step η, momentum β and weight decay λ as the
*modified equation* (time t = kη; torch's heavy ball v ← βv + g + λθ,
θ ← θ − ηv; Taylor-expanding θ_{k±1} around θ_k to second order):

    (η/2)(1 + β)·θ̈ + (1 − β)·θ̇ = −∇L(θ) − λθ.

For a quadratic law h(θ) = θᵀMθ of a symmetry, ⟨∇h(θ), ∇L(θ)⟩ = 0 for any
data, so taking 2Mθ· of both sides, with ḣ = 2θᵀMθ̇ and
ḧ = 2θ̇ᵀMθ̇ + 2θᵀMθ̈, gives a damped, driven oscillator in h alone:

    (η/2)(1 + β)·ḧ + (1 − β)·ḣ + 2λ·h = η(1 + β)·h(θ̇).

- weight decay, no momentum (β = 0, dropping the O(η) inertia): ḣ = −2λh + η·h(g), i.e.
  h(t) = e^{−2λt}·h(0) + η∫_0^t e^{−2λ(t−s)}·h(g(s)) ds (Kunin's eq. for rescale symmetries;
  h(g) = ‖g_A1‖² − ‖g_A2‖² for a rescale law);
- finite step alone (β = λ = 0): the drift is the η·∫h(g) term, τ²Σ_k h(g_k) per step;
- momentum β: the oscillator, driven by h(θ̇) with θ̇ = −v (the momentum buffer).

A *linear* law (degree 1: the router sum) has no drive: (η/2)(1 + β)ḧ + (1 − β)ḣ + λh = 0.

Integration. The coefficients (η, β, λ) and the drive change from step to
step (schedules, new gradients); over one step [t_k, t_k + η_k] they are held
constant and the 2-D system x = (h, ḣ) is propagated *exactly* by the matrix
exponential of its augmented 3×3 generator (stable whatever the ratio of the
fast inertial mode, ~1/η, to the slow decay ~λ). h(0) = h(θ_0), ḣ(0) = 0
(the momentum buffer starts at zero).

The drive is measured, not modelled: h(v) of the optimiser's momentum buffer
after each step (β > 0), or h(g) + λ²·h of the gradient before it (β = 0,
where v = g + λθ and the cross term vanishes by the symmetry). What the
prediction leaves out — the O(η²) terms of the modified equation, and for
momentum the failure of ⟨∇h(θ_k), g_j⟩ = 0 for past gradients j < k — is what
the measured/predicted gap (``pred_err``) shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from flowgeom.errors import FlowgeomError


class DriftPredictor:
    """Kunin et al.'s predicted h(θ_k) for every conservation law of a :class:`ConservationMonitor`.

    Call :meth:`advance` once per optimiser step with that step's hyper-parameters and drive
    (:meth:`ConservationMonitor.values_at` of the gradient or momentum buffer); :meth:`compare`
    gives ``pred/<family>`` (ε of the predicted h) and ``pred_err/<family>`` (‖h − ĥ‖ / ‖h − h_0‖,
    how far prediction and measurement disagree relative to the drift itself).
    """

    def __init__(self, monitor: Any):
        self.monitor = monitor
        counts = [t.law.count for t in monitor.items]
        law = [t.kind == "eps" and t.law.degree in (1, 2) for t in monitor.items]
        self._seg = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))  # (total,)
        self.covered = torch.tensor(law)[self._seg]  # (total,) laws with a prediction
        self._item_degree = [float(t.law.degree) for t in monitor.items]
        self.degree = torch.tensor(self._item_degree, dtype=torch.float64)[self._seg]
        self.h = monitor.h0.clone()                      # (total,) predicted h
        self.u = torch.zeros_like(self.h)                # (total,) predicted ḣ
        self.t = 0.0
        self.steps = 0
        self._key = None        # the (lr, weight decay, momentum) the coefficients below were built for
        self._propagators: dict[tuple[float, float, float], Tensor] = {}

    def reset(self) -> None:
        self.h, self.u, self.t, self.steps = self.monitor.h0.clone(), torch.zeros_like(self.h), 0.0, 0

    def _propagator(self, lr: float, momentum: float, rate: float) -> Tensor:
        """exp(A·η) for A = [[0, 1, 0], [−c/a, −b/a, 1/a], [0, 0, 0]]: (h, ḣ, F) → (h, ḣ) after one step (3, 3)."""
        key = (lr, momentum, rate)
        if key not in self._propagators:
            a, b = 0.5 * lr * (1.0 + momentum), 1.0 - momentum
            A = torch.tensor([[0.0, 1.0, 0.0], [-rate / a, -b / a, 1.0 / a], [0.0, 0.0, 0.0]], dtype=torch.float64)
            self._propagators[key] = torch.linalg.matrix_exp(A * lr)
        return self._propagators[key]

    def _coefficients(self, lr: list[float], wd: list[float], momentum: float) -> Tensor:
        """Per quantity: the propagator's (h, ḣ, F) → (h, ḣ) entries, the drive's scale and λ² (8, total).

        Rebuilt only when a hyper-parameter changes (a constant learning rate builds them once)."""
        key = (tuple(lr), tuple(wd), momentum)
        if key != self._key:
            coef = torch.empty(8, len(lr), dtype=torch.float64)
            for i, (eta, lam, d) in enumerate(zip(lr, wd, self._item_degree)):
                P = self._propagator(eta, momentum, d * lam)
                coef[:6, i] = P[:2].reshape(-1)
                coef[6, i] = eta * (1.0 + momentum) if d == 2 else 0.0  # the drive η(1+β)·h(θ̇) of quadratic laws
                coef[7, i] = lam * lam
            self._coef, self._key = coef[:, self._seg], key
        return self._coef

    @torch.no_grad()
    def advance(self, *, lr: float | Sequence[float], momentum: float = 0.0,
                weight_decay: float | Sequence[float] = 0.0, drive: Tensor, drive_is_gradient: bool) -> None:
        """One optimiser step.

        ``drive``: h evaluated at the momentum buffer v_{k+1} (``drive_is_gradient=False``) or at the
        gradient g_k (True; then β must be 0 and h(v) = h(g) + λ²h). ``lr`` and ``weight_decay`` are
        scalars or one value per tracked item (parameter groups may differ, see :meth:`per_item`).
        """
        if not 0 <= momentum < 1:
            raise FlowgeomError(f"momentum must lie in [0, 1) for the prediction, got {momentum}")
        if drive_is_gradient and momentum:
            raise FlowgeomError("with momentum the drive is h(momentum buffer), not h(gradient)")
        n = len(self._item_degree)
        lr = [float(lr)] * n if isinstance(lr, (int, float)) else [float(x) for x in lr]
        wd = [float(weight_decay)] * n if isinstance(weight_decay, (int, float)) else [float(x) for x in weight_decay]
        if min(lr) <= 0:
            raise FlowgeomError("the prediction needs a positive learning rate at every step")
        c = self._coefficients(lr, wd, float(momentum))
        hv = drive.to(torch.float64)
        if drive_is_gradient:
            hv = hv + c[7] * self.h  # v = g + λθ, and ⟨∇h, g⟩ = 0: h(v) = h(g) + λ²h(θ)
        force = c[6] * hv
        self.h, self.u = (c[0] * self.h + c[1] * self.u + c[2] * force,
                          c[3] * self.h + c[4] * self.u + c[5] * force)
        self.t += sum(lr) / n
        self.steps += 1

    def compare(self, values: Tensor) -> dict[str, float]:
        """``pred/<family>`` and ``pred_err/<family>`` for the measured raw law values ``values`` (total,)."""
        mon = self.monitor
        zero = torch.zeros_like(self.h)
        h = torch.where(self.covered, values, zero)
        hp = torch.where(self.covered, self.h, zero)
        h0 = torch.where(self.covered, mon.h0, zero)
        pred = mon.relative(hp, h0)                       # (items,) ε of the prediction
        gap = mon.relative(h, hp)                         # ‖h − ĥ‖ / denominator
        drift = mon.relative(h, h0)                       # ‖h − h_0‖ / denominator
        out = {k: v for k, v in mon.aggregate(pred, "pred").items() if "@" not in k}  # per family only
        gaps, drifts = mon.aggregate(gap, "g"), mon.aggregate(drift, "g")
        for key, g in gaps.items():
            if "@" not in key:
                d = drifts[key]
                out[f"pred_err/{key[2:]}"] = g / d if d > 0 else float("nan")
        return out

    def per_item(self, hyper: Mapping[str, Mapping[str, float]], key: str) -> list[float]:
        """A per-parameter hyper-parameter (``hyper[name][key]``) for each tracked item, from the first
        parameter its law reads (a law whose parameters sit in no optimiser group is an error)."""
        vals = []
        for t in self.monitor.items:
            h = hyper.get(t.law.params[0])
            if h is None:
                raise FlowgeomError(f"{t.law.params[0]} is in no parameter group of the optimiser: the monitor "
                                    "cannot see how it is trained; pass the optimiser that trains the model")
            vals.append(h[key])
        return vals


def hyper_of(optimizer: Any, names: list[str], params: list[Tensor]) -> dict[str, Mapping[str, float]]:
    """Per monitored parameter name, its group's ``lr``, ``momentum``, ``weight_decay``."""
    group_of = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            group_of[id(p)] = g
    out = {}
    for n, p in zip(names, params):
        g = group_of.get(id(p))
        if g is not None:
            out[n] = {"lr": float(g["lr"]), "momentum": float(g.get("momentum", 0.0) or 0.0),
                      "weight_decay": float(g.get("weight_decay", 0.0) or 0.0)}
    return out
