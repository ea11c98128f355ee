"""Top singular pairs of stacks of matrices, without a full SVD.

For a stack ``A`` of shape ``(L, m, n)`` (or one ``(m, n)`` matrix) we want the
top ``k`` singular triplets ``A v_i = sigma_i u_i``, ``sigma_1 >= sigma_2 >= ...``.

1. Form the Gram of the *small* side once, ``G = A^T A`` (n x n) if ``n <= m``
   else ``G = A A^T`` (m x m). Its eigenpairs are ``(sigma_i^2, v_i)`` (resp.
   ``u_i``). The analyzer needs this Gram anyway for the sigma^2-weighted Gram
   similarity, so reusing it costs nothing extra. On CPU it is a BLAS
   ``syrk`` (only one triangle: half the flops of ``A.mT @ A``).
2. Find the top ``k`` eigenpairs of ``G`` with one of two solvers:

   * ``krylov``: randomised **block Krylov** iteration with Rayleigh-Ritz
     (Musco & Musco 2015, "Randomized block Krylov methods for stronger and
     faster approximate SVD"), batched over the stack::

         K_t = [Q_0, G Q_0, ..., G^t Q_0] (orthonormalised block by block),
         Q_0 = orth(G Omega), Omega ~ N(0, 1)^{d x b}, b = k + oversample (10),
         Ritz pairs from eigh(K_t^T G K_t);  stop when for all i <= k
         r_i = ||G y_i - theta_i y_i|| / theta_1 <= tol, or r_i has stagnated
         at the rounding level eps sqrt(d) (krylov_top_eigenpairs).

     Krylov depth converges like ``exp(-2 t sqrt(gap))`` instead of the power
     method's ``(1 - gap)^t``, which matters on the flat spectra of trained
     weights. The products ``G Q`` run in the Gram's dtype, the basis and
     Ritz pairs (d x D, D = b (t+1)) in float64. Cost ~ t d^2 b: it wins
     for large d and on GPUs.
   * ``dense``: LAPACK's Householder tridiagonal reduction (``?sytrd``),
     then MRRR (``?stemr``) for the top k eigenpairs only and ``?ormqr`` to
     map them back (``_blas.tridiagonal_top``), in the Gram's dtype. Cost ~ (4/3) d^3 with BLAS-3 blocking and no iteration: on CPU
     it beats Krylov for small d (at d = 576, k = 8: 7 ms vs 25 ms).
   * ``auto`` (default): ``dense`` on CPU when d <= ``DENSE_MAX_DIM`` (the
     measured crossover on a 2-core EPYC is d ~ 1.5-2k), else ``krylov``.

3. The other side follows exactly: ``u_i = A v_i / sigma_i`` (or
   ``v_i = A^T u_i / sigma_i``).

Accuracy: the angle between a computed ``v_i`` and the exact one is at most
``r_i theta_1 / gap_i`` with ``gap_i = min_{j != i} |sigma_i^2 - sigma_j^2|``
(Davis-Kahan); both solvers report ``r`` (``SingularPairs.residual``). The
test suite checks both against a full float64 SVD to 1e-4 in |cos| on real
(SmolLM2, MiniLM) and planted matrices.

**Near-degenerate tops.** When ``sigma_1 ~ sigma_2`` the top vector itself is
not determined by the matrix (any unit vector of the 2-D top subspace is a
top vector up to O(gap)); no method, full SVD included, returns a stable
``v_1``. We return the Ritz vector and report the relative gap
``(sigma_1 - sigma_2) / sigma_1`` of every matrix (``SingularPairs.gap``), so
callers can flag such pairs; the top-k subspace alignment stays well defined.

**Extreme scales.** Singular vectors do not depend on scale, but a float32
Gram does: ``|w| ~ 1e25`` gives entries ``~ n 1e50`` (overflow to inf), ``|w|
~ 1e-30`` gives ``1e-60`` (flushed to 0, so the matrix looks "all zeros").
:func:`unit_scale` multiplies each matrix whose ``max|w|`` lies outside
``[2^-30, 2^30]`` by ``2^-e`` (``max|w| = f 2^e``, ``f`` in [0.5, 1)): a
power of two, so the scaling is exact and the vectors are those of the
unscaled matrix bit for bit wherever that one did not over/underflow;
singular values are scaled back by ``2^e`` in float64
(:func:`unscale_pairs`). Matrices inside the window are not touched (no copy).

Signs are arbitrary: every metric built on these vectors uses ``|cos|``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flowgeom.continuity import _blas
from flowgeom.errors import FlowgeomError, choice_error

F64 = torch.float64
SOLVERS = ("auto", "krylov", "dense")
DENSE_MAX_DIM = 1536  # CPU crossover dense (tridiagonal) vs block Krylov (benchmarks/continuity_solvers.py)
SMALL_GRAM = 192  # Krylov may fill the whole space of Grams up to this size (krylov_top_eigenpairs)
RESIDUAL_FLOOR = 8  # Krylov residuals are floored at 8 eps of the Gram's dtype (krylov_top_eigenpairs)
STAGNATION = 1.0  # a residual that stops falling at or below STAGNATION eps sqrt(d) is rounding (krylov_top_eigenpairs)
OVERSAMPLE = 10  # Krylov block b = k + OVERSAMPLE (k = 1 runs a block of 11)
SAFE_EXPONENT = 30  # max|w| in [2^-30, 2^30]: float32 Grams of any practical size neither overflow nor underflow


@dataclass(frozen=True)
class SingularPairs:
    """Top-k singular triplets of a stack: ``A[b] V[b] = U[b] diag(S[b])``.

    ``U`` (L m k), ``S`` (L k), ``V`` (L n k), float64; ``residual`` (L,) is the
    largest relative Ritz residual ``||G y_i - s_i^2 y_i|| / s_1^2`` over
    ``i <= k``; ``iters`` the Krylov depth used (0 for a full SVD).
    """

    U: torch.Tensor
    S: torch.Tensor
    V: torch.Tensor
    residual: torch.Tensor
    iters: int

    @property
    def gap(self) -> torch.Tensor:
        """Relative top gap ``(s_1 - s_2) / s_1`` per matrix, shape (L,) (1.0 when k = 1)."""
        if self.S.shape[-1] < 2:
            return torch.ones_like(self.S[..., 0])
        return (self.S[..., 0] - self.S[..., 1]) / self.S[..., 0].clamp_min(torch.finfo(F64).tiny)

    def __getitem__(self, idx) -> "SingularPairs":
        """Pairs of one matrix or a sub-stack (indexing the leading dim)."""
        return SingularPairs(self.U[idx], self.S[idx], self.V[idx], self.residual[idx], self.iters)


def as_stack(mats: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(L, m, n)`` view of a matrix or stack, and whether the input was one matrix."""
    if not isinstance(mats, torch.Tensor) or mats.ndim not in (2, 3):
        shape = tuple(mats.shape) if isinstance(mats, torch.Tensor) else type(mats).__name__
        raise FlowgeomError(f"expected a matrix (m, n) or a stack (L, m, n), got {shape}")
    return (mats.unsqueeze(0), True) if mats.ndim == 2 else (mats, False)


