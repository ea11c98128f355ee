"""Loss-aware rank allocation: which whitened singular components to keep, model-wide, at a budget.

Pure functions: per-component loss estimates in, one rank per unit out
(the gradients behind the estimates are measured by
:func:`flowgeom.compress.calibrate.sensitivity`).

**Components.** A unit's full-rank factorisation (:mod:`flowgeom.compress.factorize`)
writes every layer l of the unit as a sum of rank-one components,
``W_l = sum_i p_li q_i^T`` (input space: ``p_li`` = column i of the
coefficients ``W_l S V``, ``q_i`` = row i of the basis ``V^T S^{-1}``;
output space: ``p_i = u_i``, ``q_li = W_l^T u_i``), ordered by whitened
singular value. For a per-layer whitened unit component i is ZS-SVD's
``W_i = σ_i u_i v_i^T S^{-1}`` of ``W S = U Σ V^T``. Truncating to rank k
removes components k, k+1, ...; the whitened loss they carry is the sum of
their ``σ_i^2`` (Eckart-Young), so each unit is cut from the tail, in
ascending σ, as ZS-SVD does.

**What removing a component costs the model** (L = mean next-token NLL on
calibration text; ``g_t = ∂L/∂y_t`` the gradient at the projection's output
``y_t = W x_t`` for token t; N tokens). Removing i changes ``W_l`` by
``-p_li q_i^T`` and the output of token t by ``-p_li (q_i^T x_t)``. With
``a_ti = g_t^T p_li`` and ``b_ti = q_i^T x_t``, summed over the unit's layers:

* first order (ZS-SVD, Abbasi et al. 2026, arXiv 2602.02848):
  ``Δ1_i = -<∇_W L, p_i q_i^T> = -sum_t a_ti b_ti`` (for a per-layer whitened
  unit ``-σ_i u_i^T ∇_W L S^{-T} v_i``, the paper's estimate);
* second order, empirical Fisher with token positions as samples (the Fisher
  of the mean loss is ``(1/N) sum_t ∇l_t ∇l_t^T`` and ``∇l_t ≈ N g_t x_t^T``):
  ``Δ2_i = (N/2) sum_t (a_ti b_ti)^2 >= 0``.

The ``taylor`` score is ``Δ1 + Δ2``; ``fisher`` is ``Δ2`` alone.

**Selection at a budget** (:func:`select`). Unit u of ``r_u`` components
costs ``c_u`` numbers per kept component (``m + n`` per layer; ``n + g m``
or ``m + g n`` for a shared basis) and ``D_u`` numbers dense (``g m n``).
Keeping ``k`` components saves ``D_u - k c_u`` when that is positive;
otherwise factoring saves nothing, the unit stays dense (rank ``None``)
and loses nothing. We minimise the summed predicted cost of the removed
components subject to the savings reaching the target: a Lagrangian
relaxation (for a price λ per number saved each unit independently takes
the k, or dense, minimising ``cost(k) - λ savings(k)``; λ bisected to the
smallest price that meets the target), then the overshoot is given back
greedily, component by component (the largest predicted cost per number
first) while the target still holds, so the savings exceed the target by
less than one component's cost.

ZS-SVD's own rule (:func:`zero_sum`) is kept for comparison: components are
removed one at a time from the units' tails, choosing, while the running
sum s of the removed ``Δ1`` is positive, the candidate with the most negative
``Δ1``, otherwise the one with the smallest non-negative ``Δ1``, so that s
stays near zero, until the target is met.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flowgeom.errors import FlowgeomError, choice_error

SCORES = ("taylor", "fisher", "first")
RULES = ("lagrange", "zero-sum")


@dataclass(frozen=True)
class Candidate:
    """One unit as the allocator sees it: ``cost`` (r,) predicted loss of removing each component
    (index 0 = largest σ), ``per_rank`` numbers per kept component, ``dense`` numbers when not factored."""

    cost: torch.Tensor
    per_rank: int
    dense: int
    cap: int | None = None  # the largest rank worth running factored (speed: plan.speed_cap); None: no cap

    def __post_init__(self):
        if self.cost.ndim != 1 or len(self.cost) < 1:
            raise FlowgeomError(f"a unit's component costs must be a non-empty vector, got shape {list(self.cost.shape)}")
        if not torch.isfinite(self.cost).all():
            raise FlowgeomError("a unit's component costs hold NaN or Inf; the calibration gradients overflowed")
        if self.cap is not None and self.cap < 0:
            raise FlowgeomError(f"a unit's rank cap must be >= 0, got {self.cap}")
        if self.per_rank < 1 or self.dense < 1:
            raise FlowgeomError(f"per-rank ({self.per_rank}) and dense ({self.dense}) costs must be >= 1")

    @property
    def max_rank(self) -> int:
        """The largest rank that still saves something and is within the cap (0 when none is)."""
        kmax = min(len(self.cost), (self.dense - 1) // self.per_rank)
        return kmax if self.cap is None else min(kmax, self.cap)

    def savings(self, k: int | None) -> int:
        return 0 if k is None else self.dense - k * self.per_rank


def component_cost(first: torch.Tensor, fisher: torch.Tensor, score: str = "taylor") -> torch.Tensor:
    """The predicted loss of removing each component (module docstring): ``Δ1 + Δ2``, ``Δ2`` or ``Δ1``."""
    if score not in SCORES:
        raise choice_error("score", score, SCORES)
    first, fisher = first.double(), fisher.double()
    return {"taylor": first + fisher, "fisher": fisher, "first": first}[score]


def max_savings(cands: Sequence[Candidate]) -> int:
    return sum(c.savings(1) for c in cands if c.max_rank >= 1)


def _check_target(cands: Sequence[Candidate], target: int) -> None:
    if target > max_savings(cands):
        raise FlowgeomError(f"saving {target:,} numbers needs more than rank 1 everywhere (at most "
                            f"{max_savings(cands):,} can be saved); ask for a smaller budget")


def _best_k(tail: torch.Tensor, cand: Candidate, price: float) -> int | None:
    """argmin over k in 1..max_rank of ``tail[k] - price (dense - k c)``, or None (dense) when nothing beats 0."""
    kmax = cand.max_rank
    if kmax < 1:
        return None
    ks = torch.arange(1, kmax + 1, dtype=torch.float64)
    obj = tail[1:kmax + 1] - price * (cand.dense - ks * cand.per_rank)  # (kmax,)
    i = int(torch.argmin(obj))
    return i + 1 if float(obj[i]) < 0.0 else None


def select(cands: Sequence[Candidate], target: int) -> list[int | None]:
    """Ranks (None = keep dense) minimising the summed cost of the removed components with savings >= ``target``
    numbers (Lagrangian relaxation, then the overshoot given back; module docstring)."""
    if target <= 0:
        return [None] * len(cands)
    _check_target(cands, target)
    # tail[k] = cost of removing components k.. (keeping k), (r + 1,)
    tails = [torch.cat([c.cost.flip(0).cumsum(0).flip(0), c.cost.new_zeros(1)]) for c in cands]

    def solve(price: float) -> list[int | None]:
        return [_best_k(t, c, price) for t, c in zip(tails, cands)]

    def saved(ks) -> int:
        return sum(c.savings(k) for c, k in zip(cands, ks))

    scale = max(float(t.abs().max()) for t in tails) + 1.0
    lo, hi = 0.0, scale
    while saved(solve(hi)) < target:  # at a price above every cost per number, every unit takes rank 1
        hi *= 2.0
        if hi > 1e300:
            raise FlowgeomError("the rank allocation did not converge; the component costs are not finite")
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if saved(solve(mid)) >= target:
            hi = mid
        else:
            lo = mid
    ks = solve(hi)
    return _give_back(cands, ks, target)


def _give_back(cands: Sequence[Candidate], ks: list[int | None], target: int) -> list[int | None]:
    """Re-add tail components (largest cost per number first) while the savings stay >= target."""
    ks = list(ks)
    slack = sum(c.savings(k) for c, k in zip(cands, ks)) - target
    heap = []
    for u, (c, k) in enumerate(zip(cands, ks)):
        if k is not None and k < c.max_rank:
            heapq.heappush(heap, (-float(c.cost[k]) / c.per_rank, u))
    while heap:
        _, u = heapq.heappop(heap)
        c, k = cands[u], ks[u]
        if c.per_rank > slack:
            continue  # this unit's component no longer fits; a cheaper one may
        ks[u], slack = k + 1, slack - c.per_rank
        if k + 1 < c.max_rank:
            heapq.heappush(heap, (-float(c.cost[k + 1]) / c.per_rank, u))
    return ks


def zero_sum(cands: Sequence[Candidate], target: int) -> list[int | None]:
    """ZS-SVD's rule on the first-order estimates in ``Candidate.cost`` (module docstring): tails removed one
    component at a time, keeping the running sum of the removed estimates near zero, until the target holds."""
    if target <= 0:
        return [None] * len(cands)
    _check_target(cands, target)
    ks = [len(c.cost) for c in cands]
    pos: list[tuple[float, int]] = []  # (Δ, unit) of each unit's next candidate, Δ >= 0: smallest first
    neg: list[tuple[float, int]] = []  # Δ < 0: most negative first
    def push(u: int) -> None:
        if ks[u] > 1:
            d = float(cands[u].cost[ks[u] - 1])
            heapq.heappush(pos if d >= 0 else neg, (d, u))
    for u in range(len(cands)):
        push(u)

    def saved() -> int:
        return sum(c.savings(k) if k * c.per_rank < c.dense else 0 for c, k in zip(cands, ks))

    running, total = 0.0, saved()
    while total < target:
        heap = neg if (running > 0 and neg) or not pos else pos
        d, u = heapq.heappop(heap)
        c = cands[u]
        before = c.savings(ks[u]) if ks[u] * c.per_rank < c.dense else 0
        ks[u] -= 1
        after = c.savings(ks[u]) if ks[u] * c.per_rank < c.dense else 0
        running, total = running + d, total + after - before
        push(u)
    return [k if k * c.per_rank < c.dense else None for c, k in zip(cands, ks)]


def allocate(cands: Sequence[Candidate], target: int, rule: str = "lagrange") -> list[int | None]:
    """:func:`select` or :func:`zero_sum` by ``rule``."""
    if rule not in RULES:
        raise choice_error("allocation rule", rule, RULES)
    if not isinstance(target, int) or isinstance(target, bool) or not math.isfinite(target):
        raise FlowgeomError(f"the savings target must be a whole number of parameters, got {target!r}")
    return select(cands, target) if rule == "lagrange" else zero_sum(cands, target)


def predicted(cands: Sequence[Candidate], ks: Sequence[int | None]) -> float:
    """Summed predicted cost of what ``ks`` removes."""
    return sum(float(c.cost[k:].sum()) for c, k in zip(cands, ks) if k is not None)
