"""Analytical random baselines against Monte-Carlo draws of Gaussian matrices."""

from __future__ import annotations

import pytest
import torch

from flowgeom.continuity.baselines import analytic_baselines, expected_abs_cos, monte_carlo_baselines


@pytest.mark.parametrize("d", [1, 2, 3, 10, 100])
def test_expected_abs_cos_matches_sampling(d):
    g = torch.Generator().manual_seed(d)
    x = torch.nn.functional.normalize(torch.randn(40_000, d, generator=g, dtype=torch.float64), dim=1)
    y = torch.nn.functional.normalize(torch.randn(40_000, d, generator=g, dtype=torch.float64), dim=1)
    sample = (x * y).sum(1).abs()
    assert expected_abs_cos(d) == pytest.approx(float(sample.mean()), abs=4 * float(sample.std()) / 200 + 1e-12)
    if d == 1:
        assert expected_abs_cos(1) == pytest.approx(1.0)


@pytest.mark.parametrize("shape", [(48, 32), (32, 64)])
def test_analytic_matches_monte_carlo(shape):
    k = 3
    mc = monte_carlo_baselines(shape, k=k, draws=24, seed=1)
    an = analytic_baselines(shape, k=k)
    assert set(mc) == set(an)
    for key, (mean, std) in mc.items():
        se = std / 24 ** 0.5
        if key.startswith("gram"):  # ratio of expectations: within 2%
            assert mean == pytest.approx(an[key], rel=0.02), key
        else:  # exact expectations: within 4 standard errors
            assert abs(mean - an[key]) < 4 * se + 1e-3, (key, mean, an[key], se)
