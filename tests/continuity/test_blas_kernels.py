"""The GIL-free BLAS/LAPACK kernels (continuity/_blas.py) against scipy's own wrappers: bit for bit.

The kernels call the routines scipy links through its published function
pointers; the references here go through ``scipy.linalg.blas``/``lapack``
(f2py), the path the analyzer used before. Equality is exact, so the
analyzer's numbers do not move with the change of calling route, and a
second thread really runs while a kernel holds no GIL.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.linalg import blas, lapack

from flowgeom.continuity import _blas
from flowgeom.errors import FlowgeomError

DTYPES = (np.float32, np.float64)


def matrix(m: int, n: int, dtype, seed: int, graded: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, n))
    if graded:  # a spread of scales: the eigensolvers' harder regime
        a *= np.logspace(0, -6, n)
    return a.astype(dtype)


def symmetric(d: int, dtype, seed: int, graded: bool = False) -> np.ndarray:
    a = matrix(d + 3, d, dtype, seed, graded)
    g = a.T @ a
    return ((g + g.T) / 2).astype(dtype)


def reference_tridiagonal_top(g: np.ndarray, k: int):
    """The f2py route (scipy.linalg.lapack): ?sytrd on the upper triangle, ?sterf, ?stemr; then Q applied
    reflector by reflector in numpy (scipy wraps no ?ormtr/?ormql), as LAPACK documents Q for uplo = U:
    Q = H(d-1) ... H(1), H(i) = I - tau_i v v^T, v = (c[:i-1, i], 1, 0, ...) (1-based)."""
    pre = "s" if g.dtype == np.float32 else "d"
    fn = lambda name: getattr(lapack, pre + name)  # noqa: E731
    d = g.shape[0]
    lwork = int(fn("sytrd_lwork")(d, lower=0)[0])
    c, diag, off, tau, info = fn("sytrd")(g.T, lower=0, lwork=lwork)
    values, info = fn("sterf")(diag, off)
    off_n = np.zeros(d, dtype=g.dtype)
    off_n[:-1] = off
    args = (diag, off_n, 2, 0.0, 1.0, d - k + 1, d)
    lw, liw, info = fn("stemr_lwork")(*args, compute_v=1)
    m, w, z, info = fn("stemr")(*args, compute_v=1, lwork=lw, liwork=liw)
    y = z[:, :k].astype(np.float64)
    for i in range(d - 1):  # 0-based reflector i: v[:i] = c[:i, i + 1], v[i] = 1; applied H(1) first
        v = np.zeros(d)
        v[:i] = c[:i, i + 1]
        v[i] = 1.0
        y -= tau[i] * np.outer(v, v @ y)
    return values, w[:k][::-1], y[:, ::-1]


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 40), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_syrk_gram_equals_scipy_syrk(m, n, dtype, seed):
    X = matrix(m, n, dtype, seed)
    for side, trans in (("in", 0), ("out", 1)):
        upper = getattr(blas, ("s" if dtype == np.float32 else "d") + "syrk")(1.0, X.T, trans=trans)
        expected = upper + upper.T
        np.fill_diagonal(expected, np.diag(upper))
        got = _blas.syrk_gram(torch.from_numpy(X), side).numpy()
        assert np.array_equal(got, expected)
        assert np.allclose(got, X.T @ X if side == "in" else X @ X.T, rtol=1e-4, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 30), m2=st.integers(1, 30), n=st.integers(1, 30), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_cross_product_equals_scipy_gemm(m, m2, n, dtype, seed):
    gemm = getattr(blas, ("s" if dtype == np.float32 else "d") + "gemm")
    A, B = matrix(m, n, dtype, seed), matrix(m2, n, dtype, seed + 1)
    got = _blas.cross_product(torch.from_numpy(A), torch.from_numpy(B), "in").numpy()
    assert np.array_equal(got, gemm(1.0, A.T, B.T, trans_a=1))
    A, B = matrix(n, m, dtype, seed), matrix(n, m2, dtype, seed + 1)
    got = _blas.cross_product(torch.from_numpy(A), torch.from_numpy(B), "out").numpy()
    assert np.array_equal(got, gemm(1.0, A.T, B.T, trans_b=1))


@settings(max_examples=30, deadline=None)
@given(d=st.integers(2, 70), frac=st.floats(0, 1), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       graded=st.booleans())
def test_tridiagonal_top_equals_the_f2py_route(d, frac, dtype, seed, graded):
    k = max(1, round(frac * d))
    g = symmetric(d, dtype, seed, graded)
    values, w, y = _blas.tridiagonal_top(g, k)
    ref_values, ref_w, ref_y = reference_tridiagonal_top(g, k)
    assert np.array_equal(values, ref_values) and np.array_equal(w, ref_w)
    assert np.abs(y - ref_y).max() <= 20 * d * np.finfo(dtype).eps  # unit columns: ?ormtr blocks the same product
    exact = np.linalg.eigvalsh(g.astype(np.float64))  # and right, not merely equal
    tol = (1e-4 if dtype == np.float32 else 1e-10) * max(exact[-1], 1e-30)
    assert np.abs(values - exact).max() <= tol


@settings(max_examples=30, deadline=None)
@given(d=st.integers(1, 70), frac=st.floats(0, 1), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       graded=st.booleans())
def test_top_pairs_alone_match_scipy_eigh(d, frac, dtype, seed, graded):
    """Without ?sterf (the default analysis), the top-k pairs are the same bits as with it, and agree with
    scipy's ?syevr to rounding: same values, same vectors up to sign."""
    k = max(1, round(frac * d))
    g = symmetric(d, dtype, seed, graded)
    values, w, y = _blas.tridiagonal_top(g, k, all_values=False)
    assert values is None
    _, w_all, y_all = _blas.tridiagonal_top(g, k)
    assert np.array_equal(w, w_all) and np.array_equal(y, y_all)
    ref_w, ref_y = scipy.linalg.eigh(g.astype(np.float64), subset_by_index=[d - k, d - 1])
    ref_w, ref_y = ref_w[::-1], ref_y[:, ::-1]
    eps = np.finfo(dtype).eps
    assert np.abs(w - ref_w).max() <= 50 * d * eps * max(ref_w[0], 1e-30)
    full = np.r_[np.inf, np.linalg.eigvalsh(g.astype(np.float64))[::-1], -np.inf]  # descending, padded
    gaps = np.minimum(full[:-2] - full[1:-1], full[1:-1] - full[2:])[:k]  # to the nearest other eigenvalue
    well_separated = gaps > 1e-3 * max(ref_w[0], 1e-30)
    cos = np.abs(np.sum(y.astype(np.float64) * ref_y, axis=0))
    assert np.all(cos[well_separated] > 1 - 1e-3)  # Davis-Kahan: vectors are defined only up to the gap


