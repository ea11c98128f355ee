"""Predicted drift of the laws: exact for plain SGD, Kunin et al.'s modified equation beyond it.

**Plain SGD: exact** (:class:`SGDPrediction`). For a quadratic law h(θ) = θᵀAθ
and one step θ' = θ − Δ with Δ = τg,

    h(θ') − h(θ) = −⟨∇h(θ), Δ⟩ + h(Δ),

with no remainder. Conservation is ⟨∇h(θ), g⟩ = 0 for the gradient of any
batch's loss, so the step moves h by exactly h(Δ) = τ²·h(g), and after k steps
h(θ_k) = h(θ_0) + Σ_j τ_j²·h(g_j). A linear law (degree 1: h(θ') − h(θ) =
−⟨∇h, Δ⟩) does not move at all. Nothing is approximated, so the measured h may
differ from the predicted one only by round-off; a larger gap means the
optimiser's steps were not along the gradients of a loss the law is a symmetry
of: the law is broken. Per-group learning rates enter through Δ_p = τ_p·g_p (a
law whose parameters get different rates is preconditioned, and then the first-
order term, not the prediction, shows).

Round-off. The optimiser stores θ' in the weights' dtype, which moves every
entry by at most u·|θ'_i| (u: the dtype's unit round-off, 2^-24 for float32);
for the laws of the catalogue (differences of squared norms of slices, so
‖A‖₂ ≤ 1 per law) that moves h by at most b_k = 2u·S_k, with S = Σ_p ‖p‖²_F
over the parameters the law reads (S^{1/2} for a linear law). The gradient is
computed in the weights' dtype too, which leaves a first-order term of about
the same size: b_k = 4u·S_k per step. Summed linearly over k steps this bound
is far above what rounding does (errors of different steps do not align), so
the steps' errors are taken as independent and unbiased, and Hoeffding's
inequality bounds their sum: |Σ e_k| > z·(Σ_k b_k²)^{1/2} with probability
below 2·exp(−z²/2), 3e-8 for z = ROUNDOFF_SIGMAS = 6. Add the float64
evaluation of h and ĥ (n·2^-53·S each, n the longest dimension the law sums
over). A bfloat16/float16 update smaller than half an ulp is swallowed, a
biased error this model does not cover: the monitor warns about such weights.

**Beyond plain SGD** (:class:`DriftPredictor`, Kunin et al., ICLR 2021, "Neural Mechanics").

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

ROUNDOFF_PER_STEP = 4.0  # b_k = 4u·S_k: the stored weights' rounding (2u·S) and the gradient's own, per step
ROUNDOFF_SIGMAS = 6.0    # z of Hoeffding's bound on the sum of the steps' errors (module docstring)


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


class SGDPrediction:
    """The exact drift of the laws under plain SGD: ĥ_k = h(θ_0) + Σ_j h(Δ_j), Δ_j = τ_j·g_j (module docstring).

    Fed by :class:`~flowgeom.laws.monitor.ConservationMonitor` from a step hook of the optimiser (the
    gradient the step used, clipping included, and the learning rate of that step). Quadratic laws
    (degree 2) are driven by h(Δ); linear laws (degree 1) are predicted not to move; controls and
    refuted claims, and laws of any other degree, have no prediction. :meth:`compare` gives, per
    family, ``pred/…`` (ε of ĥ), ``pred_err/…`` (‖h − ĥ‖ / ‖h − h_0‖; quadratic families only: a linear
    law's drift is round-off, nothing to compare) and ``pred_excess/…`` (the largest ‖h_i − ĥ_i‖ /
    tolerance_i over the family's laws: ≤ 1 is round-off).
    """

    def __init__(self, monitor: Any):
        self.monitor = monitor
        seg = monitor._seg  # (total,) item of each value
        quad = [t.kind == "eps" and t.law.degree == 2 for t in monitor.items]
        self.covered = torch.tensor([t.kind == "eps" and t.law.degree in (1, 2) for t in monitor.items])  # (items,)
        self._quad = torch.tensor(quad, dtype=torch.float64)[seg]  # (total,) 1: driven by h(Δ), 0: does not move
        self._halves = torch.tensor([t.law.degree / 2 for t in monitor.items], dtype=torch.float64)  # S^(d/2)
        index = {n: i for i, n in enumerate(monitor.param_names)}
        params = dict(zip(monitor.param_names, monitor._params))
        member = torch.zeros(len(monitor.items), len(index), dtype=torch.float64)  # (items, params)
        unit, longest = [], []
        for i, t in enumerate(monitor.items):
            for n in set(t.law.params):
                member[i, index[n]] = 1.0
            unit.append(max(torch.finfo(params[n].dtype).eps / 2 for n in t.law.params))
            longest.append(max(max(params[n].shape, default=1) for n in t.law.params))
        self._member = member
        self._unit = torch.tensor(unit, dtype=torch.float64)                            # (items,)
        self._eval = 2.0 * torch.tensor(longest, dtype=torch.float64) * (torch.finfo(torch.float64).eps / 2)
        self.reset()

    def reset(self) -> None:
        """Start from the monitor's θ_0: ĥ = h(θ_0), no step, no round-off yet."""
        self.h = self.monitor.h0.clone()                                     # (total,) predicted h
        self.roundoff = torch.zeros(len(self.monitor.items), dtype=torch.float64)  # (items,) Σ_k (u·S_k)²
        self.steps = 0

    def scale(self, params: Sequence[Tensor]) -> Tensor:
        """S^(d/2) per item at ``params`` (the monitor's parameters, in its order): (items,)."""
        sq = torch.stack([torch.linalg.vector_norm(p.detach(), dtype=torch.float64) ** 2 for p in params])
        return (self._member @ sq) ** self._halves

    @torch.no_grad()
    def advance(self, drive: Tensor, scale: Tensor) -> None:
        """One optimiser step: ``drive`` = h(Δ) (total,), ``scale`` = S^(d/2) per item after the step (items,)."""
        self.h = self.h + self._quad * drive.to(torch.float64)
        self.roundoff = self.roundoff + (self._unit * scale) ** 2
        self.steps += 1

    def tolerance(self, scale: Tensor) -> Tensor:
        """The round-off allowed to ‖h_i − ĥ_i‖ per item (items,), ``scale`` = S^(d/2) now."""
        return ROUNDOFF_SIGMAS * ROUNDOFF_PER_STEP * self.roundoff.sqrt() + 2.0 * self._eval * scale

    def compare(self, values: Tensor, scale: Tensor) -> dict[str, float]:
        """``pred/…``, ``pred_err/…`` and ``pred_excess/…`` per law family for the measured ``values`` (total,)."""
        mon = self.monitor
        cov = self.covered[mon._seg]
        zero = torch.zeros_like(self.h)
        h, hp, h0 = (torch.where(cov, x, zero) for x in (values, self.h, mon.h0))
        out = {k: v for k, v in mon.aggregate(mon.relative(hp, h0), "pred").items() if "@" not in k}
        gap_abs = mon._segment_norm(h - hp)                                  # (items,) ‖h_i − ĥ_i‖
        gaps, drifts = mon.aggregate(mon.relative(h, hp), "g"), mon.aggregate(mon.relative(h, h0), "g")
        excess = gap_abs / self.tolerance(scale).clamp_min(torch.finfo(torch.float64).tiny)
        worst: dict[str, float] = {}
        driven = set()  # families with a quadratic law: a predicted drift to compare with (a linear one has none)
        for t, covered, x in zip(mon.items, self.covered.tolist(), excess.tolist()):
            if covered:
                worst[t.family] = max(worst.get(t.family, 0.0), x)
                if t.law.degree == 2:
                    driven.add(t.family)
        for key, g in gaps.items():
            fam = key[2:]
            if "@" in fam or fam not in worst:
                continue
            d = drifts[key]
            if fam in driven:
                out[f"pred_err/{fam}"] = g / d if d > 0 else (0.0 if g == 0 else float("inf"))
            out[f"pred_excess/{fam}"] = worst[fam]
        return {k: v for k, v in out.items() if k.split("/", 1)[1] in worst}

    def state_dict(self) -> dict[str, Tensor]:
        return {"h": self.h.clone(), "roundoff": self.roundoff.clone(),
                "steps": torch.tensor(self.steps, dtype=torch.int64)}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        h, roundoff = state["h"], state["roundoff"]
        if h.shape != self.h.shape or roundoff.shape != self.roundoff.shape:
            raise FlowgeomError(f"saved SGD prediction has {h.numel()} values, this monitor tracks {self.h.numel()}; "
                                "it was saved for another model")
        self.h, self.roundoff = h.to(torch.float64).clone(), roundoff.to(torch.float64).clone()
        self.steps = int(state["steps"])
