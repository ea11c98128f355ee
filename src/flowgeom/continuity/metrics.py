"""Cross-layer alignment metrics between two weight matrices (or two stacks).

Conventions: weights are ``(out, in)`` (``nn.Linear``); ``A = U diag(s) V^T``;
``v_i`` live in the input space (the residual stream for Q, K, V, Gate, Up),
``u_i`` in the output space (the residual stream for O, Down). Every function
takes two matrices ``A`` (m n) and ``B`` (m' n') or two stacks (L m n), and is
pure. Singular vectors have arbitrary signs, so every cosine is ``|cos|``.

Metrics (seed 001, "geometric continuity"):

* ``v1_cos(A, B) = |<v_1(A), v_1(B)>|`` (input space, needs n = n');
  ``u1_cos(A, B) = |<u_1(A), u_1(B)>|`` (output space, needs m = m').
* ``subspace_alignment(X, Y) = ||X^T Y||_F^2 / k = (1/k) sum_i cos^2 theta_i``,
  the mean squared cosine of the principal angles between the top-k
  singular subspaces (X, Y with orthonormal columns). 1 = same subspace.
* sigma^2-weighted Gram similarity (no SVD needed):
  input space ``<A^T A, B^T B>_F / (||A^T A||_F ||B^T B||_F) = ||A B^T||_F^2 / (...)``,
  output space ``<A A^T, B B^T>_F / (||A A^T||_F ||B B^T||_F) = ||A^T B||_F^2 / (...)``.
  Writing ``A^T A = sum_i s_i^2 v_i v_i^T`` it equals
  ``sum_ij s_i^2 s'_j^2 <v_i, v'_j>^2 / (sqrt(sum s_i^4) sqrt(sum s'_j^4))``: every pair
  of directions counts, weighted by both energies. Computed with the cheaper of
  the two forms, never forming a Gram of the large side.
* index-matched spectrum-weighted alignment over the top k:
  ``sum_{i<=k} s_i s'_i |<v_i, v'_i>| / sum_{i<=k} s_i s'_i`` (input; ``u`` for output).
  The weight ``s_i s'_i`` is ``s_i^2`` when both spectra agree. With k = min(m, n)
  it covers the whole spectrum; the analyzer's default k truncates it (the name
  carries k). Index matching is fragile where consecutive sigmas are close
  (vectors swap order); the Gram similarity has no such issue.
"""

from __future__ import annotations

import torch

from flowgeom.continuity import _blas
from flowgeom.continuity.spectra import F64, SingularPairs, as_stack, small_gram, top_singular_pairs
from flowgeom.errors import FlowgeomError

ACCUMULATE = F64  # every Frobenius sum of the Gram similarity: d^2 terms (16.8M at d = 4096) need float64 sums


