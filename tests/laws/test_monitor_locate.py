"""Finding laws by HF names in models not built from zoo classes."""

import pytest
import torch
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.laws import catalogue, check
from flowgeom.laws.locate import locate
from flowgeom.laws.monitor import ConservationMonitor
from flowgeom.nn import MultiHeadAttention, SwiGLU
from flowgeom.nn.attention import apply_rope, rope_angles


class HFAttention(nn.Module):
    """A user's own attention with Llama names and a head count attribute (wraps the zoo maths)."""

    def __init__(self, d_model, num_heads, head_dim, rope=False, kv_heads=None, bias=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        if kv_heads is not None:
            self.num_key_value_heads = kv_heads
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, num_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias)
        if rope:
            self.rotary_emb = nn.Identity()
        self.rope = rope

    def forward(self, x):  # (B, T, d) -> (B, T, d), written independently of the zoo
        B, T, _ = x.shape
        H, d = self.num_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, d).transpose(1, 2)  # (B, H, T, d)
        k = self.k_proj(x).view(B, T, H, d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, H, d).transpose(1, 2)
        if self.rope:
            cos, sin = (t.to(x.dtype) for t in rope_angles(T, d))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = torch.softmax(q @ k.transpose(-2, -1) / d ** 0.5, dim=-1)  # (B, H, T, T)
        return self.o_proj((a @ v).transpose(1, 2).reshape(B, T, H * d))


class HFMLP(nn.Module):
    def __init__(self, d, m):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, m, bias=False), nn.Linear(d, m, bias=False), nn.Linear(m, d, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, rope=False):
        super().__init__()
        torch.manual_seed(0)
        self.attn = HFAttention(6, 2, 4, rope=rope)
        self.mlp = HFMLP(6, 5)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)

    def sample_input(self, batch, generator=None):
        return torch.randn(batch, 4, 6, generator=generator, dtype=self.mlp.up_proj.weight.dtype)


@pytest.mark.parametrize("rope", [False, True])
def test_located_laws_equal_the_zoo_laws_and_pass_the_check(rope):
    block = Block(rope).double()
    entry = locate(block)
    fams = sorted({law.family for law in entry.laws})
    assert fams == sorted(["attn.qk_rope" if rope else "attn.qk", "attn.vo", "swiglu.up_down"])
    zoo = MultiHeadAttention(6, 2, 4, positions="rope" if rope else "none").double()
    zoo.load_state_dict({k.removeprefix("attn."): v for k, v in block.state_dict().items() if k.startswith("attn.")},
                        strict=False)
    params = {f"attn.{n}": p for n, p in zoo.named_parameters()} | dict(block.named_parameters())
    zoo_laws = [law for law in catalogue(zoo).laws]
    mine = [law for law in entry.laws if law.family.startswith("attn")]
    for a, b in zip(mine, zoo_laws):
        assert torch.allclose(a.evaluate(params), b.evaluate(dict(zoo.named_parameters())))
    report = check(block, entry.laws + entry.controls, n_fields=24, n_points=2)
    assert report.passed and report.max_violation < 1e-10
    assert min(v.max_violation for v in report.verdicts if v.status == "control") > 1e-3


def test_monitor_uses_the_locator():
    block = Block().double()
    mon = ConservationMonitor(block, warn=False)
    assert "eps/attn.qk@attn" in mon._keys and "eps/swiglu.up_down@mlp" in mon._keys


def test_skips_gqa_and_biases_with_notes_and_needs_heads():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.gqa = HFAttention(6, 2, 4, kv_heads=1)
            self.biased = HFAttention(6, 2, 4, bias=True)
            self.mlp = HFMLP(6, 3)

    entry = locate(Model())
    assert any("grouped-query" in n for n in entry.notes) and any("biases" in n for n in entry.notes)
    assert {law.family for law in entry.laws} == {"swiglu.up_down"}

    class NoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(4, 4, bias=False) for _ in range(4))

    with pytest.raises(FlowgeomError, match="heads="):
        locate(NoHeads())
    assert len(locate(NoHeads(), heads=2).laws) == 4
    with pytest.raises(FlowgeomError, match="not divisible"):
        locate(NoHeads(), heads=3)


def test_zoo_blocks_are_not_counted_twice():
    model = nn.Sequential(SwiGLU(4, 3), MultiHeadAttention(4, 2, 2))
    assert len(locate(model).laws) == len(catalogue(model).laws)
