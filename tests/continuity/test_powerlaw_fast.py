"""The fast alpha fit (numpy, pruned x_min scan) against the exhaustive scan and the pre-optimisation torch code.

Pins the performance rewrite of ``powerlaw.fit_power_law``: the pruning is
exact (same x_min, hence alpha bit for bit) and the numpy rewrite gives the
same alpha as the torch implementation it replaced (kept below, verbatim in
its arithmetic, as the reference), on planted power laws, ties, flat tails
and real SmolLM2 spectra.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.continuity.powerlaw import EVALS_THRESH, _ks_argmin_pruned, fit_power_law, layer_spectrum

F64 = torch.float64


def _torch_fit(evals: torch.Tensor) -> tuple[float, float, float] | None:
    """The N >= 20 branch of the torch implementation before the rewrite: ``(alpha, xmin, D)``, exhaustive scan."""
    lam = evals.to(F64).reshape(-1)
    x = torch.sort(lam[lam > EVALS_THRESH]).values
    N = x.shape[0]
    logx = x.log()
    tail_log = torch.flip(torch.cumsum(torch.flip(logx, [0]), 0), [0])
    n = (N - torch.arange(N - 1)).to(F64)
    alpha = 1 + n / (tail_log[:-1] - n * logx[:-1])
    beta = torch.where(torch.isfinite(alpha), 1 - alpha, torch.zeros_like(alpha))
    pos = torch.arange(N, dtype=F64)
    D = torch.ones(N - 1, dtype=F64)
    for i in range(N - 1):
        power = ((logx[i:] - logx[i]) * beta[i]).exp()
        emp = (pos[i:] - i) / (N - i)
        D[i] = (1 - (power + emp)).abs().max()
    D = torch.where(alpha > 1, D, torch.ones_like(D))
    best = int(torch.argmin(D))
    return float(alpha[best]), float(x[best]), float(D[best])


def _pareto(alpha: float, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (1.0 - rng.random(n)) ** (-1.0 / (alpha - 1.0))  # rho(l) ~ l^-alpha, l >= 1


def _assert_same(evals: np.ndarray) -> None:
    t = torch.from_numpy(evals)
    fast, full = fit_power_law(t), fit_power_law(t, prune=False)
    assert fast is not None and full is not None
    assert (fast.alpha, fast.xmin, fast.n_tail, fast.n_fit) == (full.alpha, full.xmin, full.n_tail, full.n_fit)
    assert fast.D == pytest.approx(full.D, rel=1e-12, abs=1e-15)
    ref = _torch_fit(t)
    assert fast.xmin == ref[1]
    assert fast.alpha == pytest.approx(ref[0], rel=1e-12, abs=1e-10)
    assert fast.D == pytest.approx(ref[2], rel=1e-12, abs=1e-15)


@settings(max_examples=30, deadline=None)
@given(alpha=st.floats(1.5, 6.0), n=st.integers(20, 400), seed=st.integers(0, 2**16),
       bulk=st.floats(0.0, 0.9), repeats=st.integers(0, 3))
def test_pruned_scan_is_the_exhaustive_scan(alpha, n, seed, bulk, repeats):
    """A Pareto tail over a log-normal bulk, with repeated values (ties in x and in D): identical fits."""
    rng = np.random.default_rng(seed)
    k = int(bulk * n)
    evals = np.concatenate([_pareto(alpha, n - k, seed), np.exp(rng.normal(-1.0, 1.0, size=k))])
    if repeats:  # exact duplicates: flat stretches of the ESD
        evals = np.concatenate([evals, np.repeat(evals[: 5 * repeats], repeats)])
    _assert_same(evals)


@pytest.mark.parametrize("alpha", [2.0, 3.5, 5.0])
def test_planted_alpha_is_recovered_by_the_pruned_fit(alpha):
    """ESD drawn from rho(l) ~ l^-alpha: |alpha_hat - alpha| <= 4 standard errors (alpha - 1) / sqrt(n_tail)."""
    lam = _pareto(alpha, 576, seed=int(alpha * 10))
    fit = fit_power_law(torch.from_numpy(lam))
    assert fit.n_tail >= 57
    assert abs(fit.alpha - alpha) <= 4 * (alpha - 1) / math.sqrt(fit.n_tail), (fit.alpha, alpha)
    _assert_same(lam)


def test_degenerate_spectra_flat_tail_and_constant():
    """A flat top (alpha = inf there), an all-equal spectrum (every alpha invalid) and a two-level spectrum."""
    flat_top = np.concatenate([_pareto(3.0, 100, 1), np.full(30, 50.0)])
    _assert_same(flat_top)
    const = np.full(40, 2.0)
    fast, full = fit_power_law(torch.from_numpy(const)), fit_power_law(torch.from_numpy(const), prune=False)
    assert (fast.alpha, fast.xmin, fast.D) == (full.alpha, full.xmin, full.D)
    two = np.concatenate([np.full(25, 1.0), np.full(25, 3.0)])
    fast, full = fit_power_law(torch.from_numpy(two)), fit_power_law(torch.from_numpy(two), prune=False)
    assert (fast.alpha, fast.xmin, fast.D) == (full.alpha, full.xmin, full.D)


def test_pruning_evaluates_few_candidates_and_bounds_hold():
    """The lower bounds really prune (the point of the rewrite) and every evaluated D is >= its bound."""
    lam = np.sort(_pareto(2.5, 576, seed=3))
    logx = np.log(lam)
    N = len(lam)
    n = (N - np.arange(N - 1)).astype(np.float64)
    s = np.cumsum(logx[::-1])[::-1][:-1] - n * logx[:-1]
    alpha = 1 + n / s
    best, D = _ks_argmin_pruned(logx, 1 - alpha, alpha > 1)
    evaluated = np.isfinite(D)
    assert evaluated.sum() <= N // 4
    full = fit_power_law(torch.from_numpy(lam), prune=False)
    assert D[best] == pytest.approx(full.D, rel=1e-12) and lam[best] == full.xmin


def test_real_smollm2_spectra_unchanged():
    """Eigenvalues of real SmolLM2 projections (float32 Grams, as the CLI computes them): same fit as before."""
    from flowgeom.continuity import open_source
    from flowgeom.continuity.layouts import hints_for
    from flowgeom.continuity.naming import resolve_roles

    src = open_source("builtin:smollm2")
    layout = resolve_roles(src.shapes, hints=hints_for("builtin:smollm2"))
    for role, layer in [("q", 0), ("k", 7), ("up", 15), ("down", 29)]:
        W = layout.roles[role][layer].load(src).float()
        G = W.mT @ W if W.shape[1] <= W.shape[0] else W @ W.mT
        evals = torch.linalg.eigvalsh(G.double()).numpy()
        _assert_same(evals)
        out = layer_spectrum(torch.from_numpy(evals), tuple(W.shape), torch.finfo(torch.float32).eps)
        assert out["alpha"] == fit_power_law(torch.from_numpy(evals), prune=False).alpha
