"""Activation-aware low-rank factorisations of projection matrices: pure tensor functions.

Weights are ``(m, n) = (out, in)`` as in ``nn.Linear``; ``G = sum_t x_t x_t^T``
(n, n) is the Gram of the inputs the projection sees on calibration text.
What a compression must keep is the *output* ``W x``, so every method here
minimises the whitened loss ``||(W - W') X||_F^2 = tr((W - W') G (W - W')^T)``.

**Whitening (SVD-LLM, Wang et al. 2024).** With ``S = chol(G)`` (lower,
``G = S S^T``) the loss is ``||(W - W') S||_F^2``; truncating the SVD
``W S = U Σ V^T`` to rank k and mapping back, ``W' = U_k Σ_k (V_k^T S^{-1})``,
is optimal (Eckart-Young on ``W S``) and its loss is the sum of the
discarded ``σ_i^2`` (tests/compress/test_factorize.py checks both). A Gram
that is not numerically positive definite is shifted by
``(-λ_min + 1e-6) I`` before the Cholesky factorisation, as SVD-LLM's code
does; :func:`whitener` reports the shift.

**Shared input-space basis (Basis Sharing, Wang et al. ICLR 2025).** A group
of g layers stacks its matrices vertically, ``[W_1; ...; W_g] S`` with ``S``
the Cholesky factor of the group's *summed* Gram; the top-k right singular
vectors give one basis ``B = V_k^T S^{-1}`` (k, n) shared by the group, and
layer l keeps ``C_l = W_l S V_k`` (m, k): ``W_l ~ C_l B``.

**Shared output-space basis** (seed 001's space for O and Down). ``W_l ~ U C_l``
with one orthonormal ``U`` (m, k). For fixed U the whitened loss of layer l is
minimised by ``C_l = U^T W_l``, and then ``sum_l ||(I - U U^T) W_l S_l||^2`` is
minimised by the top-k eigenvectors of ``sum_l W_l G_l W_l^T``: no Cholesky
factor is needed.

**Refit.** With a basis fixed, each layer's coefficients can be re-solved by
least squares against *its own* Gram (in the sequential variant: the Gram of
the compressed model's own activations), ``C_l = W_l G_l B^T (B G_l B^T)^{-1}``,
Basis Sharing's optional refit step.

**Balance.** ``W = C B`` is unchanged by ``C -> C D^{-1}``, ``B -> D B`` for any
positive diagonal D, so the split of scale between the factors is a free choice,
and the truncations above make a bad one: ``B = V_k^T S^{-1}`` carries the inverse
whitening (rms ~1e-3 on SmolLM2) and ``C = U_k Σ_k`` the singular values (rms ~10).
Adam moves every entry by about its learning rate, so one step changes the basis
by ~100% of its size and the coefficients by ~0.001%: training such factors
diverges at once. :func:`balance` picks ``D`` so that, per rank i, the column of
the *stacked* coefficients (all layers of the group) and the row of the basis
have equal norms, ``||C_stack[:, i]|| = ||B[i, :]||``. This is the diagonal of the
conservation law of the linear chain ``y = C B x`` (seed 000; the catalogue's
``linear`` law): gradient flow conserves ``C^T C - B B^T``, so a start whose
diagonal is zero keeps it zero and neither factor grows at the other's expense.
(The exact split ``U sqrt(Σ)`` / ``sqrt(Σ) V^T S^{-1}`` also zeroes the diagonal
in whitened coordinates, but not in the coordinates the weights live in, and it
has no shared-basis analogue; the diagonal rescale is one rule for both.)

A factorisation is a :class:`Factors` (one basis, one coefficient matrix per
layer of the group, in float64 here; callers cast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flowgeom.errors import FlowgeomError, choice_error

SPACES = ("input", "output")
JITTER = 1e-6  # SVD-LLM's shift above -λ_min when the Gram is not positive definite


@dataclass(frozen=True)
class Factors:
    """``W_l ~ coeffs[l] @ basis`` (input: basis (k, n), coeffs (m, k)) or ``basis @ coeffs[l]`` (output:
    basis (m, k), coeffs (k, n)). ``sigma`` holds the whitened singular values of the group (all of them),
    ``shift`` the jitter added to the Gram (0 when its Cholesky factor existed)."""

    space: str
    basis: torch.Tensor
    coeffs: tuple[torch.Tensor, ...]
    sigma: torch.Tensor
    shift: float = 0.0

    @property
    def rank(self) -> int:
        return self.basis.shape[0] if self.space == "input" else self.basis.shape[1]

    def dense(self) -> torch.Tensor:
        """The reconstructed matrices, (g, m, n)."""
        return torch.stack([c @ self.basis if self.space == "input" else self.basis @ c for c in self.coeffs])

    def stored(self) -> int:
        """Numbers stored: one basis plus every layer's coefficients."""
        return self.basis.numel() + sum(c.numel() for c in self.coeffs)


