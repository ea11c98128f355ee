"""``flowgeom laws count hf:MODEL_TYPE:PART`` and the engine's precision detection.

Counts of real transformers blocks (tiny float64 configs) against the closed
forms derived in ``flowgeom.laws.hf_target`` (each worked out by hand here
too, not read back from the module); a planted float32 op inside a float64
module is detected; bad targets and configs are one-line errors with exit 2.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from flowgeom.cli import main  # noqa: E402
from flowgeom.laws.count import count  # noqa: E402
from flowgeom.laws.hf_target import _typed  # noqa: E402
from flowgeom.laws.precision import gap_notes, keep_dtype  # noqa: E402
from flowgeom.laws.target import resolve  # noqa: E402


def _count(target, *items, keep_casts=False):
    t = resolve(target, hf_config=list(items), keep_casts=keep_casts)
    return t, count(t.module, t.sampler, expected=t.expected)


# Closed forms by hand for the count-sized configs (hidden d = 8, H = 2 heads of d_h = 4, MLP width 6):
#   RoPE attention, per K/V group: d_h/2 (rotation pairs) + d_h(d_h+1)/2 (V–O)    -> kv · (2 + 10)
#   Qwen3 per-head QK-norm (eps > 0): d_h/2 (γ_q/γ_k pairs, shared) + kv·10; eps = 0 adds H + kv scale laws
#   GPT-2 (no positions, biases), per head: 10 (Q_aug–K) + 4 (k bias: zero gradient) + 10 (V_aug–O)
#   SwiGLU MLP: width 6; Mixtral MoE (3 experts of width 3): d + E·m = 8 + 9
CASES = [
    ("hf:llama:attention", (), 2 * (2 + 10)),
    ("hf:llama:attention", ("num_key_value_heads=1",), 1 * (2 + 10)),
    ("hf:qwen3:attention", (), 2 + 2 * 10),
    pytest.param("hf:qwen3:attention", ("num_key_value_heads=1", "rms_norm_eps=0"), 2 + 10 + (2 + 1), marks=pytest.mark.slow),
    ("hf:llama:mlp", (), 6),
    ("hf:gpt2:attention", (), 2 * (10 + 4 + 10)),
    ("hf:mixtral:moe", (), 8 + 3 * 3),
]


def _id(case):
    t, i, _ = case.values if hasattr(case, "values") else case
    return t + ("+" + "+".join(i) if i else "")


@pytest.mark.parametrize("target,items,laws", CASES, ids=[_id(c) for c in CASES])
def test_hf_counts_match_closed_forms(target, items, laws):
    t, res = _count(target, *items)
    assert res.laws == laws
    assert res.expected == laws  # the module's closed form agrees with the hand count
    assert res.precision["effective"] == "float64" and not res.precision["reduced"]
    assert res.gap["ratio"] > 1e6  # a clear gap, not a tolerance-dependent count
    for item in items:
        key, _, value = item.partition("=")
        assert str(t.config[key]) == str(_typed(key, value, t.config[key]))


@pytest.mark.slow
@pytest.mark.parametrize("target,laws", [("hf:llama:block", 24 + 6 + 2 * 8), ("hf:bert:attention", 48 + 8 + 1),
                                         ("hf:gpt_neox:attention", 2 * (1 + 3 + 2 + 10))])
def test_hf_heavier_counts(target, laws):
    _, res = _count(target)
    assert res.laws == laws == res.expected


def test_native_float32_casts_are_detected_and_the_count_still_right():
    """--keep-casts: eager softmax in float32; the engine says so, raises the tolerance, and still counts 24."""
    _, res = _count("hf:llama:attention", keep_casts=True)
    assert res.precision["reduced"] and res.precision["effective"] == "float32"
    assert 1e-9 < res.precision["noise"] < 1e-5
    assert res.tolerance > 1e-9  # adapted to the noise
    assert res.laws == 24
    assert any(n.startswith("reduced precision") for n in res.notes)
    # the default float64 tolerance on the same module is fooled: the noise σ lie above it
    t = resolve("hf:llama:attention", keep_casts=True)
    fooled = count(t.module, t.sampler, tol=1e-9)
    assert fooled.laws < 24
    assert any(n.startswith("unclear rank gap") for n in fooled.notes)


class _SwiGLU(nn.Module):
    """d=3 -> m=4 -> 3 SwiGLU; ``cast`` runs the gate product in float32 (a planted low-precision op)."""

    def __init__(self, cast: bool):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate = nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64))
        self.up = nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64))
        self.down = nn.Parameter(torch.randn(3, 4, generator=g, dtype=torch.float64))
        self.cast = cast

    def forward(self, x):  # x (B, 3)
        h = nn.functional.silu(x @ self.gate.T) * (x @ self.up.T)  # (B, 4)
        if self.cast:
            h = h.to(torch.float32).to(x.dtype)
        return h @ self.down.T

    def sample_input(self, n, generator):
        return torch.randn(n, 3, generator=generator, dtype=torch.float64)


class _Lifted(_SwiGLU):
    def forward(self, x):
        with keep_dtype():
            return super().forward(x)


@pytest.mark.parametrize("cls,cast,reduced", [(_SwiGLU, False, False), (_SwiGLU, True, True), (_Lifted, True, False)])
def test_planted_float32_op_is_detected(cls, cast, reduced):
    res = count(cls(cast))
    assert res.precision["reduced"] is reduced
    assert (res.precision["noise"] > 1e-9) is reduced
    assert res.laws == 4  # one law per hidden unit, with the adapted tolerance too


def test_keep_dtype_lifts_only_float64_down_casts():
    x = torch.randn(3, dtype=torch.float64)
    with keep_dtype():
        assert x.to(torch.float32).dtype == torch.float64
        assert x.float().dtype == torch.float64
        assert x.to("cpu", torch.float16).dtype == torch.float64
        assert nn.functional.softmax(x, dim=0, dtype=torch.float32).dtype == torch.float64
        assert x.to(torch.float32).data_ptr() == x.data_ptr()
        y = torch.randn(3)  # float32 tensors keep their own casts
        assert y.half().dtype == torch.float16 and y.double().dtype == torch.float64
    assert x.to(torch.float32).dtype == torch.float32  # nothing leaks out of the context


def test_gap_notes_flag_an_unclear_gap_only():
    clear = {"tolerance": 1e-9, "smallest_kept": [1e-3], "largest_dropped": [1e-15]}
    muddy = {"tolerance": 1e-9, "smallest_kept": [2e-9], "largest_dropped": [8e-10]}
    assert gap_notes(clear, None, default_tol=1e-9, tol_given=False) == []
    assert [n.split(":")[0] for n in gap_notes(muddy, None, default_tol=1e-9, tol_given=False)] == ["unclear rank gap"]


def test_sdpa_module_is_switched_to_eager():
    from transformers.models.llama.modeling_llama import LlamaAttention

    from flowgeom.hf.tiny import tiny_config

    config = tiny_config("llama", hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    config._attn_implementation = "sdpa"

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = LlamaAttention(config, 0).double()

        def forward(self, x):  # x (B, T, d); no positions: cos = 1, sin = 0
            ones = torch.ones(*x.shape[:-1], 4, dtype=x.dtype)
            return self.attn(x, position_embeddings=(ones, 0 * ones), attention_mask=None)[0]

        def sample_input(self, n, g):
            return torch.randn(n, 3, 8, generator=g, dtype=torch.float64)

    res = count(Wrap())
    assert any("switched to 'eager'" in n for n in res.notes)
    assert config._attn_implementation == "sdpa"  # the caller's module is untouched (the count works on a copy)
    # no positions, one K/V group: d_h(d_h+1)/2 for Q–K and for V–O; the float32 softmax is detected
    assert res.laws == 10 + 10 and res.precision["reduced"]


def test_typed_config_values():
    assert _typed("attention_bias", "true", False) is True
    assert _typed("rms_norm_eps", "0", 1e-6) == 0.0
    assert _typed("num_key_value_heads", "1", 2) == 1
    assert _typed("rope_parameters", '{"rope_theta": 100.0}', {"rope_theta": 1e4}) == {"rope_theta": 100.0}
    assert _typed("sliding_window", "none", None) is None


def test_cli_json_shows_config_and_precision(capsys):
    rc = main(["laws", "count", "hf:llama:attention", "--config", "num_key_value_heads=1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["config"]["num_key_value_heads"] == 1 and out["config"]["_attn_implementation"] == "eager"
    assert out["laws"] == out["expected"] == 12
    assert out["precision"]["effective"] == "float64"


@pytest.mark.parametrize("argv,needle", [
    (["hf:nope:attention"], "supported: bert,"),
    (["hf:llama:ffn"], "parts: attention, mlp, moe, block"),
    (["hf:llama:moe"], "llama has no moe block"),
    (["hf:llama:attention", "--config", "not_a_key=1"], "keys: "),
    (["hf:llama:attention", "--config", "num_attention_heads=two"], "expected an integer"),
    (["hf:llama:attention", "--config", "attn_implementation=sdpa"], "eager"),
    (["hf:llama:attention", "--config", "num_attention_heads=3"], "change the --config values"),
    (["hf:llama:attention", "--config", "num_key_value_heads=5"], "2 query heads are not a multiple of 5 key/value"),
    (["hf:mixtral:block", "--config", "num_key_value_heads=3"], "pick num_key_value_heads among [1, 2]"),
    (["hf:llama:attention", "--config", "num_key_value_heads=0"], "change the --config values"),
    (["mha", "--config", "heads=2"], "only applies to hf:"),
    (["hf:llama:attention", "--config", "vocab_size=3000000"], "a tiny model for counting may have"),
])
def test_cli_errors_are_one_line(capsys, argv, needle):
    rc = main(["laws", "count", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("flowgeom: error: ") and needle in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("target,items", [("hf:llama:attention", ("num_key_value_heads=1",)), ("hf:qwen3:attention", ()),
                                          ("hf:gpt2:attention", ()), ("hf:qwen2_moe:moe", ())])
def test_closed_forms_agree_with_the_located_catalogue(target, items):
    """The law families flowgeom.laws.locate finds in the same block add up to the same count."""
    locate = pytest.importorskip("flowgeom.laws.locate").locate
    t = resolve(target, hf_config=list(items))
    entry = locate(t.module, warn=False)
    assert sum(law.count for law in entry.laws) == t.expected


def test_curvature_is_not_mistaken_for_rounding_noise():
    """A steep float64 module: one second difference reads ε²·curvature (> 1e-11) as noise; the estimate cancels it."""
    from flowgeom.laws.fields import FieldModel
    from flowgeom.laws.precision import EPS, measure

    class Steep(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.w = nn.Parameter(torch.randn(3, 4, generator=g, dtype=torch.float64))
            self.v = nn.Parameter(torch.randn(2, 3, generator=g, dtype=torch.float64))

        def forward(self, x):  # x (B, 4)
            return torch.exp(60.0 * (x @ self.w.T)) @ self.v.T

    model = FieldModel(Steep())
    theta = model.layout.flatten(dict(model.module.named_parameters())).detach()
    g = torch.Generator().manual_seed(1)
    xs, cs = torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randn(16, 2, generator=g, dtype=torch.float64)
    u = torch.randn(theta.shape, generator=g, dtype=torch.float64) * theta.abs()
    g0 = model.field(theta, xs, cs)
    single = (model.field(theta + EPS * u, xs, cs) + model.field(theta - EPS * u, xs, cs) - 2 * g0).norm() / g0.norm()
    assert single > 1e-11  # the naive estimate would call this module float32
    prec = measure(model.field, theta, [(xs, cs)], torch.Generator().manual_seed(2), dtype=torch.float64)
    assert prec.effective == "float64" and prec.noise < 1e-12 and not prec.reduced
