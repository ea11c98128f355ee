"""Convergence-rate experiment on a tiny budget: regularised chains come back from the plateau, free ones do not."""

from __future__ import annotations

import pytest

from flowgeom.errors import FlowgeomError
from flowgeom.experiments.langevin_rate import RateConfig, plot_rate, run_rate


def test_rate_regularised_converges_free_stays(tmp_path):
    cfg = RateConfig(loss="lora", chains=8, steps=300, lr=0.1, restarts=2, restart_steps=200, regs=("none", "log"))
    result = run_rate(cfg)
    free, reg = result["suboptimality"]["none"], result["suboptimality"]["log"]
    assert reg[-1] < 0.6 * reg[0]  # pulled back off the plateau
    assert free[-1] > 0.8 * free[0]  # gradient ~ 0 out there: the free chains stay
    assert result["reached"]["log"] >= result["reached"]["none"]
    taus = [t for t in result["tau"]["log"] if t is not None]
    assert taus == sorted(taus)  # smaller ε never reached earlier
    plot_rate(result, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000


@pytest.mark.parametrize("bad", [dict(loss="norm1"), dict(lam=0.0), dict(eps=0.0), dict(temperature=-1.0), dict(chains=0)])
def test_rate_bad_config(bad):
    with pytest.raises(FlowgeomError):
        RateConfig(**bad)


def test_hitting_times_on_planted_exponential():
    """d(t) = e^{-t}: τ(ε) = log(1/ε) + const, slope 1 against log(1/ε); a flat curve never hits."""
    import math

    from flowgeom.langevin.rate import hitting_times

    times = [k * 0.001 for k in range(10001)]
    table = hitting_times({"exp": (times, [math.exp(-t) for t in times]), "flat": (times, [1.0] * len(times))},
                          floor_ratio=1e-3)
    assert table["slope"]["exp"] == pytest.approx(1.0, abs=1e-3)
    assert table["reached"]["flat"] == 0 and table["slope"]["flat"] is None
    for e, t in zip(table["eps"], table["tau"]["exp"]):
        assert t == pytest.approx(math.log(1 / e), abs=2e-3)
