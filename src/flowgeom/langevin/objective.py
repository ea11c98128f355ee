"""An objective for the Villani probe and the Langevin runs: a loss of named tensors, its flat view and orbit.

The paper's losses (:mod:`flowgeom.langevin.losses`) and a user's own
(:mod:`flowgeom.langevin.user_loss`) are both made as one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flowgeom.langevin.regularizers import Regularizer

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Objective:
    """A loss of named tensors with a flat view and (optionally) a symmetry orbit.

    ``orbit(params, t)`` moves along ``M_t = diag(e^t, e^{-t}, 1, …)``: the
    one-parameter subgroup that sends the weights to infinity while the
    unregularised loss stays constant.
    """

    name: str
    shapes: dict[str, tuple[int, ...]]
    loss: Callable[[Params], torch.Tensor]
    orbit_fn: Callable[[Params, torch.Tensor], Params] | None = None
    orbit_dim: int = 0
    regularizer: Regularizer = field(default_factory=lambda: Regularizer("none"))
    theta0: Params | None = None  # where the probe starts (a user's model: its weights); None: a random point

    @property
    def dim(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values())

    def unflatten(self, theta: torch.Tensor) -> Params:
        pieces = theta.split([math.prod(s) for s in self.shapes.values()])
        return {n: p.reshape(s) for (n, s), p in zip(self.shapes.items(), pieces)}

    def flatten(self, params: Params) -> torch.Tensor:
        return torch.cat([params[n].reshape(-1) for n in self.shapes])

    def __call__(self, params: Params) -> torch.Tensor:
        value = self.loss(params)
        if self.regularizer.kind != "none":
            value = value + self.regularizer.penalty(params[n] for n in self.shapes)
        return value

    def flat(self, theta: torch.Tensor) -> torch.Tensor:
        """``V(θ)`` for a flat ``θ`` (D,)."""
        return self(self.unflatten(theta))

    def with_regularizer(self, regularizer: Regularizer) -> Objective:
        return dataclasses.replace(self, regularizer=regularizer)

    def orbit(self, theta: torch.Tensor, t: float) -> torch.Tensor:
        """The point ``M_t · θ`` of the symmetry orbit through ``θ`` (flat in, flat out)."""
        if self.orbit_fn is None:
            return theta
        diag = torch.ones(self.orbit_dim, dtype=theta.dtype)
        diag[0], diag[1] = math.exp(t), math.exp(-t)
        return self.flatten(self.orbit_fn(self.unflatten(theta), torch.diag(diag)))
