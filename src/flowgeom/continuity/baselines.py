"""Random-matrix baselines: what each metric gives for unrelated layers.

Baseline model: ``A`` (m n) and ``B`` (m' n') independent with i.i.d. N(0, 1)
entries (same shapes as the real pair). Rotation invariance makes the
singular vectors of a Gaussian matrix Haar-distributed and independent of its
singular values, which gives exact values for the vector metrics:

* ``v1``: ``E|<x, y>|`` for independent uniform unit vectors in R^d is
  ``c(d) = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2))`` (~ sqrt(2 / (pi d))), d = n;
  ``u1`` likewise with d = m.
* top-k subspace alignment ``||X^T Y||_F^2 / k``: ``E = k / d`` (each of the k
  columns of Y has expected squared projection k/d on a random k-subspace).
* index-matched alignment: each ``|<v_i, v'_i>|`` has mean c(d) and is
  independent of the weights, so ``E = c(d)`` exactly.
* Gram similarity: ``E||A B^T||_F^2 = m m' n`` and ``E||A^T A||_F^2 = m n (m + n + 1)``
  give the ratio-of-expectations value
  ``sqrt(m m') / sqrt((m + n + 1)(m' + n + 1))`` (input; swap m <-> n for output).
  This is an approximation of ``E[ratio]`` that concentrates as dims grow;
  tests check it against :func:`monte_carlo_baselines` (within 2% at d >= 32).

Note the Gram baseline is large (0.5 for square matrices): every Gram shares
the identity-like bulk, so "x above chance" matters more than the raw value.
"""

from __future__ import annotations

import math

import torch

from flowgeom.continuity.metrics import gram_fro, gram_numerator, pair_metrics
from flowgeom.continuity.spectra import F64, small_gram, top_singular_pairs
from flowgeom.errors import FlowgeomError, positive_int

METRICS = ("v1", "u1", "subspace_in", "subspace_out", "index_in", "index_out", "gram_in", "gram_out")


def expected_abs_cos(d: int) -> float:
    """``E|<x, y>|`` for independent uniform unit vectors in R^d."""
    positive_int(d, "dimension")
    return math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)


def _gram_baseline(m: int, n: int, m2: int, n2: int) -> float:
    return math.sqrt(m * m2) / math.sqrt((m + n + 1) * (m2 + n2 + 1))


def analytic_baselines(shape_a: tuple[int, int], shape_b: tuple[int, int] | None = None, *, k: int) -> dict[str, float]:
    """Baseline of every metric for Gaussian matrices of shapes ``(m, n)`` and ``(m', n')``."""
    (m, n), (m2, n2) = shape_a, shape_b or shape_a
    out: dict[str, float] = {}
    if n == n2:
        out.update(v1=expected_abs_cos(n), subspace_in=k / n, index_in=expected_abs_cos(n),
                   gram_in=_gram_baseline(m, n, m2, n2))
    if m == m2:
        out.update(u1=expected_abs_cos(m), subspace_out=k / m, index_out=expected_abs_cos(m),
                   gram_out=_gram_baseline(n, m, n2, m2))
    return out


def monte_carlo_baselines(shape_a: tuple[int, int], shape_b: tuple[int, int] | None = None, *, k: int,
                          draws: int = 8, seed: int = 0, device: str | torch.device = "cpu") -> dict[str, tuple[float, float]]:
    """``{metric: (mean, std)}`` over ``draws`` pairs of Gaussian matrices, through the analyzer's own code path."""
    if draws < 2:
        raise FlowgeomError(f"--draws must be >= 2 for a Monte-Carlo baseline, got {draws}")
    (m, n), (m2, n2) = shape_a, shape_b or shape_a
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(draws, m, n, generator=gen, dtype=F64).to(device)  # (draws, m, n)
    B = torch.randn(draws, m2, n2, generator=gen, dtype=F64).to(device)
    pa = top_singular_pairs(A, k, seed=seed)
    pb = top_singular_pairs(B, k, seed=seed + 1)
    values = pair_metrics(pa, pb, in_ok=n == n2, out_ok=m == m2)
    (ga, side_a), (gb, side_b) = small_gram(A), small_gram(B)
    side = side_a if side_a == side_b else None
    for space, ok in (("in", n == n2), ("out", m == m2)):
        if ok:
            num = gram_numerator(A, B, space, gram_a=ga, gram_b=gb, side=side)
            values[f"gram_{space}"] = num / (gram_fro(A, ga) * gram_fro(B, gb))
    return {key: (float(v.mean()), float(v.std())) for key, v in values.items()}
