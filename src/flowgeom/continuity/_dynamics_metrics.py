"""Adapter: the analyzer's pair metrics, shaped for :mod:`flowgeom.continuity.dynamics`.

Every number comes from :mod:`flowgeom.continuity.spectra` (top singular
pairs, pair metrics, random baselines); this module only batches them over
the ``L-1`` adjacent pairs of one stack and names the outputs.
"""

from __future__ import annotations

import math

import torch

from flowgeom.continuity.spectra import top_singular_pairs

SVD_TOL = 1e-8  # eigen-residual tolerance of the analyzer's Krylov solver (on the Gram, i.e. sigma^2)


def pair_metrics(stack: torch.Tensor, *, k: int, seed: int) -> dict[str, torch.Tensor]:
    """Metrics of the adjacent pairs of ``stack`` (L m n); each value has L-1 rows."""
    p = top_singular_pairs(stack, k, tol=SVD_TOL, seed=seed)
    a, b = slice(0, -1), slice(1, None)
    v_idx = (p.V[a] * p.V[b]).sum(-2).abs()  # (L-1, k)
    u_idx = (p.U[a] * p.U[b]).sum(-2).abs()  # (L-1, k)
    w = p.S[a] ** 2 + p.S[b] ** 2  # (L-1, k)
    A, B = stack[a].double(), stack[b].double()
    gram_in = (A @ B.mT).square().sum((-2, -1)) / ((A.mT @ A).norm(dim=(-2, -1)) * (B.mT @ B).norm(dim=(-2, -1)))
    gram_out = (A.mT @ B).square().sum((-2, -1)) / ((A @ A.mT).norm(dim=(-2, -1)) * (B @ B.mT).norm(dim=(-2, -1)))
    return {"v_idx": v_idx, "u_idx": u_idx, "sw_v": (w * v_idx).sum(-1) / w.sum(-1),
            "sw_u": (w * u_idx).sum(-1) / w.sum(-1), "gram_in": gram_in, "gram_out": gram_out}


def _mean_abs_cos(n: int) -> float:
    """E|<x, y>| for independent uniform unit vectors in R^n: Γ(n/2) / (√π Γ((n+1)/2))."""
    return math.exp(math.lgamma(n / 2) - math.lgamma((n + 1) / 2)) / math.sqrt(math.pi)


def baselines(m: int, n: int) -> dict[str, float]:
    """Random-matrix baselines of v1 (input dim n) and u1 (output dim m)."""
    return {"v1_baseline": _mean_abs_cos(n), "u1_baseline": _mean_abs_cos(m)}
