"""Metrics against independent float64 formulas (explicit Grams, SVD principal angles)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.continuity.metrics import (
    gram_numerator,
    gram_similarity_in,
    gram_similarity_out,
    index_matched_alignment,
    subspace_alignment,
    u1_cos,
    v1_cos,
)
from flowgeom.continuity.spectra import full_singular_pairs, small_gram
from flowgeom.errors import FlowgeomError


def _explicit(A, B, space):
    GA, GB = (A.mT @ A, B.mT @ B) if space == "in" else (A @ A.mT, B @ B.mT)
    return float((GA * GB).sum() / (GA.norm() * GB.norm()))


@settings(max_examples=10, deadline=None)
@given(m=st.integers(2, 30), m2=st.integers(2, 30), n=st.integers(2, 30), seed=st.integers(0, 999))
def test_gram_similarity_matches_explicit_grams(m, m2, n, seed):
    g = torch.Generator().manual_seed(seed)
    A, B = torch.randn(m, n, generator=g).double(), torch.randn(m2, n, generator=g).double()
    assert float(gram_similarity_in(A, B)) == pytest.approx(_explicit(A, B, "in"), rel=1e-10)
    assert float(gram_similarity_out(A.mT, B.mT)) == pytest.approx(_explicit(A.mT, B.mT, "out"), rel=1e-10)
    # both numerator paths (cached Grams vs cross product) agree
    if m == m2:
        (ga, side), (gb, _) = small_gram(A), small_gram(B)
        for space in ("in", "out"):
            cached = gram_numerator(A, B, space, gram_a=ga, gram_b=gb, side=side)
            cross = gram_numerator(A, B, space)
            assert float(cached) == pytest.approx(float(cross), rel=1e-10)


def test_gram_similarity_is_one_for_same_gram_and_scale_invariant():
    A = torch.randn(7, 5, dtype=torch.float64)
    Q, _ = torch.linalg.qr(torch.randn(7, 7, dtype=torch.float64))
    assert float(gram_similarity_in(A, 3.0 * Q @ A)) == pytest.approx(1.0, abs=1e-12)  # same A^T A up to scale


def test_subspace_alignment_is_mean_cos2_of_principal_angles():
    g = torch.Generator().manual_seed(0)
    X, _ = torch.linalg.qr(torch.randn(20, 4, generator=g, dtype=torch.float64))
    Y, _ = torch.linalg.qr(torch.randn(20, 4, generator=g, dtype=torch.float64))
    cosines = torch.linalg.svdvals(X.mT @ Y)  # cos of principal angles
    assert float(subspace_alignment(X, Y)) == pytest.approx(float(cosines.pow(2).mean()), rel=1e-12)
    assert float(subspace_alignment(X, X @ torch.linalg.qr(torch.randn(4, 4, dtype=torch.float64))[0])) == pytest.approx(1.0)


def test_index_matched_weights_and_sign_invariance():
    X = torch.eye(3, dtype=torch.float64)
    Y = torch.stack([-X[:, 0], X[:, 2], X[:, 1]], dim=1)  # first matches (sign flip), others swapped
    s = torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64)
    assert float(index_matched_alignment(X, s, Y, s)) == pytest.approx(4.0 / 6.0)


def test_v1_u1_cos_planted_and_sign_invariant():
    g = torch.Generator().manual_seed(3)
    u, v = torch.randn(12, generator=g).double(), torch.randn(9, generator=g).double()
    A = 5 * torch.outer(u, v) / (u.norm() * v.norm()) + 0.01 * torch.randn(12, 9, generator=g).double()
    B = -A + 0.01 * torch.randn(12, 9, generator=g).double()
    assert float(v1_cos(A, B)) > 0.999 and float(u1_cos(A, B)) > 0.999
    full_a, full_b = full_singular_pairs(A), full_singular_pairs(B)
    assert float(v1_cos(A, B)) == pytest.approx(float((full_a.V[:, 0] @ full_b.V[:, 0]).abs()), abs=1e-10)


def test_space_mismatch_is_a_clear_error():
    with pytest.raises(FlowgeomError, match="input dimension"):
        v1_cos(torch.randn(4, 5), torch.randn(4, 6))


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 30), m2=st.integers(1, 30), n=st.integers(1, 30), transposed=st.booleans(),
       dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 999))
def test_blas_cross_product_matches_matmul(m, m2, n, transposed, dtype, seed):
    """scipy ?gemm with transposition flags on .T views equals torch's product, for any memory layout."""
    from flowgeom.continuity._blas import cross_product

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    A = torch.randn(n, m, generator=g, dtype=dt).mT if transposed else torch.randn(m, n, generator=g, dtype=dt)
    B = torch.randn(m2, n, generator=g, dtype=dt)
    rtol = 1e-5 if dtype == "float32" else 1e-12
    assert torch.allclose(cross_product(A, B, "in").double(), A.double() @ B.double().mT, rtol=rtol, atol=rtol * n)
    C = torch.randn(m, m2, generator=g, dtype=dt)
    assert torch.allclose(cross_product(A, C, "out").double(), A.double().mT @ C.double(), rtol=rtol, atol=rtol * m)


def test_cpu_threads_sets_and_restores_both_pools():
    from flowgeom.continuity._blas import _controller, cpu_threads

    blas = lambda: {lib.num_threads for lib in _controller().select(user_api="blas").lib_controllers}  # noqa: E731
    before_torch, before_blas = torch.get_num_threads(), blas()
    torch.set_num_threads(2)
    try:
        with cpu_threads(1):
            assert torch.get_num_threads() == 1 and blas() == {1}
        assert torch.get_num_threads() == 2
        _controller.cache_clear()  # a fresh scan must see the original BLAS limits again
        assert blas() == before_blas
    finally:
        torch.set_num_threads(before_torch)
