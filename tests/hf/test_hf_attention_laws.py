"""HF attention / gated-MLP laws: catalogue count == numeric count, orthogonality on the real blocks."""

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from flowgeom.errors import FlowgeomError  # noqa: E402
from flowgeom.hf.families import FAMILIES, family  # noqa: E402
from flowgeom.hf.tiny import SUPPORTED, tiny_config  # noqa: E402
from flowgeom.laws import check, count  # noqa: E402
from flowgeom.laws.hf_target import build  # noqa: E402
from flowgeom.laws.locate import locate_blocks  # noqa: E402

PARTIAL = dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)
FAST = [
    ("llama", "attention", dict(num_key_value_heads=1)),               # GQA + RoPE
    ("qwen2", "attention", dict(num_key_value_heads=1)),               # q/k/v biases + GQA + RoPE
    ("phi3", "mlp", {}),                                               # fused gate_up
]
SLOW = [
    ("qwen3", "attention", dict(rms_norm_eps=0.0)),                    # per-head QK-norm (scale laws at eps 0)
    ("gpt_neox", "attention", {}),                                     # interleaved qkv, biases, partial rotary
    ("phi3", "attention", dict(num_key_value_heads=1, rope_parameters=PARTIAL)),  # fused qkv, GQA, partial rotary
    ("qwen3", "attention", {}),                                        # eps > 0: scale laws not claimed
    ("olmoe", "attention", dict(rms_norm_eps=0.0, num_key_value_heads=1)),  # full-width QK-norm
    ("gpt2", "attention", {}),                                         # Conv1D, biases, no positions (k bias frozen)
    ("gemma2", "attention", {}),
    ("mistral", "attention", dict(num_key_value_heads=1)),
    ("llama", "mlp", {}),
    ("gemma", "mlp", {}),                                              # GeGLU
]


def _laws(module):
    found = locate_blocks(module, warn=False)
    assert not found.uncovered
    return found.entry


def _count_case(mt, part, overrides):
    built = build(mt, part, overrides=overrides)
    entry = _laws(built.module)
    result = count(built.module)
    assert entry.count == result.laws, (mt, part, entry.count, result.laws)
    assert built.expected is None or built.expected == entry.count  # the hf: target's closed form agrees too
    return entry


@pytest.mark.parametrize("mt,part,overrides", FAST, ids=[f"{m}-{p}" for m, p, _ in FAST])
def test_catalogue_count_equals_numeric_count(mt, part, overrides):
    entry = _count_case(mt, part, overrides)
    assert entry.count > 0


@pytest.mark.slow
@pytest.mark.parametrize("mt,part,overrides", SLOW, ids=[f"{m}-{p}" for m, p, _ in SLOW])
def test_catalogue_count_equals_numeric_count_slow(mt, part, overrides):
    _count_case(mt, part, overrides)


ATTENTION = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox", "mixtral",
             "qwen2_moe", "olmoe"]


@pytest.mark.parametrize("mt", ATTENTION)
def test_laws_orthogonal_to_every_field_and_controls_are_not(mt):
    overrides = {"rms_norm_eps": 0.0} if mt in ("qwen3", "olmoe") else {}
    if mt in ("llama", "qwen2", "phi3"):
        overrides["num_key_value_heads"] = 1
    built = build(mt, "attention", overrides=overrides)
    entry = _laws(built.module)
    report = check(built.module, list(entry.laws) + list(entry.controls), n_fields=16, n_points=2)
    assert report.passed and report.max_violation < 1e-11, report.as_dict()
    controls = [v for v in report.verdicts if v.status == "control"]
    assert len(controls) == 2 and min(v.max_violation for v in controls) > 1e-4


def test_hand_law_flips_when_the_group_is_wrong():
    """The GQA law needs the sum over the group: a per-head law (ignoring the sharing) is not conserved."""
    built = build("llama", "attention", overrides=dict(num_key_value_heads=1))
    entry = _laws(built.module)
    qk = next(law for law in entry.laws if law.family == "attn.qk_rope")
    q, k = qk.params

    def one_head(p):  # head 0 alone against the shared K: wrong under GQA
        qn = (p[q][:4] ** 2).sum(1) - (p[k][:4] ** 2).sum(1)
        return qn[:2] + qn[2:]

    wrong = type(qk)(family="attn.qk_rope", name="wrong", formula="", count=2, params=(q, k), fn=one_head)
    assert check(built.module, [wrong], n_fields=8, n_points=1).max_violation > 1e-4


def test_family_table_and_tiny_errors_name_the_supported_ones():
    assert set(FAMILIES) == set(SUPPORTED)
    with pytest.raises(FlowgeomError, match="supported: .*llama"):
        tiny_config("gpt-j")
    with pytest.raises(FlowgeomError, match="supported: .*qwen3"):
        family("opt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tiny_config("phi3").pad_token_id < tiny_config("phi3").vocab_size
    assert tiny_config("llama")._attn_implementation == "eager"
