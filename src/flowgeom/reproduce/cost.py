"""What one run of a claim costs, in the unit of the progress line's ETA (:mod:`flowgeom.reproduce.progress`).

A run's size is its steps times what one step costs:

    size = steps × (parameters × examples + overhead)

``steps`` the optimiser steps (for runs that do not train: a law check's
gradient fields, a Villani probe's points), ``parameters × examples`` the
multiply-adds of one step up to a constant (trained parameters × the
examples or tokens of its batch; a probe's D² Hessian entries), and
``overhead`` the fixed cost of a step of that kind, in the same unit. The
quick tour's models are so small that the overhead dominates most of its
runs: an instrumented training step (the conservation monitor, the
continuity metrics) costs about 35 ms on one core whether the model has 25
thousand or 1.3 million parameters. The overheads below were fitted to the
CPU seconds of one quick tour on the development VM (one thread per run;
docs/benchmarks.md); the ETA turns sizes into seconds with a rate measured
by the runs that have finished on the machine at hand, and corrects each
claim by its own finished runs, so sizes need to be right in proportion
within a claim and within a small factor across claims. They are estimates
read from the experiments' presets, not exact counts (embeddings use
:data:`VOCAB` characters).
"""

from __future__ import annotations

from collections.abc import Iterable

TRAIN_STEP = 2e8   # an instrumented training step: Python, the optimiser, the monitor or continuity metrics
PLAIN_STEP = 1e7   # a step of a tiny model with a metric line every hundred steps (the Darcy protocol)
PROBE_POINT = 7e7  # one point of a Villani probe: the Hessian (or Hutchinson probes) of a small objective
LAW_FIELD = 1e8    # one gradient field of a law check and count
VOCAB = 96  # the character vocabularies of the shipped texts (KJV: 75 distinct characters)


def work(steps: float, parameters: float, *, examples: float = 1, overhead: float = TRAIN_STEP) -> float:
    """``steps × (parameters × examples + overhead)``."""
    return float(steps) * (float(parameters) * float(examples) + float(overhead))


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
    return sum(work(cfg.steps, conservation_parameters(cfg), examples=cfg.batch * (cfg.seq_len if cfg.task == "lm" else 1))
               for cfg in cfgs)


def mlp_parameters(*, width: int, depth: int, inputs: int = 28 * 28, classes: int = 10) -> int:
    """Weights of the residual MLP of the continuity ablation (MNIST in, 10 classes out)."""
    return inputs * width + depth * width * width + width * classes
