"""The sketch on real weights (issue 41): SmolLM2-135M's q and down, 8 layers, default probe rule (2%).

Measured on all 30 layers and 7 roles (406 values, docs/continuity.md): median relative error 0.30%, 90th
percentile 0.91%, max 1.8%; 392/406 pair intervals hold the exact value; verdicts 7/7 equal.
"""

from __future__ import annotations

import torch

from flowgeom.continuity import AnalyzeConfig, analyze


def test_smollm2_sketch_against_exact():
    common = dict(roles=("q", "down"), max_layers=8, dtype="float32", workers=1)
    exact = analyze("builtin:smollm2", AnalyzeConfig(gram_method="exact", **common))
    sketch = analyze("builtin:smollm2", AnalyzeConfig(gram_method="sketch", **common))
    errors, held = [], 0
    for role, r in sketch["roles"].items():
        assert r["verdict"] == exact["roles"][role]["verdict"]
        for key in ("gram_in", "gram_out"):
            for p, q in zip(r["pairs"], exact["roles"][role]["pairs"]):
                errors.append(abs(p[key] - q[key]) / q[key])
                held += p[f"{key}_ci"][0] <= q[key] <= p[f"{key}_ci"][1]
            ci = r["metrics"][key]["ci"]
            assert ci[0] <= exact["roles"][role]["metrics"][key]["mean"] <= ci[1]
    errors = torch.tensor(errors)
    assert float(errors.median()) <= 0.02 / 3  # a 2% half-width target: the median error is well inside it
    assert held >= 0.9 * len(errors), (held, len(errors))
