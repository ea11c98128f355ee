"""``compress sweep``: held-out perplexity, agreement and generation health against parameters saved, one
point per budget, and the largest budget a user can trust.

One calibration serves every budget. Each point compresses the model with
the method and options of :class:`~flowgeom.compress.run.CompressionConfig`,
builds the factored model in memory and scores the first ``eval_tokens``
tokens of the held-out KJV split (context 512,
:func:`flowgeom.compress.perplexity.perplexity`); with ``judge``, it is also
judged against the dense model on the out-of-domain text
(:class:`flowgeom.compress.agreement.Judge`: teacher-forced top-1 agreement on
its first ``eval_tokens`` tokens, the health of greedy continuations of its
prompts) and the sweep marks the largest budget that meets the targets of
:func:`flowgeom.compress.agreement.meets_targets` (``recommended``). With
``heal``, each point is written to ``<out>-b<budget>/`` and healed there
before it is judged (what a user would keep). The folder gets ``sweep.json``
(the curve) and ``sweep.png`` (its figure), atomically.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from flowgeom.compress.agreement import GenerationConfig
from flowgeom.compress.blocks import drop_blocks
from flowgeom.compress.lowrank import compress_model
from flowgeom.compress.run import DROP_METHODS, CompressionConfig, Progress, check_weights, for_family
from flowgeom.compress.run import run_compression
from flowgeom.compress.source import build_model, load_dense, model_tokenizer, source_path
from flowgeom.errors import FlowgeomError


def held_out_ids(tokenizer, tokens: int | None) -> torch.Tensor:
    from flowgeom.data.text import load_text
    from flowgeom.data.tokens import token_ids

    ids = token_ids(load_text("kjv", split="test"), tokenizer)
    return ids if tokens is None else ids[:tokens]


def point_folder(out: Path, budget: float) -> Path:
    """Where a healed sweep keeps the folder of one budget: beside ``out``, named by it."""
    return out.parent / f"{out.name}-b{budget:g}"


def sweep_budgets(source: str, out: Path, config: CompressionConfig, budgets: Sequence[float], *, force: bool = False,
                  eval_tokens: int = 4096, context: int = 512, progress: Progress | None = None,
                  judge: GenerationConfig | None = GenerationConfig(), heal=None) -> dict[str, Any]:
    from flowgeom.compress.write import check_out_folder, write_folder
    from flowgeom.compress.perplexity import EvalConfig, perplexity
    from flowgeom.runs import atomic_write_json

    budgets = sorted(set(budgets))
    path = source_path(source)
    check_out_folder(path, out, force=force)
    if heal is not None:
        if config.method in DROP_METHODS:
            raise FlowgeomError("sweep --heal heals factored points; for dropped blocks run compress run --heal per "
                                "budget")
        for b in budgets:
            check_out_folder(path, point_folder(out, b), force=force)
    cfg, state = load_dense(path)
    config = for_family(config, cfg)
    check_weights(state, config.roles, cfg.num_hidden_layers)
    tokenizer = model_tokenizer(path)
    if tokenizer is None:
        raise FlowgeomError(f"{source} has no tokenizer: the sweep scores held-out text; copy the model's "
                            "tokenizer.json into the folder")
    ids = held_out_ids(tokenizer, eval_tokens)
    ev = EvalConfig(context=min(context, len(ids), cfg.max_position_embeddings), max_tokens=None)
    t0 = time.perf_counter()
    dense = build_model(cfg, state)
    reference = perplexity(dense, ids, ev)["ppl"]
    judged = None if judge is None else _judge(dense, tokenizer, judge, eval_tokens, context, cfg)
    del dense
    shared: dict = {}
    points = []
    for i, b in enumerate(budgets):
        point = replace(config, budget=b, rank=None)
        if heal is not None:
            model, saved, fraction = _healed_point(source, point_folder(out, b), point, heal, force=force,
                                                   progress=progress)
        elif config.method in DROP_METHODS:
            new_cfg, new_state, facts = drop_blocks(point, cfg, state, path, tokenizer, calib_cache=shared,
                                                    progress=progress)
            model, saved, fraction = (build_model(new_cfg, new_state), facts["saved_params"],
                                      facts["scope_saved_fraction"])
        else:
            compressed, _ = compress_model(point, cfg, state, path, tokenizer, calib_cache=shared, progress=progress)
            p = compressed.plan
            model, saved, fraction = (build_model(cfg, compressed.dense_state(state)),
                                      p.dense_params - p.stored_params, p.saved_fraction)
        ppl = perplexity(model, ids, ev)["ppl"]
        points.append({"budget": b, "saved_fraction": fraction, "saved_params": saved, "ppl": ppl,
                       "ppl_ratio": ppl / reference, **({} if judged is None else judged(model))})
        if heal is not None:
            points[-1]["folder"] = str(point_folder(out, b))
        del model
        if progress:
            progress("sweep", i + 1, len(budgets))
    trusted = [p["budget"] for p in points if p.get("targets", {}).get("all")]
    result = {"source": str(source), "method": config.method, "roles": list(config.roles),
              "sequential": config.sequential, "refit": config.refit, "eval_tokens": int(len(ids)),
              "context": ev.context, "reference_ppl": reference, "points": points,
              "healed": None if heal is None else heal.tokens,
              "judge": None if judged is None else {"text": judge.text, "prompts": judge.prompts,
                                                    "new_tokens": judge.new_tokens,
                                                    "reference_generation": judged.health},
              "recommended": max(trusted) if trusted else None,
              "json": str(out / "sweep.json"), "figure": str(out / "sweep.png"),
              "seconds": time.perf_counter() - t0}

    def fill(tmp: Path) -> None:
        atomic_write_json(tmp / "sweep.json", result, root=tmp)
        sweep_figure(result, tmp / "sweep.png")

    write_folder(out, fill, force=force)
    return result


def _judge(dense, tokenizer, generation: GenerationConfig, tokens: int, context: int, cfg):
    """The dense model's side of the judgement: the first ``tokens`` tokens of the out-of-domain text, its prompts
    and the dense model's continuations (:class:`~flowgeom.compress.agreement.Judge`)."""
    from flowgeom.compress.agreement import Judge, prompts_from
    from flowgeom.compress.perplexity import EvalConfig
    from flowgeom.data.text import load_text
    from flowgeom.data.tokens import token_ids

    text = load_text(generation.text, split="test")
    ids = token_ids(text, tokenizer)[:tokens]
    prompts = [tokenizer.encode(p, add_special_tokens=False).ids
               for p in prompts_from(text, generation.prompts, generation.prompt_words)]
    return Judge(dense, ids, prompts, EvalConfig(context=min(context, len(ids), cfg.max_position_embeddings),
                                                 max_tokens=None), generation)


