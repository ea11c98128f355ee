"""A small Vision Transformer built from the zoo's blocks.

Parameter names (HF-ish, weights ``(out, in)``)::

    patch_embed.weight, patch_embed.bias      (d_model C*p*p)  linear patch embedding
    pos_embed                                 (n_patches d_model)  learned absolute positions
    layers.{l}.input_layernorm.weight         (d_model)
    layers.{l}.self_attn.{q,k,v,o}_proj.weight   zoo MultiHeadAttention, positions "none", not causal
    layers.{l}.post_attention_layernorm.weight
    layers.{l}.mlp.{gate,up,down}_proj.weight    zoo SwiGLU
    norm.weight, head.weight, head.bias       (n_classes d_model)  mean-pooled classifier

Absolute positions are added once to the patch embeddings, so inside the
attention blocks the catalogue's "none/sinusoidal" laws Q_iQ_iᵀ − K_iK_iᵀ,
V_iV_iᵀ − O_iᵀO_i apply (seed 000: an absolute encoding is a fixed shift
of the block's input).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, choice_error, positive_int
from flowgeom.nn.attention import MultiHeadAttention
from flowgeom.nn.feedforward import SwiGLU
from flowgeom.nn.block import NORMS, PreNormBlock, make_norm



@dataclass(frozen=True)
class ViTConfig:
    image_size: int = 28     # square input side
    channels: int = 1        # input channels
    patch: int = 7           # patch side (must divide image_size)
    d_model: int = 32        # residual width
    n_layers: int = 2        # encoder blocks
    heads: int = 2           # attention heads
    d_k: int = 16            # query/key/value head dim
    d_hidden: int = 64       # SwiGLU hidden width
    n_classes: int = 10      # classifier outputs
    norm: str = "rmsnorm"    # rmsnorm | layernorm | none

    def __post_init__(self):
        for name in ("image_size", "channels", "patch", "d_model", "n_layers", "heads", "d_k", "d_hidden", "n_classes"):
            positive_int(getattr(self, name), name)
        if self.image_size % self.patch:
            raise FlowgeomError(f"patch={self.patch} does not divide image_size={self.image_size}; choose a divisor")
        if self.norm not in NORMS:
            raise choice_error("norm", self.norm, NORMS)

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch) ** 2


def encoder_block(cfg: ViTConfig) -> PreNormBlock:
    """One bidirectional block over the patches: attention without positions, then SwiGLU."""
    attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.d_k, cfg.d_k, positions="none", seq_len=cfg.n_patches,
                              causal=False)
    return PreNormBlock(cfg.d_model, attn, SwiGLU(cfg.d_model, cfg.d_hidden), norm=cfg.norm)


def patchify(images: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, (H/p)*(W/p), C*p*p), patches in row-major order."""
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // patch, patch, W // patch, patch)  # (B, C, h, p, w, p)
    x = x.permute(0, 2, 4, 1, 3, 5)  # (B, h, w, C, p, p)
    return x.reshape(B, (H // patch) * (W // patch), C * patch * patch)


def unpatchify(tokens: torch.Tensor, patch: int, height: int, width: int) -> torch.Tensor:
    """(B, (H/p)*(W/p), C*p*p) -> (B, C, H, W): the inverse of :func:`patchify`."""
    B, _, D = tokens.shape
    C = D // (patch * patch)
    x = tokens.reshape(B, height // patch, width // patch, C, patch, patch)  # (B, h, w, C, p, p)
    x = x.permute(0, 3, 1, 4, 2, 5)  # (B, C, h, p, w, p)
    return x.reshape(B, C, height, width)


class ViT(nn.Module):
    """Images (B, C, H, W) float -> class logits (B, n_classes)."""

    def __init__(self, cfg: ViTConfig, *, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch ** 2, cfg.d_model)
        self.pos_embed = nn.Parameter(0.02 * torch.randn(cfg.n_patches, cfg.d_model, generator=generator))
        self.layers = nn.ModuleList(encoder_block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg.norm, cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if images.dim() == 3:
            images = images.unsqueeze(1)  # (B, 1, H, W)
        if tuple(images.shape[1:]) != (c.channels, c.image_size, c.image_size):
            raise FlowgeomError(f"ViT expects images (B, {c.channels}, {c.image_size}, {c.image_size}), "
                                f"got {tuple(images.shape)}; build it with matching image_size/channels")
        h = self.patch_embed(patchify(images, c.patch)) + self.pos_embed  # (B, P, d_model)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h).mean(1))  # (B, n_classes)

    def sample_input(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        c = self.cfg
        return torch.randn(batch, c.channels, c.image_size, c.image_size, generator=generator,
                           dtype=self.head.weight.dtype)
