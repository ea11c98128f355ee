"""Villani probe: derivative estimates vs closed forms, verdicts on textbook and paper losses."""

from __future__ import annotations

import math

import pytest
import torch

from flowgeom.errors import FlowgeomError
from flowgeom.langevin import Regularizer, derivatives, norm_objective, objective, orbit_integral, plot, probe


def test_exact_derivatives_closed_form_norm2():
    obj = norm_objective(2, dim=5)
    theta = torch.arange(5, dtype=torch.float64)
    d = derivatives(obj.flat, theta, exact=True)
    r2 = float(theta.pow(2).sum())
    assert d.value == pytest.approx(r2) and d.grad_sq == pytest.approx(4 * r2) and d.laplacian == pytest.approx(10)
    assert d.villani(0.5) == pytest.approx(8 * r2 - 10)


def test_hutchinson_matches_exact_within_error_bars():
    obj = objective("attention").with_regularizer(Regularizer("log", lam=0.05))
    theta = torch.randn(obj.dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = derivatives(obj.flat, theta, exact=True)
    est = derivatives(obj.flat, theta, exact=False, probes=400, generator=torch.Generator().manual_seed(1))
    assert est.laplacian_err > 0
    assert abs(est.laplacian - exact.laplacian) < 4 * est.laplacian_err
    assert est.grad_sq == pytest.approx(exact.grad_sq)


def test_regulariser_laplacian_matches_probe():
    reg = Regularizer("power", lam=0.2, eps=0.7)
    obj = norm_objective(2, dim=6).with_regularizer(reg)
    theta = torch.linspace(-1, 2, 6, dtype=torch.float64)
    d = derivatives(obj.flat, theta, exact=True)
    assert d.laplacian == pytest.approx(12 + float(reg.laplacian(theta)))


@pytest.mark.parametrize("name,reg,expected", [
    ("norm2", "none", "holds"), ("norm1", "none", "fails"),
    ("attention", "none", "fails"), ("attention", "log", "holds"), ("attention", "power", "holds"),
    ("lora", "none", "fails"), ("lora", "log", "holds"), ("lora", "power", "holds"),
    # measured, λ = 0.01: plain weight decay loses to the growing Laplacian along the LoRA orbit
    ("lora", "frobenius", "fails"),
])
def test_verdicts(name, reg, expected):
    obj = objective(name)
    if reg != "none":
        obj = obj.with_regularizer(Regularizer(reg, lam=0.01, eps=0.5))
    report = probe(obj, temperature=1.0, rays=2, points=8)
    assert report.verdict == expected, [(p.kind, p.verdict) for p in report.paths]
    if name in ("attention", "lora"):
        assert report.orbit_integral["verdict"] == ("diverges" if reg == "none" else "converges")
    if reg == "frobenius":  # confining (V → ∞, ∫ converges) yet not Villani: Q → −∞ on the orbit
        orbit = report.paths[-1]
        assert orbit.kind == "orbit" and orbit.confining and orbit.villani[-1] < 0


def test_norm1_quantity_tends_to_finite_limit():
    report = probe(norm_objective(1, dim=4), temperature=0.5, rays=1, points=8)
    q = report.paths[0].villani
    assert q[-1] == pytest.approx(1 / 0.5, rel=0.01)  # |∇‖x‖|² = 1, Δ‖x‖ = (D−1)/r → 0


def test_orbit_integral_linear_vs_saturating():
    base = objective("lora")
    theta = torch.randn(base.dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    free = orbit_integral(base, theta, temperature=1.0, t_max=6.0)
    assert free["I"][-1] == pytest.approx(free["T"][-1], rel=1e-9)  # integrand ≡ 1: I(T) = T
    conf = orbit_integral(base.with_regularizer(Regularizer("power", lam=0.01)), theta, temperature=1.0, t_max=6.0)
    assert conf["I"][-1] - conf["I"][-3] < 1e-6 * conf["I"][-1]


def test_probe_rejects_bad_options_and_plots(tmp_path):
    with pytest.raises(FlowgeomError):
        probe(norm_objective(2), temperature=0.0)
    with pytest.raises(FlowgeomError):
        probe(norm_objective(2), r_max=2.0)
    report = probe(norm_objective(2), rays=1, points=5, exact_max_dim=0, probes=16)
    assert not report.exact and report.verdict == "holds"
    plot(report, tmp_path / "v.png")
    assert (tmp_path / "v.png").stat().st_size > 1000
    assert math.isfinite(report.paths[0].villani[-1])


@pytest.mark.parametrize("reg,lam,expected", [("log", 1e-3, "holds"), ("log", 1e-4, "inconclusive")])
def test_extension_past_r_max(reg, lam, expected):
    """Tiny λ: Q < 0 at r_max on the LoRA orbit; the far pass finds the log term winning (or still catching up)."""
    obj = objective("lora").with_regularizer(Regularizer(reg, lam=lam))
    report = probe(obj, rays=1, points=8)
    orbit = report.paths[-1]
    assert orbit.extended and orbit.verdict == expected, orbit.reason
    assert max(orbit.radius) > 1e29
