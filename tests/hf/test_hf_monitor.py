"""ConservationMonitor on real transformers models: the one-step test, uncovered blocks, PEFT."""

import math
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from one_step import TAUS, log_slope  # noqa: E402

from flowgeom.errors import FlowgeomError  # noqa: E402
from flowgeom.hf.tiny import SUPPORTED, tiny_config, tiny_model  # noqa: E402
from flowgeom.laws.locate import FlowgeomWarning, locate_blocks  # noqa: E402
from flowgeom.laws.monitor import ConservationMonitor  # noqa: E402
from flowgeom.laws.precision import keep_dtype  # noqa: E402


def _away_from_init(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.abs().mean().clamp_min(0.02) * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _one_step(mt):
    overrides = {"rms_norm_eps": 0.0} if mt in ("qwen3", "olmoe") else {}
    model = tiny_model(mt, seed=0, **overrides)
    _away_from_init(model, 1)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = ConservationMonitor(model, warn=False, per_block=False)
    with keep_dtype():  # transformers' float32 softmax/RMSNorm would leave a ~1e-9 first-order floor
        loss = model(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    theta = [p.detach().clone() for p in model.parameters()]
    eps, values = [], []
    for tau in TAUS:
        with torch.no_grad():
            for p, t, g in zip(model.parameters(), theta, grads):
                p.copy_(t - tau * g)
        eps.append(mon.measure())
        values.append(mon.values())
    grad = dict(zip((n for n, _ in model.named_parameters()), grads))
    return mon, eps, values, grad


def _first_order(mon, values, grad, family):
    """‖Δh‖/(τ‖∇L‖) of one family at τ = TAUS[0]: the first-order size of its one-step change (≈ 0 for a law)."""
    start, dh, names = 0, 0.0, set()
    for t in mon.items:
        if t.kind == "eps" and t.family == family:
            dh += float(((values[0] - mon.h0)[start:start + t.law.count] ** 2).sum())
            names |= set(t.law.params)
        start += t.law.count
    return math.sqrt(dh) / (TAUS[0] * math.sqrt(sum(float(grad[n].norm()) ** 2 for n in names)))


@pytest.mark.parametrize("mt", SUPPORTED)
def test_one_step_laws_second_order_controls_first_order(mt):
    """Quadratic laws change at τ² (slope 2); linear laws (router sum, k bias) have no τ² term and change
    only by round-off, so their criterion is ‖Δh‖/(τ‖∇L‖) ≪ 1; controls change at τ (slope 1)."""
    mon, eps, values, grad = _one_step(mt)
    laws, controls, linear = mon.families("eps"), mon.families("control"), mon.linear_families()
    assert laws and controls
    if mt not in ("bert", "gpt2", "gpt_neox", "falcon"):
        assert any("W_V" in c for c in controls)  # a V/O-side control
    if mt in ("mixtral", "qwen2_moe", "olmoe"):
        assert "eps/moe.router_sum" in linear
    for key in laws:
        if key in linear:
            assert _first_order(mon, values, grad, key[4:]) < 1e-8, key
            continue
        vals = [e[key] for e in eps]
        assert 1.8 <= log_slope(vals) <= 2.2, (key, vals)
    for key in controls:
        vals = [e[key] for e in eps]
        assert 0.8 <= log_slope(vals) <= 1.2, (key, vals)


def test_a_law_zero_at_init_is_relative_to_its_weights_and_named():
    """transformers initialises the QK-norm weights to ones, so ‖γ_q^(j)‖² − ‖γ_k^(j)‖² is exactly 0 at θ_0 and
    ε relative to ‖h(θ_0)‖ was (a τ²-sized change) / 0 ~ 1e297 when training from scratch. It is now relative to
    the scale of γ_q, γ_k, named in the monitor and its records, and still changes at second order. (OLMoE's
    full-width form Σ_i∈g ‖γ_q^(i,j)‖² − ‖γ_k^(g,j)‖² is H/G − 1 ≠ 0 at the same init.)"""
    model = tiny_model("qwen3", seed=0)
    gamma = model.model.layers[0].self_attn.q_norm.weight
    assert torch.equal(gamma, torch.ones_like(gamma))  # the premise: transformers' own init, no perturbation
    with pytest.warns(FlowgeomWarning, match="zero at θ_0"):
        mon = ConservationMonitor(model, per_block=False, warn=True,
                                  optimizer=torch.optim.SGD(model.parameters(), lr=0.1))  # plain GD: no other warning
    assert mon.zero_baseline and all("attn.qk_norm_gamma" in z for z in mon.zero_baseline)
    assert mon.step(0)["zero_baseline"] == mon.zero_baseline  # every record names them
    key = "eps/attn.qk_norm_gamma"
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    with keep_dtype():
        grads = torch.autograd.grad(model(input_ids=ids, labels=ids).loss, list(model.parameters()))
    theta = [p.detach().clone() for p in model.parameters()]
    eps = []
    for tau in TAUS:
        with torch.no_grad():
            for p, t, g in zip(model.parameters(), theta, grads):
                p.copy_(t - tau * g)
        eps.append(mon.measure())
    vals = [e[key] for e in eps]
    assert all(math.isfinite(v) and v < 1e-2 for v in vals), vals
    assert 1.8 <= log_slope(vals) <= 2.2, vals
    # the denominator is the weights' energy: check one block's value by hand at the smallest τ
    qn, kn = (f"model.layers.0.self_attn.{n}.weight" for n in ("q_norm", "k_norm"))
    i = next(j for j, t in enumerate(mon.items) if t.family == "attn.qk_norm_gamma" and qn in t.law.params)
    start = sum(t.law.count for t in mon.items[:i])
    with torch.no_grad():
        for p, t, g in zip(model.parameters(), theta, grads):
            p.copy_(t - TAUS[0] * g)
    dh = (mon.values() - mon.h0)[start:start + mon.items[i].law.count].norm()
    scale = float(theta_of(model, theta, qn).pow(2).sum() + theta_of(model, theta, kn).pow(2).sum())
    assert float(mon._h0_norm[i]) == pytest.approx(scale, rel=1e-12)
    assert float(dh) / scale > 0  # the change is real, not rounding of a zero
    # a law with a nonzero baseline keeps the seed's ε = ‖Δh‖ / ‖h(θ_0)‖
    j = next(j for j, t in enumerate(mon.items) if t.kind == "eps" and t.family == "attn.vo")
    start_j = sum(t.law.count for t in mon.items[:j])
    assert float(mon._h0_norm[j]) == pytest.approx(float(mon.h0[start_j:start_j + mon.items[j].law.count].norm()))
    # resume: the saved denominators come back exactly, whatever θ is now
    state = mon.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = ConservationMonitor(model, per_block=False, warn=False)
    again.load_state_dict(state)
    assert torch.equal(again._h0_norm, mon._h0_norm) and again.zero_baseline == mon.zero_baseline
    assert again.measure()[key] == mon.measure()[key]


@pytest.mark.parametrize("mt", ["gpt2", "bert", "gpt_neox"])
def test_a_zero_initialised_k_bias_law_is_relative_to_its_block(mt):
    """transformers zero-initialises attention biases: the k-bias law h = b_k (gradient ≡ 0) is 0 at θ_0 and so
    is the bias it reads; its ε is relative to the block's weights and stays at round-off (it was ~1e285)."""
    model = tiny_model(mt, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.warns(FlowgeomWarning, match="zero at θ_0"):
        mon = ConservationMonitor(model, per_block=False, optimizer=opt)
    assert any("attn.k_bias" in z for z in mon.zero_baseline)
    assert len(mon.zero_baseline) == len(set(mon.zero_baseline))
    ids = torch.randint(3, 60, (2, 8), generator=torch.Generator().manual_seed(0))
    for k in range(4):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    rec = mon.measure()
    assert 0 <= rec["eps/attn.k_bias"] < 1e-10, rec["eps/attn.k_bias"]  # round-off of a zero-gradient bias
    assert max(v for k, v in rec.items() if k.startswith("control/")) > 1e-7  # while the weights did move


def test_half_precision_weights_are_warned_about_and_recorded():
    """bfloat16 weights round every update (2^-8 relative): ε then measures the rounding; said, not hidden."""
    model = tiny_model("llama", seed=0, dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.warns(FlowgeomWarning, match=r"bfloat16 weights: every step rounds them by up to 3\.9e-03"):
        mon = ConservationMonitor(model, optimizer=opt)
    assert mon.low_precision == ["bfloat16"] and mon.step(0)["low_precision"] == ["bfloat16"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlowgeomWarning)  # float32: no such warning
        full = ConservationMonitor(tiny_model("llama", seed=0, dtype=torch.float32), optimizer=opt)
    assert full.low_precision == [] and "low_precision" not in full.step(0)


def theta_of(model, theta, name):
    return dict(zip((n for n, _ in model.named_parameters()), theta))[name]


def test_every_attention_family_has_a_vo_control():
    for mt in ("gpt2", "gpt_neox", "falcon", "bert"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            entry = locate_blocks(tiny_model(mt, seed=0), warn=False).entry
        assert any(c.family == "norm.W_V" for c in entry.controls), mt


def test_unknown_family_is_warned_listed_and_the_rest_measured():
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("opt", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                               ffn_dim=32, vocab_size=32, max_position_embeddings=16,
                                               word_embed_proj_dim=16)
    opt = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()
    llama = tiny_model("llama", seed=0)

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.opt, self.llama = opt, llama

    with pytest.warns(FlowgeomWarning, match="opt.model.decoder.layers.0.self_attn.*model_type 'opt'"):
        mon = ConservationMonitor(Both(), warn=True)
    assert [u["block"] for u in mon.uncovered_list()] == ["opt.model.decoder.layers.0.self_attn"]
    record = mon.step(0)
    assert record["uncovered"][0]["reason"].startswith("model_type 'opt'")
    assert "eps/attn.qk_rope" in record and not any("opt." in k for k in record)


def test_partly_frozen_attention_is_uncovered_fully_frozen_is_a_note():
    model = tiny_model("llama", seed=0)
    model.model.layers[0].self_attn.k_proj.weight.requires_grad_(False)
    for p in model.model.layers[1].self_attn.parameters():
        p.requires_grad_(False)
    found = locate_blocks(model, warn=False)
    assert [u.block for u in found.uncovered] == ["model.layers.0.self_attn"]
    assert any(n.startswith("model.layers.1.self_attn: all parameters frozen") for n in found.entry.notes)
    assert not any("layers.1.self_attn" in n for law in found.entry.laws for n in law.params)


def test_peft_lora_base_weights_give_no_laws():
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", seed=0)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    found = locate_blocks(lora, warn=False)
    params = {n for law in found.entry.laws for n in law.params}
    assert params and all("lora_" in n for n in params)  # only the adapters' laws, no frozen base
    assert not found.uncovered


def test_gqa_from_config_not_child_names():
    cfg = tiny_config("mistral")
    model = tiny_model("mistral", seed=0)
    entry = locate_blocks(model, warn=False).entry
    vo = [law for law in entry.laws if law.family == "attn.vo"]
    assert len(vo) == cfg.num_hidden_layers * cfg.num_key_value_heads  # one V/O law per K/V group


@pytest.mark.parametrize("mt", ["gpt2", "gpt_neox", "mixtral"])
def test_declared_degree_is_the_measured_homogeneity(mt):
    """law.degree (what the monitor calls linear) agrees with h(2θ) = 2^d h(θ) measured on the model."""
    from flowgeom.laws.monitor import homogeneity_degree

    model = tiny_model(mt, seed=0)
    _away_from_init(model, 3)  # biases away from 0: every law non-zero
    entry = locate_blocks(model, warn=False).entry
    params = dict(model.named_parameters())
    degrees = {law.family: law.degree for law in entry.laws}
    assert all(homogeneity_degree(law, params) == law.degree for law in entry.laws)
    assert 1 in degrees.values() and 2 in degrees.values(), degrees  # k bias (gpt2, gpt_neox), router sum (mixtral)


def test_a_meta_or_non_finite_model_is_refused_at_construction():
    """Built on the meta device: a raw NotImplementedError before; NaN weights at θ_0: every ε silently NaN."""
    cfg = tiny_config("llama")
    with torch.device("meta"):
        meta = transformers_model(cfg)
    with pytest.raises(FlowgeomError, match="meta device"):
        ConservationMonitor(meta, warn=False)
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    with pytest.raises(FlowgeomError, match=r"q_proj.weight contains NaN or Inf\): every ε would be NaN"):
        ConservationMonitor(model, warn=False)


def transformers_model(cfg):
    import transformers

    return transformers.LlamaForCausalLM(cfg)
