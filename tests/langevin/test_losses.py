"""The paper's losses: definitions vs naive loops, invariance along the symmetry orbits."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.langevin import Regularizer, attention_loss, attention_objective, lora_loss, lora_objective


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_attention_loss_matches_loop():
    x, y = _rand(0, 3, 5, 4), _rand(1, 3, 5, 2)
    w_q, w_k, w_v = _rand(2, 2, 4), _rand(3, 2, 4), _rand(4, 2, 4)
    total = 0.0
    for i in range(3):
        scores = torch.stack([torch.stack([(w_q @ x[i, a]) @ (w_k @ x[i, b]) for b in range(5)]) for a in range(5)])
        att = torch.softmax(scores / math.sqrt(2), dim=1)
        total += ((att @ (x[i] @ w_v.T) - y[i]) ** 2).sum()
    assert torch.allclose(attention_loss(w_q, w_k, x, y, w_v), total / 3)


def test_lora_loss_matches_linear_layers():
    x, y = _rand(0, 6, 4), _rand(1, 6, 2)
    u, v, w_pre, w_out = _rand(2, 5, 2), _rand(3, 2, 4), _rand(4, 5, 4), _rand(5, 2, 5)
    layer = torch.nn.Linear(4, 5, bias=False).double()
    layer.weight.data = w_pre + 0.5 * u @ v
    expected = ((torch.tanh(layer(x)) @ w_out.T - y) ** 2).sum(1).mean()
    assert torch.allclose(lora_loss(u, v, x, y, w_pre, w_out, alpha=0.5), expected)


def _random_invertible(seed: int, n: int) -> torch.Tensor:
    return torch.linalg.matrix_exp(_rand(seed, n, n))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 1000), which=st.sampled_from(["attention", "lora"]))
def test_invariant_along_orbit_not_when_regularised(seed, which):
    obj = attention_objective(seed=seed) if which == "attention" else lora_objective(seed=seed)
    theta = _rand(seed + 1, obj.dim)
    m = _random_invertible(seed + 2, obj.orbit_dim)
    params = obj.unflatten(theta)
    moved = obj.orbit_fn(params, m)
    assert torch.allclose(obj(moved), obj(params), rtol=1e-9, atol=1e-10)
    assert torch.allclose(obj.flat(obj.orbit(theta, 3.0)), obj.flat(theta), rtol=1e-9)
    reg = obj.with_regularizer(Regularizer("log", lam=0.1))
    assert not torch.allclose(reg.flat(obj.orbit(theta, 3.0)), reg.flat(theta))
    assert obj.orbit(theta, 3.0).norm() > 5 * theta.norm() / 10  # the orbit really moves
