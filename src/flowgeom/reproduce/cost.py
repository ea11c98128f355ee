"""What one run of a claim costs, in the unit of the progress line's ETA (:mod:`flowgeom.reproduce.progress`).

A run's size is

    size = steps × (parameters + STEP_OVERHEAD)

``steps`` the optimiser steps (or, for runs that do not train, the
gradient-like evaluations: a law check's fields, a Villani probe's points),
``parameters`` what one step touches (the trained parameters; a probe's
D² Hessian entries), and :data:`STEP_OVERHEAD` the fixed cost of a step
(Python, the optimiser's loop, logging), in parameter-equivalents. The ETA
turns sizes into seconds with a rate measured on this machine by the runs
that have finished, and corrects each claim by its own finished runs, so a
size needs to be right in proportion within a claim and within a small
factor across claims; it is an estimate of the work, read from the
experiments' presets, not an exact count of their parameters
(embeddings use :data:`VOCAB` characters).
"""

from __future__ import annotations

from collections.abc import Iterable

# The per-step cost of the tiny models of the quick tour (a 16-32-wide LM step is mostly Python and the monitor),
# in parameter-equivalents: fitted to the idle tour's run times on the development VM (docs/benchmarks.md).
STEP_OVERHEAD = 200_000
VOCAB = 96  # the character vocabularies of the shipped texts (KJV: 75 distinct characters)


def work(steps: float, parameters: float) -> float:
    """``steps × (parameters + STEP_OVERHEAD)``."""
    return float(steps) * (float(parameters) + STEP_OVERHEAD)


def lm_parameters(*, d_model: int, n_layers: int, heads: int, d_k: int, d_hidden: int, mlp: str = "swiglu",
                  experts: int = 1, vocab: int = VOCAB) -> int:
    """Weights of a decoder LM: per block Q, K, V, O (``heads × d_k`` wide) and the MLP, plus embedding and head."""
    attention = 4 * d_model * heads * d_k
    if mlp == "moe":
        ffn = experts * 3 * d_model * d_hidden + experts * d_model  # SwiGLU experts + router
    elif mlp == "swiglu":
        ffn = 3 * d_model * d_hidden
    elif mlp == "identity":
        ffn = 0
    else:
        ffn = 2 * d_model * d_hidden
    return n_layers * (attention + ffn) + 2 * vocab * d_model


def conservation_parameters(cfg) -> int:
    """Weights of a :class:`~flowgeom.experiments.conservation.ConservationConfig`'s model (LM or ViT)."""
    if cfg.task == "vit":  # patches of 28×28 MNIST into d_model, 10 classes
        return lm_parameters(d_model=cfg.d_model, n_layers=cfg.n_layers, heads=cfg.heads, d_k=cfg.d_k,
                             d_hidden=cfg.d_hidden, mlp=cfg.mlp, experts=cfg.experts, vocab=0) \
            + cfg.patch * cfg.patch * cfg.d_model + 10 * cfg.d_model
    return lm_parameters(d_model=cfg.d_model, n_layers=cfg.n_layers, heads=cfg.heads, d_k=cfg.d_k,
                         d_hidden=cfg.d_hidden, mlp=cfg.mlp, experts=cfg.experts)


def conservation_work(cfgs: Iterable) -> float:
    """The size of a sequence of conservation training runs (ConservationConfig each)."""
    return sum(work(cfg.steps, conservation_parameters(cfg)) for cfg in cfgs)


def mlp_parameters(*, width: int, depth: int, inputs: int = 28 * 28, classes: int = 10) -> int:
    """Weights of the residual MLP of the continuity ablation (MNIST in, 10 classes out)."""
    return inputs * width + depth * width * width + width * classes
