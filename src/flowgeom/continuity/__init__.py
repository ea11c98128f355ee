"""Geometric continuity of checkpoints (seed 001): cross-layer singular-vector alignment.

Public API::

    from flowgeom.continuity import analyze, AnalyzeConfig
    report = analyze("builtin:smollm2", AnalyzeConfig(k=8))
    report["roles"]["q"]["v1"], report["roles"]["q"]["verdict"]

Pure metric functions (two matrices or two stacks in, tensors out) for reuse:
``top_singular_pairs``, ``v1_cos``, ``u1_cos``, ``subspace_alignment``,
``index_matched_alignment``, ``gram_similarity_in/out``, ``pair_metrics``,
and the random baselines ``analytic_baselines``, ``monte_carlo_baselines``,
``expected_abs_cos``. See ``docs/continuity.md``.

Compression and evaluation (``docs/continuity-sharing.md``)::

    from pathlib import Path
    from flowgeom.continuity import ShareConfig, share_model
    shared = share_model("builtin:smollm2", Path("runs/w20"), ShareConfig(method="whiten", budget=0.2))

    from flowgeom.continuity import compression  # plan, then factorise, without writing a folder
    from flowgeom.nn.llama import llama_state_dict
    cfg, state = llama_state_dict("builtin:smollm2")
    p = compression.plan("share", state, n_layers=cfg.num_hidden_layers, ratio=0.2, group=2)
    new = compression.compress(p, state, None).dense_state(state)  # None: data-free; a Calibration whitens

Pure stack functions (:mod:`flowgeom.continuity.factorize`; ``grams`` None = data-free SVD) ``share_input``,
``share_output`` returning ``Factors``; counts ``stored_per_rank``, ``rank_for_ratio``; ``layer_groups``,
``SEED_SPACE``, ``opposite``; layer dropping ``drop_layers``, ``block_params``, ``continuity_scores``,
``drop_order``, ``random_drop_order``; perplexity ``EvalConfig``, ``windows``, ``perplexity``. ``compress`` and
``factorize`` are reached through their modules (:mod:`~flowgeom.continuity.compression`,
:mod:`~flowgeom.continuity.factorize`), whose names they share. Loaded on first use (they import more):
``save_llama_folder`` (:mod:`flowgeom.continuity.checkpoint_out`), ``load_tokenizer``, ``cached_ids``
(:mod:`flowgeom.data.tokens`).

Reading checkpoints lives below this package, in :mod:`flowgeom.io` (``open_source``, ``TensorSource`` and
``BUILTINS`` are re-exported here because :func:`analyze` takes what they describe); the Llama forward and its
loaders (``load_llama``, ``llama_state_dict``, ``llama_from_state``) live in :mod:`flowgeom.nn.llama`.
"""

from flowgeom.continuity.analyze import AnalyzeConfig, analyze, verdict
from flowgeom.continuity.baselines import METRICS, analytic_baselines, expected_abs_cos, monte_carlo_baselines
from flowgeom.continuity.compress import (
    SEED_SPACE,
    block_params,
    continuity_scores,
    drop_layers,
    drop_order,
    layer_groups,
    opposite,
    random_drop_order,
)
from flowgeom.continuity.factorize import Factors, rank_for_ratio, share_input, share_output, stored_per_rank
from flowgeom.continuity.lm_eval import EvalConfig, perplexity, windows
from flowgeom.continuity.metrics import (
    abs_cos,
    gram_similarity,
    gram_similarity_in,
    gram_similarity_out,
    index_matched_alignment,
    pair_metrics,
    subspace_alignment,
    u1_cos,
    v1_cos,
)
from flowgeom.continuity.naming import ROLES, SCHEMES, resolve_roles
from flowgeom.continuity.share import ShareConfig, share_model
from flowgeom.continuity.spectra import SingularPairs, full_singular_pairs, top_singular_pairs
from flowgeom.io import BUILTINS, TensorSource, open_source

# heavier to use: the tokenizer cache, the checkpoint writer (imported on first access)
_LAZY = {"save_llama_folder": "flowgeom.continuity.checkpoint_out", "load_tokenizer": "flowgeom.data.tokens",
         "cached_ids": "flowgeom.data.tokens"}

__all__ = [
    "AnalyzeConfig", "analyze", "verdict", "METRICS", "analytic_baselines", "expected_abs_cos",
    "monte_carlo_baselines", "abs_cos", "gram_similarity", "gram_similarity_in", "gram_similarity_out",
    "index_matched_alignment", "pair_metrics", "subspace_alignment", "u1_cos", "v1_cos", "ROLES", "SCHEMES",
    "resolve_roles", "BUILTINS", "TensorSource", "open_source", "SingularPairs", "full_singular_pairs",
    "top_singular_pairs",
    # compression (flowgeom.continuity.compress, .factorize, .share) and perplexity (flowgeom.continuity.lm_eval)
    "SEED_SPACE", "block_params", "continuity_scores", "drop_layers", "drop_order", "layer_groups", "opposite",
    "random_drop_order", "Factors", "rank_for_ratio", "share_input", "share_output", "stored_per_rank",
    "ShareConfig", "share_model", "EvalConfig", "perplexity", "windows",
    *_LAZY,
]


def __getattr__(name: str):
    """The tokenizer/checkpoint helpers of :data:`_LAZY`, imported on first use."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
