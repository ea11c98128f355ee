"""Statistical tests: long Langevin runs sample exp(−2V/s) (many independent chains, one tensor)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from flowgeom.langevin import Langevin

CHAINS = 20000


def _sample(potential, *, lr: float, s: float, steps: int, seed: int, x0: float = 0.0,
            symmetric: bool = False) -> np.ndarray:
    """Run CHAINS independent 1-D chains for ``steps`` and return the final positions."""
    start = torch.full((CHAINS,), x0, dtype=torch.float64)
    if symmetric:  # half the chains in each well: the target is symmetric, mixing is then within wells
        start[::2] *= -1
    x = torch.nn.Parameter(start)
    opt = Langevin([x], lr=lr, temperature=s, seed=seed)
    for _ in range(steps):
        opt.zero_grad()
        potential(x).sum().backward()
        opt.step()
    return x.detach().numpy()


@pytest.mark.parametrize("a,s,lr", [(1.0, 1.0, 0.05), (4.0, 0.5, 0.02)])
def test_quadratic_matches_gibbs_with_known_bias(a, s, lr):
    x = _sample(lambda x: 0.5 * a * x.pow(2), lr=lr, s=s, steps=int(8 / (a * lr)), seed=1, x0=2.0)
    gibbs_var = s / (2 * a)  # exp(−2V/s) = N(0, s/(2a))
    chain_var = s / (a * (2 - a * lr))  # exact stationary variance of the Euler chain
    n = len(x)
    assert abs(x.mean()) < 4 * np.sqrt(chain_var / n)
    # sample variance CI (chi^2, 4 sigma) must contain the chain's value
    assert abs(x.var() - chain_var) < 4 * chain_var * np.sqrt(2 / n)
    # and the Gibbs value, within the O(lr) bias
    assert abs(x.var() - gibbs_var) <= abs(chain_var - gibbs_var) + 4 * chain_var * np.sqrt(2 / n)
    p = stats.kstest(x, stats.norm(scale=np.sqrt(chain_var)).cdf).pvalue
    assert p > 1e-3, p


def _double_well_cdf(s: float):
    grid = np.linspace(-4, 4, 20001)
    dens = np.exp(-2 * (grid**2 - 1) ** 2 / s)
    cdf = integrate.cumulative_trapezoid(dens, grid, initial=0.0)
    return grid, dens / cdf[-1], cdf / cdf[-1]


@pytest.fixture(scope="module")
def double_well():
    """Samples at s = 1 (lr 4e-3, 3000 steps; half the chains started in each well)."""
    return _sample(lambda x: (x.pow(2) - 1).pow(2), lr=4e-3, s=1.0, steps=3000, seed=2, x0=1.0, symmetric=True)


def test_double_well_matches_gibbs(double_well):
    x = double_well
    grid, dens, cdf = _double_well_cdf(1.0)
    m2 = integrate.trapezoid(grid**2 * dens, grid)
    m4 = integrate.trapezoid(grid**4 * dens, grid)
    n = len(x)
    assert abs(x.mean()) < 4 * np.sqrt(m2 / n)  # symmetric wells, half started in each
    assert abs((x**2).mean() - m2) < 4 * np.sqrt((m4 - m2**2) / n)
    p = stats.kstest(x, lambda q: np.interp(q, grid, cdf)).pvalue
    assert p > 1e-3, p


def test_ks_detects_wrong_temperature(double_well):
    """The test has power: samples at s=1 are rejected against the s=0.5 Gibbs measure."""
    x = double_well
    grid, _, cdf = _double_well_cdf(0.5)
    assert stats.kstest(x, lambda q: np.interp(q, grid, cdf)).pvalue < 1e-6


def test_double_well_barrier_crossing_from_one_well():
    """Chains all started in the right well populate the left one (the chain mixes, not just wobbles)."""
    x = _sample(lambda x: (x.pow(2) - 1).pow(2), lr=4e-3, s=1.0, steps=1500, seed=4, x0=1.0)
    assert 0.25 < (x < 0).mean() < 0.5
