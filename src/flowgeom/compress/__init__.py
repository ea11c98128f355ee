"""Compression: continuity put to use. A smaller model that still works, judged by perplexity.

The modules are the stages, in the order a compression runs them::

    source      the dense model of any causal-LM family, as role weights
    arch        where each family keeps its roles (fused, Conv1D), blocks run one at a time
    calibrate   per-projection input Grams from calibration text (and block-drop scores)
    blocks      roles, layer groups, spaces; which whole blocks to drop
    plan        units (role x layer group, space, rank) of each method, and their factorisation
    factorize   the pure tensor maths: whitening, shared bases, balanced factors
    folder      factored folders on disk (bases + coefficients) and their loaders
    auto        factored folders in transformers' Auto classes (never loaded silently as dense)
    write       atomic, streamed checkpoint folders
    run         ``compress_model`` / ``share_model``: load, calibrate, plan, factorise, write
    stream      the same, one block in memory at a time (sharded safetensors larger than memory)
    heal        distillation of the dense model back into a compressed folder
    perplexity  held-out perplexity in windows
    evaluate    several models compared on the same text
    sweep       one method over several budgets

Public API::

    from pathlib import Path
    from flowgeom.compress import ShareConfig, share_model
    share_model("builtin:smollm2", Path("runs/w20"), ShareConfig(method="whiten", budget=0.2))

See docs/continuity-sharing.md.
"""

from flowgeom.compress.auto import register_transformers
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
    "EvalConfig", "perplexity", "windows", "ShareConfig", "share_model", "load", "register_transformers",
]


def load(folder, *, dtype=None):
    """The ``transformers`` causal LM of a compressed folder (the hf extra), in its family's own class: factored
    projections for a factored folder, the plain model for a dropped one. Also registers the factored classes with transformers' Auto
    classes (:mod:`flowgeom.compress.auto`)."""
    import torch

    from flowgeom.compress.folder import factored_hf, is_factored

    register_transformers()
    dtype = torch.float32 if dtype is None else dtype
    if is_factored(folder):
        return factored_hf(folder, dtype=dtype)
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype).eval()


register_transformers(only_if_imported=True)  # transformers already loaded: its Auto classes know factored folders
