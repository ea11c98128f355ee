"""Compression: continuity put to use. A smaller model that still works, judged by perplexity.

The modules are the stages, in the order a compression runs them::

    source      the dense model of any causal-LM family, as role weights
    arch        where each family keeps its roles (fused, Conv1D), blocks run one at a time
    calibrate   per-projection input Grams from calibration text (and block-drop scores)
    blocks      roles, layer groups, spaces; which whole blocks to drop
    plan        units (role x layer group, space, rank) of each method, and their factorisation
    factorize   the pure tensor maths: whitening, shared bases, balanced factors
    folder      factored folders on disk (bases + coefficients) and their loaders
    auto        ``load``, any source as a transformers model; the Auto classes (refused without flowgeom)
    write       atomic, streamed checkpoint folders
    run         ``compress_model`` / ``share_model``: load, calibrate, plan, factorise, write
    stream      the same, one block in memory at a time (sharded safetensors larger than memory)
    heal        distillation of the dense model back into a compressed folder
    perplexity  held-out perplexity in windows
    evaluate    several models compared on the same text
    sweep       one method over several budgets

Public API::

    from pathlib import Path
    from flowgeom.compress import ShareConfig, load, share_model
    share_model("builtin:smollm2", Path("runs/w20"), ShareConfig(method="whiten", budget=0.2))
    model = load("runs/w20")  # the family's transformers model with factored projections

See docs/continuity-sharing.md.
"""

from flowgeom.compress.auto import load
from flowgeom.compress.blocks import (
    SEED_SPACE,
    block_params,
    continuity_scores,
    drop_layers,
    drop_order,
    layer_groups,
    opposite,
    random_drop_order,
)
from flowgeom.compress.factorize import Factors, rank_for_ratio, share_input, share_output, stored_per_rank
from flowgeom.compress.perplexity import EvalConfig, perplexity, windows
from flowgeom.compress.run import ShareConfig, share_model

__all__ = [
    "SEED_SPACE", "block_params", "continuity_scores", "drop_layers", "drop_order", "layer_groups", "opposite",
    "random_drop_order", "Factors", "rank_for_ratio", "share_input", "share_output", "stored_per_rank",
    "EvalConfig", "perplexity", "windows", "ShareConfig", "share_model", "load",
]

