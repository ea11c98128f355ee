"""Regularisers: closed-form gradient and Laplacian vs autograd, validation, selection by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.langevin import Regularizer, select
from flowgeom.nn.attention import MultiHeadAttention


@settings(max_examples=10, deadline=None)
@given(kind=st.sampled_from(["log", "power", "frobenius"]), seed=st.integers(0, 100),
       scale=st.sampled_from([0.1, 1.0, 7.0]), eps=st.sampled_from([0.2, 0.5, 2.0]))
def test_grad_and_laplacian_match_autograd(kind, seed, scale, eps):
    reg = Regularizer(kind, lam=0.3, eps=eps)
    w = (scale * torch.randn(3, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).requires_grad_()
    (auto,) = torch.autograd.grad(reg.value(w), w)
    assert torch.allclose(reg.grad(w), auto, rtol=1e-10)
    hess = torch.autograd.functional.hessian(lambda t: reg.value(t.reshape(3, 4)), w.detach().reshape(-1))
    assert torch.allclose(reg.laplacian(w), hess.diagonal().sum(), rtol=1e-9)


def test_values_closed_form():
    w = torch.full((2, 2), 0.5, dtype=torch.float64)  # ‖W‖²_F = 1
    assert Regularizer("log", lam=2.0).value(w).item() == pytest.approx(2 * torch.log(torch.tensor(2.0)).item())
    assert Regularizer("power", lam=2.0, eps=1.0).value(2 * w).item() == pytest.approx(2 * 2.0**3)
    assert Regularizer("frobenius", lam=3.0).value(w).item() == pytest.approx(3.0)
    assert Regularizer("none").value(w).item() == 0.0


@pytest.mark.parametrize("kw", [dict(kind="log", lam=0.0), dict(kind="power", lam=-1.0), dict(kind="power", eps=0.0),
                                dict(kind="power", eps=-0.5), dict(kind="frobenius", lam=float("nan")), dict(kind="l1")])
def test_bad_options(kw):
    with pytest.raises(FlowgeomError):
        Regularizer(**kw)


class _FakeLora(nn.Module):
    """Mimics HF PEFT naming: base_layer + lora_A/lora_B ModuleDicts keyed by adapter."""

    def __init__(self):
        super().__init__()
        self.base_layer = nn.Linear(4, 3, bias=False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(4, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, 3, bias=False)})


def test_select_presets_and_penalty_grad():
    model = nn.ModuleDict({"q_proj": _FakeLora(), "v_proj": _FakeLora()})
    chosen = select(model, preset="lora")
    assert sorted(chosen) == sorted(f"{m}.lora_{x}.default.weight" for m in ("q_proj", "v_proj") for x in "AB")
    reg = Regularizer("log", lam=0.1)
    reg.penalty(chosen.values()).backward()
    manual = {n: p.grad.clone() for n, p in chosen.items()}
    model.zero_grad(set_to_none=True)
    reg.add_grad_(chosen.values())
    for n, p in chosen.items():
        assert torch.allclose(p.grad, manual[n], rtol=1e-6)
    assert model["q_proj"].base_layer.weight.grad is None
    attn = MultiHeadAttention(8, 2, 4)
    assert sorted(select(attn, preset="qk")) == ["k_proj.weight", "q_proj.weight"]
    assert list(select(attn, pattern=r"^v_proj")) == ["v_proj.weight"]
    assert list(select(attn, names=["o_proj.weight"])) == ["o_proj.weight"]


def test_select_errors():
    attn = MultiHeadAttention(8, 2, 4)
    for kw in (dict(pattern="lora_A"), dict(names=["nope"]), dict(preset="mlp"), dict(pattern="("), {}):
        with pytest.raises(FlowgeomError):
            select(attn, **kw)


def test_power_regulariser_is_twice_differentiable_at_zero():
    """PEFT starts lora_B at 0: autograd's Hessian of ‖W‖^{2+ε} there must be the closed form's 0, not NaN."""
    from flowgeom.langevin.villani import laplacian_exact

    reg = Regularizer("power", lam=0.01, eps=0.5)
    zero = torch.zeros(6, dtype=torch.float64)
    assert float(reg.value(zero.view(2, 3))) == 0.0
    assert float(laplacian_exact(lambda th: reg.value(th.view(2, 3)), zero)) == float(reg.laplacian(zero.view(2, 3))) == 0.0
    theta = torch.linspace(-1, 1, 6, dtype=torch.float64)
    assert float(laplacian_exact(lambda th: reg.value(th.view(2, 3)), theta)) == pytest.approx(
        float(reg.laplacian(theta.view(2, 3))), rel=1e-12)
