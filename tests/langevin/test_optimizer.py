"""The Langevin optimiser: update rule, foreach = loop, RNG discipline, schedules, resume, blow-up."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.errors import FlowgeomError
from flowgeom.langevin import Langevin, check_loss


def _model(seed: int, shapes) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _run(params, opt, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        sum((p.pow(2).sum() + p.sin().sum()) for p in params).backward()
        opt.step()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), shapes=st.lists(st.sampled_from([(3,), (2, 5), (17,), (4, 4, 2)]), min_size=1, max_size=4))
def test_foreach_equals_loop(seed, shapes):
    a, b = _model(seed, shapes), _model(seed, shapes)
    _run(a, Langevin(a, lr=0.05, temperature=0.3, seed=seed, foreach=True), 5)
    _run(b, Langevin(b, lr=0.05, temperature=0.3, seed=seed, foreach=False), 5)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_one_step_is_euler_maruyama():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    opt = Langevin([p], lr=0.1, temperature=0.5, generator=torch.Generator().manual_seed(7))
    p.grad = torch.tensor([0.3, 0.1, -0.2])
    xi = torch.randn(3, generator=torch.Generator().manual_seed(7))
    expected = torch.tensor([1.0, -2.0, 0.5]) - 0.1 * p.grad + math.sqrt(0.1 * 0.5) * xi
    opt.step()
    assert torch.allclose(p.detach(), expected, atol=1e-7)


def test_zero_temperature_is_sgd():
    a, b = _model(1, [(4, 3)]), _model(1, [(4, 3)])
    _run(a, Langevin(a, lr=0.1, temperature=0.0), 4)
    _run(b, torch.optim.SGD(b, lr=0.1), 4)
    assert torch.allclose(a[0], b[0], atol=1e-6)


def test_global_rng_untouched_and_seeded():
    state = torch.random.get_rng_state()
    a, b = _model(0, [(10,)]), _model(0, [(10,)])
    _run(a, Langevin(a, lr=0.1, temperature=1.0, seed=3), 3)
    _run(b, Langevin(b, lr=0.1, temperature=1.0, seed=3), 3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(a[0], b[0])
    c = _model(0, [(10,)])
    _run(c, Langevin(c, lr=0.1, temperature=1.0, seed=4), 3)
    assert not torch.equal(a[0], c[0])


def test_state_dict_resume_reproduces_noise():
    a = _model(2, [(6,), (2, 3)])
    opt = Langevin(a, lr=0.05, temperature=0.2, seed=5)
    _run(a, opt, 3)
    saved = ([p.detach().clone() for p in a], opt.state_dict())
    _run(a, opt, 4)
    b = [torch.nn.Parameter(t.clone()) for t in saved[0]]
    opt_b = Langevin(b, lr=0.05, temperature=0.2, seed=999)
    opt_b.load_state_dict(saved[1])
    _run(b, opt_b, 4)
    assert opt_b.step_count == 7
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_schedules_callable_and_lr_scheduler():
    p = torch.nn.Parameter(torch.zeros(3))
    temps = []
    opt = Langevin([p], lr=lambda k: 0.1 / (1 + k), temperature=lambda k: temps.append(k) or 0.0)
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
    assert temps == [0, 1, 2]
    assert torch.allclose(p.detach(), -torch.full((3,), 0.1 + 0.05 + 0.1 / 3))
    q = torch.nn.Parameter(torch.zeros(1))
    opt = Langevin([q], lr=1.0, temperature=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        q.grad = torch.ones(1)
        opt.step()
        sched.step()
    assert torch.allclose(q.detach(), torch.tensor([-1.75]))


@pytest.mark.parametrize("lr,temperature", [(0.0, 1.0), (-1.0, 1.0), (0.1, -0.5), (float("nan"), 1.0), (0.1, float("inf"))])
def test_bad_hyper_parameters(lr, temperature):
    with pytest.raises(FlowgeomError):
        Langevin([torch.nn.Parameter(torch.zeros(1))], lr=lr, temperature=temperature)


def test_bad_schedule_value_named_at_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = Langevin([p], lr=lambda k: 0.1 if k < 2 else -1.0, temperature=0.1)
    p.grad = torch.zeros(1)
    opt.step()
    opt.step()
    with pytest.raises(FlowgeomError, match="step 2"):
        opt.step()


def test_blow_up_detected():
    p = torch.nn.Parameter(torch.ones(4))
    opt = Langevin([p], lr=10.0, temperature=1.0)
    with pytest.raises(FlowgeomError, match="blew up"):
        for _ in range(200):
            opt.zero_grad()
            p.pow(4).sum().backward()
            opt.step()
    with pytest.raises(FlowgeomError, match="loss became nan"):
        check_loss(torch.tensor(float("nan")), 12)
