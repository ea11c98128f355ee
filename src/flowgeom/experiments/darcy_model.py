"""ViT-style regressor for Darcy flow with one single-head attention layer over patches.

``a`` (B res res) → patches of p×p pixels → tokens (B T d), ``T = (res/p)²``::

    h0 = PatchEmbed(a) + P                               (B T d)
    h1 = h0 + o_proj(softmax(q(x) k(x)ᵀ / √d_k) v(x)),  x = LN(h0)
    h2 = h1 + MLP(LN(h1))
    û  = Unpatch(Head(h2))                               (B res res)

The attention weights use the zoo's names (``attn.q_proj.weight`` … (out,
in)), so the regularisers' ``"qk"`` preset selects exactly ``W_Q`` and ``W_K``.
Inputs are centred (``(a − 7.5)/4.5 ∈ {−1, 1}``); outputs are in the units of
the normalised targets the experiment feeds it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flowgeom.errors import FlowgeomError


class SingleHeadAttention(nn.Module):
    """``o_proj(softmax(q_proj(x) k_proj(x)ᵀ / √d_k) v_proj(x))``, no mask, no biases."""

    def __init__(self, d_model: int, d_k: int):
        super().__init__()
        self.d_k = d_k
        self.q_proj = nn.Linear(d_model, d_k, bias=False)
        self.k_proj = nn.Linear(d_model, d_k, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.o_proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, d)
        scores = self.q_proj(x) @ self.k_proj(x).transpose(-1, -2) / math.sqrt(self.d_k)  # (B, T, T)
        return self.o_proj(torch.softmax(scores, dim=-1) @ self.v_proj(x))


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
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = SingleHeadAttention(d_model, d_k)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_mlp), nn.GELU(), nn.Linear(d_mlp, d_model))
        self.head = nn.Linear(d_model, patch * patch)

    def patchify(self, a: torch.Tensor) -> torch.Tensor:
        b, r, p = a.shape[0], self.resolution, self.patch
        x = a.reshape(b, r // p, p, r // p, p).permute(0, 1, 3, 2, 4)  # (B, r/p, r/p, p, p)
        return x.reshape(b, (r // p) ** 2, p * p)  # (B, T, p²)

    def unpatchify(self, t: torch.Tensor) -> torch.Tensor:
        b, r, p = t.shape[0], self.resolution, self.patch
        x = t.reshape(b, r // p, r // p, p, p).permute(0, 1, 3, 2, 4)  # (B, r/p, p, r/p, p)
        return x.reshape(b, r, r)

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
