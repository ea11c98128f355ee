"""Feed-forward blocks: two-layer FFN (any activation) and SwiGLU.

Weights are ``(out, in)`` as in ``nn.Linear``; names follow HF Llama
(``gate_proj``, ``up_proj``, ``down_proj``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flowgeom.errors import choice_error

ACTIVATIONS = {
    "gelu": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
    "tanh": torch.tanh,
    "identity": lambda z: z,
}


class FeedForward(nn.Module):
    """``f(x) = down_proj(act(up_proj(x)))``.

    Shapes: ``up_proj.weight`` (d_hidden d_model), ``down_proj.weight``
    (d_out d_hidden). With ``activation="identity"`` it is the two-layer
    linear network ``U V x`` of Marcotte et al. (U = down, V = up); with
    ``"relu"`` their two-layer ReLU network.
    """

    def __init__(self, d_model: int, d_hidden: int, d_out: int | None = None, *, activation: str = "gelu", bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise choice_error("activation", activation, ACTIVATIONS)
        self.d_model, self.d_hidden, self.d_out = d_model, d_hidden, d_out or d_model
        self.activation = activation
        self.up_proj = nn.Linear(d_model, d_hidden, bias=bias)
        self.down_proj = nn.Linear(d_hidden, self.d_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_model) -> (..., d_out)
        return self.down_proj(ACTIVATIONS[self.activation](self.up_proj(x)))

    def sample_input(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(batch, self.d_model, generator=generator, dtype=self.up_proj.weight.dtype)


class SwiGLU(nn.Module):
    """``f(x) = down_proj(silu(gate_proj(x)) * up_proj(x))`` (Llama MLP).

    Shapes: ``gate_proj.weight``, ``up_proj.weight`` (d_hidden d_model),
    ``down_proj.weight`` (d_out d_hidden).
    """

    def __init__(self, d_model: int, d_hidden: int, d_out: int | None = None):
        super().__init__()
        self.d_model, self.d_hidden, self.d_out = d_model, d_hidden, d_out or d_model
        self.gate_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.up_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.down_proj = nn.Linear(d_hidden, self.d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_model) -> (..., d_out)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def sample_input(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(batch, self.d_model, generator=generator, dtype=self.up_proj.weight.dtype)


class LinearChain(nn.Module):
    """Deep linear network ``layers.{L-1} ∘ ... ∘ layers.0``; ``widths`` = (d_0, ..., d_L)."""

    def __init__(self, widths: tuple[int, ...]):
        super().__init__()
        self.widths = tuple(widths)
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=False) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def sample_input(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(batch, self.widths[0], generator=generator, dtype=self.layers[0].weight.dtype)
