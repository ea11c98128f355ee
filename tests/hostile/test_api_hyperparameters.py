"""Python API entry points refuse degenerate hyper-parameters and state with one FlowgeomError, never a torch error.

``ConservationMonitor(weight_decay=nan)`` used to turn every ε into NaN;
``Langevin`` with an lr that overflows float32 or a malformed generator state
in ``load_state_dict`` used to end in a bare ``RuntimeError``; complex or
integer weights in the monitor likewise. Each case checks the exact message,
that it is one line, and that nothing was changed (parameters, generator).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from flowgeom.errors import FlowgeomError, finite_number
from flowgeom.langevin import Langevin
from flowgeom.laws import ConservationMonitor
from flowgeom.laws.locate import FlowgeomWarning
from flowgeom.nn import build


def _moe():
    return build("moe", seed=0, gate="softmax").double()


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("value, text", [
    (float("nan"), "is nan; it must be a finite real number >= 0"),
    (math.inf, "is inf; it must be a finite real number >= 0"),
    (-0.1, "is -0.1; it must be a finite real number >= 0"),
    ("0.1", "must be a finite real number >= 0, got str '0.1'"),
    (1j, "must be a finite real number >= 0, got complex 1j"),
    (10**400, "must be a finite real number >= 0, got int 1000000000"),
])
def test_monitor_refuses_a_non_finite_weight_decay(value, text):
    with pytest.raises(FlowgeomError) as info:
        ConservationMonitor(_moe(), weight_decay=value, warn=False)
    assert _one_line(info).startswith(f"ConservationMonitor weight_decay {text}")


def test_monitor_refuses_a_non_finite_lr():
    with pytest.raises(FlowgeomError) as info:
        ConservationMonitor(_moe(), weight_decay=0.1, lr=math.nan, rescale="sgd", warn=False)
    assert _one_line(info) == ("ConservationMonitor lr is nan; it must be a finite real number > 0 (pass the step "
                               "size τ > 0, or None)")


def test_monitor_with_a_finite_weight_decay_still_measures():
    mon = ConservationMonitor(_moe(), weight_decay=0.01, warn=False)
    record = mon.measure(time=1.0)
    assert record and all(math.isfinite(v) for v in record.values())


def test_monitor_refuses_complex_and_integer_weights():
    with pytest.raises(FlowgeomError) as info:
        ConservationMonitor(_moe().to(torch.complex128), warn=False)
    assert _one_line(info).endswith("has dtype complex128; the conservation laws are defined for real floating-point "
                                    "weights: convert the model with .float() (or .double()) before building the "
                                    "monitor")
    model = _moe()
    name, param = next(iter(model.named_parameters()))
    owner = model.get_submodule(name.rpartition(".")[0])
    setattr(owner, name.rpartition(".")[2], nn.Parameter(torch.ones_like(param, dtype=torch.int64),
                                                         requires_grad=False))
    with pytest.raises(FlowgeomError, match=f"^{name} .*has dtype int64; the conservation laws"):
        ConservationMonitor(model, warn=False)


def test_monitor_warns_on_a_fully_frozen_model():
    model = _moe().requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ConservationMonitor(model)
    frozen = [w for w in caught if issubclass(w.category, FlowgeomWarning) and "requires grad" in str(w.message)]
    assert len(frozen) == 1 and "every ε will be 0" in str(frozen[0].message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ConservationMonitor(_moe())  # trainable: no such warning
    assert not [w for w in caught if "requires grad" in str(w.message)]


@pytest.mark.parametrize("lr, temperature, text", [
    (math.nan, 0.1, "Langevin lr at step 0 is nan; it must be a finite real number > 0 (fix the value or the "
                    "schedule)"),
    (0.1, math.inf, "Langevin temperature at step 0 is inf; it must be a finite real number >= 0 (fix the value or "
                    "the schedule)"),
    ("0.1", 0.1, "Langevin lr at step 0 must be a finite real number > 0, got str '0.1'; fix the value or the "
                 "schedule"),
    (None, 0.1, "Langevin lr at step 0 must be a finite real number > 0, got NoneType None; fix the value or the "
                "schedule"),
    (1e300, 1e300, "Langevin lr=1e+300 times temperature=1e+300 overflows (the noise scale sqrt(lr·temperature) "
                   "is infinite); lower lr or temperature"),
])
def test_langevin_refuses_bad_hyper_parameters_at_construction(lr, temperature, text):
    with pytest.raises(FlowgeomError) as info:
        Langevin([nn.Parameter(torch.ones(3))], lr=lr, temperature=temperature)
    assert _one_line(info) == text


@pytest.mark.parametrize("lr, temperature, sigma", [(1e200, 0.0, "0"), (1.0, 1e80, "1e+40")])
def test_langevin_refuses_a_step_its_dtype_cannot_hold_and_changes_nothing(lr, temperature, sigma):
    p = nn.Parameter(torch.ones(3))
    opt = Langevin([p], lr=lr, temperature=temperature)
    p.grad = torch.ones(3)
    gen = opt.generator.get_state()
    with pytest.raises(FlowgeomError) as info:
        opt.step()
    assert _one_line(info) == (f"Langevin lr={lr:g} with noise scale sqrt(lr·temperature)={sigma} overflows float32 "
                               "parameters (max 3.40282e+38); lower lr or temperature")
    assert torch.equal(p.detach(), torch.ones(3)) and torch.equal(opt.generator.get_state(), gen)
    q = nn.Parameter(torch.ones(3, dtype=torch.float64))  # float64 holds lr = 1e100 (not float32): the step runs
    opt64 = Langevin([q], lr=1e100, temperature=0.0)
    q.grad = torch.ones(3, dtype=torch.float64)
    opt64.step()
    assert torch.equal(q.detach(), torch.full((3,), 1 - 1e100, dtype=torch.float64))


def test_langevin_schedule_returning_garbage_is_one_error():
    p = nn.Parameter(torch.ones(3))
    opt = Langevin([p], lr=lambda k: "fast", temperature=0.0)
    p.grad = torch.ones(3)
    with pytest.raises(FlowgeomError) as info:
        opt.step()
    assert _one_line(info) == ("Langevin lr at step 0 must be a finite real number > 0, got str 'fast'; fix the "
                               "value or the schedule")
    assert torch.equal(p.detach(), torch.ones(3))


@pytest.mark.parametrize("corrupt, text", [
    (lambda g: [1, 2], "Langevin state_dict['langevin'] must be a dict with step_count and generator, got list"),
    (lambda g: {"step_count": -1, "generator": g}, "Langevin state_dict step_count must be a whole number >= 0, got -1"),
    (lambda g: {"step_count": True, "generator": g}, "step_count must be a whole number >= 0, got True"),
    (lambda g: {"step_count": 3, "generator": g[:5]},
     f"generator state must be a uint8 tensor of shape [{torch.Generator().get_state().numel()}] (a cpu generator), "
     "got torch.uint8 [5]"),
    (lambda g: {"step_count": 3, "generator": g.float()}, "got torch.float32"),
    (lambda g: {"step_count": 3, "generator": torch.zeros_like(g)}, "generator state is invalid (Invalid mt19937 "
                                                                    "state)"),
])
def test_langevin_load_state_dict_refuses_a_malformed_state_and_loads_nothing(corrupt, text):
    p = nn.Parameter(torch.ones(3))
    opt = Langevin([p], lr=0.1, temperature=0.01, seed=1)
    p.grad = torch.ones(3)
    opt.step()
    saved = opt.state_dict()
    fresh = Langevin([nn.Parameter(torch.ones(3))], lr=0.2, temperature=0.01, seed=2)
    before = (fresh.step_count, fresh.generator.get_state(), fresh.param_groups[0]["lr"])
    with pytest.raises(FlowgeomError) as info:
        fresh.load_state_dict({**saved, "langevin": corrupt(saved["langevin"]["generator"])})
    assert text in _one_line(info) and _one_line(info).endswith(
        "load a state_dict saved by Langevin.state_dict() for this device")
    assert (fresh.step_count, fresh.param_groups[0]["lr"]) == (before[0], before[2])
    assert torch.equal(fresh.generator.get_state(), before[1])
    fresh.load_state_dict(saved)  # the real state loads
    assert fresh.step_count == 1 and torch.equal(fresh.generator.get_state(), opt.generator.get_state())


def test_finite_number_accepts_tensors_and_numpy_scalars():
    import numpy as np

    assert finite_number(torch.tensor(0.5), "x") == 0.5 and finite_number(np.float32(0.25), "x") == 0.25
    for bad in (torch.ones(2), np.complex128(1 + 1j), True, b"1"):
        with pytest.raises(FlowgeomError, match="^x must be a finite real number"):
            finite_number(bad, "x")


def _entry_points():
    """``(name, call(value))`` for every other API entry point that takes a real hyper-parameter."""
    from flowgeom.continuity import AnalyzeConfig
    from flowgeom.experiments.conservation import ConservationConfig
    from flowgeom.experiments.langevin_rate import RateConfig
    from flowgeom.integrations.session import MonitorSession
    from flowgeom.langevin import Regularizer, objective, probe

    return {
        "regulariser lambda": lambda v: Regularizer("log", lam=v),
        "power regulariser epsilon": lambda v: Regularizer("power", lam=1.0, eps=v),
        "r_ext": lambda v: probe(objective("norm2", seed=0), rays=1, points=4, r_ext=v),
        "temperature s": lambda v: probe(objective("norm2", seed=0), rays=1, points=4, temperature=v),
        "start_radius": lambda v: RateConfig(start_radius=v),
        "weight_decay": lambda v: ConservationConfig(weight_decay=v),
        "lr": lambda v: ConservationConfig(lr=v),
        "--threshold": lambda v: AnalyzeConfig(threshold=v),
        "--tol": lambda v: AnalyzeConfig(tol=v),
        "threshold": lambda v: MonitorSession(nn.Linear(2, 2), optimizer_kind="sgd", threshold=v),
    }


@pytest.mark.parametrize("name", sorted(_entry_points()))
@pytest.mark.parametrize("value", [math.nan, math.inf, "0.5"])
def test_every_real_hyper_parameter_refuses_nan_inf_and_text(name, value):
    with pytest.raises(FlowgeomError) as info:
        _entry_points()[name](value)
    text = _one_line(info)
    assert text.startswith(f"{name} is {value}; it must be a finite real number" if isinstance(value, float)
                           else f"{name} must be a finite real number"), text
