"""Layer spectra: stable rank, spectral entropy and the power-law exponent alpha of one matrix's ESD.

Input: the eigenvalues ``lambda_i = sigma_i^2`` of ``W^T W`` (equivalently of
``W W^T`` without its zeros) of one ``(m, n)`` matrix ``W``, ``d = min(m, n)``
of them, **unnormalised** (no ``1/N`` factor: weightwatcher 0.7.7's default,
``normalize=False``; its ``glorot_fix`` is off too). Pure tensor functions.

* **Stable rank** ``||W||_F^2 / ||W||_2^2 = sum_i lambda_i / max_i lambda_i``
  (weightwatcher's ``stable_rank``), in [1, d].
* **Spectral entropy** ``H = -sum_i p_i log p_i / log r``, ``p_i = lambda_i /
  sum_j lambda_j`` (the normalised sigma^2 distribution), divided by the log
  of the numerical rank ``r`` (eigenvalues above ``lambda_1 d_max eps``,
  ``d_max = max(m, n)``, ``eps`` the precision the eigenvalues were computed
  in; see :func:`numerical_rank`). Normalised this way, as weightwatcher's ``entropy`` (``matrix_entropy``)
  is, ``H`` is 1 for a flat spectrum of rank ``r`` and 0 for rank one.
  weightwatcher adds ``1e-10`` to every ``p_i`` and to ``r``; we do not, which
  changes ``H`` by at most ``d 1e-10 |log 1e-10| / log r`` (4e-7 at d = 576).
* **alpha**: the exponent of a power law ``rho(lambda) ~ lambda^-alpha``
  fitted to the tail ``lambda >= x_min`` of the ESD, exactly as
  weightwatcher 0.7.7 does by default (``fit='PL'``, ``pl_package='ww'``,
  i.e. its ``WW_powerlaw.WWFit``; ``fix_fingers=False``, ``xmax=None``):

  1. keep the eigenvalues ``> 1e-5`` (its ``EVALS_THRESH``, absolute), sort
     them ascending: ``x_0 <= ... <= x_{N-1}``;
  2. every ``x_i`` with ``i < N - 1`` is a candidate ``x_min``; its tail has
     ``n = N - i`` points and the continuous MLE (Clauset, Shalizi & Newman
     2009, eq. 3.1)
     ``alpha_i = 1 + n / sum_{j >= i} log(x_j / x_i)``;
  3. its Kolmogorov-Smirnov distance between the fitted CDF
     ``1 - (x / x_i)^(1 - alpha_i)`` and the empirical one ``(j - i) / n``:
     ``D_i = max_{j >= i} |1 - (x_j / x_i)^(1 - alpha_i) - (j - i) / n|``;
  4. ``x_min = x_{i*}``, ``i* = argmin_i D_i`` (the first minimum);
     reported with ``alpha``, ``D``, ``sigma = (alpha - 1) / sqrt(n)`` and
     the tail size ``n``.

  With ``N < 20`` weightwatcher switches to a small-sample variant (a
  bias-corrected ``alpha = 1 + (n - 1) / sum log(x_j / x_i)``, tails of at
  least 8 points, ``x_min`` minimising ``D_i - 0.868 / sqrt(n)``), mirrored
  by :func:`fit_power_law` too. Fewer than two eigenvalues above ``1e-5``:
  no fit (``None``; weightwatcher reports ``alpha = -1``).

The exhaustive search costs ``O(N^2)`` exponentials (``N^2 / 2`` pairs
``j >= i``). :func:`fit_power_law` prunes it exactly (``prune=True``, the
default): each ``D_i`` is a maximum over ``j``, so the same maximum over a
strided subset ``j in {i, i + s, i + 2s, ...} ∪ {N - 1}`` is a lower bound
``LB_i <= D_i`` (its terms are the very terms of ``D_i``, computed by the same
expression). Candidates are then evaluated in full in order of increasing
``LB_i``, and the search stops once every remaining ``LB_i`` exceeds the best
``D`` found plus a margin (``1e-12``, far above the one-ulp differences of a
vectorised ``exp``). A candidate left out has ``D_i >= LB_i > min D + 1e-12``,
so it can be neither the minimum nor tied with it: the argmin (the first
minimum), hence ``x_min``, ``alpha``, ``D``, is that of the exhaustive scan.
On trained-weight spectra (N ~ 576) the lower bound with ``s ~ sqrt(N) / 2``
rules out most candidates, and the fit runs several times faster.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

F64 = torch.float64
EVALS_THRESH = 1e-5  # weightwatcher's EVALS_THRESH: eigenvalues at or below it are left out of the fit
SMALL_N = 20  # weightwatcher's SMALL_N_CUTOFF: below it, the small-sample fit
SMALL_N_MIN_TAIL = 8  # k_min of weightwatcher's small-sample fit
_BLOCK_ELEMENTS = 1 << 21  # rows x columns of one block of the KS search (16 MiB in float64)
KS_MARGIN = 1e-12  # pruning margin: far above the one-ulp noise of exp, far below any D difference that matters


@dataclass(frozen=True)
class PowerLawFit:
    """Power-law fit of an ESD tail: ``alpha``, ``xmin``, KS distance ``D``, ``sigma``, tail size ``n_tail``."""

    alpha: float
    xmin: float
    D: float
    sigma: float
    n_tail: int  # eigenvalues >= xmin (weightwatcher's num_pl_spikes)
    n_fit: int  # eigenvalues above EVALS_THRESH the fit saw

    def as_dict(self) -> dict:
        return asdict(self)


def stable_rank(evals: torch.Tensor) -> torch.Tensor:
    """``sum lambda / max lambda`` over the last dim of ``evals`` (... d); 0 for an all-zero spectrum."""
    top = evals.amax(-1)
    return torch.where(top > 0, evals.sum(-1) / top.clamp_min(torch.finfo(evals.dtype).tiny), torch.zeros_like(top))


def numerical_rank(evals: torch.Tensor, d_max: int, eps: float) -> torch.Tensor:
    """Eigenvalues above the Gram's noise floor ``lambda_1 d_max eps``, per row of (... d).

    Eigenvalues of a Gram computed to precision ``eps`` carry an absolute
    error ~ ``d eps lambda_1``, so a zero singular value comes out as a
    ``lambda`` of that size: anything at or below ``lambda_1 d_max eps`` is
    counted as zero. weightwatcher thresholds the singular values of a float64
    SVD instead (``sigma_i > sigma_1 d_max eps``); the two ranks differ only when
    some ``sigma_i / sigma_1`` lies in ``(d_max eps, sqrt(d_max eps))``
    (1e-13 to 4e-7 in float64; 7e-5 to 8e-3 in float32).
    """
    top = evals.amax(-1, keepdim=True)
    return (evals > top * d_max * eps).sum(-1)


def spectral_entropy(evals: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """``-sum p log p / log rank``, ``p = lambda / sum lambda`` (module docstring); 0 where rank <= 1."""
    lam = evals.to(F64).clamp_min(0)
    p = lam / lam.sum(-1, keepdim=True).clamp_min(torch.finfo(F64).tiny)
    h = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
    r = rank.to(F64)
    return torch.where(r > 1, h / r.clamp_min(2).log(), torch.zeros_like(h))


def _ks_terms_max(logx: np.ndarray, beta: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``max_{j in cols, j >= i} |1 - exp(beta_i (log x_j - log x_i)) - (j - i) / (N - i)|`` per ``i`` in ``rows``.

    ``rows`` (B,) and ``cols`` (J,) index ``logx`` (N,). Over a subset of the
    columns ``j >= i`` this is a lower bound of ``D_i``; over all of them it is
    ``D_i``; 0 where no column reaches ``i``. ``(x_j / x_i)^(1 - alpha) =
    exp((1 - alpha)(log x_j - log x_i))``: exp is ~5x cheaper than pow and
    differs from weightwatcher's pow by ~1e-15 relative; a flat tail (alpha =
    inf, all x_j = x_i, beta set to 0) gives exp(0) = 1 = 1^(-inf).
    """
    N = logx.shape[0]
    fi = rows.astype(np.float64)[:, None]  # (B, 1)
    with np.errstate(over="ignore"):  # j < i may overflow to inf: masked below
        power = np.exp((logx[cols][None, :] - logx[rows][:, None]) * beta[rows][:, None])  # (B, J)
    emp = (cols.astype(np.float64)[None, :] - fi) / (N - fi)  # (B, J): (j - i) / n, negative where j < i
    dev = np.abs(1 - (power + emp))
    dev[emp < 0] = 0
    return dev.max(1)


