"""Kunin et al.'s predicted drift: the integrator against scipy, the closed form, and real training."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from flowgeom.errors import FlowgeomError
from flowgeom.laws.monitor import ConservationMonitor
from flowgeom.laws.predict import DriftPredictor, hyper_of


class _OneLaw:
    """The smallest monitor a predictor needs: one scalar degree-2 law with h(θ_0) = h0."""

    def __init__(self, h0: float, degree: int = 2):
        law = type("L", (), {"count": 1, "degree": degree})()
        self.items = [type("T", (), {"kind": "eps", "law": law})()]
        self.h0 = torch.tensor([h0], dtype=torch.float64)


@pytest.mark.parametrize("beta,lam", [(0.0, 0.0), (0.0, 0.5), (0.9, 0.0), (0.9, 0.3), (0.5, 2.0)])
def test_integrator_matches_scipy_on_the_modified_equation(beta, lam):
    from scipy.integrate import solve_ivp

    eta, steps, h0 = 0.05, 40, 1.3
    drive = 0.2 + 0.1 * np.sin(np.arange(steps))  # h(θ̇) per step, held constant over the step
    pr = DriftPredictor(_OneLaw(h0))
    for k in range(steps):
        pr.advance(lr=eta, momentum=beta, weight_decay=lam, drive=torch.tensor([drive[k]]), drive_is_gradient=False)
    a, b, c = eta / 2 * (1 + beta), 1 - beta, 2 * lam
    h, u = h0, 0.0
    for k in range(steps):  # an independent integration, step by step, of a ḧ + b ḣ + c h = η(1+β)·drive
        f = eta * (1 + beta) * drive[k]
        sol = solve_ivp(lambda t, x: [x[1], (f - c * x[0] - b * x[1]) / a], (0, eta), [h, u], rtol=1e-11, atol=1e-13,
                        method="LSODA")
        h, u = sol.y[0, -1], sol.y[1, -1]
    assert float(pr.h[0]) == pytest.approx(h, rel=1e-6)
    assert float(pr.u[0]) == pytest.approx(u, rel=1e-5, abs=1e-9)


def test_weight_decay_tends_to_kunins_closed_form():
    """β = 0: h(t) = e^{−2λt}h0 + η∫e^{−2λ(t−s)} h(g) ds, up to the O(η) inertia of the modified equation."""
    eta, lam, steps, h0, hg = 0.01, 0.5, 400, 2.0, 3.0
    pr = DriftPredictor(_OneLaw(h0))
    for _ in range(steps):
        pr.advance(lr=eta, weight_decay=lam, drive=torch.tensor([hg]), drive_is_gradient=True)
    t = eta * steps
    closed = math.exp(-2 * lam * t) * h0 + eta * hg * (1 - math.exp(-2 * lam * t)) / (2 * lam)
    assert float(pr.h[0]) == pytest.approx(closed, rel=2e-3)
    assert pr.t == pytest.approx(t)
    # a linear law (degree 1) decays at rate λ and has no drive
    lin = DriftPredictor(_OneLaw(h0, degree=1))
    for _ in range(steps):
        lin.advance(lr=eta, weight_decay=lam, drive=torch.tensor([hg]), drive_is_gradient=True)
    assert float(lin.h[0]) == pytest.approx(h0 * math.exp(-lam * t), rel=5e-3)
    # exactly: (η/2)ḧ + ḣ + λh = 0 with ḣ(0) = 0 has roots r = (−1 ± √(1 − 2ηλ))/η
    r1, r2 = (-1 + math.sqrt(1 - 2 * eta * lam)) / eta, (-1 - math.sqrt(1 - 2 * eta * lam)) / eta
    exact = h0 * (r1 * math.exp(r2 * t) - r2 * math.exp(r1 * t)) / (r1 - r2)
    assert float(lin.h[0]) == pytest.approx(exact, rel=1e-9)


def _train(model, opt, steps, *, seed=0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = ConservationMonitor(model, optimizer=opt, warn=False)
    pr = DriftPredictor(mon)
    named = dict(model.named_parameters())
    g = torch.Generator().manual_seed(seed)
    beta = opt.param_groups[0]["momentum"]
    for _ in range(steps):
        ids = torch.randint(3, 64, (4, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        hyper = hyper_of(opt, mon.param_names, [named[n] for n in mon.param_names])
        if beta == 0:
            drive = mon.values_at({n: named[n].grad for n in mon.param_names})
        opt.step()
        if beta:
            drive = mon.values_at({n: opt.state[named[n]]["momentum_buffer"] for n in mon.param_names})
        pr.advance(lr=pr.per_item(hyper, "lr"), momentum=beta, weight_decay=pr.per_item(hyper, "weight_decay"),
                   drive=drive, drive_is_gradient=beta == 0)
        opt.zero_grad()
    return mon, pr.compare(mon.values())


@pytest.mark.parametrize("momentum,wd,lr", [(0.0, 0.1, 0.05), (0.9, 0.0, 0.01), (0.9, 0.1, 0.01)])
def test_prediction_agrees_with_real_training(tiny_llama, momentum, wd, lr):
    pytest.importorskip("transformers")
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    mon, c = _train(model, opt, 40)
    rec = mon.step(40)
    for fam in ("attn.vo", "mlp.gated"):
        assert c[f"pred_err/{fam}"] < 0.05, (fam, c)  # the predicted h is within 5% of the drift of the measured h
        assert c[f"pred/{fam}"] == pytest.approx(rec[f"eps/{fam}"], rel=0.05)


def test_bad_hyper_parameters():
    pr = DriftPredictor(_OneLaw(1.0))
    with pytest.raises(FlowgeomError, match="momentum"):
        pr.advance(lr=0.1, momentum=1.0, drive=torch.tensor([0.0]), drive_is_gradient=False)
    with pytest.raises(FlowgeomError, match="momentum buffer"):
        pr.advance(lr=0.1, momentum=0.9, drive=torch.tensor([0.0]), drive_is_gradient=True)
    with pytest.raises(FlowgeomError, match="positive learning rate"):
        pr.advance(lr=0.0, drive=torch.tensor([0.0]), drive_is_gradient=True)
