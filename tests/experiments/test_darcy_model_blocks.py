"""DarcyViT rebuilt from nn/ blocks computes the same function, from the same initial weights, as before.

``LegacyDarcyViT`` below is the model as it was before (its own attention,
patchify and a ``nn.Sequential`` MLP), kept here as the reference. Both are
initialised from the same generator with ``init_``; the weights must match
through ``KEY_MAP`` exactly (same RNG order), and outputs and gradients to
1e-12 in float64.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.experiments.darcy_model import DarcyViT, init_
from flowgeom.langevin import select
from flowgeom.nn.attention import MultiHeadAttention
from flowgeom.nn.feedforward import FeedForward

# old name -> new name; every other key is unchanged
KEY_MAP = {"mlp.0.weight": "mlp.up_proj.weight", "mlp.0.bias": "mlp.up_proj.bias",
           "mlp.2.weight": "mlp.down_proj.weight", "mlp.2.bias": "mlp.down_proj.bias"}


class _LegacyAttention(nn.Module):
    def __init__(self, d_model, d_k):
        super().__init__()
        self.d_k = d_k
        self.q_proj = nn.Linear(d_model, d_k, bias=False)
        self.k_proj = nn.Linear(d_model, d_k, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x):  # (B, T, d)
        att = torch.softmax(self.q_proj(x) @ self.k_proj(x).mT / math.sqrt(self.d_k), dim=-1)  # (B, T, T)
        return self.o_proj(att @ self.v_proj(x))


class LegacyDarcyViT(nn.Module):
    def __init__(self, *, resolution=16, patch=4, d_model=32, d_k=16, d_mlp=64):
        super().__init__()
        self.r, self.p = resolution, patch
        self.embed = nn.Linear(patch * patch, d_model)
        self.pos = nn.Parameter(torch.zeros((resolution // patch) ** 2, d_model))
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _LegacyAttention(d_model, d_k)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_mlp), nn.GELU(), nn.Linear(d_mlp, d_model))
        self.head = nn.Linear(d_model, patch * patch)

    def forward(self, a):  # (B, r, r)
        b, r, p, n = a.shape[0], self.r, self.p, self.r // self.p
        x = ((a - 7.5) / 4.5).reshape(b, n, p, n, p).permute(0, 1, 3, 2, 4).reshape(b, n * n, p * p)  # (B, T, p²)
        h = self.embed(x) + self.pos
        h = h + self.attn(self.ln1(h))
        h = h + self.mlp(self.ln2(h))
        y = self.head(h).reshape(b, n, n, p, p).permute(0, 1, 3, 2, 4)  # (B, n, p, n, p)
        return y.reshape(b, r, r)


def _pair(seed, **sizes):
    old, new = LegacyDarcyViT(**sizes), DarcyViT(**sizes)
    init_(old, torch.Generator().manual_seed(seed))
    init_(new, torch.Generator().manual_seed(seed))
    return old, new


def _mapped(state):
    return {KEY_MAP.get(k, k): v for k, v in state.items()}


def _inputs(batch, resolution, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(batch, resolution, resolution, generator=g) < 0.5, 3.0, 12.0).double()  # (B, r, r)


SIZES = st.fixed_dictionaries({
    "resolution": st.sampled_from([4, 8, 12, 16]), "patch": st.sampled_from([1, 2, 4]),
    "d_model": st.integers(2, 12), "d_k": st.integers(1, 8), "d_mlp": st.integers(1, 10)})


@settings(max_examples=25, deadline=None)
@given(sizes=SIZES, seed=st.integers(0, 2**31 - 1))
def test_same_initial_weights_same_function_same_gradients(sizes, seed):
    old, new = _pair(seed, **sizes)
    # same keys (through KEY_MAP), same order, same values: init_ drew them in the same order
    assert list(_mapped(old.state_dict())) == list(new.state_dict())
    for key, value in _mapped(old.state_dict()).items():
        assert torch.equal(value, new.state_dict()[key]), key
    new.load_state_dict(_mapped(old.state_dict()))  # strict: no key missing or left over
    old.double(), new.double()
    a = _inputs(3, sizes["resolution"], seed + 1)
    w = torch.randn(3, sizes["resolution"], sizes["resolution"], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed + 2))
    y_old, y_new = old(a), new(a)
    assert y_new.shape == a.shape
    torch.testing.assert_close(y_new, y_old, rtol=0, atol=1e-12)
    ((y_old * w).sum() + (y_old ** 2).mean()).backward()
    ((y_new * w).sum() + (y_new ** 2).mean()).backward()
    new_params = dict(new.named_parameters())
    for name, p in old.named_parameters():
        torch.testing.assert_close(new_params[KEY_MAP.get(name, name)].grad, p.grad, rtol=0, atol=1e-12, msg=name)


def test_default_construction_draws_the_global_rng_in_the_same_order():
    """Before ``init_``, torch's own ``nn.Linear`` init draws from the global RNG: same draws, same places."""
    sizes = dict(resolution=8, patch=2, d_model=6, d_k=3, d_mlp=5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        old = LegacyDarcyViT(**sizes)
        after_old = torch.rand(1)
        torch.manual_seed(11)
        new = DarcyViT(**sizes)
        after_new = torch.rand(1)
    for key, value in _mapped(old.state_dict()).items():
        assert torch.equal(value, new.state_dict()[key]), key
    assert torch.equal(after_old, after_new)  # and the same number of draws


def test_quick_preset_model_matches_and_is_made_of_zoo_blocks():
    old, new = _pair(0)  # the experiment's default sizes
    assert isinstance(new.attn, MultiHeadAttention) and not new.attn.causal and new.attn.n_heads == 1
    assert isinstance(new.mlp, FeedForward) and new.mlp.activation == "gelu"
    new.load_state_dict(_mapped(old.state_dict()))
    a = _inputs(4, 16, 5).float()
    torch.testing.assert_close(new(a), old(a), rtol=0, atol=1e-6)


def test_qk_preset_selects_exactly_wq_and_wk():
    model = DarcyViT(d_model=32, d_k=16)
    qk = select(model, preset="qk")
    assert sorted(qk) == ["attn.k_proj.weight", "attn.q_proj.weight"]
    assert qk["attn.q_proj.weight"].shape == qk["attn.k_proj.weight"].shape == (16, 32)


def test_checkpoint_with_the_old_keys_still_loads():
    old, _ = _pair(3, resolution=8, patch=2, d_model=6, d_k=3, d_mlp=5)
    new = DarcyViT(resolution=8, patch=2, d_model=6, d_k=3, d_mlp=5)  # different (torch default) weights
    result = new.load_state_dict(old.state_dict())  # mlp.0.* / mlp.2.* keys, strict
    assert not result.missing_keys and not result.unexpected_keys
    a = _inputs(2, 8, 4).float()
    torch.testing.assert_close(new(a), old(a), rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="Unexpected key"):  # the hook renames only the known legacy keys
        new.load_state_dict({**old.state_dict(), "mlp.1.weight": torch.zeros(1)})


def test_patchify_round_trip_and_token_order():
    model = DarcyViT(resolution=8, patch=2, d_model=4, d_k=2, d_mlp=3)
    a = torch.arange(2 * 64, dtype=torch.float64).reshape(2, 8, 8)
    tokens = model.patchify(a)  # (B, 16, 4)
    assert tokens.shape == (2, 16, 4)
    assert tokens[0, 1].tolist() == [2.0, 3.0, 10.0, 11.0]  # second patch of the first row, row-major inside
    assert torch.equal(model.unpatchify(tokens), a)


def test_patch_must_divide_resolution():
    with pytest.raises(FlowgeomError, match="patch size 3 must divide the resolution 16"):
        DarcyViT(resolution=16, patch=3)
