"""Adapter: the analyzer's pair metrics, shaped for :mod:`flowgeom.continuity.dynamics`.

Every number comes from the analyzer (:mod:`flowgeom.continuity.spectra`,
:mod:`~flowgeom.continuity.metrics`, :mod:`~flowgeom.continuity.baselines`);
this module only slices one stack ``(L, m, n)`` into its ``L-1`` adjacent
pairs ``(M[:-1], M[1:])``, calls those functions once per stack, and adds a
convergence guard.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from flowgeom.continuity import _blas
from flowgeom.continuity.baselines import analytic_baselines
from flowgeom.continuity.metrics import abs_cos, gram_fro, gram_numerator, pair_metrics
from flowgeom.continuity.spectra import F64, SingularPairs, full_singular_pairs, pairs_from_gram, small_gram

SVD_TOL = 1e-8    # eigen-residual tolerance of the analyzer's Krylov solver (on the Gram, i.e. sigma^2)
CHECK_TOL = 1e-5  # a matrix whose returned residual exceeds this is recomputed by the full SVD


def checked_pairs(stack: torch.Tensor, gram: torch.Tensor, side: str, k: int, seed: int) -> SingularPairs:
    """Top-k pairs of float64 ``stack`` from its small-side ``gram``; matrices the solver did not converge on are
    redone by the full SVD.

    Guard for gradients at initialisation (near-degenerate, low-rank stacks),
    where an earlier version of the batched Krylov solver returned a non-unit
    ``v_1`` with a residual of ~3 for one matrix of the stack; it costs nothing
    when the solver converges.
    """
    p = pairs_from_gram(stack, gram, side, k, tol=SVD_TOL, seed=seed)
    bad = ~(p.residual <= CHECK_TOL)  # (L,), NaN counts as bad
    if not bool(bad.any()):
        return p
    U, S, V = p.U.clone(), p.S.clone(), p.V.clone()
    f = full_singular_pairs(stack[bad], k)
    U[bad], S[bad], V[bad] = f.U.to(U), f.S.to(S), f.V.to(V)
    return SingularPairs(U, S, V, torch.where(bad, torch.zeros_like(p.residual), p.residual), p.iters)


def stack_pair_metrics(stack: torch.Tensor, *, k: int, seed: int) -> dict[str, torch.Tensor]:
    """Metrics of the adjacent pairs of ``stack`` (L m n); each value has L-1 rows.

    Keys: the analyzer's ``v1 u1 subspace_in subspace_out index_in index_out
    gram_in gram_out`` (each (L-1,)) and ``v_idx``/``u_idx`` (L-1, k), the
    ``|cos|`` of the i-th singular vectors.
    """
    # Inside a training loop: one BLAS thread and one torch thread while measuring, so neither
    # library's spin-waiting workers slow the other's next call (_blas.cpu_threads).
    with _blas.cpu_threads(1) if stack.device.type == "cpu" else nullcontext():
        A = stack.to(F64)
        G, side = small_gram(A)  # once per layer: the pairs and both Gram similarities share it
        p = checked_pairs(A, G, side, k, seed)
        fro = gram_fro(A, G)
        denom = (fro[:-1] * fro[1:]).clamp_min(torch.finfo(F64).tiny)
        grams = {f"gram_{space}": gram_numerator(A[:-1], A[1:], space, gram_a=G[:-1], gram_b=G[1:], side=side) / denom
                 for space in ("in", "out")}
    a, b = p[:-1], p[1:]
    out = dict(pair_metrics(a, b)) | grams
    out["v_idx"] = abs_cos(a.V.mT, b.V.mT)  # (L-1, k)
    out["u_idx"] = abs_cos(a.U.mT, b.U.mT)  # (L-1, k)
    return out


def baselines(m: int, n: int, k: int) -> dict[str, float]:
    """The analyzer's random-matrix baselines for a pair of (m, n) matrices, keys ``<metric>_baseline``."""
    return {f"{key}_baseline": value for key, value in analytic_baselines((m, n), k=k).items()}