def _ks_distances(logx: np.ndarray, beta: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``D_i`` for every candidate ``i`` in ``starts`` (ascending): the exhaustive scan, in row blocks."""
    N = logx.shape[0]
    out = np.ones(len(starts))
    rows = max(1, min(64, _BLOCK_ELEMENTS // max(N, 1)))  # small row blocks: ~N^2/2 work, not N^2
    for b in range(0, len(starts), rows):
        i = starts[b:b + rows]
        out[b:b + rows] = _ks_terms_max(logx, beta, i, np.arange(int(i.min()), N))
    return out


def _ks_argmin_pruned(logx: np.ndarray, beta: np.ndarray, valid: np.ndarray, *, chunk: int = 32,
                      stride: int | None = None) -> tuple[int, np.ndarray]:
    """First argmin of ``D_i`` over ``i < N - 1`` (``D_i = 1`` where not ``valid``), pruned exactly.

    Returns ``(best, D)``, ``D`` (N-1,) exact where evaluated and ``inf``
    where the strided lower bound ruled the candidate out (module docstring).
    """
    N = logx.shape[0]
    D = np.where(valid, np.inf, 1.0)
    cand = np.flatnonzero(valid)
    if len(cand) == 0:
        return 0, D
    stride = max(2, math.isqrt(N) // 2) if stride is None else stride
    grid = np.union1d(np.arange(0, N, stride), [N - 1])  # (J,) ascending
    lb = np.concatenate([_ks_terms_max(logx, beta, cand[b:b + 256], grid) for b in range(0, len(cand), 256)])
    order = np.argsort(lb, kind="stable")
    lb, cand = lb[order], cand[order]
    best = 1.0 if len(cand) < N - 1 else math.inf  # an invalid candidate has D = 1
    pos = 0
    while pos < len(cand) and lb[pos] <= best + KS_MARGIN:
        rows = cand[pos:pos + chunk]
        d = _ks_terms_max(logx, beta, rows, np.arange(int(rows.min()), N))
        D[rows] = d
        best = min(best, float(d.min()))
        pos += chunk
    return int(np.argmin(D)), D


def fit_power_law(evals: torch.Tensor, *, prune: bool = True) -> PowerLawFit | None:
    """weightwatcher 0.7.7's default power-law fit of one ESD ``evals`` (d,) (module docstring); None if < 2 points.

    ``prune=False`` runs the exhaustive ``O(N^2)`` scan over every ``x_min``
    candidate; the default prunes it exactly (same argmin, module docstring).
    Computed in float64 numpy: the per-call overhead of small tensor ops
    would be most of the cost.
    """
    lam = evals.detach().to(device="cpu", dtype=F64).reshape(-1).numpy()
    return _fit(lam, prune)


def _fit(lam: np.ndarray, prune: bool) -> PowerLawFit | None:
    x = np.sort(lam[lam > EVALS_THRESH])  # (N,) ascending
    N = x.shape[0]
    if N < 2:
        return None
    logx = np.log(x)
    tail_log = np.cumsum(logx[::-1])[::-1]  # sum_{j >= i} log x_j, (N,)
    n = (N - np.arange(N - 1)).astype(np.float64)
    s = tail_log[:-1] - n * logx[:-1]  # sum_{j >= i} log(x_j / x_i) >= 0, (N-1,)
    with np.errstate(divide="ignore", invalid="ignore"):
        if N >= SMALL_N:
            alpha = 1 + n / s  # inf for a flat tail, like weightwatcher's n / 0.0
            beta = np.where(np.isfinite(alpha), 1 - alpha, 0.0)
            valid = alpha > 1
            if prune and np.isfinite(logx).all():
                best, D = _ks_argmin_pruned(logx, beta, valid)
            else:
                D = np.where(valid, _ks_distances(logx, beta, np.arange(N - 1)), 1.0)
                best = int(np.argmin(D))  # first minimum, as weightwatcher's np.argmin
        else:
            alpha = np.zeros(N - 1)
            D = np.ones(N - 1)
            J = np.full(N - 1, np.inf)
            ok = (n >= SMALL_N_MIN_TAIL) & (s > 1e-12)
            alpha[ok] = 1 + (n[ok] - 1) / s[ok]
            valid = np.flatnonzero(ok & (alpha > 1))
            if len(valid):
                beta = np.where(np.isfinite(alpha), 1 - alpha, 0.0)
                D[valid] = _ks_distances(logx, beta, valid)
                J[valid] = D[valid] - 0.868 / np.sqrt(n[valid])
            if np.isfinite(J).any():
                best = int(np.argmin(J))
            else:  # weightwatcher's fallback: the whole sample as the tail
                best = 0
                if s[0] <= 1e-12:
                    return PowerLawFit(1.0, float(x[0]), 1.0, 0.0, int((lam >= x[0]).sum()), N)
                alpha[0] = 1 + (n[0] - 1) / s[0]
                beta = np.where(np.isfinite(alpha), 1 - alpha, 0.0)
                D[0] = _ks_distances(logx, beta, np.array([0]))[0]
    sigma = (alpha[best] - 1) / math.sqrt(N - best)
    xmin = float(x[best])
    return PowerLawFit(float(alpha[best]), xmin, float(D[best]), float(sigma), int((lam >= xmin).sum()), N)


def layer_spectrum(evals: torch.Tensor, shape: tuple[int, int], eps: float) -> dict:
    """Stable rank, entropy and alpha of one matrix of ``shape`` from its ESD ``evals`` (d,), computed to ``eps``.

    Returns ``{"stable_rank", "entropy", "rank", "alpha", "alpha_xmin", "alpha_D", "alpha_sigma",
    "alpha_n_tail", "alpha_n_fit"}``; the ``alpha*`` entries are None (with ``"alpha_note"``)
    when fewer than two eigenvalues exceed ``EVALS_THRESH``.
    """
    lam = evals.detach().to(device="cpu", dtype=F64).reshape(-1)
    rank = numerical_rank(lam, max(shape), eps)
    out = {"stable_rank": float(stable_rank(lam)), "entropy": float(spectral_entropy(lam, rank)), "rank": int(rank)}
    fit = fit_power_law(lam)
    if fit is None:
        out.update(alpha=None, alpha_xmin=None, alpha_D=None, alpha_sigma=None, alpha_n_tail=None,
                   alpha_n_fit=int((lam > EVALS_THRESH).sum()),
                   alpha_note=f"fewer than 2 eigenvalues above {EVALS_THRESH:g}: no power-law fit")
    else:
        out.update(alpha=fit.alpha, alpha_xmin=fit.xmin, alpha_D=fit.D, alpha_sigma=fit.sigma,
                   alpha_n_tail=fit.n_tail, alpha_n_fit=fit.n_fit)
    return out
