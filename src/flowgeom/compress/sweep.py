"""``share --sweep``: held-out perplexity against parameters saved, one point per budget, to pick a safe budget.

One calibration serves every budget. Each point compresses the model with
the method and options of :class:`~flowgeom.compress.run.ShareConfig`,
builds the factored model in memory and scores the first ``eval_tokens``
tokens of the held-out KJV split (context 512,
:func:`flowgeom.compress.perplexity.perplexity`). The folder gets
``sweep.json`` (the curve) and ``sweep.png`` (its figure), atomically.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from flowgeom.compress.run import (
    DROP_METHODS, Progress, ShareConfig, check_weights, compress_model, drop_blocks, model_tokenizer, source_path,
)
from flowgeom.errors import FlowgeomError


def held_out_ids(tokenizer, tokens: int | None) -> torch.Tensor:
    from flowgeom.data.text import load_text
    from flowgeom.data.tokens import token_ids

    ids = token_ids(load_text("kjv", split="test"), tokenizer)
    return ids if tokens is None else ids[:tokens]


def sweep_budgets(source: str, out: Path, config: ShareConfig, budgets: Sequence[float], *, force: bool = False,
                  eval_tokens: int = 4096, context: int = 512, progress: Progress | None = None) -> dict[str, Any]:
    from flowgeom.compress.write import check_out_folder, write_folder
    from flowgeom.compress.perplexity import EvalConfig, perplexity
    from flowgeom.compress.run import for_family
    from flowgeom.compress.source import build_model, load_dense
    from flowgeom.runs import atomic_write_json

    budgets = sorted(set(budgets))
    path = source_path(source)
    check_out_folder(path, out, force=force)
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
    reference = perplexity(build_model(cfg, state), ids, ev)["ppl"]
    shared: dict = {}
    points = []
    for i, b in enumerate(budgets):
        point = replace(config, budget=b, rank=None)
        if config.method in DROP_METHODS:
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
                       "ppl_ratio": ppl / reference})
        if progress:
            progress("sweep", i + 1, len(budgets))
    result = {"source": str(source), "method": config.method, "roles": list(config.roles),
              "sequential": config.sequential, "refit": config.refit, "eval_tokens": int(len(ids)),
              "context": ev.context, "reference_ppl": reference, "points": points,
              "json": str(out / "sweep.json"), "figure": str(out / "sweep.png"),
              "seconds": time.perf_counter() - t0}

    def fill(tmp: Path) -> None:
        atomic_write_json(tmp / "sweep.json", result, root=tmp)
        sweep_figure(result, tmp / "sweep.png")

    write_folder(out, fill, force=force)
    return result


def sweep_figure(result: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend switch

    from flowgeom.runs import atomic_write_figure

    fig = Figure(figsize=(5, 3.4))
    ax = fig.add_subplot()
    pts = result["points"]
    ax.plot([100 * p["saved_fraction"] for p in pts], [p["ppl"] for p in pts], "o-", label=result["method"])
    ax.axhline(result["reference_ppl"], color="k", ls="--", lw=1, label="uncompressed")
    ax.set_xlabel("projection parameters saved (%)")
    ax.set_ylabel("held-out perplexity")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(Path(result["source"]).name, fontsize=9)
    fig.tight_layout()
    atomic_write_figure(path, fig, dpi=120)
