"""Layer spectra (continuity analyze --spectra): stable rank, entropy, power-law alpha; dense/Krylov paths; CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from synthetic_checkpoints import llama_state

from flowgeom.cli import main
from flowgeom.continuity import AnalyzeConfig, analyze
from flowgeom.continuity.powerlaw import EVALS_THRESH, fit_power_law, layer_spectrum
from flowgeom.continuity.spectra import pairs_and_spectrum_from_gram, small_gram, unit_scale, unscale_values

F64 = torch.float64


def _reference_fit(evals: np.ndarray) -> tuple[float, float, float]:
    """The estimator written as plainly as possible (numpy loop, pow): ``(alpha, xmin, D)``; the independent check."""
    x = np.sort(evals[evals > EVALS_THRESH]).astype(np.float64)
    N = len(x)
    small = N < 20
    best, best_key = None, math.inf
    for i in range(N - 1):
        n = N - i
        s = float(np.sum(np.log(x[i:])) - n * np.log(x[i]))
        if small and (n < 8 or s <= 1e-12):
            continue
        alpha = 1 + (n - 1 if small else n) / s
        D = float(np.max(np.abs(1 - (x[i:] / x[i]) ** (1 - alpha) - np.arange(n) / n)))
        key = D - 0.868 / math.sqrt(n) if small else D
        if key < best_key:  # strict: the first minimum wins, as argmin
            best, best_key = (alpha, float(x[i]), D), key
    return best


def _planted(sigmas: torch.Tensor, m: int, n: int, seed: int) -> torch.Tensor:
    """An (m, n) float64 matrix with singular values ``sigmas`` (d,) and random singular vectors."""
    g = torch.Generator().manual_seed(seed)
    d = sigmas.numel()
    U = torch.linalg.qr(torch.randn(m, d, generator=g, dtype=F64)).Q
    V = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=F64)).Q
    return U @ torch.diag(sigmas) @ V.T


def _spectrum(W: torch.Tensor, solver: str = "dense") -> tuple[torch.Tensor, str]:
    A = W.unsqueeze(0)
    G, side = small_gram(A)
    _, values, how = pairs_and_spectrum_from_gram(A, G, side, 2, solver=solver)
    return values[0], how


@settings(max_examples=25, deadline=None)
@given(m=st.integers(2, 60), n=st.integers(2, 60), seed=st.integers(0, 2**16), log_scale=st.integers(-3, 3))
def test_stable_rank_and_entropy_match_a_float64_svd(m, n, seed, log_scale):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(m, n, generator=g, dtype=F64) * torch.linspace(0.05, 1, n, dtype=F64) * 10.0 ** log_scale
    values, how = _spectrum(W)
    assert how == "tridiagonal" and values.shape == (min(m, n),)
    s = torch.linalg.svdvals(W)  # reference: full float64 SVD
    lam = s**2
    assert torch.allclose(values.flip(0), lam, rtol=0, atol=1e-12 * float(lam[0]))
    out = layer_spectrum(values, (m, n), torch.finfo(F64).eps)
    assert out["stable_rank"] == pytest.approx(float((s**2).sum() / s[0] ** 2), rel=1e-10)
    p = lam / lam.sum()
    assert out["rank"] == min(m, n)  # random Gaussian columns: full rank
    expected = float(-(p * p.log()).sum() / math.log(min(m, n))) if min(m, n) > 1 else 0.0
    assert out["entropy"] == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_entropy_limits_and_rank_deficiency():
    flat = _planted(torch.ones(20, dtype=F64), 30, 20, seed=1)
    out = layer_spectrum(_spectrum(flat)[0], (30, 20), torch.finfo(F64).eps)
    assert out["entropy"] == pytest.approx(1.0, abs=1e-12) and out["stable_rank"] == pytest.approx(20.0, rel=1e-12)
    sig = torch.tensor([3.0, 1.0, 0.5] + [0.0] * 17, dtype=F64)  # rank 3 in a 30 x 20 matrix
    out = layer_spectrum(_spectrum(_planted(sig, 30, 20, seed=2))[0], (30, 20), torch.finfo(F64).eps)
    p = sig[:3] ** 2 / (sig[:3] ** 2).sum()
    assert out["rank"] == 3
    assert out["entropy"] == pytest.approx(float(-(p * p.log()).sum() / math.log(3)), rel=1e-9)
    one = layer_spectrum(_spectrum(_planted(sig[:1].clone().resize_(20).zero_().index_fill_(0, torch.tensor([0]), 2.0),
                                            30, 20, seed=3))[0], (30, 20), torch.finfo(F64).eps)
    assert one["rank"] == 1 and one["entropy"] == 0.0 and one["stable_rank"] == pytest.approx(1.0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), N=st.sampled_from([5, 12, 19, 20, 40, 150]), spread=st.floats(0.5, 4.0))
def test_fit_is_the_reference_estimator(seed, N, spread):
    """Both sample-size branches, against the plain numpy loop: alpha, xmin and D to 1e-9."""
    rng = np.random.default_rng(seed)
    evals = np.exp(rng.normal(0.0, spread, size=N))
    evals[0] = 1e-7  # below the 1e-5 threshold: left out of the fit
    fit = fit_power_law(torch.from_numpy(evals))
    ref = _reference_fit(evals)
    if ref is None:
        assert fit is None or int((evals > EVALS_THRESH).sum()) < 20
        return
    assert fit is not None
    assert fit.xmin == ref[1]
    assert fit.alpha == pytest.approx(ref[0], rel=1e-9) and fit.D == pytest.approx(ref[2], rel=1e-9, abs=1e-12)
    assert fit.n_fit == int((evals > EVALS_THRESH).sum()) and fit.n_tail == int((evals >= fit.xmin).sum())


@pytest.mark.parametrize("alpha,n,seed", [(2.0, 400, 0), (3.0, 400, 1), (4.5, 500, 2), (2.5, 1500, 3)])
def test_planted_power_law_is_recovered(alpha, n, seed):
    """ESD drawn from rho(l) ~ l^-alpha (Pareto, l >= 1): |alpha_hat - alpha| <= 4 (alpha - 1) / sqrt(n_tail).

    (alpha - 1) / sqrt(n_tail) is the MLE's standard error (Clauset et al. 2009, eq. 3.2) on the n_tail
    points the KS step keeps; 4 of them is far outside sampling noise.
    """
    rng = np.random.default_rng(seed)
    lam = (1.0 - rng.random(n)) ** (-1.0 / (alpha - 1.0))  # inverse CDF of the Pareto law
    W = _planted(torch.from_numpy(np.sqrt(lam)), n + 10, n, seed=seed)
    fit = layer_spectrum(_spectrum(W)[0], tuple(W.shape), torch.finfo(F64).eps)
    tol = 4 * (alpha - 1) / math.sqrt(fit["alpha_n_tail"])
    assert fit["alpha_n_tail"] >= n // 10
    assert abs(fit["alpha"] - alpha) <= tol, (fit["alpha"], alpha, tol)


def test_no_fit_below_the_threshold_and_scale_invariance():
    tiny = _planted(torch.full((30,), 1e-4, dtype=F64), 40, 30, seed=4)  # eigenvalues 1e-8 < 1e-5
    out = layer_spectrum(_spectrum(tiny)[0], (40, 30), torch.finfo(F64).eps)
    assert out["alpha"] is None and "fewer than 2 eigenvalues" in out["alpha_note"]
    assert out["stable_rank"] == pytest.approx(30.0, rel=1e-9)
    W = _planted(torch.linspace(1, 5, 30, dtype=F64), 40, 30, seed=5)
    big = W * 2.0**80  # rescaled exactly before the Gram (spectra.unit_scale), eigenvalues scaled back by 4^e
    A, e = unit_scale(big.unsqueeze(0), F64)
    G, side = small_gram(A)
    values = unscale_values(pairs_and_spectrum_from_gram(A, G, side, 2)[1], e)[0]
    ref = _spectrum(W)[0] * 2.0**160
    assert torch.allclose(values, ref, rtol=1e-12, atol=0)
    a, b = fit_power_law(values), fit_power_law(ref)
    assert a.alpha == pytest.approx(b.alpha, rel=1e-9) and a.n_tail == b.n_tail


@pytest.mark.parametrize("m,n", [(120, 80), (80, 120)])
def test_dense_and_krylov_paths_agree(m, n):
    W = _planted(torch.linspace(0.1, 3, min(m, n), dtype=F64) ** 2, m, n, seed=6)
    dense, how_d = _spectrum(W, "dense")
    krylov, how_k = _spectrum(W, "krylov")
    assert (how_d, how_k) == ("tridiagonal", "eigvalsh")
    assert torch.allclose(dense, krylov, rtol=0, atol=1e-12 * float(dense[-1]))
    a = layer_spectrum(dense, (m, n), torch.finfo(F64).eps)
    b = layer_spectrum(krylov, (m, n), torch.finfo(F64).eps)
    assert a["alpha_n_tail"] == b["alpha_n_tail"] and a["alpha"] == pytest.approx(b["alpha"], rel=1e-9)
    assert a["stable_rank"] == pytest.approx(b["stable_rank"], rel=1e-12)


def test_analyzer_spectra_both_solvers_and_off_by_default():
    sd = llama_state(layers=3, d=24, kv=12, hidden=40, seed=7)
    base = analyze(sd, AnalyzeConfig(k=2))
    assert all("layer_spectra" not in r and "alpha" not in r["spectra"][0] for r in base["roles"].values())
    reps = {s: analyze(sd, AnalyzeConfig(k=2, spectra=True, solver=s)) for s in ("dense", "krylov")}
    for role, r in reps["dense"]["roles"].items():
        other = reps["krylov"]["roles"][role]
        assert r["layer_spectra"]["eigenvalues"] == ["tridiagonal"]
        assert other["layer_spectra"]["eigenvalues"] == ["eigvalsh"]
        for s, t in zip(r["spectra"], other["spectra"]):
            m, n = r["shape"]
            W = sd[r["tensors"][r["spectra"].index(s)]].double()
            sv = torch.linalg.svdvals(W)
            assert s["stable_rank"] == pytest.approx(float((sv**2).sum() / sv[0] ** 2), rel=1e-9)
            assert s["alpha"] == pytest.approx(t["alpha"], rel=1e-8) and s["alpha_n_tail"] == t["alpha_n_tail"]
        assert r["layer_spectra"]["alpha"]["mean"] == pytest.approx(
            float(np.mean([s["alpha"] for s in r["spectra"]])), rel=1e-12)
        assert r["v1"] == pytest.approx(base["roles"][role]["v1"], rel=1e-9)  # same metrics (another LAPACK path)


def test_cli_spectra_json_and_table(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    save_file(llama_state(layers=3, d=24, kv=12, hidden=40, seed=8), path)
    assert main(["continuity", "analyze", str(path), "--spectra", "--json", "--k", "2", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["spectra"] is True
    for role, r in report["roles"].items():
        assert set(r["layer_spectra"]) == {"alpha", "stable_rank", "entropy", "alpha_missing", "eigenvalues"}
        assert len(r["spectra"]) == 3
        for s in r["spectra"]:
            assert {"alpha", "alpha_xmin", "alpha_D", "alpha_n_tail", "stable_rank", "entropy", "rank"} <= set(s)
            assert 1 <= s["stable_rank"] <= min(r["shape"]) and 0 < s["entropy"] <= 1 and s["alpha"] > 1
    assert main(["continuity", "analyze", str(path), "--spectra", "--k", "2", "--roles", "q,down"]) == 0
    out = capsys.readouterr().out
    assert "layer spectra" in out and "tridiagonal" in out and "stable rank" in out
