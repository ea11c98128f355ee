"""Top singular pairs by both solvers (block Krylov, dense ?syevr) agree with a full float64 SVD (|cos| within 1e-4)."""

from __future__ import annotations

import pytest
import torch
from synthetic_checkpoints import planted_stack
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.continuity.metrics import abs_cos
from flowgeom.continuity.spectra import full_singular_pairs, small_gram, top_singular_pairs
from flowgeom.errors import FlowgeomError
from flowgeom.io import open_source

SOLVERS = pytest.mark.parametrize("solver", ["krylov", "dense"])


def _agree(mats: torch.Tensor, k: int, solver: str, tol: float = 1e-4) -> None:
    fast, full = top_singular_pairs(mats, k, solver=solver), full_singular_pairs(mats, k)
    assert torch.allclose(fast.S, full.S, rtol=1e-8)
    # top pair to tol (headline v1/u1); pairs 2..k (residual 1e-5) as a subspace to 1e-3
    assert (abs_cos(fast.V[..., 0], full.V[..., 0]) > 1 - tol).all()
    assert (abs_cos(fast.U[..., 0], full.U[..., 0]) > 1 - tol).all()
    for X, Y in ((fast.V, full.V), (fast.U, full.U)):
        assert ((X.mT @ Y).pow(2).sum((-2, -1)) / k > 1 - 1e-3).all()
    # cross-layer cosines, the quantity the analyzer reports
    for X, Y in ((fast.V, full.V), (fast.U, full.U)):
        c_fast = abs_cos(X[:-1, :, 0], X[1:, :, 0])
        c_full = abs_cos(Y[:-1, :, 0], Y[1:, :, 0])
        assert (c_fast - c_full).abs().max() < tol


@SOLVERS
@settings(max_examples=8, deadline=None)
@given(m=st.integers(8, 48), n=st.integers(8, 48), k=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_planted_spectra_agree_with_full_svd(solver, m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    r = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(3, m, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(3, n, r, generator=g, dtype=torch.float64))
    s = torch.linspace(1.0, 0.05, r, dtype=torch.float64) ** 2  # distinct, decaying
    mats = (U * s) @ V.mT  # (3, m, n)
    _agree(mats, k, solver)


@SOLVERS
def test_near_degenerate_top_reports_gap_and_keeps_subspace(solver):
    g = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(30, 30, generator=g, dtype=torch.float64))
    s = torch.cat([torch.tensor([1.0, 1.0 - 1e-9]), torch.linspace(0.5, 0.1, 28)]).double()
    A = (U[:, :30] * s) @ V.mT
    p = top_singular_pairs(A, 2, solver=solver)
    assert p.gap < 1e-8  # the degeneracy is reported, not hidden
    # the 2-D top subspace is exact even though v1 alone is not determined
    proj = (p.V.mT @ V[:, :2]).pow(2).sum()
    assert proj == pytest.approx(2.0, abs=1e-8)


def test_k_out_of_range_is_a_clear_error():
    with pytest.raises(FlowgeomError, match="choose 1 <= k <= 3"):
        top_singular_pairs(torch.randn(3, 5), 4)


def test_unknown_solver_is_a_clear_error():
    with pytest.raises(FlowgeomError, match="solver"):
        top_singular_pairs(torch.randn(6, 5), 1, solver="lanczos")


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 40), batch=st.integers(1, 3), dtype=st.sampled_from(["float32", "float64"]),
       transposed=st.booleans(), seed=st.integers(0, 10_000))
def test_syrk_gram_matches_matmul(m, n, batch, dtype, transposed, seed):
    """The CPU syrk Gram (one triangle, mirrored) equals the plain product, for any layout of the input."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(batch, n, m, generator=g, dtype=getattr(torch, dtype)).mT if transposed else \
        torch.randn(batch, m, n, generator=g, dtype=getattr(torch, dtype))
    G, side = small_gram(A)
    ref = A.double().mT @ A.double() if n <= m else A.double() @ A.double().mT
    assert side == ("in" if n <= m else "out")
    assert G.dtype == A.dtype and torch.equal(G, G.mT)
    assert torch.allclose(G.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_float32_dense_path_matches_float64_svd_on_real_weights():
    """The CLI default (float32 Gram, float32 ?syevr) keeps the cross-layer cosines of a float64 SVD."""
    src = open_source("builtin:smollm2")
    mats = torch.stack([src.load(f"blk.{i}.ffn_up.weight") for i in range(4)]).float()
    fast = top_singular_pairs(mats, 4, dtype=torch.float32, solver="dense")
    full = full_singular_pairs(mats, 4)
    assert float(fast.residual.max()) < 1e-5
    for X, Y in ((fast.V, full.V), (fast.U, full.U)):
        assert (abs_cos(X[:-1, :, 0], X[1:, :, 0]) - abs_cos(Y[:-1, :, 0], Y[1:, :, 0])).abs().max() < 1e-4


@pytest.mark.parametrize("spec,names", [
    ("builtin:smollm2", ["blk.{}.attn_q.weight", "blk.{}.attn_k.weight"]),
    ("builtin:minilm", ["encoder.layer.{}.attention.self.query.weight", "encoder.layer.{}.intermediate.dense.weight"]),
])
@SOLVERS
def test_real_matrices_agree_with_full_svd(spec, names, solver):
    src = open_source(spec)
    for name in names:
        mats = torch.stack([src.load(name.format(i)).double() for i in range(3)])  # (3, m, n)
        _agree(mats, 4, solver)
