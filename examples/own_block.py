"""Your own module as input to ``flowgeom laws count`` / ``discover`` (see docs/own-module.md).

``path/to/file.py:NAME`` names either an ``nn.Module`` class (built with no
arguments) or a zero-argument factory returning one. Inputs come from the
module's ``sample_input(batch, generator)`` when it has one, else from
``--input-shape`` (the shape of ONE input, without the batch dimension); the
engine calls ``forward`` on one such input at a time.

    flowgeom laws count examples/own_block.py:LayerNormMLP
    flowgeom laws count examples/own_block.py:make_mlp --input-shape 6
"""

from __future__ import annotations

import torch
from torch import nn


class LayerNormMLP(nn.Module):
    """y = W_down relu(W_up LayerNorm(x)): a pre-norm MLP with the norm's affine weights."""

    def __init__(self, d_model: int = 6, d_hidden: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.up_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.down_proj = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_model) -> (..., d_model); the engine passes one input
        return self.down_proj(torch.relu(self.up_proj(self.norm(x))))

    def sample_input(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """``batch`` valid inputs stacked on dim 0: (batch, d_model). Optional: without it, pass --input-shape."""
        return torch.randn(batch, self.norm.normalized_shape[0], generator=generator)


def make_mlp() -> nn.Module:
    """A factory works as well as a class; this module has no sample_input, so pass --input-shape 6."""
    return nn.Sequential(nn.Linear(6, 4, bias=False), nn.ReLU(), nn.Linear(4, 6, bias=False))
