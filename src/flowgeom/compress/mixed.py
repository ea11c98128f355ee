"""Mixed plans: drop n whole blocks and low-rank the rest to the exact budget, n chosen by measured loss.

Dropping a block saves all its parameters for the price of one residual
update; low rank saves a fraction of every projection for the price of
its discarded components. ``--method mixed`` tries every split between the
two at the same budget B (numbers saved out of the in-scope projections):

1. for n = 0, 1, ..., N (N = the block count ``drop-angular`` takes at B),
   the n consecutive blocks of least angular distance between their input
   and their output (Gromov et al. 2024, as ``drop-angular``) are dropped;
2. the remaining target ``B - n · block`` is met by per-layer whitened
   low rank (SVD-LLM) over the kept blocks, ranks allocated by the
   calibration loss (``--allocate loss``, :mod:`flowgeom.compress.allocate`)
   or evenly (the rank rule at the remaining fraction);
3. the calibration loss (mean next-token NLL) of that model is measured on
   calibration sequences the gradients did not see, and the n with the
   lowest loss is written.

Everything is measured once on the dense model: the Grams, the full-rank
whitened factors (each candidate truncates them) and, for the loss
allocation, the component estimates. For the blocks after a dropped run
these are the dense model's statistics, not re-measured on the shortened
model; the angular criterion picks the run whose removal changes the
residual stream least, which is what keeps that approximation close.

The folder is a factored folder of the shortened model (the kept blocks
renumbered), so ``compress evaluate`` and the loaders read it as any
other. Llama only, as block dropping is.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flowgeom.compress import factorize as fz
from flowgeom.compress import plan as C
from flowgeom.compress.allocate import allocate
from flowgeom.compress.blocks import angular_drop, block_params, drop_count, drop_layers
from flowgeom.compress.calibrate import GRAD_TOKENS, cached_calibration, calibrate, calibration_ids, logits_of
from flowgeom.compress.calibrate import sensitivity
from flowgeom.errors import FlowgeomError
from flowgeom.nn.llama import llama_from_state

METHOD = "mixed"
EVAL_SEQUENCES = 4  # calibration sequences (from the end of the calibration ids) that judge each n


@torch.inference_mode()
def calibration_loss(model, ids: torch.Tensor, *, batch: int = 2) -> float:
    """Mean next-token NLL of ``model`` on ``ids`` (S, T)."""
    total, count = 0.0, 0
    for i in range(0, len(ids), batch):
        x = ids[i:i + batch]
        logits = logits_of(model, x)  # (B, T, vocab)
        total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1),
                                       reduction="sum"))
        count += x[:, 1:].numel()
    return total / count


def renumber(units: Sequence[C.Unit], dropped: Sequence[int], n_layers: int) -> tuple[C.Unit, ...]:
    """``units`` (per-layer) of the kept blocks with the layer indices of the shortened model."""
    new = {old: i for i, old in enumerate(l for l in range(n_layers) if l not in set(dropped))}
    return tuple(C.Unit(u.role, u.space, tuple(new[l] for l in u.layers), u.rank, u.shape) for u in units)


def even_ranks(units: Sequence[C.Unit], target: int) -> list[int | None]:
    """The rank rule at the fraction ``target`` is of the units' parameters (never under the target)."""
    scope = sum(u.dense_params for u in units)
    ratio = target / scope
    if ratio >= 1.0:
        raise FlowgeomError(f"saving {target:,} of {scope:,} numbers by low rank is impossible")
    ranks = [fz.rank_for_ratio(*u.shape, len(u.layers), ratio, u.space) for u in units]
    if min(ranks) < 1:
        raise FlowgeomError(f"a saving of {ratio:.3g} leaves no rank for some role; ask for a smaller budget")
    return ranks