def compute_dtype(A: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``A`` in the compute dtype (default: float64; half types never stay half)."""
    return A.to(dtype or F64)


def unit_scale(A: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A 2^-e in dtype, e)`` per matrix of ``A`` (m n) or (L m n); ``e`` int64, shape () or (L,).

    ``e = 0`` when ``max|A|`` is within ``2^±SAFE_EXPONENT`` (or 0): then no
    copy beyond the dtype conversion. Otherwise ``max|A 2^-e|`` is in [0.5, 1)
    and the scaling is exact (module docstring, "Extreme scales"). A float64
    ``A`` is scaled before it is narrowed, so 1e300 survives ``dtype=float32``;
    every other dtype fits float32's range and is converted first. ``A``
    itself is never modified.
    """
    X = A if A.dtype == F64 else A.to(dtype)
    if X.numel() == 0:
        return X.to(dtype), torch.zeros(X.shape[:-2], dtype=torch.int64)
    lo, hi = torch.aminmax(X.flatten(-2), dim=-1) if X.ndim > 2 else torch.aminmax(X)
    peak = torch.maximum(-lo, hi).to(device="cpu", dtype=F64)  # () or (L,)
    e = torch.frexp(peak).exponent.to(torch.int64)  # peak = f 2^e, f in [0.5, 1)
    inside = (peak == 0) | ~torch.isfinite(peak) | ((e > -SAFE_EXPONENT) & (e <= SAFE_EXPONENT))
    e = torch.where(inside, torch.zeros_like(e), e)
    if not e.any():
        return X.to(dtype), e
    out = X.clone() if X is A else X  # never scale the caller's tensor in place
    for i, ei in enumerate(e.reshape(-1).tolist()):
        view = out if out.ndim == 2 else out[i]
        left = -ei
        while left:  # steps of at most 2^±100: every factor is a normal float32, every product exact
            step = max(-100, min(100, left))
            view.mul_(2.0 ** step)
            left -= step
    return out.to(dtype), e


def unscale_pairs(pairs: "SingularPairs", e: torch.Tensor) -> "SingularPairs":
    """Pairs of ``A`` from those of ``A 2^-e`` (:func:`unit_scale`): singular values times ``2^e``, float64."""
    if not e.any():
        return pairs
    factor = torch.tensor([math.ldexp(1.0, int(x)) for x in e.reshape(-1).tolist()], dtype=F64,
                          device=pairs.S.device).reshape(e.shape)
    return SingularPairs(pairs.U, pairs.S * factor.unsqueeze(-1), pairs.V, pairs.residual, pairs.iters)


def small_gram(A: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Gram of the small side of a stack ``A`` (L m n): ``(A^T A, "in")`` if n <= m else ``(A A^T, "out")``."""
    m, n = A.shape[-2:]
    side = "in" if n <= m else "out"
    if _blas.supported(A):
        d = min(m, n)
        grams = [_blas.syrk_gram(X, side) for X in A.reshape(-1, m, n)]  # one BLAS call per matrix of the stack
        stacked = grams[0].unsqueeze(0) if len(grams) == 1 else torch.stack(grams)  # no copy for one matrix
        return stacked.reshape(*A.shape[:-2], d, d), side
    return (A.mT @ A if side == "in" else A @ A.mT), side


class GramOperator:
    """``G = A^T A`` (side "in") or ``A A^T`` ("out") of a stack ``A`` (L m n), applied without forming ``G``.

    ``G @ X = A^T (A X)`` costs ``4 m n b`` flops for ``b`` columns, against
    ``m d^2`` to form ``G`` once. The block Krylov solver needs ``G`` only
    through such products (5-6 of them for a decaying spectrum, ~30 for a
    flat one at d = 4096), so when the analyzer does not need an exact
    ``G`` itself (a bf16 checkpoint: its Gram for the sigma^2-similarity
    comes from a bf16 GEMM, :func:`bf16_gram`) the ``m d^2`` float32 Gram
    (half of an 8B layer's time) is never formed. :meth:`dense` forms it
    for the dense fallback (:func:`_exact_top`).
    """

    def __init__(self, A: torch.Tensor, side: str):
        self.A, self.side = A, side
        d = min(A.shape[-2:])
        self.shape, self.dtype, self.device = (*A.shape[:-2], d, d), A.dtype, A.device

    def __matmul__(self, X: torch.Tensor) -> torch.Tensor:  # (L, d, b) -> (L, d, b)
        if self.side == "in":  # A^T (A X)
            return _product(self.A, _product(self.A, X), transpose_a=True)
        return _product(self.A, _product(self.A, X, transpose_a=True))  # A (A^T X)

    def dense(self) -> torch.Tensor:
        return small_gram(self.A)[0]


def bf16_gram(A: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Small-side Gram of a bf16 matrix or stack by a bf16 GEMM, as float32 ``(G, side)``.

    Products of bf16 numbers are exact in float32 and accumulate in float32;
    each entry of ``G`` is then rounded once to bf16 (relative ``2^-8`` at
    most). That is not precise enough for eigenvectors (the analyzer finds
    those with :class:`GramOperator` on the float32 matrix), but the
    Frobenius products of the sigma^2-similarity sum d^2 such entries and
    the roundings average out (relative ~1e-5, as for
    :func:`flowgeom.continuity.metrics._cross_sq`). 1.4-1.9x less CPU than
    float32 ``?syrk`` on an AVX512-BF16 CPU (a full GEMM at 2.7x the rate).
    """
    m, n = A.shape[-2:]
    side = "in" if n <= m else "out"
    G = A.mT @ A if side == "in" else A @ A.mT  # bf16 (…, d, d), float32 accumulation
    return G.to(torch.float32), side


def _check_k(k: int, m: int, n: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1 or k > min(m, n):
        raise FlowgeomError(f"k={k!r} singular pairs asked for a {m}x{n} matrix; choose 1 <= k <= {min(m, n)}")


def krylov_top_eigenpairs(G: "torch.Tensor | GramOperator", k: int, *, oversample: int = OVERSAMPLE,
                          max_depth: int = 200, tol: float = 1e-10, tol_rest: float = 1e-5,
                          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Top ``k`` eigenpairs of symmetric PSD ``G`` (L d d, or a :class:`GramOperator`) by randomised block
    Krylov + Rayleigh-Ritz.

    The projected matrix ``T = K^T G K`` is grown block by block (cost d D b
    per step, never d D^2). The top pair must reach ``tol`` (it carries the
    headline v1/u1 cosines); pairs 2..k need ``tol_rest`` (they feed the
    subspace and index-matched metrics, where a 1e-5 residual moves the
    value by far less than its spread over layers). Returns ``(theta (L k) descending, Y (L d k),
    residual (L,), depth)`` in float64.

    **Precision.** The products ``G Q``, the basis and ``T`` stay in
    ``G``'s own dtype (a float32 Gram is never copied to float64: that copy
    doubled the memory traffic of every step); the Ritz problem ``eigh(T)``
    and the returned pairs are float64, the vectors normalised there. A
    residual cannot fall below the rounding of those products, so both
    tolerances are floored at ``RESIDUAL_FLOOR * eps(G.dtype)`` (about 1e-6
    for float32; a float64 Gram keeps 1e-10). Asking for less was the bad
    scaling of issue 34: on a flat (Gaussian) spectrum a float32 Gram never
    reached 1e-10 and ran to ``max_depth`` (43 s per 3072x3072 matrix). The
    angle of the top vector is at most ``r theta_1 / gap`` (Davis-Kahan),
    on top of what rounding the float32 Gram itself costs; measured on a
    3072x3072 Gaussian matrix (relative gap 0.009) against a float64 SVD:
    5e-6 (1.9e-6 with a float64 basis, at 2x the time;
    tests/continuity/test_scale.py checks the metrics to 1e-4).

    **Stagnation (issue 41).** The rounding floor of a residual is not
    ``8 eps``: it is the rounding of the products ``G y`` themselves, about
    ``eps sqrt(d) theta_1`` for a float32 Gram (measured 0.08-0.24
    ``eps sqrt(d)`` on Gaussian Grams at d = 1024). Near ``8 eps`` whether a
    pair "converged" was a coin toss per matrix and k; a lost toss grows the
    basis to its cap and then pays for the dense solver too. That is the
    issue's 23-29 s for 3 Gaussian 3072x3072 matrices at k = 1, 2 against 5 s
    at k = 4 (inferred: cap plus dense reduction is ~8 s a matrix; not re-run
    at 3072 here), and at d = 1024 a floor moved just below the plateau
    reproduces it (3.3x the time). So
    a pair also counts as converged when its residual has *stagnated*: it fell
    by less than half since the previous Ritz check (at least one Krylov block
    earlier) and is within the rounding level ``eps sqrt(d)``
    (``STAGNATION``). Krylov convergence is geometric, so a residual that
    stops falling that low is rounding; the vectors are then as good as the
    Gram's dtype allows.

    **Block.** ``b = k + oversample`` (default ``OVERSAMPLE`` = 10, so k = 1
    runs a block of 11): a product ``G Q`` reads all of ``G`` whatever ``b``,
    so a wider block costs little more per step and needs fewer steps.
    Randomised subspace iteration (a range finder with power iterations) was
    measured against it at d = 1024 (float32 Gaussian Gram, one thread,
    same stopping rule): 125-160 iterations / 135-227 ms against Krylov depth
    17-22 / 43-65 ms, and equal on a decaying spectrum (9 vs 8 ms): its space
    after t steps is inside the Krylov space, so it never needs fewer products.

    **Cost cap.** When the basis would pass ``d / 3`` columns (its
    orthogonalisation and Ritz steps then cost about what a dense reduction
    does) the top pairs come from the dense solver instead
    (:func:`_exact_top`); Grams up to ``SMALL_GRAM`` wide may fill the
    whole space first.
    """
    L, d, _ = G.shape
    eps = torch.finfo(G.dtype).eps
    floor = RESIDUAL_FLOOR * eps
    tol, tol_rest = max(tol, floor), max(tol_rest, floor)
    rounding = STAGNATION * eps * math.sqrt(d)  # a stagnated residual this low is the products' rounding (docstring)
    b = min(k + oversample, d)
    cap = d if d <= SMALL_GRAM else d // 3  # largest basis before the dense solver is cheaper (docstring)
    work = G.dtype if G.dtype in (torch.float32, F64) else F64  # products and basis in G's dtype (docstring)
    gen = torch.Generator().manual_seed(seed)
    omega = torch.randn(L, d, b, generator=gen, dtype=F64).to(device=G.device, dtype=work)  # (L, d, b)

    def apply(X: torch.Tensor) -> torch.Tensor:  # G X in G's dtype, returned in the basis dtype (L, d, b)
        return (G @ X.to(G.dtype)).to(work)

    Q = torch.linalg.qr(apply(omega)).Q  # (L, d, b)
    GQ = apply(Q)
    basis = _Basis(Q, GQ)  # K (L d D) and G K, grown in place
    T = Q.mT @ GQ  # (L, D, D) = K^T G K
    depth, check, before = 0, 0, None  # before: the residuals (L, k) at the previous Ritz check
    while True:
        room = basis.size + b <= cap and depth < max_depth
        if depth < check and room:
            depth += 1
            T = _extend(apply, basis, T)
            continue
        check = max(depth + 1, int(depth * 1.4))  # Ritz checks on a geometric schedule (eigh is the costly part)
        K, GK = basis.K, basis.GK
        theta, W = torch.linalg.eigh(0.5 * (T + T.mT).to(F64))  # ascending, (L, D), (L, D, D)
        theta, W = theta.flip(-1)[..., :k], W.flip(-1)[..., :k]
        Y, GY = (K @ W.to(work)).to(F64), (GK @ W.to(work)).to(F64)  # (L, d, k)
        scale = theta[..., :1].clamp_min(torch.finfo(F64).tiny)
        r = (GY - Y * theta.unsqueeze(-2)).norm(dim=-2) / scale  # (L, k)
        residual = r.amax(-1)  # (L,)
        stalled = (r > 0.5 * before) & (r <= rounding) if before is not None else torch.zeros_like(r, dtype=torch.bool)
        before = r
        converged = bool(((r[..., 0] <= tol) | stalled[..., 0]).all()) and bool(
            ((r[..., 1:] <= tol_rest) | stalled[..., 1:]).all())
        if converged or not room:
            if not converged and basis.size + b > cap:
                # Krylov would cost as much as a dense reduction: finish exactly on the whole (small) space.
                theta, Y = _exact_top(G.dense() if isinstance(G, GramOperator) else G, k)
                residual = torch.zeros_like(residual)
            return theta, Y / Y.norm(dim=-2, keepdim=True), residual, depth  # unit columns in float64
        depth += 1
        T = _extend(apply, basis, T)


class _Basis:
    """The Krylov basis ``K`` (L d D) and ``G K``, in buffers that double when full (no copy per step)."""

    def __init__(self, Q: torch.Tensor, GQ: torch.Tensor):
        L, d, b = Q.shape
        self.block = b
        self._K = Q.new_empty(L, d, 4 * b)
        self._GK = Q.new_empty(L, d, 4 * b)
        self.size = 0
        self.append(Q, GQ)

    @property
    def K(self) -> torch.Tensor:
        return self._K[..., :self.size]

    @property
    def GK(self) -> torch.Tensor:
        return self._GK[..., :self.size]

    def append(self, Q: torch.Tensor, GQ: torch.Tensor) -> None:
        b = Q.shape[-1]
        if self.size + b > self._K.shape[-1]:
            grow = max(self._K.shape[-1], b)
            self._K = torch.cat([self._K, self._K.new_empty(*self._K.shape[:-1], grow)], -1)
            self._GK = torch.cat([self._GK, self._GK.new_empty(*self._GK.shape[:-1], grow)], -1)
        self._K[..., self.size:self.size + b] = Q
        self._GK[..., self.size:self.size + b] = GQ
        self.size += b


def _extend(apply, basis: _Basis, T: torch.Tensor) -> torch.Tensor:
    """One Krylov block: orthogonalise G Q_last against the basis K (twice), grow K, G K and T = K^T G K."""
    K = basis.K
    new = basis.GK[..., -basis.block:]  # G Q of the last block (L, d, b)
    for _ in range(2):  # block Gram-Schmidt against the whole basis, twice
        new = new - K @ (K.mT @ new)
    Q = torch.linalg.qr(new).Q  # (L, d, b)
    GQ = apply(Q)
    C = K.mT @ GQ  # (L, D, b)
    basis.append(Q, GQ)
    return torch.cat([torch.cat([T, C], -1), torch.cat([C.mT, Q.mT @ GQ], -1)], -2)  # (L, D+b, D+b)


def _exact_top(G: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` eigenpairs of ``G`` (L d d), float64: LAPACK's tridiagonal solver on CPU, ``eigh`` elsewhere."""
    if _blas.supported(G):
        theta, Y = dense_top_eigenpairs(G, k)[:2]
        return theta, Y
    theta, Y = torch.linalg.eigh(G)
    return theta.flip(-1)[..., :k].to(F64), Y.flip(-1)[..., :k].to(F64)


def dense_top_eigenpairs(G: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Top ``k`` eigenpairs of symmetric ``G`` (L d d) on CPU: LAPACK tridiagonal reduction, MRRR on the top k only.

    Runs in ``G``'s dtype (float32 or float64), with the GIL released
    (:func:`_blas.tridiagonal_top`). Same return convention as
    :func:`krylov_top_eigenpairs` (depth 0); the residual is measured, not assumed.
    """
    return _dense_top(G, k, all_values=False)[:4]


def dense_top_eigenpairs_and_values(G: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int,
                                                                      torch.Tensor]:
    """:func:`dense_top_eigenpairs` plus every eigenvalue (L d, ascending, float64) from the same reduction."""
    return _dense_top(G, k, all_values=True)


def _dense_top(G: torch.Tensor, k: int, *, all_values: bool):
    d = G.shape[-1]
    vals, thetas, vecs = [], [], []
    for g in G.reshape(-1, d, d).numpy():
        v, w, y = _blas.tridiagonal_top(g, k, all_values=all_values)
        vals.append(None if v is None else torch.from_numpy(v))
        thetas.append(torch.from_numpy(w))
        vecs.append(torch.from_numpy(y))
    theta, Y = torch.stack(thetas).to(F64), torch.stack(vecs)  # (L, k), (L, d, k)
    r = (_product(G, Y) - Y * theta.to(G.dtype).unsqueeze(-2)).norm(dim=-2).to(F64)  # in G's dtype: ~ eps * theta_1
    residual = (r / theta[..., :1].clamp_min(torch.finfo(F64).tiny)).amax(-1)
    values = torch.stack(vals).to(F64) if all_values else None
    return theta, Y.to(F64), residual, 0, values


def _use_dense(G: torch.Tensor, solver: str) -> bool:
    """Whether ``solver`` means the dense LAPACK path for this Gram (``auto``: CPU and d <= DENSE_MAX_DIM)."""
    if solver not in SOLVERS:
        raise choice_error("solver", solver, SOLVERS)
    dense = solver == "dense" or (solver == "auto" and G.device.type == "cpu" and G.shape[-1] <= DENSE_MAX_DIM)
    if dense and G.device.type != "cpu":
        raise FlowgeomError(f"--solver dense runs on CPU only (got a {G.device.type} tensor); use krylov or auto")
    return dense


def top_eigenpairs(G: "torch.Tensor | GramOperator", k: int, *, solver: str = "auto", **krylov
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Top ``k`` eigenpairs of PSD ``G`` (L d d) by ``solver`` (see module docstring); Krylov options pass through."""
    if _use_dense(G, solver):
        G = G.dense() if isinstance(G, GramOperator) else G
        return dense_top_eigenpairs(G if _blas.supported(G) else G.to(F64), k)
    return krylov_top_eigenpairs(G, k, **krylov)


def pairs_from_gram(A: torch.Tensor, G: "torch.Tensor | GramOperator", side: str, k: int, **opts) -> SingularPairs:
    """Top-k singular triplets of ``A`` (L m n) given its small-side Gram ``G`` (:func:`small_gram`, or
    :class:`GramOperator`)."""
    _check_k(k, *A.shape[-2:])
    theta, Y, residual, depth = top_eigenpairs(G, k, **opts)
    return _pairs(A, side, theta, Y, residual, depth)


def pairs_and_spectrum_from_gram(A: torch.Tensor, G: torch.Tensor, side: str, k: int, *, solver: str = "auto",
                                 **krylov) -> tuple[SingularPairs, torch.Tensor, str]:
    """:func:`pairs_from_gram` plus the whole ESD: ``(pairs, eigenvalues of G (L d) ascending float64, how)``.

    ``how`` says where the eigenvalues came from: ``"tridiagonal"`` (dense
    solver: the reduction the top-k pairs need anyway, plus an O(d^2)
    ``?sterf``) or ``"eigvalsh"`` (Krylov solver: it never sees the whole
    spectrum, so a separate ``torch.linalg.eigvalsh`` of the Gram runs, at
    the cost of one more O(d^3) reduction per matrix).
    """
    _check_k(k, *A.shape[-2:])
    if _use_dense(G, solver):
        theta, Y, residual, depth, values = dense_top_eigenpairs_and_values(G if _blas.supported(G) else G.to(F64), k)
        how = "tridiagonal"
    else:
        theta, Y, residual, depth = top_eigenpairs(G, k, solver=solver, **krylov)
        values, how = torch.linalg.eigvalsh(G).to(F64), "eigvalsh"
    return _pairs(A, side, theta, Y, residual, depth), values, how


def _product(A: torch.Tensor, B: torch.Tensor, *, transpose_a: bool = False) -> torch.Tensor:
    """``A @ B`` (``A^T @ B``) for stacks of one dtype: scipy's BLAS on CPU (:func:`_blas.matmul`), torch elsewhere."""
    if _blas.supported(A, B):
        return _blas.matmul(A, B, transpose_a=transpose_a)
    return (A.mT if transpose_a else A) @ B


def _pairs(A, side, theta, Y, residual, depth) -> SingularPairs:
    s = theta.clamp_min(0).sqrt()  # (L, k)
    inv = torch.where(s > 0, 1.0 / s.clamp_min(torch.finfo(F64).tiny), torch.zeros_like(s))
    # products in A's dtype (no float64 copy of A: memory stays ~ one matrix), then float64
    if side == "in":  # Y = V, U = A V / s
        U, V = _product(A, Y.to(A.dtype)).to(F64) * inv.unsqueeze(-2), Y
    else:  # Y = U, V = A^T U / s
        U, V = Y, _product(A, Y.to(A.dtype), transpose_a=True).to(F64) * inv.unsqueeze(-2)
    return SingularPairs(U, s, V, residual, depth)


def unscale_values(values: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of ``A^T A`` from those of ``(A 2^-e)^T (A 2^-e)``: times ``4^e`` (:func:`unit_scale`), float64."""
    if not e.any():
        return values
    factor = torch.tensor([math.ldexp(1.0, 2 * int(x)) for x in e.reshape(-1).tolist()], dtype=F64,
                          device=values.device).reshape(e.shape)
    return values * factor.unsqueeze(-1)


def top_singular_pairs(mats: torch.Tensor, k: int = 1, *, dtype: torch.dtype | None = None, solver: str = "auto",
                       oversample: int = OVERSAMPLE, max_depth: int = 200, tol: float = 1e-10, tol_rest: float = 1e-5,
                       seed: int = 0) -> SingularPairs:
    """Top ``k`` singular triplets of every matrix of ``mats`` (L m n) or (m n).

    The Gram is formed in ``dtype`` (default float64), the Krylov part runs in
    float64; the start block comes from a ``torch.Generator`` seeded with
    ``seed`` (made on CPU, then moved), never the global RNG. Outputs are
    float64 on ``mats.device``; a 2-D input gives un-stacked (m k), (k,), (n k).
    ``solver``: ``auto`` | ``krylov`` | ``dense`` (module docstring).
    """
    A, single = as_stack(mats)
    A, e = unit_scale(A, dtype or F64)  # exact power-of-two rescale of extreme matrices (module docstring)
    _check_k(k, *A.shape[-2:])
    G, side = small_gram(A)
    pairs = pairs_from_gram(A, G, side, k, solver=solver, oversample=oversample, max_depth=max_depth, tol=tol,
                            tol_rest=tol_rest, seed=seed)
    pairs = unscale_pairs(pairs, e)
    return pairs[0] if single else pairs


def full_singular_pairs(mats: torch.Tensor, k: int = 1) -> SingularPairs:
    """Reference: top-k triplets from a full float64 SVD (what spectrum tools do)."""
    A, single = as_stack(mats)
    _check_k(k, *A.shape[-2:])
    U, S, Vh = torch.linalg.svd(A.to(F64), full_matrices=False)
    zeros = torch.zeros(A.shape[0], dtype=F64, device=A.device)
    pairs = SingularPairs(U[..., :k], S[..., :k], Vh[..., :k, :].mT, zeros, 0)
    return pairs[0] if single else pairs
