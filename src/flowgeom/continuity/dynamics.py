"""Training-time continuity: weights, gradients and accumulated updates, per role.

Seed ``001_…`` explains geometric continuity by a causal chain measured
during training. For every role (a set of same-shape matrices, one per layer,
e.g. all ``gate_proj`` weights) and every adjacent pair of layers ``(l, l+1)``
we track three stacks of shape ``(L, m, n)``:

- **weight** ``W_l(t)``;
- **grad** the instantaneous mini-batch gradient ``G_l(t) = dLoss/dW_l``
  (gradient coherence: residual connections put an identity term in
  ``dh_L/dh_l``, so adjacent layers see similar error signals);
- **delta** the accumulated update ``ΔW_l(t) = W_l(t) - W_l(0)`` (the sum of
  all steps taken), with the ratio ``||ΔW_l||_F / ||W_l(0)||_F``: once it
  exceeds ~1 the weights inherit the structure of ``ΔW``.

On each stack, with ``A = M_l``, ``B = M_{l+1}`` and top singular triplets
``A v_i = s_i u_i`` (signs arbitrary, so every cosine is taken absolute):

- ``v1 = |<v_1(A), v_1(B)>|`` (input space), ``u1 = |<u_1(A), u_1(B)>|`` (output space);
- ``v_idx[i] = |<v_i(A), v_i(B)>|`` for ``i < k`` (is continuity concentrated in
  the top direction or spread over several?), ``u_idx`` likewise;
- the analyzer's top-k subspace alignment (``subspace_in/out``), index-matched
  spectrum-weighted alignment ``Σ s_i s'_i |cos(v_i, v'_i)| / Σ s_i s'_i``
  (``index_in/out``) and σ²-weighted Gram similarity (input
  ``<AᵀA, BᵀB>_F / (||AᵀA||_F ||BᵀB||_F)``, output with ``AAᵀ``; ``gram_in/out``),
  see :mod:`flowgeom.continuity.metrics`;
- the analyzer's random-matrix baselines for the same shapes (``<metric>_baseline``).

All metrics come from the analyzer's pure functions, called once per role and
kind on the whole stack (batched randomised SVD, no Python loop over layers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flowgeom.continuity import _dynamics_metrics as pm
from flowgeom.errors import FlowgeomError

KINDS = ("weight", "grad", "delta")
SCALARS = ("v1", "u1", "subspace_in", "subspace_out", "index_in", "index_out", "gram_in", "gram_out")


def stack_continuity(stack: torch.Tensor, *, k: int = 4, seed: int = 0) -> dict[str, Any]:
    """Adjacent-pair continuity of one stack ``(L, m, n)``, as plain numbers.

    Returns the analyzer's metrics :data:`SCALARS` (means over the ``L-1``
    adjacent pairs), ``"v1_pairs"``, ``"u1_pairs"`` (per pair) and ``"v_idx"``,
    ``"u_idx"`` (mean ``|cos|`` of the i-th singular vectors, ``i <= k``). A
    zero or non-finite stack (no gradient yet, ΔW at step 0) gives NaNs.
    """
    if stack.ndim != 3 or stack.shape[0] < 2:
        raise FlowgeomError(f"continuity needs a stack (L, m, n) with L >= 2 layers, got {tuple(stack.shape)}")
    k = min(k, *stack.shape[-2:])
    if not bool(torch.isfinite(stack).all()) or float(stack.abs().amax()) == 0.0:
        nan, L = float("nan"), stack.shape[0]
        return {**{key: nan for key in SCALARS}, "v1_pairs": [nan] * (L - 1), "u1_pairs": [nan] * (L - 1),
                "v_idx": [nan] * k, "u_idx": [nan] * k}
    m = pm.stack_pair_metrics(stack, k=k, seed=seed)  # tensors over the L-1 adjacent pairs
    out: dict[str, Any] = {key: float(m[key].mean()) for key in SCALARS}
    out.update(v1_pairs=m["v1"].tolist(), u1_pairs=m["u1"].tolist(),
               v_idx=m["v_idx"].mean(0).tolist(), u_idx=m["u_idx"].mean(0).tolist())
    return out


def relative_update(w: torch.Tensor, w0: torch.Tensor) -> torch.Tensor:
    """``||W_l - W_l(0)||_F / ||W_l(0)||_F`` per layer of stacks (L, m, n) -> (L,)."""
    return (w - w0).flatten(1).norm(dim=1) / w0.flatten(1).norm(dim=1).clamp_min(torch.finfo(w0.dtype).tiny)


class ContinuityTracker:
    """Tracks the continuity of weights, gradients and ``W - W(0)`` per role.

    ``roles`` maps a role name to its parameters in depth order (same shape
    within a role). The tracker snapshots ``W(0)`` at construction (or takes it
    from :meth:`load_state_dict` on resume). Call :meth:`measure` after
    ``loss.backward()`` (gradients are read from ``.grad``) every N steps; it
    returns one JSON-ready dict per role::

        {role: {"weight": {...}, "grad": {...}, "delta": {...},
                "dw_ratio": mean_l ||ΔW_l||/||W_l(0)||, "dw_ratio_layers": [...],
                "v1_baseline": ..., "u1_baseline": ..., "gram_in_baseline": ..., ...}}

    >>> tracker = ContinuityTracker({"hidden": model.hidden_weights()})   # doctest: +SKIP
    >>> loss.backward(); record = tracker.measure()                       # doctest: +SKIP
    """

    def __init__(self, roles: Mapping[str, Sequence[torch.Tensor]], *, k: int = 4, seed: int = 0,
                 kinds: Sequence[str] = KINDS):
        if not roles:
            raise FlowgeomError("ContinuityTracker needs at least one role; pass {name: [W_0, W_1, ...]}")
        for name, params in roles.items():
            shapes = {tuple(p.shape) for p in params}
            if len(params) < 2 or len(shapes) != 1 or len(next(iter(shapes))) != 2:
                raise FlowgeomError(
                    f"role {name!r} needs >= 2 matrices of one shape, got shapes {[tuple(p.shape) for p in params]}")
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise FlowgeomError(f"unknown kinds {sorted(unknown)}; choose among {', '.join(KINDS)}")
        self.roles = {name: list(params) for name, params in roles.items()}
        self.k, self.seed, self.kinds = k, seed, tuple(kinds)
        self.w0 = {name: self._stack(params) for name, params in self.roles.items()}
        self.baselines = {name: pm.baselines(w.shape[-2], w.shape[-1], min(k, *w.shape[-2:]))
                          for name, w in self.w0.items()}

    @staticmethod
    def _stack(params: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack([p.detach().float() for p in params]).clone()  # (L, m, n)

    @staticmethod
    def _grad_stack(params: Sequence[torch.Tensor]) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        return torch.stack([g.detach().float() for g in grads])  # (L, m, n)

    def measure(self) -> dict[str, dict[str, Any]]:
        """Continuity of every role now; see the class docstring for the layout."""
        out: dict[str, dict[str, Any]] = {}
        for name, params in self.roles.items():
            w = self._stack(params)
            stacks = {"weight": w, "grad": self._grad_stack(params), "delta": w - self.w0[name]}
            ratio = relative_update(w, self.w0[name])
            rec: dict[str, Any] = {kind: stack_continuity(stacks[kind], k=self.k, seed=self.seed) for kind in self.kinds}
            rec["dw_ratio"] = float(ratio.mean())
            rec["dw_ratio_layers"] = ratio.tolist()
            rec.update(self.baselines[name])
            out[name] = rec
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: w.clone() for name, w in self.w0.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != set(self.w0):
            raise FlowgeomError(f"tracker state holds roles {sorted(state)}, expected {sorted(self.w0)}")
        self.w0 = {name: state[name].clone() for name in self.w0}


def series(records: Sequence[Mapping[str, Any]], role: str, kind: str | None, metric: str
           ) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of one tracked metric from metrics.jsonl records.

    ``kind=None`` reads a role-level value (``dw_ratio``). Records without a
    ``continuity`` entry (plain loss lines) are skipped.
    """
    steps, values = [], []
    for rec in records:
        cont = rec.get("continuity")
        if not cont or role not in cont:
            continue
        entry = cont[role] if kind is None else cont[role][kind]
        value = entry[metric]
        steps.append(int(rec["step"]))
        values.append(float(value) if value is not None else math.nan)
    return steps, values
