"""Mixture of SwiGLU experts with a softmax or normalised-sigmoid router.

Parameters: ``router.weight`` (E d_model) [+ ``router.bias`` (E)], and
``experts.{e}.gate_proj/up_proj/down_proj`` as in :class:`SwiGLU`.

Gate values for router logits z (over the selected experts S: all E when
dense, the top-k logits otherwise, as in Mixtral):

- ``softmax``: g_i = exp(z_i) / sum_{j in S} exp(z_j);
- ``sigmoid`` (normalised): g_i = sigma(z_i) / sum_{j in S} sigma(z_j).

Output: f(x) = sum_{i in S} g_i(x) * expert_i(x).
"""

from __future__ import annotations

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.nn.feedforward import SwiGLU

GATES = ("softmax", "sigmoid")


class MixtureOfExperts(nn.Module):
    def __init__(self, d_model: int, d_hidden: int, n_experts: int, *, gate: str = "softmax", top_k: int | None = None,
                 router_bias: bool = False):
        super().__init__()
        if gate not in GATES:
            raise choice_error("gate", gate, GATES)
        if top_k is not None and not 1 <= top_k <= n_experts:
            raise FlowgeomError(f"top_k={top_k} must lie in 1..n_experts={n_experts}; lower --top-k or raise --experts")
        self.d_model, self.d_hidden, self.n_experts = d_model, d_hidden, n_experts
        self.gate, self.top_k = gate, top_k
        self.router = nn.Linear(d_model, n_experts, bias=router_bias)
        self.experts = nn.ModuleList(SwiGLU(d_model, d_hidden) for _ in range(n_experts))

    def gate_values(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> (..., E) gate weights, zero outside the selected experts."""
        z = self.router(x)  # (..., E)
        if self.top_k is not None and self.top_k < self.n_experts:
            kth = z.topk(self.top_k, dim=-1).values[..., -1:]  # (..., 1)
            selected = z >= kth
        else:
            selected = torch.ones_like(z, dtype=torch.bool)
        if self.gate == "softmax":
            z = z.masked_fill(~selected, float("-inf"))
            return torch.softmax(z, dim=-1)
        s = torch.sigmoid(z) * selected
        return s / s.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_model) -> (..., d_model)
        g = self.gate_values(x)  # (..., E)
        outs = torch.stack([expert(x) for expert in self.experts], dim=-1)  # (..., d_model, E)
        return (outs * g.unsqueeze(-2)).sum(-1)

    def sample_input(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return torch.randn(batch, self.d_model, generator=generator, dtype=self.router.weight.dtype)
