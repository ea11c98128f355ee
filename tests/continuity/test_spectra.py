"""Top singular pairs by block Krylov agree with a full float64 SVD (|cos| within 1e-4)."""

from __future__ import annotations

import pytest
import torch
from synthetic_checkpoints import planted_stack
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.continuity.metrics import abs_cos
from flowgeom.continuity.sources import open_source
from flowgeom.continuity.spectra import full_singular_pairs, top_singular_pairs
from flowgeom.errors import FlowgeomError


def _agree(mats: torch.Tensor, k: int, tol: float = 1e-4) -> None:
    fast, full = top_singular_pairs(mats, k), full_singular_pairs(mats, k)
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


@settings(max_examples=8, deadline=None)
@given(m=st.integers(8, 48), n=st.integers(8, 48), k=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_planted_spectra_agree_with_full_svd(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    r = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(3, m, r, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(3, n, r, generator=g, dtype=torch.float64))
    s = torch.linspace(1.0, 0.05, r, dtype=torch.float64) ** 2  # distinct, decaying
    mats = (U * s) @ V.mT  # (3, m, n)
    _agree(mats, k)


def test_near_degenerate_top_reports_gap_and_keeps_subspace():
    g = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(30, 30, generator=g, dtype=torch.float64))
    s = torch.cat([torch.tensor([1.0, 1.0 - 1e-9]), torch.linspace(0.5, 0.1, 28)]).double()
    A = (U[:, :30] * s) @ V.mT
    p = top_singular_pairs(A, 2)
    assert p.gap < 1e-8  # the degeneracy is reported, not hidden
    # the 2-D top subspace is exact even though v1 alone is not determined
    proj = (p.V.mT @ V[:, :2]).pow(2).sum()
    assert proj == pytest.approx(2.0, abs=1e-8)


def test_k_out_of_range_is_a_clear_error():
    with pytest.raises(FlowgeomError, match="choose 1 <= k <= 3"):
        top_singular_pairs(torch.randn(3, 5), 4)


@pytest.mark.parametrize("spec,names", [
    ("builtin:smollm2", ["blk.{}.attn_q.weight", "blk.{}.attn_k.weight"]),
    ("builtin:minilm", ["encoder.layer.{}.attention.self.query.weight", "encoder.layer.{}.intermediate.dense.weight"]),
])
def test_real_matrices_agree_with_full_svd(spec, names):
    src = open_source(spec)
    for name in names:
        mats = torch.stack([src.load(name.format(i)).double() for i in range(3)])  # (3, m, n)
        _agree(mats, 4)