def test_smollm2_sized_gram_matches_the_f2py_route():
    """The analyzer's real size (576, k = 8) in float32, where blocked ?sytrd and workspace sizes matter:
    the reduction's eigenvalues are the f2py route's bits, the vectors its reflectors' product to rounding."""
    g = symmetric(576, np.float32, 3)
    (values, w, y), (ref_values, ref_w, ref_y) = _blas.tridiagonal_top(g, 8), reference_tridiagonal_top(g, 8)
    assert np.array_equal(values, ref_values) and np.array_equal(w, ref_w)
    assert np.abs(y - ref_y).max() <= 1e-5


def test_nan_gram_is_one_clear_error():
    g = symmetric(12, np.float64, 0)
    g[3, 4] = g[4, 3] = np.nan
    with pytest.raises(FlowgeomError, match="LAPACK"):
        _blas.tridiagonal_top(g, 2, all_values=False)


def test_kernels_release_the_gil():
    """While a long ?gemm runs in one thread, a pure-Python thread keeps counting (it could not with the GIL held)."""
    A = torch.from_numpy(matrix(1500, 1500, np.float64, 0))
    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    with _blas.cpu_threads(1):
        _blas.cross_product(A, A, "in")  # warm up (first-call setup holds the GIL)
        counter = threading.Thread(target=count)
        counter.start()
        try:
            before = ticks[0]
            for _ in range(3):
                _blas.cross_product(A, A, "in")
            during = ticks[0] - before
        finally:
            stop.set()
            counter.join()
    assert during > 1000, f"the counting thread advanced only {during} times during three 1500^3 products"


@settings(max_examples=30, deadline=None)
@given(L=st.integers(1, 3), m=st.integers(1, 30), n=st.integers(1, 30), p=st.integers(1, 10),
       dtype=st.sampled_from(DTYPES), transpose_a=st.booleans(), seed=st.integers(0, 2**16))
def test_matmul_equals_numpy(L, m, n, p, dtype, transpose_a, seed):
    A = torch.from_numpy(np.stack([matrix(n, m, dtype, seed + i) if transpose_a else matrix(m, n, dtype, seed + i)
                                   for i in range(L)]))
    B = torch.from_numpy(np.stack([matrix(n, p, dtype, seed + 10 + i) for i in range(L)]))
    got = _blas.matmul(A, B, transpose_a=transpose_a)
    expected = (A.mT if transpose_a else A).double() @ B.double()
    assert got.shape == (L, m, p) and got.dtype == A.dtype
    assert torch.allclose(got.double(), expected, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)