def mixed_plans(cfg, state: Mapping[str, torch.Tensor], calib, *, budget: float, roles: Sequence[str],
                allocation: str, model=None, grad_ids: torch.Tensor | None = None, eval_ids: torch.Tensor,
                sens: Mapping | None = None, progress=None) -> tuple[Any, dict[str, torch.Tensor], C.Compressed, dict[str, Any]]:
    """``(config, state, compressed, facts)`` of the best split (module docstring): the shortened model's
    config and state (kept blocks renumbered, projections dense) and its factors."""
    L = cfg.num_hidden_layers
    base = C.plan("whiten", state, n_layers=L, ratio=budget, roles=roles)
    scope = base.dense_params
    target = math.ceil(budget * scope)
    block = block_params(state, 0)
    top = drop_count(budget, scope, block, L)
    factors = C.full_factors(base, state, calib)
    units = base.units
    cands = None
    if allocation == "loss" and sens is None:
        sens, _ = sensitivity(model, grad_ids, C.probes(units, factors),
                              progress=(lambda d, t: progress("gradients", d, t)) if progress else None)
    if allocation == "loss":
        cands = C.candidates(units, sens)
    tried, best = [], None
    for n in range(0, top + 1):
        dropped = angular_drop(calib.angular, n) if n else []
        rest = target - n * block
        keep = [i for i, u in enumerate(units) if u.layers[0] not in set(dropped)]
        if rest <= 0:
            ranks = [None] * len(keep)
        elif allocation == "loss":
            ranks = allocate([cands[i] for i in keep], rest, C.LOSS_RULE)
        else:
            ranks = even_ranks([units[i] for i in keep], rest)
        new_units = renumber([units[i] for i in keep], dropped, L)
        plan_ = C.with_ranks(C.Plan(METHOD, budget, ()), new_units, ranks,
                             f"dropped blocks {dropped}; the rest low rank ({allocation} ranks)")
        fs = [C.truncate(factors[i], k) for i, k in zip(keep, ranks) if k is not None]
        compressed = C.Compressed(plan_, fs)
        new_cfg = replace(cfg, num_hidden_layers=L - n)
        new_state = drop_layers(state, dropped, n_layers=L) if n else dict(state)
        loss = calibration_loss(llama_from_state(new_cfg, compressed.dense_state(new_state)), eval_ids)
        saved = n * block + (plan_.dense_params - plan_.stored_params)
        tried.append({"n": n, "dropped": dropped, "loss": loss, "saved_params": saved,
                      "scope_saved_fraction": saved / scope})
        if best is None or loss < best[0]:
            best = (loss, new_cfg, new_state, compressed, n, dropped, saved)
        if progress:
            progress("mixed", n + 1, top + 1)
    loss, new_cfg, new_state, compressed, n, dropped, saved = best
    facts = {"dropped": dropped, "layers": L - n, "allocate": allocation, "mixed_tried": tried,
             "calib_loss": loss, "scope_params": scope, "block_params": block, "target_params": target,
             "mixed_saved_params": saved, "notes": [f"mixed: dropping {n} block(s) {dropped} and low-ranking the "
                                                   f"rest gave the lowest calibration loss ({loss:.4f}) of n = "
                                                   f"0..{top}"]}
    return new_cfg, new_state, compressed, facts


def compress_mixed(config, cfg, state: Mapping[str, torch.Tensor], path: Path, tokenizer, *, progress=None
                   ) -> tuple[Any, dict[str, torch.Tensor], C.Compressed, dict[str, Any]]:
    """``--method mixed`` (module docstring): calibrate, choose n; ``(config, state, compressed, facts)`` of the
    shortened model, ``facts`` counting the dropped blocks among the savings."""
    ids = calibration_ids(path, config.calib, config.calib_tokens, config.seq_len, tokenizer)
    if len(ids) < 2:
        raise FlowgeomError(f"--method mixed judges each split on calibration sequences the rest did not use: pass "
                            f"--calib-tokens of at least {2 * config.seq_len}")
    model = llama_from_state(cfg, state)
    step = (lambda d, t: progress("calibrate", d, t)) if progress else None
    t1 = time.perf_counter()
    calib, hit = cached_calibration(model, state, ids, progress=step) if config.cache else (None, False)
    if calib is None:
        calib = calibrate(model, ids, progress=step)
    calib_seconds = time.perf_counter() - t1
    held = min(EVAL_SEQUENCES, len(ids) // 2)
    eval_ids, grad_ids = ids[-held:], ids[: min(len(ids) - held, max(1, GRAD_TOKENS // config.seq_len))]
    new_cfg, new_state, compressed, facts = mixed_plans(
        cfg, state, calib, budget=config.budget, roles=config.roles, allocation=config.allocation, model=model,
        grad_ids=grad_ids, eval_ids=eval_ids, progress=progress)
    facts |= {"calib": config.calib, "calib_tokens": int(ids.numel()), "calib_cached": hit,
              "calib_seconds": calib_seconds, "eval_tokens": int(eval_ids.numel())}
    return new_cfg, new_state, compressed, facts
