"""Multi-head self-attention with none / sinusoidal / RoPE positions.

Parameters (HF Llama names, weights ``(out, in)``, no biases):
``q_proj.weight``, ``k_proj.weight`` (H*d_k d_model); ``v_proj.weight``
(H*d_v d_model); ``o_proj.weight`` (d_model H*d_v). Head i owns rows
``i*d_k:(i+1)*d_k`` of q/k (``i*d_v:(i+1)*d_v`` of v) and the same columns
of o.

RoPE follows the HF "rotate_half" layout: inside a head, the 2x2 rotation
block j (j < d_k/2) acts on rows ``j`` and ``j + d_k/2``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flowgeom.errors import FlowgeomError, choice_error

POSITIONS = ("none", "sinusoidal", "rope")


def sinusoidal_table(seq_len: int, d_model: int, dtype=torch.float32) -> torch.Tensor:
    """Vaswani et al. absolute encodings, (seq_len d_model)."""
    pos = torch.arange(seq_len, dtype=torch.float64)[:, None]
    i = torch.arange(0, d_model, 2, dtype=torch.float64)
    angle = pos / (10000.0 ** (i / d_model))  # (T, ceil(d/2))
    table = torch.zeros(seq_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return table.to(dtype)


def rope_angles(seq_len: int, d_k: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (seq_len d_k), in the rotate_half layout."""
    inv_freq = base ** (-torch.arange(0, d_k, 2, dtype=torch.float64) / d_k)  # (d_k/2,)
    freqs = torch.arange(seq_len, dtype=torch.float64)[:, None] * inv_freq  # (T, d_k/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, d_k)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, d_k) by position: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class MultiHeadAttention(nn.Module):
    """Self-attention ``o_proj(concat_i softmax(Q_i x (K_i x)^T / sqrt(d_k)) V_i x)``."""

    def __init__(self, d_model: int, n_heads: int, d_k: int, d_v: int | None = None, *, positions: str = "none",
                 seq_len: int = 4, causal: bool = True):
        super().__init__()
        if positions not in POSITIONS:
            raise choice_error("positions", positions, POSITIONS)
        if positions == "rope" and d_k % 2:
            raise FlowgeomError(f"RoPE needs an even head dim, got d_k={d_k}; pass an even --d-k")
        self.d_model, self.n_heads, self.d_k, self.d_v = d_model, n_heads, d_k, d_v or d_k
        self.positions, self.seq_len, self.causal = positions, seq_len, causal
        self.q_proj = nn.Linear(d_model, n_heads * d_k, bias=False)
        self.k_proj = nn.Linear(d_model, n_heads * d_k, bias=False)
        self.v_proj = nn.Linear(d_model, n_heads * self.d_v, bias=False)
        self.o_proj = nn.Linear(n_heads * self.d_v, d_model, bias=False)
        if positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(seq_len, d_model), persistent=False)
        if positions == "rope":
            cos, sin = rope_angles(seq_len, d_k)
            self.register_buffer("rope_cos", cos.float(), persistent=False)
            self.register_buffer("rope_sin", sin.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d_model) -> (B, T, d_model)
        B, T, _ = x.shape
        if T > self.seq_len and self.positions != "none":
            raise FlowgeomError(f"sequence length {T} exceeds the module's seq_len={self.seq_len}; build it with a larger seq_len")
        if self.positions == "sinusoidal":
            x = x + self.pos_table[:T].to(x.dtype)
        H = self.n_heads
        q = self.q_proj(x).view(B, T, H, self.d_k).transpose(1, 2)  # (B, H, T, d_k)
        k = self.k_proj(x).view(B, T, H, self.d_k).transpose(1, 2)  # (B, H, T, d_k)
        v = self.v_proj(x).view(B, T, H, self.d_v).transpose(1, 2)  # (B, H, T, d_v)
        if self.positions == "rope":
            cos, sin = self.rope_cos[:T].to(x.dtype), self.rope_sin[:T].to(x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)  # (B, H, T, T)
        if self.causal:
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        y = F.softmax(scores, dim=-1) @ v  # (B, H, T, d_v)
        y = y.transpose(1, 2).reshape(B, T, H * self.d_v)  # (B, T, H*d_v)
        return self.o_proj(y)

    def sample_input(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(batch, self.seq_len, self.d_model, generator=generator, dtype=self.q_proj.weight.dtype)
