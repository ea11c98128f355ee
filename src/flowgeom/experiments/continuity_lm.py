"""Projection-specific continuity in a small Llama-style LM (seed ``001_…``).

An 8-layer decoder (:class:`flowgeom.nn.lm.TinyLM`: RMSNorm, RoPE, SwiGLU) is
trained on real text (character tokens) while the continuity of every
projection role ``q k v o gate up down`` is tracked (weights, instantaneous
gradients, ``W - W(0)``, ``||ΔW||/||W(0)||``).

The seed's pattern: projections that *read* the residual stream and are
followed by a non-linearity (Q, K: softmax; Gate: the MLP activation; Up: the
product with the activated gate) become **input-continuous** (v1); those that
*write* to the stream after a non-linearity (O, Down) become
**output-continuous** (u1); V, with no adjacent non-linearity, stays low. It
forms as gradient coherence (present at init) is transferred to the weights
once ``||ΔW||`` dominates ``||W(0)||``.

Presets (:data:`PRESETS`): ``quick`` (~3.5M parameters on KJV, minutes on 2
cores), ``cpu`` (6.3M parameters, ~30 min on one core) and ``full`` (d_model
576, ~33M parameters, the seed's 34M scale; pass a WikiText-103 folder as
``data``). ``mlp`` ablates the MLP activation (``swiglu``, ``gelu``,
``relu``, ``silu``, ``identity``; plain FFNs have only ``up``/``down``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flowgeom.continuity import verdict as continuity_verdict
from flowgeom.errors import choice_error
from flowgeom.experiments.continuity_loop import make_optimizer, train_tracked, validate_run
from flowgeom.experiments.presets import preset as resolve
from flowgeom.experiments.presets import scales
from flowgeom.nn.lm import LMConfig, TinyLM
from flowgeom.runs import RunFolder

LM_MLPS = ("swiglu", "gelu", "relu", "silu", "identity")
ROLE_PATHS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
SEED_PATTERN = {"q": "input", "k": "input", "gate": "input", "up": "input", "o": "output", "down": "output", "v": "low"}
VERDICT_THRESHOLD = 3.0  # ratio to chance counted as continuous (the analyzer's default)

@dataclass(frozen=True)
class LMRunConfig:
    """One LM run; the defaults are the quick preset (:data:`PRESETS`)."""

    data: str = "kjv"          # "kjv" or a text file / WikiText-103 / PTB folder
    mlp: str = "swiglu"        # swiglu | gelu | relu | silu | identity
    n_layers: int = 8          # decoder blocks
    d_model: int = 192         # residual width
    heads: int = 6             # attention heads
    d_k: int = 32              # head dim
    d_hidden: int = 512        # MLP hidden width
    seq_len: int = 64          # context (tokens are characters)
    batch: int = 16            # sequences per step
    optimizer: str = "adam"    # sgd | adam | adam_b2_0
    lr: float = 3e-3           # learning rate
    steps: int = 200           # updates
    log_every: int = 25        # continuity measured every N steps
    ckpt_every: int = 100      # checkpoint for --resume every N updates
    k: int = 4                 # singular pairs per matrix
    seed: int = 0              # init, batches, SVD start blocks
    device: str = "cpu"        # cpu | cuda

    def __post_init__(self):
        if self.mlp not in LM_MLPS:
            raise choice_error("mlp", self.mlp, LM_MLPS)
        validate_run(self, positive=("d_model", "heads", "d_k", "d_hidden", "seq_len"), depth_field="n_layers")

    def model_config(self, vocab: int) -> LMConfig:
        return LMConfig(vocab=vocab, d_model=self.d_model, n_layers=self.n_layers, heads=self.heads, d_k=self.d_k,
                        d_hidden=self.d_hidden, seq_len=self.seq_len, positions="rope", mlp=self.mlp, norm="rmsnorm")


# quick: a narrow 8-layer model on the shipped KJV text, 200 steps (~1.5 min on 2 CPU cores): what the quick
# claim (`reproduce --quick`, `make demo`) has always trained; the 400 steps this preset once had were never
# what a claim ran.
QUICK = LMRunConfig(d_model=192, heads=6, d_k=32, d_hidden=512, seq_len=64, batch=16, steps=200, log_every=25, lr=3e-3)
# full: the seed's small Llama (seed 001): 8 layers, d_model 576 (~34M parameters with a WikiText-103 vocabulary).
FULL = LMRunConfig(d_model=576, heads=9, d_k=64, d_hidden=1536, seq_len=256, batch=32, steps=20000, log_every=250,
                   lr=6e-4)
# cpu: the largest that trains on the shipped KJV in about 30 min on one CPU core (6.3M parameters, 1000 steps).
CPU = LMRunConfig(d_model=256, heads=8, d_k=32, d_hidden=704, seq_len=128, batch=16, steps=1000, log_every=50, lr=1e-3)
PRESETS = scales(quick=QUICK, cpu=CPU, full=FULL)


def lm_config(preset: str = "quick", **overrides: Any) -> LMRunConfig:
    """The ``quick``/``cpu``/``full`` preset with ``overrides`` (field names of :class:`LMRunConfig`)."""
    return resolve(PRESETS, preset, what="LM run option(s)", **overrides)


def role_parameters(model: TinyLM) -> dict[str, list[torch.nn.Parameter]]:
    """``{role: [layer 0 weight, layer 1 weight, ...]}`` for the roles this model has."""
    roles: dict[str, list[torch.nn.Parameter]] = {}
    for role, path in ROLE_PATHS.items():
        params = []
        for layer in model.layers:
            mod = layer
            for attr in path.split("."):
                mod = getattr(mod, attr, None)
            if mod is not None:
                params.append(mod.weight)
        if params:
            roles[role] = params
    return roles


def train_lm(cfg: LMRunConfig, out: str | Path, *, resume: bool = False, stop_after: int | None = None,
             text: str | None = None) -> dict[str, Any] | None:
    """Train the LM into run folder ``out`` with continuity tracking; returns the summary.

    ``text`` overrides the corpus (tests pass a short string).
    """
    from flowgeom.data.text import CharVocab, lm_batch, load_text

    corpus = text if text is not None else load_text(cfg.data, split="train")
    vocab = CharVocab.from_text(corpus)
    tokens = vocab.encode(corpus)
    device = torch.device(cfg.device)
    model = TinyLM(cfg.model_config(vocab.size))
    _seeded_init(model, cfg.seed)
    model.to(device)
    opt = make_optimizer(cfg.optimizer, model.parameters(), lr=cfg.lr)

    def next_batch(gen: torch.Generator):
        x, y = lm_batch(tokens, batch=cfg.batch, seq_len=cfg.seq_len, generator=gen)
        return x.to(device), y.to(device)

    def loss_fn(m, batch):
        logits = m(batch[0])  # (B, T, vocab)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))

    config = {**dataclasses.asdict(cfg), "vocab": vocab.size, "params": sum(p.numel() for p in model.parameters())}
    return train_tracked(RunFolder(out), config=config, model=model, optimizer=opt, next_batch=next_batch,
                         loss_fn=loss_fn, roles=role_parameters(model), steps=cfg.steps, log_every=cfg.log_every,
                         ckpt_every=cfg.ckpt_every, seed=cfg.seed, k=cfg.k, resume=resume, stop_after=stop_after,
                         label=f"LM {cfg.mlp}")


def _seeded_init(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every matrix ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (nn.Linear's default) from ``seed``.

    TinyLM's constructor uses the global RNG; this makes the run depend on
    ``seed`` only. Norm weights stay at one.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                bound = 1 / math.sqrt(p.shape[1]) if "embed" not in name else 1.0
                p.copy_(torch.rand(p.shape, generator=gen) * (2 * bound) - bound)


def projection_pattern(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per role: final weight v1/u1 (× baseline), verdict, and how it formed over training.

    ``verdict`` is the analyzer's rule (:func:`flowgeom.continuity.verdict`,
    ratio to chance >= 3): ``input-continuous``, ``output-continuous``,
    ``input+output-continuous`` or ``neither``. ``grad_v1_init`` /
    ``grad_u1_init`` are the gradient continuities at step 0 (before any
    update); ``step_dw1`` the first logged step with ``||ΔW||/||W(0)|| >= 1``.
    """
    recs = [r for r in records if "continuity" in r]
    if not recs:
        return {}
    first, last = recs[0]["continuity"], recs[-1]["continuity"]
    out = {}
    for role, fin in last.items():
        xv = fin["weight"]["v1"] / fin["v1_baseline"]
        xu = fin["weight"]["u1"] / fin["u1_baseline"]
        verdict = continuity_verdict(xv, xu, VERDICT_THRESHOLD)
        crossing = next((r["step"] for r in recs if r["continuity"][role]["dw_ratio"] >= 1.0), None)
        out[role] = {"v1": fin["weight"]["v1"], "u1": fin["weight"]["u1"], "v1_x": xv, "u1_x": xu,
                     "v1_baseline": fin["v1_baseline"], "u1_baseline": fin["u1_baseline"], "verdict": verdict,
                     "seed": SEED_PATTERN.get(role, "-"),
                     "grad_v1_init": first[role]["grad"]["v1"], "grad_u1_init": first[role]["grad"]["u1"],
                     "delta_v1": fin["delta"]["v1"], "delta_u1": fin["delta"]["u1"],
                     "dw_ratio": fin["dw_ratio"], "step_dw1": crossing}
    return out