def _healed_point(source: str, folder: Path, point: CompressionConfig, heal, *, force: bool, progress):
    """One budget compressed into ``folder`` and healed there; the healed model and its savings."""
    from flowgeom.compress.folder import load_model
    from flowgeom.compress.heal import heal_folder

    report = run_compression(source, folder, point, force=force, progress=progress).report
    heal_folder(folder, folder, heal, in_place=True, progress=progress)
    return load_model(folder), report["saved_params"], report["scope_saved_fraction"]  # of the projections


def sweep_figure(result: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend switch

    from flowgeom.runs import atomic_write_figure

    pts = result["points"]
    judged = result.get("judge") is not None
    fig = Figure(figsize=(9.5 if judged else 5, 3.4))
    ax = fig.add_subplot(1, 2 if judged else 1, 1)
    saved = [100 * p["saved_fraction"] for p in pts]
    ax.plot(saved, [p["ppl"] for p in pts], "o-", label=result["method"])
    ax.axhline(result["reference_ppl"], color="k", ls="--", lw=1, label="uncompressed")
    ax.set_xlabel("projection parameters saved (%)")
    ax.set_ylabel("held-out perplexity")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(Path(result["source"]).name, fontsize=9)
    if judged:
        from flowgeom.compress.agreement import LOOP_POINTS, TOP1

        right = fig.add_subplot(1, 2, 2)
        right.plot(saved, [p["agreement"]["top1"] for p in pts], "o-", label="top-1 agreement")
        right.plot(saved, [p["generation"]["loop_fraction"] for p in pts], "s-", label="loop fraction")
        right.axhline(TOP1, color="C0", ls=":", lw=1)
        right.axhline(result["judge"]["reference_generation"]["loop_fraction"] + LOOP_POINTS, color="C1", ls=":",
                      lw=1)
        for p, x in zip(pts, saved):
            if p["budget"] == result["recommended"]:
                right.axvline(x, color="g", lw=1, label="recommended")
        right.set_ylim(0, 1)
        right.set_xlabel("projection parameters saved (%)")
        right.set_title(f"against the dense model on {result['judge']['text']}"
                        + (f", healed {result['healed']:,} tokens" if result.get("healed") else ", not healed"),
                        fontsize=9)
        right.legend(fontsize=8)
    fig.tight_layout()
    atomic_write_figure(path, fig, dpi=120)