def summed(grams: torch.Tensor) -> torch.Tensor:
    """The float64 sum of a stack of Grams (g, n, n); a stack of one is returned as it is, not copied."""
    grams = grams.double()
    return grams[0] if len(grams) == 1 else grams.sum(0)


def symmetrised_(g: torch.Tensor, tile: int = 512) -> torch.Tensor:
    """``g`` made exactly ``(g + g^T) / 2`` in place, tile by tile: the Gram a GEMM returns is symmetric only to
    rounding, and an (n, n) float64 temporary is 254 MB at n = 5,632 (the peak of a streamed compression).
    Idempotent, so a Gram shared by several units (or a float64 caller's own) may be symmetrised again."""
    n = len(g)
    with torch.inference_mode():  # a Gram measured under inference mode is only writable inside it
        for i in range(0, n, tile):
            for j in range(i, n, tile):
                upper, lower = g[i:i + tile, j:j + tile], g[j:j + tile, i:i + tile]
                mean = (upper + lower.T) * 0.5  # a tile-sized temporary
                upper.copy_(mean)
                lower.copy_(mean.T)
    return g


def whitener(gram: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(S, shift)``: the lower Cholesky factor of ``gram + shift I`` in float64, shift 0 when ``gram`` is
    positive definite, else SVD-LLM's ``-λ_min + 1e-6``."""
    g = symmetrised_(gram.double())
    S, info = torch.linalg.cholesky_ex(g)
    if int(info) == 0:
        return S, 0.0
    shift = float(-torch.linalg.eigvalsh(g)[0]) + JITTER
    S, info = torch.linalg.cholesky_ex(g + shift * torch.eye(len(g), dtype=g.dtype, device=g.device))
    if int(info) != 0:  # only a non-finite Gram gets here
        raise FlowgeomError("a calibration Gram is not finite; the model's activations overflow on the calibration "
                            "text (check the weights for NaN/Inf)")
    return S, shift


def _check(mats: torch.Tensor, rank: int) -> None:
    if mats.ndim != 3:
        raise FlowgeomError(f"expected a stack (g, m, n) of matrices, got shape {list(mats.shape)}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= min(mats.shape[1:]):
        raise FlowgeomError(f"rank {rank!r} is outside 1..{min(mats.shape[1:])}, the rank bound of "
                            f"{mats.shape[1]}x{mats.shape[2]} matrices")


def share_input(mats: torch.Tensor, grams: torch.Tensor | None, rank: int) -> Factors:
    """Basis Sharing: one input-space basis for the group ``mats`` (g, m, n), whitened by the summed Gram of
    ``grams`` (g, n, n); ``grams`` None = data-free (plain SVD of the stack). g = 1 is SVD-LLM's per-layer
    truncation-aware whitening."""
    _check(mats, rank)
    g, m, n = mats.shape
    w = mats.double()
    if grams is None:
        S, shift = torch.eye(n, dtype=w.dtype, device=w.device), 0.0
    else:
        S, shift = whitener(summed(grams))
    A = w.reshape(g * m, n) @ S  # (gm, n)
    sig, V = _top_right(A, rank)  # (q,), (n, k)
    basis = torch.linalg.solve_triangular(S, V.T, upper=False, left=False)  # V_k^T S^{-1}: (k, n)
    coeffs = (A @ V).reshape(g, m, rank)  # U_k Σ_k
    return Factors("input", basis, tuple(coeffs), sig, shift)


def _top_right(A: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All singular values of ``A`` (descending) and its top-``rank`` right singular vectors (n, k), from the
    eigendecomposition of the smaller Gram (2-4x faster than an SVD on CPU; float64 keeps every σ_i above
    ~1e-8 σ_1 exact, and the ones below are those a truncation discards)."""
    rows, n = A.shape
    if rows >= n:
        evals, evecs = torch.linalg.eigh(A.T @ A)  # ascending
        sig = evals.flip(0).clamp_min(0).sqrt()
        return sig, evecs[:, -rank:].flip(-1)
    evals, evecs = torch.linalg.eigh(A @ A.T)
    sig = evals.flip(0).clamp_min(0).sqrt()
    U = evecs[:, -rank:].flip(-1)  # (rows, k)
    # a numerically zero σ (an exactly low-rank stack) has no direction to recover: A^T u / σ would be rounding
    # noise divided by ~0 (inf in float32). Its column is left zero, so the component contributes nothing.
    zero = sig[:rank] <= sig[0] * max(A.shape) * torch.finfo(A.dtype).eps
    V = A.T @ U / torch.where(zero, 1.0, sig[:rank])  # (n, k)
    return sig, V.masked_fill(zero, 0.0)


def share_output(mats: torch.Tensor, grams: torch.Tensor | None, rank: int) -> Factors:
    """One orthonormal output-space basis U (m, k) for the group, minimising ``sum_l ||(W_l - U U^T W_l) X_l||^2``
    (``grams`` (g, n, n) per layer; None = data-free). ``sigma`` = square roots of the eigenvalues of
    ``sum_l W_l G_l W_l^T``, descending."""
    _check(mats, rank)
    w = mats.double()
    wg = w if grams is None else w @ grams.double()  # (g, m, n)
    M = torch.einsum("gmi,gni->mn", wg, w)  # sum_l W_l G_l W_l^T, (m, m)
    evals, evecs = torch.linalg.eigh((M + M.T) / 2)
    U = evecs[:, -rank:].flip(-1)  # (m, k), largest first
    sig = evals.flip(0).clamp_min(0).sqrt()
    return Factors("output", U, tuple(U.T @ w), sig, 0.0)


def factorize(mats: torch.Tensor, grams: torch.Tensor | None, rank: int, space: str) -> Factors:
    """:func:`share_input` or :func:`share_output` by ``space``."""
    if space not in SPACES:
        raise choice_error("space", space, SPACES)
    return share_input(mats, grams, rank) if space == "input" else share_output(mats, grams, rank)


def spectrum(mats: torch.Tensor, grams: torch.Tensor | None, space: str) -> torch.Tensor:
    """The whitened ``σ_i^2`` of the group in ``space``, descending: the loss each rank of a
    :func:`factorize` removes (singular values only, no vectors)."""
    if space not in SPACES:
        raise choice_error("space", space, SPACES)
    w = mats.double()
    g, m, n = w.shape
    if space == "input":
        S = torch.eye(n, dtype=w.dtype) if grams is None else whitener(summed(grams))[0]
        A = w.reshape(g * m, n) @ S
        return torch.linalg.eigvalsh(A.T @ A if g * m >= n else A @ A.T).flip(0).clamp_min(0)[: min(g * m, n)]
    wg = w if grams is None else w @ grams.double()
    M = torch.einsum("gmi,gni->mn", wg, w)
    return torch.linalg.eigvalsh((M + M.T) / 2).flip(0).clamp_min(0)[: min(m, n)]


def refit(factors: Factors, mats: torch.Tensor, grams: torch.Tensor) -> Factors:
    """Coefficients re-solved per layer by least squares against each layer's own Gram, basis kept.

    Input space: ``C_l = W_l G_l B^T (B G_l B^T)^{-1}``; output space with an orthonormal U the optimum is
    ``U^T W_l`` whatever the Gram, so output factors are returned unchanged.
    """
    if factors.space == "output":
        return factors
    B = factors.basis
    coeffs = []
    for w, gram in zip(mats.double(), grams.double()):
        rhs = w @ gram @ B.T  # (m, k)
        lhs = B @ gram @ B.T  # (k, k)
        sol, info = torch.linalg.solve_ex(lhs, rhs.T)
        coeffs.append((sol if int(info) == 0 else torch.linalg.pinv(lhs, hermitian=True) @ rhs.T).T)
    return Factors("input", B, tuple(coeffs), factors.sigma, factors.shift)


def whitened_loss(mats: torch.Tensor, approx: torch.Tensor, grams: torch.Tensor) -> torch.Tensor:
    """``tr((W_l - W'_l) G_l (W_l - W'_l)^T)`` per layer, (g,)."""
    d = (mats - approx).double()
    return torch.einsum("gmi,gij,gmj->g", d, grams.double(), d)


def balance(factors: Factors) -> Factors:
    """The same products with, per rank i, ``||C_stack[:, i]|| = ||B[i, :]||`` (module docstring, "Balance").

    Input space: basis B (k, n), coefficients C_l (m, k), stacked over the group to (g m, k); output space:
    basis (m, k) and coefficients (k, n), stacked to (k, g n). A rank whose basis or coefficients are all zero
    is left as it is (nothing to balance)."""
    B = factors.basis
    if factors.space == "input":
        basis_norm = B.norm(dim=1)  # (k,)
        coeff_norm = torch.stack(factors.coeffs).pow(2).sum(dim=(0, 1)).sqrt()  # (k,) over (g, m)
    else:
        basis_norm = B.norm(dim=0)  # (k,)
        coeff_norm = torch.stack(factors.coeffs).pow(2).sum(dim=(0, 2)).sqrt()  # (k,) over (g, n)
    ok = (basis_norm > 0) & (coeff_norm > 0)
    d = torch.where(ok, (coeff_norm / torch.where(ok, basis_norm, 1)).sqrt(), 1)  # (k,) basis scale
    if factors.space == "input":
        basis, coeffs = B * d[:, None], tuple(c / d for c in factors.coeffs)
    else:
        basis, coeffs = B * d, tuple(c / d[:, None] for c in factors.coeffs)
    return Factors(factors.space, basis, coeffs, factors.sigma, factors.shift)


# ---------------------------------------------------------------- ranks and budgets

def stored_per_rank(m: int, n: int, g: int, space: str) -> int:
    """Numbers one rank unit costs for g layers of (m, n): ``n + g m`` (input) or ``m + g n`` (output)."""
    if space not in SPACES:
        raise choice_error("space", space, SPACES)
    return n + g * m if space == "input" else m + g * n


def rank_for_ratio(m: int, n: int, g: int, ratio: float, space: str = "input") -> int:
    """Basis Sharing's rank rule, the largest k whose storage fits ``(1 - ratio) g m n``:
    ``k = floor((1 - c) m n g / (n + m g))`` for input space (d_in = n, d_out = m), the mirror for output.
    0 when even rank 1 does not fit."""
    if not 0.0 <= ratio < 1.0 or not math.isfinite(ratio):
        raise FlowgeomError(f"compression ratio {ratio!r} must be a fraction in [0, 1); e.g. 0.2 saves 20%")
    k = math.floor((1 - ratio) * g * m * n / stored_per_rank(m, n, g, space) + 1e-9)
    return min(k, min(m, n))
