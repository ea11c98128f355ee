"""The exact plain-SGD prediction h(θ_0) + Σ τ²·h(g): against measurement, a hand computation, and broken steps."""

import warnings

import pytest
import torch

from flowgeom.laws import catalogue
from flowgeom.laws.monitor import ConservationMonitor
from flowgeom.nn import build

ZOO = [("swiglu", {}), ("mha", {"positions": "none"}), ("mha", {"positions": "rope"}), ("moe", {})]


def _regression(model, seed):
    gen = torch.Generator().manual_seed(seed)
    x = model.sample_input(16, gen)
    with torch.no_grad():
        y = torch.randn(model(x).shape, generator=gen, dtype=x.dtype)
    return x, y


def _sgd(model, mon, opt, steps, *, seed=0, batch=4, after=None):
    """Mini-batch SGD on a random regression target; ``after(k)`` runs after each step (e.g. a perturbation)."""
    x, y = _regression(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for k in range(steps):
        idx = torch.randint(0, len(x), (batch,), generator=gen)
        opt.zero_grad()
        (0.5 * ((model(x[idx]) - y[idx]) ** 2).mean()).backward()
        opt.step()
        if after is not None:
            after(k)
    return mon.step(steps)


def _monitor(model, opt, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ConservationMonitor(model, optimizer=opt, warn=False, every=1, **kw)


@pytest.mark.parametrize("arch,opts", ZOO, ids=[f"{a}-{o.get('positions', '')}" for a, o in ZOO])
def test_prediction_equals_measurement_in_float64(arch, opts):
    model = build(arch, seed=0, **opts).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = _monitor(model, opt)
    rec = _sgd(model, mon, opt, 30)
    quadratic = sorted({t.family for t in mon.items if t.kind == "eps" and t.law.degree == 2})
    assert quadratic
    for fam in quadratic:
        assert rec[f"eps/{fam}"] > 1e-7, (fam, rec)  # a real drift, not round-off
        assert rec[f"pred_err/{fam}"] < 1e-6, (fam, rec)  # ‖h − ĥ‖ / ‖h − h_0‖
        assert rec[f"pred/{fam}"] == pytest.approx(rec[f"eps/{fam}"], rel=1e-6)
        assert rec[f"pred_excess/{fam}"] < 1.0
    s = mon.summary()
    assert {v["verdict"] for v in s["verdicts"]} == {"held"}, s["line"]
    assert "as expected (discretisation drift, predicted" in s["line"] and "NOT" not in s["line"]
    assert mon.prediction.steps == 30


def test_prediction_against_a_hand_computation_of_the_swiglu_law():
    """h_i = ‖up_i‖² − ‖down_:,i‖² per hidden unit, computed here from the weights and the gradients."""
    model = build("swiglu", seed=3).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = _monitor(model, opt)

    def h(up, down):  # (m,): up (m, d), down (d_out, m)
        return (up ** 2).sum(1) - (down ** 2).sum(0)

    w = lambda: (model.up_proj.weight.detach().clone(), model.down_proj.weight.detach().clone())  # noqa: E731
    h0 = h(*w())
    drift = torch.zeros_like(h0)
    x, y = _regression(model, 3)
    for k in range(25):
        opt.zero_grad()
        (0.5 * ((model(x[k % 16:k % 16 + 4]) - y[k % 16:k % 16 + 4]) ** 2).mean()).backward()
        drift += 0.1 ** 2 * h(model.up_proj.weight.grad, model.down_proj.weight.grad)  # τ²·h(g)
        opt.step()
    rec = mon.step(25)
    hk = h(*w())
    assert torch.allclose(hk - h0, drift, rtol=1e-9, atol=1e-15 * float(h0.abs().max()))  # the identity itself
    # the monitor's numbers: ε of ĥ = ‖Σ τ²h(g)‖ / ‖h_0‖ (one law vector), against the measured ε
    assert rec["pred/swiglu.up_down"] == pytest.approx(float(drift.norm() / h0.norm()), rel=1e-9)
    assert rec["eps/swiglu.up_down"] == pytest.approx(float((hk - h0).norm() / h0.norm()), rel=1e-9)


def test_float32_weights_agree_to_their_round_off():
    model = build("mha", seed=1, positions="rope")  # float32
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = _monitor(model, opt)
    rec = _sgd(model, mon, opt, 40)
    for fam in ("attn.qk_rope", "attn.vo"):
        assert rec[f"pred_excess/{fam}"] < 0.5, rec
        assert rec[f"pred_err/{fam}"] < 1e-2, rec
    assert "as expected (discretisation drift" in mon.summary()["line"]


def test_a_step_that_is_not_sgd_is_broken_beyond_round_off():
    """The same run with up_proj scaled by 1 + 1e-6 after each step: the law moves at first order, the prediction
    does not. The nudge is far below what the ratio ε_law/ε_control can see, far above float64 round-off."""
    model = build("swiglu", seed=0).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = _monitor(model, opt)

    def nudge(k):
        with torch.no_grad():
            model.up_proj.weight.mul_(1 + 1e-6)

    rec = _sgd(model, mon, opt, 20, after=nudge)
    assert rec["pred_excess/swiglu.up_down"] > 100, rec
    s = mon.summary()
    (v,) = s["verdicts"]
    assert v["verdict"] == "broken" and v["basis"] == "prediction"
    assert "NOT as expected for swiglu.up_down" in s["line"] and "beyond round-off" in s["line"]
    # the ratio heuristic alone would have called it held: the prediction is what catches it
    assert v["ratio"] < 0.1


def test_per_group_learning_rates_enter_the_step_and_break_the_law():
    """up and down trained at different rates: Δ = (τ_up g_up, τ_down g_down) is not along the gradient."""
    model = build("swiglu", seed=0).double()
    groups = [{"params": [model.up_proj.weight], "lr": 0.2},
              {"params": [model.gate_proj.weight, model.down_proj.weight], "lr": 0.05}]
    opt = torch.optim.SGD(groups, lr=0.05)
    mon = _monitor(model, opt)
    rec = _sgd(model, mon, opt, 20)
    assert rec["pred_excess/swiglu.up_down"] > 1e3 and mon.verdicts()[0].verdict == "broken"
    # equal rates in two groups: one SGD, exact again
    model = build("swiglu", seed=0).double()
    opt = torch.optim.SGD([{"params": [model.up_proj.weight]},
                           {"params": [model.gate_proj.weight, model.down_proj.weight]}], lr=0.05)
    mon = _monitor(model, opt)
    assert _sgd(model, mon, opt, 20)["pred_err/swiglu.up_down"] < 1e-6


def test_linear_laws_are_predicted_still_and_keep_the_ratio_verdict():
    model = build("moe", seed=0).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = _monitor(model, opt)
    rec = _sgd(model, mon, opt, 10)
    assert rec["pred/moe.router_sum"] == 0.0  # a linear law does not move under SGD
    v = {x.family: x for x in mon.verdicts()}
    assert v["moe.router_sum"].basis == "ratio" and v["moe.router_sum"].verdict == "held"
    assert {x.basis for f, x in v.items() if f != "moe.router_sum"} == {"prediction"}


def test_momentum_weight_decay_and_adam_have_no_exact_prediction():
    for kw in ({"momentum": 0.9}, {"weight_decay": 0.01}):
        model = build("swiglu", seed=0).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, **kw)
        mon = _monitor(model, opt)
        rec = _sgd(model, mon, opt, 5)
        assert mon.prediction is None and not any(k.startswith("pred") for k in rec)
    model = build("swiglu", seed=0).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = _monitor(model, opt)
    _sgd(model, mon, opt, 5)
    line = mon.summary()["line"]
    assert mon.prediction is None and "no prediction of the drift" in line and "as expected" in line


def test_predict_false_and_close_stop_the_hook():
    model = build("swiglu", seed=0).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    assert _monitor(model, opt, predict=False).prediction is None
    mon = _monitor(model, opt)
    _sgd(model, mon, opt, 3)
    mon.close()
    _sgd(model, mon, opt, 3)
    assert mon.prediction.steps == 3


def test_resume_continues_the_prediction():
    """10 steps, state saved, a new monitor restores it and sees 10 more: the same ĥ as 20 steps in one go."""
    def run(split):
        model = build("swiglu", seed=0).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        mon = _monitor(model, opt)
        x, y = _regression(model, 0)
        for k in range(20):
            if k == split:
                state = mon.state_dict()
                mon.close()
                mon = _monitor(model, opt)
                mon.load_state_dict(state)
            opt.zero_grad()
            (0.5 * ((model(x[k % 12:k % 12 + 4]) - y[k % 12:k % 12 + 4]) ** 2).mean()).backward()
            opt.step()
        return mon.step(20), mon
    (whole, _), (resumed, mon) = run(None), run(10)
    assert mon.prediction.steps == 20
    assert resumed["pred/swiglu.up_down"] == pytest.approx(whole["pred/swiglu.up_down"], rel=1e-12)
    # a state saved without the prediction: it cannot continue (the steps before are unknown)
    state = {k: v for k, v in mon.state_dict().items() if not k.startswith("sgd_")}
    mon.load_state_dict(state)
    assert mon.prediction is None


@pytest.mark.parametrize("arch,opts", ZOO, ids=[f"{a}-{o.get('positions', '')}" for a, o in ZOO])
def test_quadratic_laws_are_quadratic_forms(arch, opts):
    """The prediction's premise: each degree-2 law is a quadratic form (h(0) = 0 and the parallelogram identity
    h(a + b) + h(a − b) = 2h(a) + 2h(b)), each degree-1 law is linear."""
    model = build(arch, seed=0, **opts).double()
    names = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(0)
    a = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in names.items()}
    b = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in names.items()}
    zero = {n: torch.zeros_like(p) for n, p in a.items()}
    comb = lambda s, t: {n: a[n] * s + b[n] * t for n in a}  # noqa: E731
    for law in catalogue(model).laws:
        ha, hb = law.evaluate(a), law.evaluate(b)
        scale = float(ha.abs().max() + hb.abs().max())
        assert float(law.evaluate(zero).abs().max()) == 0.0, law.name
        if law.degree == 2:
            err = law.evaluate(comb(1, 1)) + law.evaluate(comb(1, -1)) - 2 * ha - 2 * hb
        else:
            assert law.degree == 1, law.name
            err = law.evaluate(comb(1, 1)) - ha - hb
        assert float(err.abs().max()) <= 1e-12 * scale, law.name


def test_a_saved_prediction_is_replayed_only_where_it_can_be_followed():
    model = build("swiglu", seed=0).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = _monitor(model, opt)
    _sgd(model, mon, opt, 3)
    state = mon.state_dict()
    assert int(state["sgd_steps"]) == 3
    off = _monitor(model, opt, predict=False)  # trains but does not follow the steps: the prediction would not move
    off.load_state_dict(state)
    assert off.prediction is None
    replay = ConservationMonitor(model, warn=False)  # no optimiser: conserve drift's replay of a checkpoint
    replay.load_state_dict(state)
    assert replay.prediction.steps == 3 and torch.equal(replay.prediction.h, mon.prediction.h)
