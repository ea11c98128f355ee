"""Top-k singular pairs for every k from 1 to 16 (issue 41 §2): against a float64 SVD, and no slow small k.

Small k was slow because a float32 Krylov residual plateaus at the rounding of the products ``G y``
(~ eps sqrt(d)), which sat just above the 8 eps floor for some (matrix, k): those runs filled the basis to
its cap and then paid for the dense solver as well. The stagnation rule (spectra.krylov_top_eigenpairs)
stops there instead. The regression test below moves the floor under the plateau on purpose, at d = 1024.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flowgeom.continuity.spectra as spectra
from flowgeom.continuity.metrics import abs_cos
from flowgeom.continuity.spectra import full_singular_pairs, krylov_top_eigenpairs, small_gram, top_singular_pairs

F64 = torch.float64


def _spiked(m: int, n: int, spikes: int, seed: int) -> torch.Tensor:
    """Gaussian bulk (edge ~1) plus ``spikes`` directions at sigma 4 (1 - 0.03 i): gaps of >= 3% between them."""
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(m, spikes, generator=g, dtype=F64)).Q
    V = torch.linalg.qr(torch.randn(n, spikes, generator=g, dtype=F64)).Q
    s = 4.0 * (1 - 0.03 * torch.arange(spikes, dtype=F64))
    return torch.randn(m, n, generator=g, dtype=F64) / (m**0.5 + n**0.5) + (U * s) @ V.mT


@settings(max_examples=12, deadline=None)
@given(m=st.integers(150, 360), n=st.integers(150, 360), k=st.integers(1, 16), seed=st.integers(0, 10_000),
       dtype=st.sampled_from([torch.float32, F64]), solver=st.sampled_from(["krylov", "auto"]))
def test_every_k_matches_the_float64_svd(m, n, k, seed, dtype, solver):
    A = _spiked(m, n, 18, seed)
    fast, full = top_singular_pairs(A, k, dtype=dtype, solver=solver), full_singular_pairs(A, k)
    rtol = 1e-5 if dtype == torch.float32 else 1e-9
    assert torch.allclose(fast.S, full.S, rtol=rtol)
    assert float(abs_cos(fast.V[:, 0], full.V[:, 0])) > 1 - 1e-8  # the top pair (sin angle < 1.4e-4)
    assert float(abs_cos(fast.U[:, 0], full.U[:, 0])) > 1 - 1e-8
    for X, Y in ((fast.V, full.V), (fast.U, full.U)):  # pairs 2..k (residual 1e-5) as a subspace
        assert float((X.mT @ Y).pow(2).sum() / k) > 1 - 1e-4


@pytest.fixture(scope="module")
def flat_1024():
    """A 1024x1024 Gaussian matrix (the Krylov worst case, like the issue's flat down_proj): its float32 Gram and
    the float64 eigendecomposition of that Gram's matrix."""
    g = torch.Generator().manual_seed(11)
    A = torch.randn(1024, 1024, generator=g)
    lam, vec = torch.linalg.eigh(A.to(F64).mT @ A.to(F64))
    return small_gram(A)[0].unsqueeze(0), lam.flip(0), vec.flip(1)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8, 16])
def test_flat_float32_spectrum_for_every_k(flat_1024, k):
    """Krylov converges by itself (a residual > 0; a dense finish reports 0) for k <= 8; at k = 16 its block of
    26 needs more than the d/3 columns past which the dense solver is the cheaper one, and finishes there. Either
    way the top pair and the top-k values match float64."""
    G, lam, vec = flat_1024
    theta, Y, residual, depth = krylov_top_eigenpairs(G, k)
    if k <= 8:
        assert float(residual) > 0 and (depth + 1) * (k + spectra.OVERSAMPLE) <= 1024 // 3
    assert float((Y[0, :, 0] @ vec[:, 0]).abs()) > 1 - 1e-8
    assert torch.allclose(theta[0], lam[:k], rtol=1e-5)


def test_a_residual_plateau_above_the_floor_no_longer_runs_to_the_dense_solver(monkeypatch):
    """The cause of the slow k = 1, 2: with the floor moved under the float32 rounding plateau (as it sat at
    d = 3072 for those k), Krylov used to fill its basis to d/3 and finish with the dense solver (residual 0,
    3.3x the time at d = 1024). It now stops where the residual stagnates, well inside its cap."""
    g = torch.Generator().manual_seed(0)
    G = small_gram(torch.randn(1024, 1024, generator=g))[0].unsqueeze(0)
    monkeypatch.setattr(spectra, "RESIDUAL_FLOOR", 1)  # 1.2e-7: below the plateau (3e-7 to 1e-6 here)
    dense_calls = []
    monkeypatch.setattr(spectra, "_exact_top", lambda *a: dense_calls.append(a) or pytest.fail("dense finish"))
    for k in (1, 2):
        _, _, residual, depth = krylov_top_eigenpairs(G, k)
        assert 0 < float(residual) <= 1.2e-7 * 1024**0.5 and depth < 40
    assert not dense_calls
