"""Which whole blocks to drop (Llama only: blocks are found by Llama's names).

Dropping a layer saves every parameter of the block (its seven projections and
two norms); the blocks to drop are ranked by continuity
(:func:`continuity_scores`), at random (the control), by ShortGPT's Block
Influence (:func:`bi_drop`) or by Gromov et al.'s angular distance
(:func:`angular_drop`). Every function but :func:`drop_blocks` (the ``drop-*``
methods of ``compress run``) works on plain values or an HF-named state dict
without touching the input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from flowgeom.compress.arch import SEED_SPACE, role_shapes, weight_key
from flowgeom.compress.calibrate import cached_calibration, calibration_ids
from flowgeom.compress.source import check_vocab, view_model
from flowgeom.errors import FlowgeomError

def block_params(state: Mapping[str, torch.Tensor], layer: int) -> int:
    """Numbers stored by decoder block ``layer`` (all its tensors)."""
    prefix = f"model.layers.{layer}."
    return sum(t.numel() for k, t in state.items() if k.startswith(prefix))


def drop_layers(state: Mapping[str, torch.Tensor], drop: Sequence[int], *, n_layers: int) -> dict[str, torch.Tensor]:
    """A state dict without blocks ``drop``; the kept blocks renumbered 0..L-len(drop)-1 in order."""
    bad = sorted({l for l in drop if not 0 <= l < n_layers})
    if bad or len(set(drop)) != len(drop) or len(drop) >= n_layers:
        raise FlowgeomError(f"cannot drop layers {list(drop)} of a {n_layers}-layer model: indices must be distinct, "
                            f"in 0..{n_layers - 1}, and leave at least one layer")
    keep = [l for l in range(n_layers) if l not in set(drop)]
    new_index = {old: new for new, old in enumerate(keep)}
    out = {}
    for key, t in state.items():
        if key.startswith("model.layers."):
            layer = int(key.split(".")[2])
            if layer in new_index:
                out[key.replace(f"model.layers.{layer}.", f"model.layers.{new_index[layer]}.", 1)] = t
        else:
            out[key] = t
    return out


def continuity_scores(report: Mapping, *, spaces: Mapping[str, str] | None = None) -> dict[int, float]:
    """Redundancy score per layer from an :func:`flowgeom.continuity.analyze` report.

    For each role, the adjacent-pair subspace alignment in the role's space
    (``subspace_in`` for input, ``subspace_out`` for output; default spaces:
    :data:`SEED_SPACE`, roles without one use the larger of the two); a layer's
    score is the mean over roles of the mean over the pairs (l-1, l) and
    (l, l+1) it belongs to. High score = the layer's weights continue their
    neighbours' directions = first candidate to drop.
    """
    spaces = dict(SEED_SPACE if spaces is None else spaces)
    per_layer: dict[int, list[float]] = {}
    for role, r in report["roles"].items():
        key = {"input": "subspace_in", "output": "subspace_out"}.get(spaces.get(role, ""))
        for p in r["pairs"]:
            if p["distance"] != 1:
                continue
            value = p[key] if key else max(p["subspace_in"], p["subspace_out"])
            for layer in (p["a"], p["b"]):
                per_layer.setdefault(layer, []).append(value)
    return {l: sum(v) / len(v) for l, v in sorted(per_layer.items())}


def drop_order(scores: Mapping[int, float], *, protect: Sequence[int] = ()) -> list[int]:
    """Layers by descending score (ties: lower index first), ``protect`` left out."""
    return [l for l, _ in sorted(scores.items(), key=lambda kv: (-kv[1], kv[0])) if l not in set(protect)]


def random_drop_order(n_layers: int, *, seed: int, protect: Sequence[int] = ()) -> list[int]:
    """A random ranking (the control for :func:`drop_order`), from its own generator."""
    gen = torch.Generator().manual_seed(seed)
    return [l for l in torch.randperm(n_layers, generator=gen).tolist() if l not in set(protect)]


def drop_count(budget: float, scope: int, block: int, n_layers: int) -> int:
    """Blocks to drop so that ``n block`` is nearest ``budget scope`` (at least 1, at most L - 2)."""
    return max(1, min(n_layers - 2, round(budget * scope / block)))


def bi_drop(block_influence: Sequence[float], n: int) -> list[int]:
    """ShortGPT (Men et al. 2024): the n blocks of lowest Block Influence ``1 - mean cos(input, output)``."""
    return sorted(sorted(range(len(block_influence)), key=lambda l: (block_influence[l], l))[:n])


def angular_drop(angular: Mapping[int, Sequence[float]], n: int) -> list[int]:
    """Gromov et al. 2024: blocks l..l+n-1 for the l whose input and the output of block l+n-1 differ least
    (angular distance ``arccos(cos)/π`` between the inputs of blocks l and l+n)."""
    row = angular[n]
    start = min(range(len(row)), key=lambda l: (row[l], l))
    return list(range(start, start + n))


def drop_blocks(config, cfg, state: Mapping[str, torch.Tensor], source, tokenizer, *, progress=None,
                calib_cache: dict | None = None) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """``(config, state, facts)`` of the model without the blocks ``config.method`` ranks first: as many as
    save ``config.budget`` of the in-scope projection parameters (the calibration pass gives BI and angles)."""
    cache = calib_cache if calib_cache is not None else {}
    if "ids" not in cache:
        check_vocab(tokenizer, cfg, source)
        cache["ids"] = calibration_ids(source, config.calib, config.calib_tokens, config.seq_len, tokenizer)
    if "calib" not in cache:
        step = (lambda d, t: progress("calibrate", d, t)) if progress else None
        cache["calib"], _ = cached_calibration(view_model(cfg, state), state, cache["ids"], progress=step)
    L = cfg.num_hidden_layers
    role_shapes(state, config.roles, L)
    scope = sum(L * state[weight_key(0, r)].numel() for r in config.roles)
    n = drop_count(config.budget, scope, block_params(state, 0), L)
    calib = cache["calib"]
    dropped = angular_drop(calib.angular, n) if config.method == "drop-angular" else bi_drop(calib.block_influence, n)
    saved = sum(block_params(state, l) for l in dropped)
    return (replace(cfg, num_hidden_layers=L - n), drop_layers(state, dropped, n_layers=L),
            {"dropped": dropped, "scope_params": scope, "saved_params": saved, "scope_saved_fraction": saved / scope})
