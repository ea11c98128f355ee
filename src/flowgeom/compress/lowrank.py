"""The low-rank methods of ``compress run`` (svd, whiten, basis-sharing, share, continuity), in memory.

:func:`compress_model` makes one budget of any family of :mod:`flowgeom.compress.arch`:
the calibration ids and Grams (:mod:`flowgeom.compress.calibrate`; cached on disk,
and shared through ``calib_cache`` across the budgets of a sweep), the analyzer's
evidence where the method asks for it, the plan (:mod:`flowgeom.compress.plan`),
ranks allocated by the calibration loss, and the factors (sequential when asked).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from flowgeom.compress import plan as C
from flowgeom.compress.calibrate import GRAD_TOKENS, cached_calibration, calibrate, calibration_ids, check_rank
from flowgeom.compress.calibrate import input_widths
from flowgeom.compress.source import build_model, check_vocab, view_model
from flowgeom.compress.store import GramFiles, TensorFiles


def compress_model(config, cfg, state, source: Path, tokenizer, *, progress=None,
                   calib_cache: dict | None = None) -> tuple[C.Compressed, dict[str, Any]]:
    """Plan + factors of one budget of ``config`` (a :class:`~flowgeom.compress.run.CompressionConfig`; the
    calibration shared through ``calib_cache`` across a sweep)."""
    L = cfg.num_hidden_layers
    if config.method in ("basis-sharing", "share"):
        C.layer_groups(L, config.group)  # --group within 1..L, refused before the calibration (minutes on a real model)
    facts: dict[str, Any] = {"notes": []}
    calib = None
    cache = calib_cache if calib_cache is not None else {}
    if config.calibrated:
        if "ids" not in cache:
            check_vocab(tokenizer, cfg, source)
            cache["ids"] = calibration_ids(source, config.calib, config.calib_tokens, config.seq_len, tokenizer)
            check_rank(input_widths(state), config.calib_tokens)
        ids = cache["ids"]
        if "calib" not in cache:
            model = view_model(cfg, state)  # read only: the weights are not copied
            step = (lambda d, t: progress("calibrate", d, t)) if progress else None
            t0 = time.perf_counter()
            if config.cache:
                cache["calib"], hit = cached_calibration(model, state, ids, progress=step)
            else:  # the Grams wait on disk, block by block, all the same (flowgeom.compress.store)
                store = GramFiles(TensorFiles.temporary(), cfg.num_hidden_layers)
                cache["calib"], hit = calibrate(model, ids, progress=step, store=store), False
            cache["calib_seconds"], cache["calib_cached"] = time.perf_counter() - t0, hit
            del model
        calib = cache["calib"]
        facts |= {"calib": config.calib, "calib_tokens": int(ids.numel()), "calib_cached": cache["calib_cached"],
                  "calib_seconds": cache["calib_seconds"]}
    evidence = None
    if config.method == "continuity" or config.space == "auto":
        if "evidence" not in cache:
            cache["evidence"] = C.continuity_evidence(state, config.roles, L)
        evidence = cache["evidence"]
        facts["evidence"] = {r: {k: v for k, v in e.items() if k != "pairs"} for r, e in evidence.items()}
        guessed = [r for r, e in evidence.items() if e["guessed"]]
        if guessed:
            facts["notes"].append(f"the analyzer measured no clear space for {', '.join(guessed)}; the larger of "
                                  "the v1/u1 ratios chose it")
    spaces = C.resolve_spaces(config.space, config.roles, evidence) if config.method == "share" else None
    ratio = config.budget if config.budget is not None else 0.5  # with --rank the ratio only names the plan
    p = C.plan(config.method, state, n_layers=L, ratio=ratio, roles=config.roles, group=config.group, spaces=spaces,
               calib=calib, continuity=evidence)
    if config.rank is not None:
        p = C.with_rank(p, config.rank)
    facts["allocate"] = config.allocation
    facts["max_flops"] = config.max_flops
    if config.allocation == "loss":  # the components scored by the gradients of the first GRAD_TOKENS
        grad_ids = cache["ids"][: max(1, GRAD_TOKENS // config.seq_len)]
        step = (lambda d, t: progress("gradients", d, t)) if progress else None
        p, facts["allocation"] = C.allocate_by_loss(p, state, calib, lambda: view_model(cfg, state), grad_ids,
                                                    progress=step, cache=cache.setdefault("sensitivity", {}),
                                                    flops=config.max_flops)
    facts["notes"] += list(p.notes)
    step = (lambda d, t: progress("factorise", d, t)) if progress else None
    if config.sequential:
        model = build_model(cfg, state)
        compressed, _ = C.compress_sequential(p, model, cache["ids"], refit=config.refit, progress=step,
                                              state=state)
        del model
    else:
        compressed = C.compress(p, state, calib, refit=config.refit, progress=step,
                                full=cache.get("sensitivity", {}).get("full"))
    facts["notes"] += compressed.notes
    return compressed, facts
