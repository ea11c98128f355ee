"""A small decoder-only language model assembled from the zoo's blocks.

Parameter names follow HF Llama so that the laws, the monitor and the
continuity analyzer find every block by name::

    embed_tokens.weight                       (vocab d_model)
    layers.{l}.input_layernorm.weight         (d_model)      [norm != "none"]
    layers.{l}.self_attn.{q,k,v,o}_proj.weight
    layers.{l}.post_attention_layernorm.weight
    layers.{l}.mlp.{gate,up,down}_proj.weight  (swiglu) | up/down (plain FFN) | router + experts (moe)
    norm.weight, lm_head.weight               (vocab d_model)

Pre-norm residual blocks (:class:`~flowgeom.nn.block.PreNormBlock`): h = h + attn(norm(h)); h = h + mlp(norm(h)).
Sinusoidal positions are added to the embeddings; RoPE acts inside attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, positive_int, require_choices
from flowgeom.nn.attention import POSITIONS, MultiHeadAttention, sinusoidal_table
from flowgeom.nn.block import NORMS, PreNormBlock, make_norm
from flowgeom.nn.feedforward import ACTIVATIONS, FeedForward, SwiGLU
from flowgeom.nn.moe import GATES, MixtureOfExperts

MLPS = ("swiglu", "moe") + tuple(ACTIVATIONS)  # a plain FFN is named by its activation


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 96            # number of token ids
    d_model: int = 64          # residual width
    n_layers: int = 2          # decoder blocks
    heads: int = 4             # attention heads
    d_k: int = 16              # query/key (and value) head dim
    d_hidden: int = 128        # MLP hidden width (per expert for moe)
    seq_len: int = 64          # maximum context
    positions: str = "rope"    # none | sinusoidal | rope
    mlp: str = "swiglu"        # swiglu | moe | gelu | silu | relu | tanh | identity
    norm: str = "rmsnorm"      # rmsnorm | layernorm | none
    experts: int = 4           # moe only
    top_k: int | None = None   # moe only; None = dense
    gate: str = "softmax"      # moe only: softmax | sigmoid (normalised)

    def __post_init__(self):
        for name in ("vocab", "d_model", "n_layers", "heads", "d_k", "d_hidden", "seq_len", "experts"):
            positive_int(getattr(self, name), name)
        require_choices(self, positions=POSITIONS, mlp=MLPS, norm=NORMS, gate=GATES)
        if self.positions == "rope" and self.d_k % 2:
            raise FlowgeomError(f"RoPE needs an even d_k, got {self.d_k}")
        if self.top_k is not None and not 1 <= self.top_k <= self.experts:
            raise FlowgeomError(f"top_k={self.top_k} must lie in 1..experts={self.experts}")


def _mlp(cfg: LMConfig) -> nn.Module:
    if cfg.mlp == "swiglu":
        return SwiGLU(cfg.d_model, cfg.d_hidden)
    if cfg.mlp == "moe":
        return MixtureOfExperts(cfg.d_model, cfg.d_hidden, cfg.experts, gate=cfg.gate, top_k=cfg.top_k)
    return FeedForward(cfg.d_model, cfg.d_hidden, activation=cfg.mlp)


def decoder_block(cfg: LMConfig) -> PreNormBlock:
    """One causal block: attention (RoPE inside when ``positions="rope"``) then ``cfg.mlp``."""
    rope = "rope" if cfg.positions == "rope" else "none"
    attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_k, cfg.d_k, positions=rope, seq_len=cfg.seq_len)
    return PreNormBlock(cfg.d_model, attn, _mlp(cfg), norm=cfg.norm)


class TinyLM(nn.Module):
    """Decoder LM: tokens (B, T) -> next-token logits (B, T, vocab)."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(decoder_block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg.norm, cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.positions == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.seq_len, cfg.d_model), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.cfg.seq_len:
            raise FlowgeomError(f"sequence of {T} tokens exceeds seq_len={self.cfg.seq_len}")
        h = self.embed_tokens(tokens)  # (B, T, d_model)
        if self.cfg.positions == "sinusoidal":
            h = h + self.pos_table[:T].to(h.dtype)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))  # (B, T, vocab)

    def sample_input(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randint(0, self.cfg.vocab, (batch, self.cfg.seq_len), generator=generator)
