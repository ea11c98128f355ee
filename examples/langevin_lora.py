"""Is the loss of *your* LoRA model a Villani function? (docs/langevin.md, "Your own model")

A tiny two-layer network adapted with real PEFT LoRA (rank 2 on both layers).
``make()`` returns ``(loss_fn, theta0)``: the mean-squared error as a function
of the adapter factors, and the factors PEFT initialised. flowgeom probes
``V = loss_fn(θ)`` along random rays from ``theta0`` and along the LoRA orbit
``B → B M, A → M⁻¹ A`` (found from the PEFT names), on which the
unregularised loss is constant::

    flowgeom langevin villani examples/langevin_lora.py:make              # fails: V bounded on the orbit
    flowgeom langevin villani examples/langevin_lora.py:make --reg log    # holds

and in Python::

    from flowgeom.langevin import Regularizer, load_objective, probe
    obj = load_objective("examples/langevin_lora.py:make")
    probe(obj).verdict                                                     # "fails"
    probe(obj.with_regularizer(Regularizer("log", lam=0.01))).verdict      # "holds"

Training the same adapters with the regularised Langevin optimiser::

    model, loss = build()
    reg = Regularizer("log", lam=0.01)
    opt = Langevin(model.named_parameters(), lr=1e-2, temperature=1e-4,
                   grad_transform=reg.transform(select(model, preset="lora")))

The probe runs in float64, so the model is built in float64. Needs
``pip install flowgeom[hf]`` (peft); nothing is downloaded.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """x (N, 4) -> tanh(up x) (N, 8) -> down (N, 2)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def build(seed: int = 0):
    """The PEFT model (float64, LoRA rank 2 on ``up`` and ``down``) and its loss ``model -> MSE``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 4, generator=g, dtype=torch.float64)  # (N, d)
    y = torch.randn(16, 2, generator=g, dtype=torch.float64)  # (N, d_out)
    model = get_peft_model(TinyNet().double(), LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0,
                                                          target_modules=["up", "down"]))

    def loss(params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        out = model(x) if params is None else torch.func.functional_call(model, params, (x,))  # (N, d_out)
        return (out - y).pow(2).sum(-1).mean()

    return model, loss


def make():
    """``(loss_fn, theta0)`` for ``flowgeom langevin villani examples/langevin_lora.py:make``."""
    model, loss = build()
    theta0 = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}  # the LoRA factors
    return loss, theta0
