"""Residual MLP of the geometric-continuity ablations (seed ``001_…``).

A stack of ``depth`` square hidden layers of width ``width`` between an input
embedding and a linear read-out::

    h_0     = embed(x)                                   (B width)
    z_l     = act(W_l norm_l(h_{l-1}))                   W_l = layers.{l}.weight  (width width)
    h_l     = h_{l-1} + z_l     (residual=True)
            = z_l               (residual=False, "NoRes")
    logits  = head(h_depth)                              (B classes)

The ablation axes of the seed:

- ``activation``: ``relu``, ``gelu``, ``silu`` (element-wise, they break the
  rotation symmetry ``W_l -> R W_l R^T`` of the residual stream), ``none``
  (linear residual network; the symmetry is exact) and ``radial``,
  ``sigma(x) = x tanh(||x||)`` with ``||x||`` the Euclidean norm of the whole
  hidden vector of one sample: non-linear but rotation-equivariant,
  ``sigma(R x) = R sigma(x)``, so it keeps the SO(width) symmetry
  (``radial_rms`` uses ``tanh(||x|| / sqrt(width))``: the seed's formula is
  numerically the identity at width 256, see :func:`radial_rms`);
- ``residual`` on/off; ``layernorm`` (pre-norm, no affine weights) on/off;
- ``init_scale``: hidden weights start ``U(-s/sqrt(width), s/sqrt(width))``
  (``s = 1`` is PyTorch's default ``nn.Linear`` init).

Hidden layers have no bias, so ``layers.{l}.weight`` is the whole linear map
the continuity metrics compare. Initialisation draws from an explicit
``torch.Generator`` (``seed``), never the global RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flowgeom.errors import FlowgeomError, choice_error, positive_int


def radial(x: torch.Tensor) -> torch.Tensor:
    """``x tanh(||x||)`` over the last dim: non-linear, rotation-equivariant."""
    return x * torch.tanh(x.norm(dim=-1, keepdim=True))


def radial_rms(x: torch.Tensor) -> torch.Tensor:
    """``x tanh(||x|| / sqrt(d))``: the radial map on the RMS scale, still rotation-equivariant.

    In 256-D the seed's ``tanh(||x||)`` is 1 to float32 precision for any
    hidden vector of O(1) entries (``||x|| ~ 16``), i.e. the identity; this
    variant is non-linear where the activations actually live.
    """
    return x * torch.tanh(x.norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1]))


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "none": lambda z: z,
    "radial": radial,
    "radial_rms": radial_rms,
}


@dataclass(frozen=True)
class ResMLPConfig:
    d_in: int = 784            # input features (flattened 28x28 MNIST)
    width: int = 256           # hidden width
    depth: int = 16            # number of square hidden layers
    classes: int = 10          # read-out size
    residual: bool = True      # h + act(W h) (True) or act(W h) (False, "NoRes")
    activation: str = "relu"   # relu | gelu | silu | none | radial | radial_rms
    layernorm: bool = False    # pre-norm LayerNorm (no affine) before each hidden layer
    init_scale: float = 1.0    # multiplies the default U(-1/sqrt(n), 1/sqrt(n)) init of hidden layers

    def __post_init__(self):
        for name in ("d_in", "width", "depth", "classes"):
            positive_int(getattr(self, name), name)
        if self.activation not in ACTIVATIONS:
            raise choice_error("activation", self.activation, ACTIVATIONS)
        if not (self.init_scale > 0 and math.isfinite(self.init_scale)):
            raise FlowgeomError(f"init_scale must be a positive number, got {self.init_scale}")


def _uniform_(weight: torch.Tensor, bound: float, gen: torch.Generator) -> None:
    with torch.no_grad():
        weight.copy_(torch.rand(weight.shape, generator=gen, dtype=weight.dtype) * (2 * bound) - bound)


class ResMLP(nn.Module):
    """Residual MLP classifier: inputs (B d_in) -> logits (B classes); see the module docstring."""

    def __init__(self, cfg: ResMLPConfig = ResMLPConfig(), *, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.d_in, cfg.width)
        self.layers = nn.ModuleList(nn.Linear(cfg.width, cfg.width, bias=False) for _ in range(cfg.depth))
        self.norms = nn.ModuleList(
            nn.LayerNorm(cfg.width, elementwise_affine=False) if cfg.layernorm else nn.Identity() for _ in range(cfg.depth)
        )
        self.head = nn.Linear(cfg.width, cfg.classes)
        gen = torch.Generator().manual_seed(seed)
        for lin in (self.embed, self.head):
            bound = 1 / math.sqrt(lin.in_features)
            _uniform_(lin.weight, bound, gen)
            _uniform_(lin.bias, bound, gen)
        for lin in self.layers:
            _uniform_(lin.weight, cfg.init_scale / math.sqrt(cfg.width), gen)
        self._act = ACTIVATIONS[cfg.activation]

    def hidden_weights(self) -> list[nn.Parameter]:
        """The ``depth`` square hidden weights ``W_l`` (width width), in depth order."""
        return [lin.weight for lin in self.layers]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, d_in) -> (B, classes)
        h = self.embed(x.reshape(x.shape[0], -1))  # (B, width)
        for lin, norm in zip(self.layers, self.norms):
            z = self._act(lin(norm(h)))
            h = h + z if self.cfg.residual else z
        return self.head(h)
