"""The pure Langevin core (build / init / update) against the in-place torch.optim wrapper."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.errors import FlowgeomError
from flowgeom.langevin import Langevin, LangevinState, Regularizer, build, chain, init, update
from flowgeom.runs import RunFolder

SHAPES = {"w": (4, 3), "b": (3,), "v": (2, 2, 2)}


def _params(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=dtype) for n, s in SHAPES.items()}


def _loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(p.pow(2).sum() + p.sin().sum() for p in params.values())


def _grads(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    live = {n: p.detach().requires_grad_() for n, p in params.items()}
    names = list(live)
    return dict(zip(names, torch.autograd.grad(_loss(live), [live[n] for n in names])))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), foreach=st.booleans(), steps=st.integers(1, 6),
       reg=st.sampled_from(["none", "log", "power"]), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_functional_equals_wrapper_bit_for_bit(seed, foreach, steps, reg, dtype):
    start = _params(seed, dtype)
    transform = Regularizer(reg, lam=0.05).transform(["w", "v"]) if reg != "none" else None
    schedule = lambda k: 0.05 / (1 + k)  # noqa: E731 - a schedule is a callable of the step
    core = build(lr=schedule, temperature=0.3, grad_transform=transform, foreach=foreach)
    params, state = dict(start), core.init(start, seed=seed)
    for _ in range(steps):
        params, state = core.update(state, params, _grads(params))
    mod = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    opt = Langevin(mod.items(), lr=schedule, temperature=0.3, seed=seed, foreach=foreach, grad_transform=transform)
    for _ in range(steps):
        opt.zero_grad()
        _loss(mod).backward()
        opt.step()
    assert state.step == opt.step_count == steps
    assert torch.equal(state.rng, opt.generator.get_state())
    for n in SHAPES:
        assert torch.equal(params[n], mod[n].detach()), n
        assert not torch.equal(params[n], start[n])


def test_update_leaves_inputs_alone_and_inplace_writes():
    start = _params(3)
    frozen = {n: t.clone() for n, t in start.items()}
    state = init(start, seed=1)
    rng = state.rng.clone()
    grads = _grads(start)
    new, state2 = update(state, start, grads, lr=0.1, temperature=1.0)
    assert all(torch.equal(start[n], frozen[n]) for n in SHAPES)
    assert torch.equal(state.rng, rng) and state.step == 0 and state2.step == 1
    again, _ = update(state, start, grads, lr=0.1, temperature=1.0)  # same state, same step
    assert all(torch.equal(again[n], new[n]) for n in SHAPES)
    work = {n: t.clone() for n, t in start.items()}
    out, _ = update(state, work, grads, lr=0.1, temperature=1.0, inplace=True)
    assert all(out[n] is work[n] and torch.equal(work[n], new[n]) for n in SHAPES)


def test_one_step_equation_and_missing_grad_carried():
    p = {"a": torch.tensor([1.0, -2.0, 0.5]), "frozen": torch.ones(2)}
    g = {"a": torch.tensor([0.3, 0.1, -0.2])}
    new, state = update(init(p, seed=7), p, g, lr=0.1, temperature=0.5)
    xi = torch.randn(3, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(new["a"], p["a"] - 0.1 * g["a"] + math.sqrt(0.05) * xi, atol=1e-7)
    assert new["frozen"] is p["frozen"] and state.step == 1


def test_regularizer_transform_equals_add_grad_and_chain_adds():
    params = _params(5, torch.float64)
    grads = _grads(params)
    log, frob = Regularizer("log", lam=0.2), Regularizer("frobenius", lam=0.1)
    out = chain(log.transform(["w"]), frob.transform())(grads, params)
    w = torch.nn.Parameter(params["w"].clone())
    w.grad = grads["w"].clone()
    log.add_grad_([w])
    frob.add_grad_([w])
    assert torch.equal(out["w"], w.grad)
    assert torch.allclose(out["b"], grads["b"] + 0.2 * params["b"])
    assert out is not grads and torch.equal(grads["w"], _grads(params)["w"])
    with pytest.raises(FlowgeomError, match="not being trained"):
        log.transform(["nope"])(grads, params)


def test_state_round_trips_through_checkpoint_and_wrapper(tmp_path):
    start = _params(9)
    core = build(lr=0.05, temperature=0.2)
    params, state = core.update(core.init(start, seed=2), start, _grads(start))
    folder = RunFolder(tmp_path)
    folder.save_checkpoint({"params": params, "state": state._asdict()})
    back = folder.load_checkpoint()
    state_b = LangevinState(**back["state"])
    a, _ = core.update(state, params, _grads(params))
    b, _ = core.update(state_b, back["params"], _grads(back["params"]))
    assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    mod = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    opt = Langevin(mod.items(), lr=0.05, temperature=0.2, seed=2)
    _loss(mod).backward()
    opt.step()
    assert opt.functional_state().step == state.step and torch.equal(opt.functional_state().rng, state.rng)
    sched = Langevin(mod.items(), lr=lambda k: 0.05, temperature=0.2, seed=2, grad_transform=Regularizer("log").transform())
    folder.save_checkpoint({"optimizer": sched.state_dict()})
    saved = folder.load_checkpoint()["optimizer"]
    assert saved["param_groups"][0]["lr"] == "schedule"
    again = Langevin(mod.items(), lr=lambda k: 0.05, temperature=0.2, seed=0)
    again.load_state_dict(saved)
    assert torch.equal(again.generator.get_state(), sched.generator.get_state())


def test_blow_up_and_bad_hyper_in_core():
    p = {"x": torch.full((3,), 1e30)}
    with pytest.raises(FlowgeomError, match="blew up at step 0"):
        update(init(p), p, {"x": torch.full((3,), 1e30)}, lr=1e10, temperature=0.0)
    with pytest.raises(FlowgeomError, match="lr"):
        build(lr=0.0, temperature=1.0)
    with pytest.raises(FlowgeomError, match="no parameters"):
        init({})
