import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.errors import FlowgeomError
from flowgeom.nn import ARCHITECTURES, build
from flowgeom.nn.attention import apply_rope, rope_angles


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_architecture_builds_and_runs_on_its_own_input(arch):
    model = build(arch, seed=0)
    x = model.sample_input(3, torch.Generator().manual_seed(1))
    y = model(x)
    assert y.shape[0] == 3 and torch.isfinite(y).all()


def test_seed_fixes_weights_without_touching_global_rng():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b = build("swiglu", seed=7), build("swiglu", seed=7)
    after = torch.rand(1)
    assert torch.equal(a.up_proj.weight, b.up_proj.weight)
    assert torch.equal(before, after)


def test_hf_llama_parameter_names():
    names = set(dict(build("mha", seed=0).named_parameters()))
    assert names == {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}
    names = set(dict(build("moe", seed=0, experts=2).named_parameters()))
    assert "router.weight" in names and "experts.1.gate_proj.weight" in names


def test_rope_is_a_rotation_per_block_and_relative():
    cos, sin = rope_angles(5, 6)
    q = torch.randn(1, 1, 5, 6, dtype=torch.float64)
    rq = apply_rope(q, cos, sin)
    # rotate_half layout: block j = coordinates (j, j + 3) keeps its norm
    for j in range(3):
        assert torch.allclose(rq[..., [j, j + 3]].norm(dim=-1), q[..., [j, j + 3]].norm(dim=-1))
    # relative: <R_s q, R_t k> depends on t - s only
    k = torch.randn(1, 1, 1, 6, dtype=torch.float64).expand(1, 1, 5, 6)
    qq = q[..., :1, :].expand(1, 1, 5, 6)
    rq, rk = apply_rope(qq, cos, sin), apply_rope(k, cos, sin)
    s01 = (rq[..., 0, :] * rk[..., 1, :]).sum()
    s23 = (rq[..., 2, :] * rk[..., 3, :]).sum()
    assert torch.allclose(s01, s23)


@settings(max_examples=15, deadline=None)
@given(E=st.integers(2, 5), k=st.integers(1, 5), gate=st.sampled_from(["softmax", "sigmoid"]))
def test_moe_gates_sum_to_one_over_top_k(E, k, gate):
    k = min(k, E)
    model = build("moe", seed=0, experts=E, top_k=k, gate=gate)
    x = model.sample_input(6, torch.Generator().manual_seed(0))
    g = model.gate_values(x)
    assert torch.allclose(g.sum(-1), torch.ones(6))
    assert ((g > 0).sum(-1) == k).all()


def test_sigmoid_gate_is_normalised_sigmoid():
    model = build("moe", seed=0, gate="sigmoid")
    x = model.sample_input(4, torch.Generator().manual_seed(0))
    s = torch.sigmoid(model.router(x))
    assert torch.allclose(model.gate_values(x), s / s.sum(-1, keepdim=True))


@pytest.mark.parametrize("arch,opts,fragment", [
    ("nope", {}, "unknown architecture"),
    ("mha", {"positions": "rope", "d_k": 3}, "even"),
    ("mha", {"positions": "alibi"}, "positions"),
    ("moe", {"top_k": 4, "experts": 3}, "top-k"),
    ("ffn", {"d_hidden": 0}, "--d-hidden"),
    ("ffn", {"activation": "softplus"}, "activation"),
    ("swiglu", {"heads": 2}, "does not apply"),
    ("chain", {"widths": "3"}, "widths"),
])
def test_bad_sizes_raise_clear_errors(arch, opts, fragment):
    with pytest.raises(FlowgeomError, match=fragment):
        build(arch, **opts)


@pytest.mark.parametrize("opts", [
    {"positions": "rope", "mlp": "swiglu"},
    {"positions": "sinusoidal", "mlp": "moe", "top_k": 2, "gate": "sigmoid"},
    {"positions": "none", "mlp": "gelu", "norm": "layernorm"},
])
def test_tiny_lm_is_causal_and_named_like_llama(opts):
    from flowgeom.nn.lm import LMConfig, TinyLM

    torch.manual_seed(0)
    lm = TinyLM(LMConfig(vocab=11, d_model=16, n_layers=2, heads=2, d_k=4, d_hidden=8, seq_len=6, **opts))
    names = set(dict(lm.named_parameters()))
    assert "layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    tokens = lm.sample_input(2, torch.Generator().manual_seed(0))
    logits = lm(tokens)
    assert logits.shape == (2, 6, 11)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 11
    assert torch.allclose(lm(changed)[:, :-1], logits[:, :-1], atol=1e-6)  # no peeking at the future
