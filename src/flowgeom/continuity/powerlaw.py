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

The search costs ``O(N^2)`` exponentials (``N^2 / 2`` pairs ``j >= i``),
done in row blocks of bounded memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

F64 = torch.float64
EVALS_THRESH = 1e-5  # weightwatcher's EVALS_THRESH: eigenvalues at or below it are left out of the fit
SMALL_N = 20  # weightwatcher's SMALL_N_CUTOFF: below it, the small-sample fit
SMALL_N_MIN_TAIL = 8  # k_min of weightwatcher's small-sample fit
_BLOCK_ELEMENTS = 1 << 21  # rows x columns of one block of the KS search (16 MiB in float64)


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


def _ks_distances(x: torch.Tensor, logx: torch.Tensor, alpha: torch.Tensor, starts) -> torch.Tensor:
    """``D_i`` for the candidates ``i`` in ``starts`` (x ascending, float64), in row blocks of bounded memory."""
    N = x.shape[0]
    idx = torch.as_tensor(list(starts), dtype=torch.long)
    out = torch.ones(len(idx), dtype=F64)
    pos = torch.arange(N, dtype=F64)  # (N,) j as a float
    # (x_j / x_i)^(1 - alpha) = exp((1 - alpha)(log x_j - log x_i)): exp is ~5x cheaper than pow and differs from
    # weightwatcher's pow by ~1e-15 relative. A flat tail (alpha = inf, all x_j = x_i) gives exp(0) = 1 = 1^(-inf).
    beta = torch.where(torch.isfinite(alpha), 1 - alpha, torch.zeros_like(alpha))
    rows = max(1, min(64, _BLOCK_ELEMENTS // max(N, 1)))  # small row blocks: ~N^2/2 work, not N^2
    for b in range(0, len(idx), rows):
        i = idx[b:b + rows]  # (B,)
        i0 = int(i.min())
        fi = pos[i].unsqueeze(1)  # (B, 1)
        power = (logx[i0:].unsqueeze(0) - logx[i].unsqueeze(1)).mul_(beta[i].unsqueeze(1)).exp_()  # (B, J)
        emp = (pos[i0:].unsqueeze(0) - fi).div_(N - fi)  # (B, J): (j - i) / n, negative where j < i
        dev = power.add_(emp).neg_().add_(1).abs_()  # |1 - power - emp|
        out[b:b + rows] = dev.masked_fill_(emp < 0, 0).amax(1)
    return out


def fit_power_law(evals: torch.Tensor) -> PowerLawFit | None:
    """weightwatcher 0.7.7's default power-law fit of one ESD ``evals`` (d,) (module docstring); None if < 2 points."""
    lam = evals.detach().to(device="cpu", dtype=F64).reshape(-1)
    x = torch.sort(lam[lam > EVALS_THRESH]).values  # (N,) ascending
    N = x.shape[0]
    if N < 2:
        return None
    logx = x.log()
    tail_log = torch.flip(torch.cumsum(torch.flip(logx, [0]), 0), [0])  # sum_{j >= i} log x_j, (N,)
    i = torch.arange(N - 1)
    n = (N - i).to(F64)
    s = tail_log[:-1] - n * logx[:-1]  # sum_{j >= i} log(x_j / x_i) >= 0, (N-1,)
    with torch.no_grad():
        if N >= SMALL_N:
            alpha = 1 + n / s  # inf for a flat tail, like numpy's n / 0.0
            D = _ks_distances(x, logx, alpha, range(N - 1))
            D = torch.where(alpha > 1, D, torch.ones_like(D))
            best = int(torch.argmin(D))  # first minimum, as np.argmin
        else:
            alpha = torch.zeros(N - 1, dtype=F64)
            D = torch.ones(N - 1, dtype=F64)
            J = torch.full((N - 1,), math.inf, dtype=F64)
            ok = [k for k in range(N - 1) if N - k >= SMALL_N_MIN_TAIL and float(s[k]) > 1e-12]
            if ok:
                okt = torch.tensor(ok)
                alpha[okt] = 1 + (n[okt] - 1) / s[okt]
                valid = [k for k in ok if float(alpha[k]) > 1]
                if valid:
                    D[valid] = _ks_distances(x, logx, alpha, valid)
                    J[valid] = D[valid] - 0.868 / n[valid].sqrt()
            if bool(torch.isfinite(J).any()):
                best = int(torch.argmin(J))
            else:  # weightwatcher's fallback: the whole sample as the tail
                best = 0
                if float(s[0]) <= 1e-12:
                    return PowerLawFit(1.0, float(x[0]), 1.0, 0.0, int((lam >= x[0]).sum()), N)
                alpha[0] = 1 + (n[0] - 1) / s[0]
                D[0] = _ks_distances(x, logx, alpha, [0])[0]
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
