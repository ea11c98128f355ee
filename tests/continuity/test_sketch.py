"""The sketched sigma^2-weighted Gram similarity (issue 41): the estimator against the exact value, and the analyzer.

The exact value is formed from the definition in float64; the sketch runs in float64 too, so what is checked is
the estimator, not rounding. Coverage over 100 probe seeds: test_sketch_coverage.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from synthetic_checkpoints import llama_state
from test_sketch_coverage import exact_similarity, planted_pair

from flowgeom.continuity import AnalyzeConfig, analyze
from flowgeom.continuity.sketch import (LayerSketch, SpaceSketcher, choose, gram_apply, hutchpp_pair, rademacher,
                                        sketch_similarity)

F64 = torch.float64


def test_the_numerators_are_the_squared_cross_products():
    """<A^T A, B^T B>_F = ||A B^T||_F^2 (input space: the m x m' product over the shared n) and
    <A A^T, B B^T>_F = ||A^T B||_F^2 (output space: n x n' over the shared m); the norms agree on both sides."""
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(7, 5, generator=g, dtype=F64), torch.randn(7, 5, generator=g, dtype=F64)
    assert float(((A.mT @ A) * (B.mT @ B)).sum()) == pytest.approx(float((A @ B.mT).pow(2).sum()), rel=1e-12)
    assert float(((A @ A.mT) * (B @ B.mT)).sum()) == pytest.approx(float((A.mT @ B).pow(2).sum()), rel=1e-12)
    assert float((A.mT @ A).norm()) == pytest.approx(float((A @ A.mT).norm()), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16])
@pytest.mark.parametrize("space", ["in", "out"])
def test_gram_apply_is_the_gram_product(space, dtype, monkeypatch):
    g = torch.Generator().manual_seed(1)
    A = torch.randn(40, 24, generator=g).to(dtype)
    monkeypatch.setattr("flowgeom.continuity.sketch.CHUNK_BYTES", 4 * 24 * 7)  # bf16: row blocks of 7
    d = 24 if space == "in" else 40
    M = torch.randn(d, 3, generator=g, dtype=F64)
    X = A.to(F64).mT @ A.to(F64) if space == "in" else A.to(F64) @ A.to(F64).mT
    tol = 1e-12 if dtype == F64 else 1e-5
    assert torch.allclose(gram_apply(A, M, space), X @ M, rtol=tol, atol=tol * float(X.norm()))


def test_probe_blocks_grow_without_redrawing():
    assert torch.equal(rademacher(50, 8, seed=3), rademacher(50, 20, seed=3)[:, :8])
    assert set(rademacher(50, 8, seed=3).unique().tolist()) == {-1.0, 1.0}


@pytest.mark.parametrize("space,shape", [("in", (30, 12)), ("out", (12, 30))])
def test_exact_when_the_probes_span_the_space(space, shape):
    """12 probes in a 12-dimensional space: Q = orth([X_a S, X_b S]) (2 x 6 columns) spans it and leaves no rest
    to sample: the exact value, with a zero-width interval."""
    A, B = planted_pair(*shape, seed=2, rank=4)
    est = sketch_similarity(A, B, space, probes=12, seed=0)
    assert est.value == pytest.approx(exact_similarity(A, B, space), rel=1e-10)
    assert est.half == pytest.approx(0, abs=1e-10)


def test_one_layer_against_itself_is_exactly_one():
    """Numerator and norms share every probe: their errors cancel, and R(A, A) = 1 whatever the probes."""
    A, _ = planted_pair(200, 300, seed=3)
    for space in ("in", "out"):
        est = sketch_similarity(A, A, space, probes=8, seed=5)
        assert est.value == pytest.approx(1.0, abs=1e-12)


def test_planted_pairs_within_their_intervals_and_the_target():
    """Planted decaying spectra at 200x320 and 320x200 (float64), default rule (2%), 20 seeds per case: the
    intervals hold the exact value (>= 17 of 20 at 95%), each meets the target, the median error is within
    it, and the mean is within 3 standard errors of exact (no bias)."""
    for shape in ((200, 320), (320, 200)):
        A, B = planted_pair(*shape, seed=4)
        for space in ("in", "out"):
            exact = exact_similarity(A, B, space)
            ests = [sketch_similarity(A, B, space, seed=seed) for seed in range(20)]
            assert sum(e.bounds[0] <= exact <= e.bounds[1] for e in ests) >= 17
            assert all(e.half <= 0.02 * e.value for e in ests)
            values = torch.tensor([e.value for e in ests], dtype=F64)
            assert float((values - exact).abs().median()) <= 0.02 * exact
            assert abs(float(values.mean()) - exact) <= 3 * float(values.std()) / 20**0.5 + 1e-12


def test_hutchpp_pair_is_exact_when_Q_holds_everything():
    """The exact part alone: Q = I (every direction deflated) gives the definition, whatever G."""
    g = torch.Generator().manual_seed(6)
    A, B = torch.randn(9, 6, generator=g, dtype=F64), torch.randn(9, 6, generator=g, dtype=F64)
    Q, G = torch.eye(6, dtype=F64), rademacher(6, 4, seed=1)
    sk = [LayerSketch(torch.zeros(6, 0, dtype=F64), gram_apply(X, G, "in")) for X in (A, B)]
    R, (lo, hi) = hutchpp_pair(gram_apply(A, Q, "in"), gram_apply(B, Q, "in"), Q, *sk, G)
    assert R == pytest.approx(exact_similarity(A, B, "in"), rel=1e-12) and hi - lo == pytest.approx(0, abs=1e-12)


def test_fixed_probes_are_kept_and_one_probe_has_no_interval():
    A, B = planted_pair(100, 80, seed=7)
    assert sketch_similarity(A, B, "in", probes=10, seed=0).probes == 10
    one = sketch_similarity(A, B, "in", probes=1, seed=0)
    assert one.bounds is None and one.half is None and one.interval is None


@pytest.mark.parametrize("kw,msg", [(dict(probes=0), "probes must be a whole number >= 1"),
                                    (dict(probes=81), "probes=81 is beyond the side 80"),
                                    (dict(rel_error=0.0), "rel_error must be between 0 and 1"),
                                    (dict(rel_error=1.0), "rel_error must be between 0 and 1")])
def test_bad_arguments_are_refused_in_python(kw, msg):
    from flowgeom.errors import FlowgeomError

    A, B = planted_pair(100, 80, seed=7)
    with pytest.raises(FlowgeomError, match=msg):
        sketch_similarity(A, B, "in", **kw)


def test_the_sketcher_extends_a_window_sketch_instead_of_redrawing():
    A, B = planted_pair(120, 200, seed=8)
    sk = SpaceSketcher("q", "in", 200, seed=0, probes=None, rel_error=1e-7, cap=120)  # a target it cannot meet
    a, b = sk.sketch(A), sk.sketch(B)
    est, a2, b2 = sk.pair(A, a, B, b)
    assert sk.N == 120 and est.probes == 120 and sk.missed == 1  # 32 -> 64 -> 120, the cap
    assert torch.equal(a2.XS[:, :16], a.XS) and a2.XS.shape[1] == 60 and b2.XG.shape[1] == 60


def test_auto_sketches_the_large_roles_only():
    """Llama-3.1-8B shapes: q, o, gate, up, down sketched (an exact pair is 2-7 s of one core), k and v exact;
    the issue's 3072x3072 case and SmolLM2's 576-wide roles exact; a GPU keeps them exact."""
    shapes = {"q": (4096, 4096), "k": (1024, 4096), "v": (1024, 4096), "o": (4096, 4096), "gate": (14336, 4096),
              "up": (14336, 4096), "down": (4096, 14336)}
    methods = {role: choose(shape, "auto")[0] for role, shape in shapes.items()}
    assert methods == {"q": "sketch", "k": "exact", "v": "exact", "o": "sketch", "gate": "sketch", "up": "sketch",
                       "down": "sketch"}
    assert choose((3072, 3072), "auto")[0] == choose((1536, 576), "auto")[0] == "exact"
    assert choose((4096, 4096), "auto", device="cuda")[0] == "exact"
    assert "> 1.5 s" in choose((14336, 4096), "auto")[1]
    assert choose((10, 10), "sketch") == ("sketch", "--gram sketch")


@pytest.fixture(scope="module")
def reports():
    state = llama_state(layers=5, d=96, kv=48, hidden=160, seed=1)
    return (analyze(state, AnalyzeConfig(k=2, gram_method="exact")),
            analyze(state, AnalyzeConfig(k=2, gram_method="sketch", probes=48)))


def test_the_analyzer_sketch_agrees_with_exact_within_its_intervals(reports):
    exact, sketch = reports
    held = total = 0
    for role, r in sketch["roles"].items():
        assert r["gram"]["method"] == "sketch" and exact["roles"][role]["gram"]["method"] == "exact"
        for key in ("gram_in", "gram_out"):
            m, ref = r["metrics"][key], exact["roles"][role]["metrics"][key]
            assert m["ci"][0] <= ref["mean"] <= m["ci"][1], (role, key)  # the role mean's interval
            assert m["ratio_ci"] == pytest.approx([x / m["baseline"] for x in m["ci"]])
            assert abs(m["mean"] - ref["mean"]) <= 0.03 * ref["mean"]
            for p, q in zip(r["pairs"], exact["roles"][role]["pairs"]):
                held += p[f"{key}_ci"][0] <= q[key] <= p[f"{key}_ci"][1]
                total += 1
                assert p[f"{key}_probes"] == 48
        for key in ("v1", "u1", "subspace_in", "subspace_out"):  # never sketched: identical
            assert r["metrics"][key]["mean"] == exact["roles"][role]["metrics"][key]["mean"]
        assert r["verdict"] == exact["roles"][role]["verdict"]
    assert held >= 0.9 * total, (held, total)
    json.dumps(sketch)  # the report stays JSON (no inf, no tensors)


def test_auto_in_the_report_names_the_method_and_why(reports):
    exact, _ = reports
    report = analyze(llama_state(layers=3, d=16, seed=2), AnalyzeConfig(k=2))
    assert all(r["gram"]["method"] == "exact" and r["gram"]["why"].startswith("auto:")
               for r in report["roles"].values())
    assert "ci" not in report["roles"]["q"]["metrics"]["gram_in"]


def test_no_gram_reports_no_gram_method():
    report = analyze(llama_state(layers=3, d=16, seed=2), AnalyzeConfig(k=2, gram=False))
    assert all("gram" not in r and "gram_in" not in r["metrics"] for r in report["roles"].values())