def abs_cos(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``|<x, y>| / (||x|| ||y||)`` over the last dim (…, d) -> (…)."""
    denom = (x.norm(dim=-1) * y.norm(dim=-1)).clamp_min(torch.finfo(x.dtype).tiny)
    return ((x * y).sum(-1) / denom).abs()


def _same(A: torch.Tensor, B: torch.Tensor, dim: int, space: str) -> None:
    if A.shape[dim] != B.shape[dim]:
        raise FlowgeomError(
            f"{space}-space metrics need the same {space} dimension; got {tuple(A.shape)} and {tuple(B.shape)}"
        )


def _pairs(A: torch.Tensor, B: torch.Tensor, k: int, seed: int) -> tuple[SingularPairs, SingularPairs]:
    return top_singular_pairs(A, k, seed=seed), top_singular_pairs(B, k, seed=seed)


def v1_cos(A: torch.Tensor, B: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
    """``|cos|`` between the top right singular vectors (input space)."""
    _same(A, B, -1, "input")
    pa, pb = _pairs(A, B, 1, seed)
    return abs_cos(pa.V[..., 0], pb.V[..., 0])


def u1_cos(A: torch.Tensor, B: torch.Tensor, *, seed: int = 0) -> torch.Tensor:
    """``|cos|`` between the top left singular vectors (output space)."""
    _same(A, B, -2, "output")
    pa, pb = _pairs(A, B, 1, seed)
    return abs_cos(pa.U[..., 0], pb.U[..., 0])


def subspace_alignment(X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
    """Mean ``cos^2`` of the principal angles between span(X) and span(Y), both (…, d, k) orthonormal."""
    k = X.shape[-1]
    return (X.mT @ Y).pow(2).sum((-2, -1)) / k


def index_matched_alignment(X: torch.Tensor, sx: torch.Tensor, Y: torch.Tensor, sy: torch.Tensor) -> torch.Tensor:
    """``sum_i sx_i sy_i |<x_i, y_i>| / sum_i sx_i sy_i`` for vectors (…, d, k) and sigmas (…, k)."""
    w = sx * sy  # (…, k)
    cos = abs_cos(X.mT, Y.mT)  # (…, k)
    return (w * cos).sum(-1) / w.sum(-1).clamp_min(torch.finfo(w.dtype).tiny)


def gram_fro(A: torch.Tensor, gram: torch.Tensor | None = None) -> torch.Tensor:
    """``||A^T A||_F = ||A A^T||_F = sqrt(sum s_i^4)`` from the small-side Gram (…,), float64.

    Accumulated in float64 (:data:`ACCUMULATE`): a float32 sum over the 16.8M entries of a 4096-wide
    Gram was off by 1.5e-3 relative, which moved the sigma^2-similarity by 1.3e-3 at Llama-8B shapes.
    """
    G = small_gram(A)[0] if gram is None else gram
    return torch.linalg.vector_norm(G, dim=(-2, -1), dtype=ACCUMULATE)


def _cross_sq(A: torch.Tensor, B: torch.Tensor, space: str) -> torch.Tensor:
    """``||A B^T||_F^2`` (input) or ``||A^T B||_F^2`` (output), contracting over the shared side.

    Two bf16 matrices (a bf16 checkpoint, kept as stored) multiply as a bf16
    GEMM: every product of two bf16 numbers is exact in float32 and the sum
    accumulates in float32, so the only error beyond a float32 GEMM is the
    rounding of each entry ``x`` of the result to bf16, ``x (1 + delta)``
    with ``|delta| <= 2^-8``. Squared and summed over the ``d^2`` entries
    (16.8M at d = 4096) these roundings average out: the sum moves by
    ``~E[delta^2] ~ 5e-6`` relative, far inside the 1e-4 the metrics are held
    to (tests/continuity/test_scale.py measures it against float64). On CPUs
    with AVX512-BF16 it runs 2.7x faster than float32 (289 vs 108 GFLOP/s a
    core measured at d = 4096); it is the largest cost of an 8B-shaped layer.
    """
    if A.dtype == torch.bfloat16 and B.dtype == torch.bfloat16:
        X = A @ B.mT if space == "in" else A.mT @ B  # bf16 (d, d'), float32 accumulation
        return X.to(torch.float32).pow_(2).sum((-2, -1), dtype=ACCUMULATE)
    if A.ndim == 2 and B.ndim == 2 and _blas.supported(A, B):
        return _blas.cross_product(A, B, space).pow_(2).sum(dtype=ACCUMULATE)
    return (A @ B.mT if space == "in" else A.mT @ B).pow(2).sum((-2, -1), dtype=ACCUMULATE)


def gram_numerator(A: torch.Tensor, B: torch.Tensor, space: str, *, gram_a=None, gram_b=None, side=None) -> torch.Tensor:
    """``<A^T A, B^T B>_F`` (space "in") or ``<A A^T, B B^T>_F`` ("out").

    Uses cached small-side Grams when they live in ``space`` (cost O(d^2)),
    else the cross product over the shared side (cost m m' n or n n' m). Sums in float64.
    """
    if gram_a is not None and gram_b is not None and side == space:
        return (gram_a * gram_b).sum((-2, -1), dtype=ACCUMULATE)
    return _cross_sq(A, B, space)


def gram_similarity(A: torch.Tensor, B: torch.Tensor, space: str, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """sigma^2-weighted Gram similarity in ``space`` ("in" or "out"); see module docstring."""
    if space not in ("in", "out"):
        raise FlowgeomError(f"unknown space {space!r}; choose in or out")
    _same(A, B, -1 if space == "in" else -2, "input" if space == "in" else "output")
    single = A.ndim == 2 and B.ndim == 2
    A, B = (as_stack(X)[0].to(dtype or F64) for X in (A, B))
    (ga, side_a), (gb, side_b) = small_gram(A), small_gram(B)
    side = side_a if side_a == side_b else None
    num = gram_numerator(A, B, space, gram_a=ga, gram_b=gb, side=side)
    out = num / (gram_fro(A, ga) * gram_fro(B, gb)).clamp_min(torch.finfo(num.dtype).tiny)
    return out[0] if single else out


def gram_similarity_in(A: torch.Tensor, B: torch.Tensor, **kw) -> torch.Tensor:
    """Input-space Gram similarity ``||A B^T||_F^2 / (||A^T A||_F ||B^T B||_F)``."""
    return gram_similarity(A, B, "in", **kw)


def gram_similarity_out(A: torch.Tensor, B: torch.Tensor, **kw) -> torch.Tensor:
    """Output-space Gram similarity ``||A^T B||_F^2 / (||A A^T||_F ||B B^T||_F)``."""
    return gram_similarity(A, B, "out", **kw)


def pair_metrics(pa: SingularPairs, pb: SingularPairs, *, in_ok: bool = True, out_ok: bool = True) -> dict[str, torch.Tensor]:
    """All factor-based metrics between two (stacks of) singular pairs; keys as in the JSON output."""
    out: dict[str, torch.Tensor] = {}
    if in_ok:
        out["v1"] = abs_cos(pa.V[..., 0], pb.V[..., 0])
        out["subspace_in"] = subspace_alignment(pa.V, pb.V)
        out["index_in"] = index_matched_alignment(pa.V, pa.S, pb.V, pb.S)
    if out_ok:
        out["u1"] = abs_cos(pa.U[..., 0], pb.U[..., 0])
        out["subspace_out"] = subspace_alignment(pa.U, pb.U)
        out["index_out"] = index_matched_alignment(pa.U, pa.S, pb.U, pb.S)
    return out
