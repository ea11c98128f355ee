"""HF MoE laws (Mixtral, Qwen2-MoE, OLMoE) on the real transformers classes: orthogonality, count, one-step slope."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from one_step import one_step_changes  # noqa: E402

from flowgeom.hf.tiny import tiny_model  # noqa: E402
from flowgeom.laws import check, count  # noqa: E402
from flowgeom.laws.moe_hf import MoEBlockModule, expected_moe_count, is_moe_block, moe_entry, moe_layout  # noqa: E402

# Small enough for the numeric count (D ≈ 330): d = 8 (= 2 heads × 4, OLMoE's q_norm needs it), 4 experts of width 3.
SMALL = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4)
CASES = {
    "mixtral": dict(intermediate_size=3),
    "mixtral_top1": dict(intermediate_size=3, num_experts_per_tok=1),
    "qwen2_moe": dict(moe_intermediate_size=3, shared_expert_intermediate_size=2),
    "olmoe": dict(intermediate_size=3),
    "olmoe_norm": dict(intermediate_size=3, norm_topk_prob=True),
}


def _block(case: str):
    model_type = case.split("_top1")[0].split("_norm")[0]
    model = tiny_model(model_type, seed=0, **SMALL, **CASES[case])
    return model.model.layers[0].mlp


@pytest.mark.parametrize("case", sorted(CASES))
def test_laws_orthogonal_and_count_matches(case):
    block = _block(case)
    assert is_moe_block(block)
    layout = moe_layout(block)
    entry = moe_entry(block, "block")
    assert entry.count == expected_moe_count(layout)
    mod = MoEBlockModule(block)
    report = check(mod, list(entry.laws) + list(entry.controls), n_fields=32, n_points=2, tolerance=1e-7)
    laws = [v for v in report.verdicts if v.status == "law"]
    experts = [v.max_violation for v in laws if v.family == "moe.expert_up_down"]
    assert len(experts) == layout.experts and max(experts) < 1e-13  # exact: no float32 op on this path
    assert all(v.passed for v in laws)  # router laws: float32 softmax inside, ~1e-9
    assert all(v.max_violation > 1e-3 for v in report.verdicts if v.status == "control")
    # float32 softmax inside the router: the numeric count needs a tolerance above its round-off
    result = count(mod, tol=1e-5)
    assert result.laws == entry.count, result.gap
    assert result.gap["ratio"] > 1e3
    routed = MoEBlockModule(block).sample_input(16, torch.Generator().manual_seed(0))  # one field: every expert
    _, _, idx = block.gate(routed.reshape(-1, layout.hidden))
    assert set(idx.flatten().tolist()) == set(range(layout.experts))


def test_top1_renormalised_freezes_router_and_drops_its_control():
    entry = moe_entry(_block("mixtral_top1"), "m")
    assert any(law.family == "moe.router_frozen" for law in entry.laws)
    assert not any(c.params == ("m.gate.weight",) for c in entry.controls)


def _one_step_slopes(model, items, seed=0):
    """One SGD step at τ = 1e-2, 1e-3, 1e-4 (float64) from a point away from init, per item:
    the log-slope of ‖h(θ − τ∇L) − h(θ)‖ vs τ, and ‖Δh‖/(τ‖∇L‖) at the smallest τ."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # away from init
        for p in model.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    return one_step_changes(model, items, ids)


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "olmoe"])
def test_one_step_laws_second_order_controls_first(case):
    """Quadratic laws change by τ²·q(∇L) (slope 2); the router sum is *linear*, so it has no τ² term:
    its one-step change is round-off of the float32 router softmax, far below τ‖∇_router L‖."""
    model = tiny_model(case, seed=1, **SMALL, **CASES[case])
    entry = moe_entry(model.model.layers[0].mlp, "model.layers.0.mlp")
    slopes, rel = _one_step_slopes(model, list(entry.laws) + list(entry.controls))
    quadratic = [law.name for law in entry.laws if law.degree == 2]
    assert len(quadratic) >= 4 and all(abs(slopes[n] - 2) < 0.2 for n in quadratic), slopes
    linear = [law for law in entry.laws if law.degree == 1]  # no τ² term: the slope test cannot apply
    assert [law.family for law in linear] == ["moe.router_sum"] and rel[linear[0].name] < 1e-5, rel
    assert all(abs(slopes[c.name] - 1) < 0.2 and rel[c.name] > 1e-3 for c in entry.controls), slopes


def test_uncovered_router_is_named_not_guessed():
    block = _block("mixtral")
    block.gate.__class__ = type("SigmoidGroupRouter", (torch.nn.Module,), {})
    entry = moe_entry(block, "layers.0.mlp")
    assert entry.laws == () and "not covered" in entry.notes[0] and "SigmoidGroupRouter" in entry.notes[0]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "olmoe"])
def test_locate_tracks_moe_laws_without_silent_skip(model_type):
    from flowgeom.laws.locate import locate_blocks

    model = tiny_model(model_type, seed=0)  # 2 layers, 4 experts
    found = locate_blocks(model, warn=False)
    families = [law.family for law in found.entry.laws]
    assert families.count("moe.expert_up_down") == 8 and families.count("moe.router_sum") == 2
    assert families.count("moe.shared_up_down") == (2 if model_type == "qwen2_moe" else 0)
    assert {"norm.router", "norm.expert_gates"} <= {c.family for c in found.entry.controls}
    assert not any("mlp" in u.block for u in found.uncovered), found.uncovered
