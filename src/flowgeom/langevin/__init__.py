"""Convergent Langevin training of attention and LoRA (seed ``004_…``).

Public API: the :class:`Langevin` optimiser over the pure core
(:func:`build` / :func:`init` / :func:`update`), the :class:`Regularizer`
(log / power / frobenius) with :func:`select`, the paper's losses and their
symmetry orbits, a user's own loss (:func:`loss_objective`, :func:`load_objective`
for ``FILE.py:NAME``), and the Villani :func:`probe`.
"""

from flowgeom.langevin.losses import (
    LOSSES,
    Objective,
    attention_loss,
    attention_objective,
    attention_orbit,
    lora_loss,
    lora_objective,
    lora_orbit,
    norm_objective,
    objective,
)
from flowgeom.langevin.optimizer import Langevin, LangevinState, LangevinTransform, build, check_loss, init, update
from flowgeom.langevin.regularizers import KINDS, PRESETS, Regularizer, chain, select
from flowgeom.langevin.user_loss import load_objective, loss_objective
from flowgeom.langevin.villani import VillaniReport, derivatives, orbit_integral, plot, probe

__all__ = [
    "KINDS", "LOSSES", "PRESETS", "Langevin", "LangevinState", "LangevinTransform", "build", "chain", "init",
    "update", "Objective", "Regularizer", "VillaniReport", "attention_loss",
    "attention_objective", "attention_orbit", "check_loss", "derivatives", "load_objective", "lora_loss",
    "lora_objective", "lora_orbit", "loss_objective", "norm_objective", "objective", "orbit_integral", "plot", "probe", "select",
]
