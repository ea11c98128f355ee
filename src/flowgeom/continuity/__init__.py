"""Geometric continuity of checkpoints (seed 001): cross-layer singular-vector alignment.

Public API::

    from flowgeom.continuity import analyze, AnalyzeConfig
    report = analyze("builtin:smollm2", AnalyzeConfig(k=8))
    report["roles"]["q"]["v1"], report["roles"]["q"]["verdict"]

Pure metric functions (two matrices or two stacks in, tensors out) for reuse:
``top_singular_pairs``, ``v1_cos``, ``u1_cos``, ``subspace_alignment``,
``index_matched_alignment``, ``gram_similarity_in/out``, ``pair_metrics``,
``sketch_similarity`` (the sigma^2-Gram similarity by Hutch++, with its 95% interval),
and the random baselines ``analytic_baselines``, ``monte_carlo_baselines``,
``expected_abs_cos``. See ``docs/continuity.md``.

Compression (calibrated low-rank factors, block dropping, healing, perplexity) lives in its own
package, :mod:`flowgeom.compress` (``docs/compression.md``).

Reading checkpoints lives below this package, in :mod:`flowgeom.io` (``open_source``, ``TensorSource`` and
``BUILTINS`` are re-exported here because :func:`analyze` takes what they describe); the Llama forward and its
loaders (``load_llama``, ``llama_state_dict``, ``llama_from_state``) live in :mod:`flowgeom.nn.llama`.
"""

from flowgeom.continuity.analyze import AnalyzeConfig, analyze, verdict
from flowgeom.continuity.baselines import METRICS, analytic_baselines, expected_abs_cos, monte_carlo_baselines
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
from flowgeom.continuity.sketch import sketch_similarity
from flowgeom.continuity.spectra import SingularPairs, full_singular_pairs, top_singular_pairs
from flowgeom.io import BUILTINS, TensorSource, open_source

__all__ = [
    "AnalyzeConfig", "analyze", "verdict", "METRICS", "analytic_baselines", "expected_abs_cos",
    "monte_carlo_baselines", "abs_cos", "gram_similarity", "gram_similarity_in", "gram_similarity_out",
    "index_matched_alignment", "pair_metrics", "subspace_alignment", "u1_cos", "v1_cos", "ROLES", "SCHEMES",
    "resolve_roles", "BUILTINS", "TensorSource", "open_source", "SingularPairs", "full_singular_pairs",
    "top_singular_pairs", "sketch_similarity",
]

