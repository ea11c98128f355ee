"""Residual MLP of the continuity ablations: shapes, activations, residual wiring, init."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.errors import FlowgeomError
from flowgeom.nn.resmlp import ACTIVATIONS, ResMLP, ResMLPConfig, radial


def test_radial_formula_and_equivariance():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    want = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64) * math.tanh(5.0)
    want[1] = 0.0
    assert torch.allclose(radial(x), want)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 7, generator=g, dtype=torch.float64)
    R = torch.linalg.qr(torch.randn(7, 7, generator=g, dtype=torch.float64)).Q
    assert torch.allclose(radial(z @ R.T), radial(z) @ R.T)  # σ(Rx) = R σ(x)
    assert not torch.allclose(F.relu(z @ R.T), F.relu(z) @ R.T)  # ReLU breaks it


@settings(max_examples=10, deadline=None)
@given(act=st.sampled_from(sorted(ACTIVATIONS)), residual=st.booleans(), ln=st.booleans(),
       width=st.integers(2, 9), depth=st.integers(2, 4), batch=st.integers(1, 5))
def test_forward_matches_manual(act, residual, ln, width, depth, batch):
    cfg = ResMLPConfig(d_in=6, width=width, depth=depth, classes=3, residual=residual, activation=act, layernorm=ln)
    model = ResMLP(cfg, seed=1).double()
    x = torch.randn(batch, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    h = x @ model.embed.weight.T + model.embed.bias
    for W in model.hidden_weights():
        inp = F.layer_norm(h, (width,)) if ln else h
        z = ACTIVATIONS[act](inp @ W.T)
        h = h + z if residual else z
    want = h @ model.head.weight.T + model.head.bias
    out = model(x)
    assert out.shape == (batch, 3)
    assert torch.allclose(out, want, atol=1e-10)


def test_hidden_weights_shapes_and_names():
    model = ResMLP(ResMLPConfig(width=8, depth=5, d_in=12))
    ws = model.hidden_weights()
    assert len(ws) == 5 and all(w.shape == (8, 8) for w in ws)
    names = [n for n, _ in model.named_parameters() if n.startswith("layers.")]
    assert names == [f"layers.{i}.weight" for i in range(5)]  # no hidden bias


def test_init_scale_and_seed():
    a = ResMLP(ResMLPConfig(width=64, depth=3), seed=4)
    b = ResMLP(ResMLPConfig(width=64, depth=3), seed=4)
    c = ResMLP(ResMLPConfig(width=64, depth=3, init_scale=2.0), seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    for wa, wc in zip((w.detach() for w in a.hidden_weights()), (w.detach() for w in c.hidden_weights())):
        assert torch.allclose(wc, 2 * wa)
        assert float(wa.abs().max()) <= 1 / 8 + 1e-7
        # U(-b, b) has std b/sqrt(3)
        assert float(wa.std()) == pytest.approx(1 / 8 / math.sqrt(3), rel=0.05)


def test_bad_configs():
    with pytest.raises(FlowgeomError, match="unknown activation"):
        ResMLPConfig(activation="tanhh")
    with pytest.raises(FlowgeomError, match="init_scale"):
        ResMLPConfig(init_scale=0.0)
    with pytest.raises(FlowgeomError, match="width"):
        ResMLPConfig(width=0)
