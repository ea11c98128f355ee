"""TinyLM and ViT now share one PreNormBlock: same function, same state-dict keys, same initial weights as before.

``legacy_layer`` below is the former ``DecoderLayer`` / ``EncoderLayer`` (they
were the same code), kept as the reference. The legacy models are rebuilt
module by module in the order their ``__init__`` ran, under the same global
seed as the new ones.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.nn.attention import MultiHeadAttention
from flowgeom.nn.block import PreNormBlock, make_norm
from flowgeom.nn.feedforward import FeedForward, SwiGLU
from flowgeom.nn.lm import LMConfig, TinyLM
from flowgeom.nn.moe import MixtureOfExperts
from flowgeom.nn.vit import ViT, ViTConfig, patchify, unpatchify


def legacy_norm(kind, d):
    return {"rmsnorm": lambda: nn.RMSNorm(d, eps=1e-6), "layernorm": lambda: nn.LayerNorm(d, bias=False),
            "none": nn.Identity}[kind]()


class LegacyLayer(nn.Module):
    def __init__(self, norm, d_model, make_attn, make_mlp):
        super().__init__()
        self.input_layernorm = legacy_norm(norm, d_model)
        self.self_attn = make_attn()
        self.post_attention_layernorm = legacy_norm(norm, d_model)
        self.mlp = make_mlp()

    def forward(self, h):
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class LegacyLM(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        rope = "rope" if c.positions == "rope" else "none"

        def mlp():
            if c.mlp == "swiglu":
                return SwiGLU(c.d_model, c.d_hidden)
            if c.mlp == "moe":
                return MixtureOfExperts(c.d_model, c.d_hidden, c.experts, gate=c.gate, top_k=c.top_k)
            return FeedForward(c.d_model, c.d_hidden, activation=c.mlp)

        self.embed_tokens = nn.Embedding(c.vocab, c.d_model)
        self.layers = nn.ModuleList(
            LegacyLayer(c.norm, c.d_model, lambda: MultiHeadAttention(c.d_model, c.heads, c.d_k, c.d_k, positions=rope,
                                                                      seq_len=c.seq_len), mlp)
            for _ in range(c.n_layers))
        self.norm = legacy_norm(c.norm, c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)


class LegacyViT(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        self.patch_embed = nn.Linear(c.channels * c.patch ** 2, c.d_model)
        self.pos_embed = nn.Parameter(0.02 * torch.randn(c.n_patches, c.d_model))
        self.layers = nn.ModuleList(
            LegacyLayer(c.norm, c.d_model, lambda: MultiHeadAttention(c.d_model, c.heads, c.d_k, c.d_k, positions="none",
                                                                      seq_len=c.n_patches, causal=False),
                        lambda: SwiGLU(c.d_model, c.d_hidden))
            for _ in range(c.n_layers))
        self.norm = legacy_norm(c.norm, c.d_model)
        self.head = nn.Linear(c.d_model, c.n_classes)


def _build_both(seed, legacy_cls, new_factory):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        old = legacy_cls()
        next_old = torch.rand(1)
        torch.manual_seed(seed)
        new = new_factory()
        next_new = torch.rand(1)
    assert torch.equal(next_old, next_new)  # the same number of global draws
    return old, new


def _assert_same_state(old, new):
    s_old, s_new = old.state_dict(), new.state_dict()
    assert list(s_old) == list(s_new)  # same keys in the same order: old checkpoints load unchanged
    for key in s_old:
        assert torch.equal(s_old[key], s_new[key]), key  # same init order
    new.load_state_dict(s_old)  # strict


def _assert_same_layers(old, new, h):
    """Each old layer and its new block: same output and same gradients (float64)."""
    for l_old, l_new in zip(old.layers, new.layers):
        l_old.double(), l_new.double()
        w = torch.randn(h.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        y_old, y_new = l_old(h), l_new(h)
        torch.testing.assert_close(y_new, y_old, rtol=0, atol=1e-12)
        (y_old * w).sum().backward()
        (y_new * w).sum().backward()
        g_new = dict(l_new.named_parameters())
        for name, p in l_old.named_parameters():
            torch.testing.assert_close(g_new[name].grad, p.grad, rtol=0, atol=1e-12, msg=name)
        h = y_new.detach()


LM_CONFIGS = st.builds(
    LMConfig, vocab=st.integers(5, 12), d_model=st.integers(2, 8), n_layers=st.integers(1, 2),
    heads=st.integers(1, 2), d_k=st.sampled_from([2, 4]), d_hidden=st.integers(1, 6), seq_len=st.integers(3, 6),
    positions=st.sampled_from(["none", "sinusoidal", "rope"]), mlp=st.sampled_from(["swiglu", "moe", "gelu", "identity"]),
    norm=st.sampled_from(["rmsnorm", "layernorm", "none"]), experts=st.integers(2, 3), top_k=st.sampled_from([None, 1]))


@settings(max_examples=25, deadline=None)
@given(cfg=LM_CONFIGS, seed=st.integers(0, 2**31 - 1))
def test_tiny_lm_blocks_unchanged(cfg, seed):
    old, new = _build_both(seed, lambda: LegacyLM(cfg), lambda: TinyLM(cfg))
    assert all(type(layer) is PreNormBlock for layer in new.layers)
    _assert_same_state(old, new)
    h = torch.randn(2, cfg.seq_len, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    _assert_same_layers(old, new, h)


VIT_CONFIGS = st.builds(
    ViTConfig, image_size=st.sampled_from([4, 8]), channels=st.integers(1, 2), patch=st.sampled_from([2, 4]),
    d_model=st.integers(2, 8), n_layers=st.integers(1, 2), heads=st.integers(1, 2), d_k=st.integers(1, 4),
    d_hidden=st.integers(1, 6), n_classes=st.integers(2, 4), norm=st.sampled_from(["rmsnorm", "layernorm", "none"]))


@settings(max_examples=25, deadline=None)
@given(cfg=VIT_CONFIGS, seed=st.integers(0, 2**31 - 1))
def test_vit_blocks_unchanged(cfg, seed):
    old, new = _build_both(seed, lambda: LegacyViT(cfg), lambda: ViT(cfg))
    _assert_same_state(old, new)
    h = torch.randn(3, cfg.n_patches, cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    _assert_same_layers(old, new, h)


def test_whole_lm_forward_unchanged_on_tokens():
    """End to end on a real forward (embedding, sinusoidal positions, final norm): the old layers in the new model."""
    cfg = LMConfig(vocab=11, d_model=8, n_layers=2, heads=2, d_k=4, d_hidden=6, seq_len=5, positions="sinusoidal")
    old, new = _build_both(3, lambda: LegacyLM(cfg), lambda: TinyLM(cfg))
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    logits = new.double()(tokens)
    new.layers = old.layers.double()  # the legacy blocks, same weights
    torch.testing.assert_close(new(tokens), logits, rtol=0, atol=1e-12)


def test_block_wiring_is_pre_norm_residual():
    """h + A(N(h)), then + M(N(.)): checked with hand-made stand-ins whose outputs are known."""

    class Scale(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c = c

        def forward(self, x):
            return self.c * x

    block = PreNormBlock(3, Scale(2.0), Scale(-0.5), norm="none")
    h = torch.tensor([[[1.0, 2.0, 3.0]]])
    assert torch.equal(block(h), 0.5 * (3 * h))  # h1 = 3h; h2 = h1 - h1/2
    assert [n for n, _ in block.named_children()] == ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]


def test_make_norm_kinds_and_bad_kind():
    assert isinstance(make_norm("rmsnorm", 4), nn.RMSNorm) and make_norm("rmsnorm", 4).eps == 1e-6
    assert make_norm("layernorm", 4).bias is None and make_norm("layernorm", 4, bias=True).bias.shape == (4,)
    assert isinstance(make_norm("none", 4), nn.Identity)
    with pytest.raises(FlowgeomError, match="batchnorm") as err:
        make_norm("batchnorm", 4)
    assert "rmsnorm" in str(err.value)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), c=st.integers(1, 3), patch=st.sampled_from([1, 2, 3]), h=st.integers(1, 3), w=st.integers(1, 3))
def test_unpatchify_inverts_patchify(b, c, patch, h, w):
    images = torch.randn(b, c, h * patch, w * patch, generator=torch.Generator().manual_seed(b + c + h + w))
    tokens = patchify(images, patch)
    assert tokens.shape == (b, h * w, c * patch * patch)
    assert torch.equal(unpatchify(tokens, patch, h * patch, w * patch), images)
