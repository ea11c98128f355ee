"""The sketched similarity's 95% interval holds the exact value in >= 93 of 100 probe seeds (issue 41).

Two kinds of pairs at 256x512 (float64, so only the sketch errs): planted (a decaying spectrum of 32 spikes
over a Gaussian bulk, input directions drifting between the layers; benchmarks/continuity_scale.py's recipe)
and flat (two independent Gaussian matrices). Both spaces: the planted input space is the shared, aligned
one (similarity 0.89), its output space the unrelated one (0.07, the hard case for a relative error).
Measured with these seeds at 32 probes (the rule's start): planted in 94, out 98; flat in 95, out 98 of 100.
The rule (--rel-error) is held to its target in median.
"""

from __future__ import annotations

import pytest
import torch

from flowgeom.continuity.sketch import sketch_similarity

F64 = torch.float64


def planted_pair(m: int, n: int, seed: int, rank: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = 8.0 * torch.arange(1, rank + 1, dtype=F64) ** -0.5  # (rank,) decaying spikes over a bulk of edge ~1
    V = torch.linalg.qr(torch.randn(n, rank, generator=g, dtype=F64)).Q
    out = []
    for _ in range(2):
        V = torch.linalg.qr(V + 0.3 * torch.randn(n, rank, generator=g, dtype=F64) / n**0.5).Q  # drifting inputs
        U = torch.linalg.qr(torch.randn(m, rank, generator=g, dtype=F64)).Q
        out.append(torch.randn(m, n, generator=g, dtype=F64) / (m**0.5 + n**0.5) + (U * s) @ V.mT)
    return out[0], out[1]


def flat_pair(m: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, n, generator=g, dtype=F64), torch.randn(m, n, generator=g, dtype=F64)


def exact_similarity(A: torch.Tensor, B: torch.Tensor, space: str) -> float:
    """Formed in float64 from the definition: <X_A, X_B>_F / (||X_A||_F ||X_B||_F), X = A^T A (in) or A A^T (out)."""
    XA, XB = (A.mT @ A, B.mT @ B) if space == "in" else (A @ A.mT, B @ B.mT)
    return float((XA * XB).sum() / (XA.norm() * XB.norm()))


PAIRS = {"planted": planted_pair(256, 512, 0), "flat": flat_pair(256, 512, 1)}


@pytest.mark.parametrize("kind", ["planted", "flat"])
@pytest.mark.parametrize("space", ["in", "out"])
def test_the_95_interval_covers_in_at_least_93_of_100_seeds(kind, space):
    A, B = PAIRS[kind]
    exact = exact_similarity(A, B, space)
    held = sum(est.bounds[0] <= exact <= est.bounds[1]
               for est in (sketch_similarity(A, B, space, probes=32, seed=seed) for seed in range(100)))
    assert held >= 93, (kind, space, held)


@pytest.mark.parametrize("kind,space,target", [("planted", "out", 0.02), ("flat", "in", 0.05)])
def test_the_probe_rule_meets_its_target_in_median(kind, space, target):
    """The rule doubles N from 32 until the 95% half-width is within the target (here it must double:
    at N = 32 these half-widths are ~3% and ~6%); the actual error's median is then within the target."""
    A, B = PAIRS[kind]
    exact = exact_similarity(A, B, space)
    ests = [sketch_similarity(A, B, space, rel_error=target, seed=seed) for seed in range(30)]
    errors = torch.tensor([abs(e.value - exact) / exact for e in ests])
    assert float(errors.median()) <= target
    assert max(e.probes for e in ests) > 32  # the rule did choose the count
    assert all(e.half <= target * e.value for e in ests)  # every stated interval meets the target


def test_the_95_interval_covers_smollm2_pairs_in_float32_at_the_default_rule():
    """Real weights as the analyzer reads them (float32, the default 2% rule): SmolLM2-135M's q of layers 0 and
    1, both spaces, 100 seeds each. Measured 95 + 93 of 100 (benchmarks/sketch_coverage.py, all four SmolLM2
    pair-spaces: 376/400)."""
    from flowgeom.io import open_source

    src = open_source("builtin:smollm2")
    A, B = (src.load(f"blk.{layer}.attn_q.weight").float() for layer in (0, 1))
    held = 0
    for space in ("in", "out"):
        exact = exact_similarity(A.double(), B.double(), space)
        held += sum(est.bounds[0] <= exact <= est.bounds[1]
                    for est in (sketch_similarity(A, B, space, seed=seed) for seed in range(100)))
    assert held >= 186, held  # >= 93%
