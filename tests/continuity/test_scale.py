"""The analyzer at the papers' scale (issue 34): every metric within 1e-4 of a float64 reference.

The reference is computed independently of the analyzer's code path: a full float64
eigendecomposition of each matrix's Gram (LAPACK, all eigenpairs) and the Gram products formed in
float64. Two paths are checked: a float32 checkpoint (small-
side float32 Gram, Krylov on it, float32 residuals floored at 8 eps) and a bf16 checkpoint (bf16
GEMMs for the similarity's Gram and cross products, Krylov on the float32 matrix itself), on a flat
(Gaussian) spectrum and on a planted decaying one. The slow cases use real sizes (3072-wide Grams,
a 6144x2048 gate-like matrix); the fast ones the same paths on small matrices.
"""

from __future__ import annotations

import pytest
import torch

from flowgeom.continuity import AnalyzeConfig, analyze
from flowgeom.continuity.spectra import GramOperator, krylov_top_eigenpairs, small_gram

F64 = torch.float64
METRICS = ("v1", "u1", "subspace_in", "subspace_out", "index_in", "index_out", "gram_in", "gram_out")


def _top(X: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ``(U, s, V)`` of float64 ``X`` from a full float64 ``eigh`` of its small-side Gram (LAPACK ?syevd:
    all eigenpairs, no Krylov, no float32 anywhere); the other side as ``X v / s`` (resp. ``X^T u / s``)."""
    m, n = X.shape
    lam, vec = torch.linalg.eigh(X.mT @ X if n <= m else X @ X.mT)
    s, Y = lam.flip(0)[:k].sqrt(), vec.flip(1)[:, :k]
    return ((X @ Y) / s, s, Y) if n <= m else (Y, s, (X.mT @ Y) / s)


def reference_metrics(A: torch.Tensor, B: torch.Tensor, k: int) -> dict[str, float]:
    """Every pair metric of the analyzer in float64 from full eigendecompositions (metrics.py formulas).

    ``eigh`` of the Gram instead of ``svd`` of the matrix: the same float64 reference (the vectors agree to
    ~1e-10 for these gaps) at a fifth of the time, which keeps the slow tests short.
    """
    A, B = A.to(F64), B.to(F64)
    (Ua, Sa, Va), (Ub, Sb, Vb) = _top(A, k), _top(B, k)
    w = Sa * Sb
    fro_a, fro_b = (small_gram(X)[0].norm() for X in (A, B))
    return {
        "v1": float((Va[:, 0] @ Vb[:, 0]).abs()), "u1": float((Ua[:, 0] @ Ub[:, 0]).abs()),
        "subspace_in": float((Va.mT @ Vb).pow(2).sum() / k), "subspace_out": float((Ua.mT @ Ub).pow(2).sum() / k),
        "index_in": float((w * (Va * Vb).sum(0).abs()).sum() / w.sum()),
        "index_out": float((w * (Ua * Ub).sum(0).abs()).sum() / w.sum()),
        "gram_in": float((A @ B.mT).pow(2).sum() / (fro_a * fro_b)),
        "gram_out": float((A.mT @ B).pow(2).sum() / (fro_a * fro_b)),
    }


def planted_pair(m: int, n: int, *, seed: int, rank: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Two layers sharing drifting input directions on a decaying spectrum (benchmarks/continuity_scale.py's recipe)."""
    g = torch.Generator().manual_seed(seed)
    s = 8.0 * torch.arange(1, rank + 1, dtype=torch.float32) ** -0.5
    V = torch.linalg.qr(torch.randn(n, rank, generator=g)).Q
    out = []
    for _ in range(2):
        V = torch.linalg.qr(V + 0.3 * torch.randn(n, rank, generator=g) / n**0.5).Q
        U = torch.linalg.qr(torch.randn(m, rank, generator=g)).Q
        out.append(torch.randn(m, n, generator=g) / (m**0.5 + n**0.5) + (U * s) @ V.mT)
    return out[0], out[1]


def _check(A: torch.Tensor, B: torch.Tensor, *, k: int = 8, solver: str = "auto", tol: float = 1e-4) -> dict:
    """Analyse the two layers (as stored: float32 or bf16) and compare every metric with the reference."""
    sd = {"model.layers.0.mlp.down_proj.weight": A, "model.layers.1.mlp.down_proj.weight": B}
    report = analyze(sd, AnalyzeConfig(k=k, dtype="float32", solver=solver, workers=1))
    pair = report["roles"]["down"]["pairs"][0]
    ref = reference_metrics(A, B, k)
    worst = {key: abs(pair[key] - ref[key]) for key in METRICS}
    assert max(worst.values()) < tol, worst
    return report


def test_float32_krylov_on_a_flat_spectrum_stops_at_its_rounding_floor():
    """A Gaussian matrix's float32 Gram: the old 1e-10 tolerance was below float32 rounding, so Krylov ran to
    its depth cap; floored at 8 eps it stops early, and its top vector still matches float64 eigh."""
    g = torch.Generator().manual_seed(3)
    A = torch.randn(1200, 800, generator=g)
    G = small_gram(A)[0].unsqueeze(0)  # (1, 800, 800) float32
    theta, Y, residual, depth = krylov_top_eigenpairs(G, 8, tol=1e-10)
    assert float(residual) <= 1e-5  # converged, not stopped by the cap (which would report residual 0, dense)
    assert 0 < depth < 14  # 800 / 3 / 18 = 14 blocks (block k + 10) is the cap past which the dense solver takes over
    lam, vec = torch.linalg.eigh(A.to(F64).mT @ A.to(F64))
    assert float((Y[0, :, 0] @ vec[:, -1]).abs()) > 1 - 1e-8
    assert float(theta[0, 0] / lam[-1]) == pytest.approx(1, abs=1e-6)


def test_gram_operator_gives_the_gram_products():
    g = torch.Generator().manual_seed(4)
    for shape in ((60, 40), (40, 60)):
        A = torch.randn(2, *shape, generator=g, dtype=F64)
        op, X = GramOperator(A, "in" if shape[1] <= shape[0] else "out"), torch.randn(2, 40, 3, generator=g, dtype=F64)
        assert torch.allclose(op @ X, small_gram(A)[0] @ X, rtol=1e-12, atol=1e-10)
        assert torch.equal(op.dense(), small_gram(A)[0])


@pytest.mark.parametrize("shape", [(300, 200), (200, 300)])
def test_bf16_path_matches_float64_on_small_matrices(shape):
    """bf16 storage + Krylov (forced) takes the bf16-GEMM path; every metric within 1e-4 of float64."""
    A, B = (X.bfloat16() for X in planted_pair(*shape, seed=5))
    _check(A, B, solver="krylov")


@pytest.mark.slow
def test_flat_3072_float32_matches_float64():
    """The issue's case: 3072x3072 Gaussian float32 (flat spectrum; ~3 s per matrix on one idle core)."""
    g = torch.Generator().manual_seed(6)
    _check(torch.randn(3072, 3072, generator=g), torch.randn(3072, 3072, generator=g))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(3072, 3072), (6144, 2048)])
def test_planted_bf16_at_scale_matches_float64(shape):
    """bf16, decaying spectrum, Grams 3072 and 2048 wide (auto solver: the bf16 path), planted input sharing."""
    A, B = (X.bfloat16() for X in planted_pair(*shape, seed=7))
    report = _check(A, B)
    assert report["roles"]["down"]["pairs"][0]["v1"] > 0.9  # the planted sharing is seen
