"""Verdicts per law family and the optimiser's expected behaviour (wrappers unwrapped)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from flowgeom.errors import FlowgeomError
from flowgeom.laws.monitor import ConservationMonitor, is_plain_sgd, warn_plain_gd_only
from flowgeom.laws.verdict import HELD_THRESHOLD, describe_optimizer, family_verdicts, summary_line
from flowgeom.nn import SwiGLU


def _params():
    return [torch.nn.Parameter(torch.ones(2))]


def test_kinds_of_torch_optimizers():
    p = _params()
    assert describe_optimizer(torch.optim.SGD(p, lr=0.1)).kind == "sgd"
    assert describe_optimizer(torch.optim.SGD(p, lr=0.1, weight_decay=0.01)).kind == "sgd+wd"
    info = describe_optimizer(torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01))
    assert (info.kind, info.momentum, info.weight_decay, info.lr) == ("momentum", 0.9, 0.01, 0.1)
    assert describe_optimizer(torch.optim.Adam(p)).kind == "adam"
    assert describe_optimizer(torch.optim.AdamW(p)).expected == "broken"
    assert describe_optimizer(torch.optim.LBFGS(p)).kind == "other"


def test_wrappers_are_seen_through():
    accelerate = pytest.importorskip("accelerate")
    sgd = torch.optim.SGD(_params(), lr=0.1)
    # the real class; its __init__ needs a global Accelerator() (which the Trainer makes), so set what it sets
    wrapped = object.__new__(accelerate.optimizer.AcceleratedOptimizer)
    wrapped.optimizer = sgd
    assert type(wrapped) is not torch.optim.SGD
    assert is_plain_sgd(wrapped) and describe_optimizer(wrapped).name == "SGD"

    class Holder:  # any object holding an .optimizer (no param_groups of its own)
        def __init__(self, inner):
            self.optimizer = inner
    assert is_plain_sgd(Holder(Holder(sgd)))
    lightning = pytest.importorskip("lightning")
    momentum = torch.optim.SGD(_params(), lr=0.1, momentum=0.9)
    wrapped_l = lightning.pytorch.core.optimizer.LightningOptimizer(momentum)  # its class is renamed LightningSGD
    assert describe_optimizer(wrapped_l).kind == "momentum" and describe_optimizer(wrapped_l).name == "SGD"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_plain_gd_only(wrapped) is False  # the false "plain GD only" warning under Trainer(optim="sgd")
    with pytest.raises(FlowgeomError, match="cannot see the optimiser.*optimizer_kind"):
        describe_optimizer(object())
    with pytest.raises(FlowgeomError, match="cannot see"):
        describe_optimizer(Holder(object()))


def test_family_verdicts_numbers():
    rec = {"step": 5, "eps/a": 1e-4, "eps/b": 0.05, "eps/c": 0.0, "eps/a@x": 9.0,
           "control/n1": 0.01, "control/n2": 0.03, "control/n1@x": 1.0}
    v = {x.family: x for x in family_verdicts(rec, controls_of={"eps/a": ["control/n1"], "eps/b": ["control/n2"]})}
    assert v["a"].control == 0.01 and v["a"].ratio == pytest.approx(0.01) and v["a"].verdict == "held"
    assert v["b"].ratio == pytest.approx(0.05 / 0.03) and v["b"].verdict == "broken"
    assert v["c"].control == pytest.approx(0.02)  # no controls of its own: the mean of all
    at_start = family_verdicts({"step": 0, "eps/a": 0.0, "control/n": 0.0})
    assert at_start[0].verdict == "n/a" and math.isnan(at_start[0].ratio)
    with pytest.raises(FlowgeomError, match="threshold"):
        family_verdicts(rec, threshold=1.5)
    assert HELD_THRESHOLD == 0.1


def test_summary_line_says_expected_or_not():
    p = _params()
    rec = {"step": 9, "eps/a": 1e-4, "control/n": 0.1}
    held = family_verdicts(rec)
    line = summary_line(held, describe_optimizer(torch.optim.SGD(p, lr=0.1)), step=9)
    assert "1 law family held, 0 broken" in line and "as expected" in line and "step 9" in line
    line = summary_line(held, describe_optimizer(torch.optim.Adam(p)))
    assert "NOT as expected" in line
    broken = family_verdicts({"eps/a": 0.3, "control/n": 0.4})
    line = summary_line(broken, describe_optimizer(torch.optim.SGD(p, lr=0.1, momentum=0.9)))
    assert "as expected" in line and "Marcotte et al., ICML 2024" in line and "Kunin" in line


def test_monitor_summary_in_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    model = SwiGLU(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = ConservationMonitor(model, optimizer=opt, warn=False)
    with pytest.raises(FlowgeomError, match="no record yet"):
        mon.summary()
    for k in range(5):
        model(torch.randn(16, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mon.step(k + 1)
    s = mon.summary()
    (v,) = s["verdicts"]
    assert v["verdict"] == "held" and v["ratio"] < 0.1
    assert v["eps"] == mon.last["eps/swiglu.up_down"]
    assert s["optimizer"]["kind"] == "sgd" and "as expected" in s["line"]
    # the same laws under Adam: broken, and the line says that is expected
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mon = ConservationMonitor(model, optimizer=opt, warn=False)
    for k in range(5):
        model(torch.randn(16, 6, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mon.step(k + 1)
    s = mon.summary()
    assert s["verdicts"][0]["verdict"] == "broken" and "as expected" in s["line"]
