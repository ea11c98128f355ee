"""ViT-style regressor for Darcy flow with one single-head attention layer over patches.

``a`` (B res res) → patches of p×p pixels → tokens (B T d), ``T = (res/p)²``::

    h0 = embed(patchify(a)) + pos                        (B T d)
    h1 = h0 + o_proj(softmax(q(x) k(x)ᵀ / √d_k) v(x)),  x = LN(h0)
    h2 = h1 + down_proj(gelu(up_proj(LN(h1))))
    û  = unpatchify(head(h2))                            (B res res)

Built from the zoo's blocks: :func:`flowgeom.nn.vit.patchify` /
:func:`~flowgeom.nn.vit.unpatchify`, :class:`flowgeom.nn.MultiHeadAttention`
(one head, ``d_v = d_model``, no positions, not causal) and
:class:`flowgeom.nn.FeedForward` (GELU, biases). Parameter names::

    embed.weight (d p²), embed.bias, pos (T d), ln1.*, ln2.* (LayerNorm with bias)
    attn.{q,k}_proj.weight (d_k d), attn.{v,o}_proj.weight (d d)
    mlp.up_proj.* (d_mlp d), mlp.down_proj.* (d d_mlp), head.* (p² d)

so the regularisers' ``"qk"`` preset selects exactly ``W_Q`` and ``W_K``.
Checkpoints written before the MLP became a ``FeedForward`` (keys
``mlp.0.*``, ``mlp.2.*``) still load. Inputs are centred
(``(a − 7.5)/4.5 ∈ {−1, 1}``); outputs are in the units of the normalised
targets the experiment feeds it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.nn.attention import MultiHeadAttention
from flowgeom.nn.block import make_norm
from flowgeom.nn.feedforward import FeedForward
from flowgeom.nn.vit import patchify, unpatchify

LEGACY_KEYS = {"mlp.0.": "mlp.up_proj.", "mlp.2.": "mlp.down_proj."}  # nn.Sequential MLP -> FeedForward


def _rename_legacy(module, state_dict, prefix, *_args) -> None:
    """Load-state-dict pre-hook: old ``mlp.0.*`` / ``mlp.2.*`` keys under their ``FeedForward`` names."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        for old, new in LEGACY_KEYS.items():
            if key.startswith(prefix + old):
                state_dict[prefix + new + key[len(prefix + old):]] = state_dict.pop(key)


class DarcyViT(nn.Module):
    """See the module docstring; ``patch`` must divide ``resolution``."""

    def __init__(self, *, resolution: int = 16, patch: int = 4, d_model: int = 32, d_k: int = 16, d_mlp: int = 64):
        super().__init__()
        if resolution % patch:
            raise FlowgeomError(f"patch size {patch} must divide the resolution {resolution}")
        self.resolution, self.patch = resolution, patch
        tokens = (resolution // patch) ** 2
        self.embed = nn.Linear(patch * patch, d_model)
        self.pos = nn.Parameter(torch.zeros(tokens, d_model))
        self.ln1 = make_norm("layernorm", d_model, bias=True)
        self.attn = MultiHeadAttention(d_model, 1, d_k, d_model, positions="none", seq_len=tokens, causal=False)
        self.ln2 = make_norm("layernorm", d_model, bias=True)
        self.mlp = FeedForward(d_model, d_mlp, activation="gelu", bias=True)
        self.head = nn.Linear(d_model, patch * patch)
        self.register_load_state_dict_pre_hook(_rename_legacy)

    def patchify(self, a: torch.Tensor) -> torch.Tensor:  # (B, res, res) -> (B, T, p²)
        return patchify(a.unsqueeze(1), self.patch)

    def unpatchify(self, t: torch.Tensor) -> torch.Tensor:  # (B, T, p²) -> (B, res, res)
        return unpatchify(t, self.patch, self.resolution, self.resolution).squeeze(1)

    def forward(self, a: torch.Tensor) -> torch.Tensor:  # a (B, res, res) in {3, 12}
        h = self.embed(self.patchify((a - 7.5) / 4.5)) + self.pos  # (B, T, d)
        h = h + self.attn(self.ln1(h))
        h = h + self.mlp(self.ln2(h))
        return self.unpatchify(self.head(h))


@torch.no_grad()
def uniform_(w: torch.Tensor, bound: float, generator: torch.Generator) -> None:
    """``w ~ U(−bound, bound)`` from ``generator`` (drawn on CPU, copied to ``w``'s device)."""
    w.copy_((torch.rand(w.shape, generator=generator, dtype=w.dtype) * 2 - 1) * bound)


@torch.no_grad()
def init_(model: nn.Module, generator: torch.Generator) -> None:
    """``nn.Linear``'s default ranges (``U(±1/√fan_in)``), drawn from ``generator``; ``pos`` starts at 0."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            bound = 1 / math.sqrt(module.in_features)
            uniform_(module.weight, bound, generator)
            if module.bias is not None:
                uniform_(module.bias, bound, generator)
