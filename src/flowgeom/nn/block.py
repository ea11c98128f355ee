"""The pre-norm residual block shared by the zoo's transformers (:class:`~flowgeom.nn.lm.TinyLM`, :class:`~flowgeom.nn.vit.ViT`).

One block, whatever its attention and MLP (HF Llama names)::

    h = h + self_attn(input_layernorm(h))            (B T d_model)
    h = h + mlp(post_attention_layernorm(h))         (B T d_model)

Parameters: ``input_layernorm.*``, ``self_attn.*``, ``post_attention_layernorm.*``,
``mlp.*``, registered in that order (the state-dict order of the former
``DecoderLayer`` / ``EncoderLayer``, so their checkpoints load unchanged).
The caller builds ``self_attn`` and ``mlp`` (attention first, as before, so a
seeded global RNG draws the same initial weights); the norms hold no random
state.
"""

from __future__ import annotations

import torch
from torch import nn

from flowgeom.errors import choice_error

NORMS = ("rmsnorm", "layernorm", "none")


def make_norm(kind: str, d: int, *, bias: bool = False) -> nn.Module:
    """``rmsnorm`` (eps 1e-6), ``layernorm`` (affine; a bias only with ``bias=True``) or ``none`` (identity) over ``d``."""
    if kind not in NORMS:
        raise choice_error("norm", kind, NORMS)
    if kind == "rmsnorm":
        return nn.RMSNorm(d, eps=1e-6)
    if kind == "layernorm":
        return nn.LayerNorm(d, bias=bias)
    return nn.Identity()


class PreNormBlock(nn.Module):
    """``h + self_attn(norm(h))`` then ``h + mlp(norm(h))``; see the module docstring.

    ``self_attn`` and ``mlp`` map (B, T, d_model) to (B, T, d_model);
    ``norm``/``norm_bias`` choose both norms as in :func:`make_norm`.
    """

    def __init__(self, d_model: int, self_attn: nn.Module, mlp: nn.Module, *, norm: str = "rmsnorm",
                 norm_bias: bool = False):
        super().__init__()
        self.input_layernorm = make_norm(norm, d_model, bias=norm_bias)
        self.self_attn = self_attn
        self.post_attention_layernorm = make_norm(norm, d_model, bias=norm_bias)
        self.mlp = mlp

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, d_model) -> (B, T, d_model)
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))
