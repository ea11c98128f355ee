"""Compression: continuity put to use. A smaller model that still works, judged by perplexity.

The modules: four helpers any stage may use, then the stages in the order a
compression runs them. Each imports only those listed above it (the order is
checked by tests/test_layering.py)::

    factorize   the pure tensor maths: whitening, shared bases, balanced factors
    allocate    ranks by the calibration loss each component costs
    write       atomic, streamed checkpoint folders
    store       tensors that wait on disk between stages
    ---
    arch        the roles, where each family keeps them; blocks run one at a time
    source      the dense model of any causal-LM family, as role weights
    calibrate   calibration ids, per-projection input Grams (and block-drop scores)
    blocks      which whole blocks to drop (Llama only)
    plan        spaces, layer groups, units (role x group, space, rank) of each method, and their factorisation
    lowrank     ``compress_model``: the low-rank methods on a model in memory (calibrate, plan, factorise)
    folder      factored folders on disk (bases + coefficients) and their loaders
    auto        ``load``, any source as a transformers model; the Auto classes (refused without flowgeom)
    mixed       drop n blocks and low-rank the rest (Llama only)
    run         ``run_compression``: load, check, compress by one method, report, write
    stream      the same, one block in memory at a time (Llama only)
    perplexity  held-out perplexity in windows
    agreement   agreement with the dense model, and the health of greedy generation
    evaluate    several models compared on the same text
    heal        distillation of the dense model back into a compressed folder
    sweep       one method over several budgets

Public API::

    from pathlib import Path
    from flowgeom.compress import CompressionConfig, load, run_compression
    run_compression("builtin:smollm2", Path("runs/w20"), CompressionConfig(method="whiten", budget=0.2))
    model = load("runs/w20")  # the family's transformers model with factored projections

See docs/compression.md.
"""

from flowgeom.compress.arch import SEED_SPACE
from flowgeom.compress.auto import load
from flowgeom.compress.blocks import block_params, continuity_scores, drop_layers, drop_order, random_drop_order
from flowgeom.compress.factorize import Factors, rank_for_ratio, share_input, share_output, stored_per_rank
from flowgeom.compress.perplexity import EvalConfig, perplexity, windows
from flowgeom.compress.plan import layer_groups, opposite
from flowgeom.compress.run import CompressionConfig, CompressionResult, renamed, run_compression

__all__ = [
    "SEED_SPACE", "block_params", "continuity_scores", "drop_layers", "drop_order", "layer_groups", "opposite",
    "random_drop_order", "Factors", "rank_for_ratio", "share_input", "share_output", "stored_per_rank",
    "EvalConfig", "perplexity", "windows", "CompressionConfig", "CompressionResult", "run_compression", "load",
]


def __getattr__(name: str):
    raise renamed(__name__, name)
