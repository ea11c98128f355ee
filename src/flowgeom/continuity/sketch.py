"""The sigma^2-weighted Gram similarity by sketching: Hutch++ with shared probes and a 95% interval (issue 41).

**What is estimated.** For two layers ``A`` (m n) and ``B`` (m' n') the
similarity in the input space is

    R_in = <A^T A, B^T B>_F / (||A^T A||_F ||B^T B||_F),

its numerator ``tr(A^T A B^T B) = ||A B^T||_F^2`` (the m x m' product
contracts the shared input dim n = n'), the norms ``||A^T A||_F^2 =
||A A^T||_F^2 = sum s_i^4``. The output space swaps the sides: ``X_A = A A^T``,
numerator ``<A A^T, B B^T>_F = ||A^T B||_F^2`` (n x n', contracting the
shared output dim m = m'). Write ``X, Y`` for the two d x d Grams of the
space (d = n in, m out): all three traces are ``tr(X Y)``, ``tr(X X)``,
``tr(Y Y)``, and ``X Y`` is similar to the PSD ``X^{1/2} Y X^{1/2}``. The
estimator only ever applies ``X M = A^T (A M)`` (in) or ``A (A^T M)`` (out)
to thin blocks ``M`` (d x c, ``4 m n c`` flops): no Gram is formed.

**Estimator (Hutch++, Meyer, Musco, Musco & Woodruff 2021), one projector
for the three traces.** Rademacher blocks ``S`` (d x s) and ``G`` (d x g),
shared by every layer of a role and by numerator and norms. ``Q =
orth([X S, Y S])`` (d x q, q <= 2s) holds the top directions of both layers;
``P = Q Q^T``, ``P' = I - P``. Splitting ``X = (P + P') X (P + P')`` and the
same for ``Y``,

    tr(X Y) = <Q^T X Q, Q^T Y Q> + 2 <P' X Q, P' Y Q>             (exact, from X Q, Y Q)
            + tr(P' X P' Y P')                                     (Hutchinson on the rest)
    tr(P' X P' Y P') ~ (1/g) sum_j <P' X P' g_j, P' Y P' g_j>,    P' X P' G = P'(X G - X Q Q^T G).

Every term with a ``P`` is exact given ``Q``; only the deflated rest is
sampled, and ``G`` is independent of ``Q``, so each trace estimate is
unbiased conditionally on ``Q``. ``X S`` and ``X G`` are computed once per
layer and reused by both of its pairs; ``X Q`` once per pair and layer.
Cost per layer and space about ``3 N`` columns of ``4 m n`` flops (``N = s +
g`` probes, ``s = floor(N/2)``): ``d / (8 N)`` of the exact path's
``3 m n d`` for both spaces. Hutchinson alone was not enough: trained and
planted weights have a few dominant sigma^4, and Hutchinson's relative
error is ``sqrt(2 sum l^4) / sum l^2`` per probe (0.85 on the planted 8B
spectrum) until they are deflated. XTrace (Epperly, Tropp & Webber 2024)
uses each probe for both parts and gives its own error estimate, but it
is written for one trace; the three traces sharing one ``Q`` and one ``G``
is what makes their errors cancel in the ratio (for ``X = Y`` the estimate
is exactly 1), and Hutch++'s conditional unbiasedness is what the interval
below rests on. (``curvlinops-for-pytorch`` implements Hutchinson, Hutch++
and XTrace for single traces of linear operators; this bilinear, shared
form is 100 lines of torch, tested against the exact value.)

**Interval.** ``R = N_ab / sqrt(N_aa N_bb)``. Its error is, to first order,
the mean over the ``g`` residual probes of the influence ``z_j = R (e_ab,j /
N_ab - e_aa,j / (2 N_aa) - e_bb,j / (2 N_bb))`` (``e`` = a probe's term minus
the mean of the terms): iid given ``Q`` (the "independent probe blocks" are
the single probes). The 95% interval is ``R +/- t_{0.975, g-1} sigma_z /
sqrt(g)``, where ``sigma_z^2`` bounds the influence's variance by the
Rademacher formula ``2 ||C||_F^2`` with ``||C||_F^2`` estimated from all
``g (g - 1)`` pairs of probes (:func:`influence_sd`): the ``z_j`` are
quadratic forms in Rademacher vectors, skewed and heavy-tailed when a few
directions dominate the rest, and their own sample variance (a plain t
interval) covered only 92-94% on planted pairs. With ``g = 1``
there is no spread and no interval (``None``). With ``q >= d`` (small
matrices) the rest is empty and the value exact (a zero-width interval). A
role's mean over pairs carries the mean of the pairs' interval offsets: the
standard deviation of a mean of errors is at most the mean of their
standard deviations whatever their correlation (Minkowski; the pairs share
probes), so that interval is no narrower than one that knew the correlation.

**Probe rule.** ``--probes N`` fixes ``N``. Otherwise the target relative
error ``E`` (default 2%) sets it: start at ``N = START_PROBES`` (32); after a
pair, while its 95% half-width exceeds ``E |R|`` and ``N`` is below the cap,
double ``N`` up to the cap (both ``s`` and ``g``; the first columns of ``S`` and ``G`` stay the
same, so only new columns are computed) and redo the pair; the role keeps
the ``N`` it reached for the layers that follow. The cap is the matrix's
rank bound ``min(m, n)`` (``--gram sketch``), or ``d / 32`` in ``auto`` (where
the sketch must stay at least ~4x cheaper than exact); a pair whose target
the cap does not reach keeps its wider interval, and the report says so.
Why doubling and not a formula: the error per probe depends on the
spectrum (Meyer et al.'s worst case ``O(1/N)``, with its constants, asks for
~280 probes at 2% where 32 gave a median 0.02-1.6% on planted and flat
256x512 pairs), so the data's own spread decides, at most twice the final cost.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from flowgeom.continuity.spectra import _product
from flowgeom.errors import FlowgeomError, finite_number, positive_int

F64 = torch.float64
CONFIDENCE = 0.95
START_PROBES = 32  # N_0 of the probe rule: s = 16 deflation probes, g = 16 residual probes
DEFAULT_REL_ERROR = 0.02  # target 95% half-width relative to the value, when --probes is not given
AUTO_COST_SHARE = 32  # auto caps N at d / 32: the sketch then costs <= ~1/4 of the exact path (d / (8 N))
CPU_FLOPS = 1e11  # flop/s of one CPU core on the exact path's GEMMs (float32 ~108, bf16 ~290 GFLOP/s, machine A)
CUDA_FLOPS = 1e13  # a GPU's (an order below an H100's float32 peak: products this thin are not at peak)
AUTO_SECONDS = 1.5  # auto sketches a role whose exact pair would take longer than this
CHUNK_BYTES = 64 << 20  # a bf16 matrix is multiplied in row blocks of this many float32 bytes


def rademacher(d: int, count: int, seed: int) -> torch.Tensor:
    """``(d, count)`` float64 matrix of independent +-1, from its own generator: the first ``c`` columns are the
    same for any ``count >= c`` (drawn row by row of the transpose), so a probe block grows without redrawing."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (count, d), generator=gen, dtype=torch.int8)  # (count, d)
    return (bits.to(F64) * 2 - 1).mT  # (d, count)


def probe_seed(seed: int, role: str, space: str, block: str) -> int:
    """The generator seed of one probe block (``"S"`` or ``"G"``) of one role and space: stable across runs."""
    return (seed * 1_000_003 + zlib.crc32(f"{role}/{space}/{block}".encode())) % (1 << 63)


def gram_apply(A: torch.Tensor, M: torch.Tensor, space: str) -> torch.Tensor:
    """``X M`` for the Gram ``X = A^T A`` (space "in", M n x c) or ``A A^T`` ("out", M m x c), float64.

    Products in ``A``'s dtype (float32/float64; a bf16 ``A`` in float32 row blocks, never a whole float32
    copy) on ``A``'s device, through scipy's BLAS on CPU (GIL released); the (d, c) result comes back to the
    CPU, where the small Hutch++ algebra runs. Cost ``4 m n c``.
    """
    if A.dtype == torch.bfloat16:
        return _chunked_apply(A, M, space)
    W = M.to(device=A.device, dtype=A.dtype)
    if space == "in":
        out = _product(A, _product(A, W), transpose_a=True)  # A^T (A M)
    else:
        out = _product(A, _product(A, W, transpose_a=True))  # A (A^T M)
    return out.to(device="cpu", dtype=F64)


def _chunked_apply(A: torch.Tensor, M: torch.Tensor, space: str) -> torch.Tensor:
    m, n = A.shape
    rows = max(1, CHUNK_BYTES // (4 * n))
    W = M.to(device=A.device, dtype=torch.float32)
    if space == "in":  # A^T A M = sum over row blocks A_c^T (A_c M)
        out = torch.zeros(n, M.shape[1], dtype=torch.float32, device=A.device)
        for i in range(0, m, rows):
            Ac = A[i:i + rows].float()  # (r, n)
            out += _product(Ac, _product(Ac, W), transpose_a=True)
        return out.to(device="cpu", dtype=F64)
    AtM = torch.zeros(n, M.shape[1], dtype=torch.float32, device=A.device)  # A^T M = sum A_c^T M_c
    for i in range(0, m, rows):
        AtM += _product(A[i:i + rows].float(), W[i:i + rows].contiguous(), transpose_a=True)
    return torch.cat([_product(A[i:i + rows].float(), AtM) for i in range(0, m, rows)]).to(device="cpu", dtype=F64)


@dataclass(frozen=True)
class Estimate:
    """A sketched similarity: ``value`` and its 95% interval ``(lo, hi)`` (``lo = hi``: exact; None: one probe)."""

    value: float
    bounds: tuple[float, float] | None
    probes: int  # N = s + g probes per matrix

    @property
    def interval(self) -> list[float] | None:
        return None if self.bounds is None else list(self.bounds)

    @property
    def half(self) -> float | None:
        """The larger of the two distances from the value to the interval's ends."""
        return None if self.bounds is None else max(self.value - self.bounds[0], self.bounds[1] - self.value)


@dataclass(frozen=True)
class LayerSketch:
    """One layer's products with the role's probes: ``XS`` (d s), ``XG`` (d g), float64."""

    XS: torch.Tensor
    XG: torch.Tensor


def split(probes: int) -> tuple[int, int]:
    """``(s, g)``: deflation and residual probes of a budget of ``probes`` (``s = floor(N/2)``)."""
    return probes // 2, probes - probes // 2


def hutchpp_pair(XaQ: torch.Tensor, XbQ: torch.Tensor, Q: torch.Tensor, ska: LayerSketch, skb: LayerSketch,
                 G: torch.Tensor, *, confidence: float = CONFIDENCE, rounding: float = 0.0
                 ) -> tuple[float, tuple[float, float] | None]:
    """``(R, (lo, hi))`` of the similarity from the pair's products (module docstring; all float64); no interval
    (None) with one residual probe.

    ``Q`` (d q) orthonormal, ``XaQ = X_a Q``, ``XbQ = X_b Q`` (d q), the layers' sketches and the residual
    probes ``G`` (d g) whose products ``ska.XG = X_a G`` they hold. ``rounding``: the relative error of the
    products' arithmetic, added to the half-width (an exact value, nothing left to sample, keeps it).
    """
    Ta, Tb = Q.mT @ XaQ, Q.mT @ XbQ  # (q, q) = Q^T X Q
    Ta, Tb = 0.5 * (Ta + Ta.mT), 0.5 * (Tb + Tb.mT)
    Ra, Rb = XaQ - Q @ Ta, XbQ - Q @ Tb  # (d, q) = P' X Q
    QG = Q.mT @ G  # (q, g)
    Wa = ska.XG - XaQ @ QG  # (d, g) = X P' G
    Wa = Wa - Q @ (Q.mT @ Wa)  # P' X P' G
    Wb = skb.XG - XbQ @ QG
    Wb = Wb - Q @ (Q.mT @ Wb)
    parts = {"ab": (Ta, Ra, Tb, Rb), "aa": (Ta, Ra, Ta, Ra), "bb": (Tb, Rb, Tb, Rb)}
    exact = {key: float((T1 * T2).sum() + 2 * (R1 * R2).sum()) for key, (T1, R1, T2, R2) in parts.items()}
    H = {"ab": Wa.mT @ Wb, "aa": Wa.mT @ Wa, "bb": Wb.mT @ Wb}  # (g, g): entry ij = g_i^T P'XP' P'YP' g_j
    est = {key: exact[key] + float(H[key].diagonal().mean()) for key in H}
    if est["aa"] <= 0 or est["bb"] <= 0:
        raise FlowgeomError("a sketched Gram norm came out <= 0 (a matrix of zeros?); use --gram exact")
    R = est["ab"] / math.sqrt(est["aa"] * est["bb"])
    g = G.shape[1]
    if g < 2:
        return R, None
    from scipy.special import stdtrit  # Student t quantile (imported here: only a sketched run needs it)

    half = float(stdtrit(g - 1, 0.5 + confidence / 2)) * influence_sd(H, est, R) / math.sqrt(g) + rounding * abs(R)
    return R, (R - half, R + half)


def influence_sd(H: dict[str, torch.Tensor], est: dict[str, float], R: float) -> float:
    """Standard deviation of one probe's influence on ``R`` (module docstring, "Interval"), from all probe pairs.

    The influence of probe ``j`` is ``g_j^T C g_j - tr C`` for the symmetric ``C = R (sym(X~Y~) / N_ab - X~^2 /
    (2 N_aa) - Y~^2 / (2 N_bb))`` (``X~ = P'XP'``), and for Rademacher ``g`` its variance is ``2 (||C||_F^2 -
    sum_i C_ii^2) <= 2 ||C||_F^2`` (Hutchinson 1990; Avron & Toledo 2011). ``||C||_F^2 = E (g_i^T C g_j)^2`` for
    ``i != j``: its mean over the ``g (g - 1)`` ordered pairs of probes is unbiased and far steadier than the
    sample variance of the ``g`` diagonal terms, whose t interval covered 92-94% on planted pairs (300 seeds);
    this bound gave 95-98% on the same pairs and on flat ones.
    """
    if est["ab"]:
        C = R * (0.5 * (H["ab"] + H["ab"].mT) / est["ab"] - H["aa"] / (2 * est["aa"]) - H["bb"] / (2 * est["bb"]))
    else:  # R = 0: only the numerator moves it
        C = 0.5 * (H["ab"] + H["ab"].mT) / math.sqrt(est["aa"] * est["bb"])
    g = C.shape[0]
    off = C.pow(2).sum() - C.diagonal().pow(2).sum()  # sum over i != j of (g_i^T C g_j)^2
    return math.sqrt(max(2 * float(off) / (g * (g - 1)), 0.0))


class SpaceSketcher:
    """The probes of one role in one space, and the probe rule (module docstring), for a stream of layers.

    ``sketch(A)`` gives a layer's :class:`LayerSketch` at the current ``N``; ``pair(A, ska, B, skb)`` returns
    ``(Estimate, ska, skb)`` with the sketches extended if ``N`` grew (keep those in the window).
    """

    def __init__(self, role: str, space: str, d: int, *, seed: int, probes: int | None, rel_error: float,
                 cap: int, confidence: float = CONFIDENCE):
        self.space, self.d, self.fixed, self.rel_error = space, d, probes is not None, rel_error
        self.cap = max(1, cap)
        self.N = probes if probes is not None else min(START_PROBES, self.cap)
        self.confidence = confidence
        self.seeds = (probe_seed(seed, role, space, "S"), probe_seed(seed, role, space, "G"))
        self.missed = 0  # pairs whose target the cap did not let the rule reach
        self._S = self._G = None

    def probes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(S, G)`` at the current ``N``: (d s), (d g) float64."""
        s, g = split(self.N)
        if self._S is None or self._S.shape[1] != s or self._G.shape[1] != g:
            self._S, self._G = rademacher(self.d, s, self.seeds[0]), rademacher(self.d, g, self.seeds[1])
        return self._S, self._G

    def sketch(self, A: torch.Tensor, have: LayerSketch | None = None) -> LayerSketch:
        """``A``'s sketch at the current ``N``, computing only the columns ``have`` lacks."""
        S, G = self.probes()
        s0, g0 = (0, 0) if have is None else (have.XS.shape[1], have.XG.shape[1])
        if have is not None and (s0, g0) == (S.shape[1], G.shape[1]):
            return have
        new = gram_apply(A, torch.cat([S[:, s0:], G[:, g0:]], 1), self.space)  # (d, new columns), one pass
        XS, XG = new[:, :S.shape[1] - s0], new[:, S.shape[1] - s0:]
        if have is not None:
            XS, XG = torch.cat([have.XS, XS], 1), torch.cat([have.XG, XG], 1)
        return LayerSketch(XS, XG)

    def pair(self, A: torch.Tensor, ska: LayerSketch, B: torch.Tensor, skb: LayerSketch
             ) -> tuple[Estimate, LayerSketch, LayerSketch]:
        while True:
            ska, skb = self.sketch(A, ska), self.sketch(B, skb)
            _, G = self.probes()
            if ska.XS.shape[1]:
                Q = torch.linalg.qr(torch.cat([ska.XS, skb.XS], 1)).Q  # (d, q) top directions of both layers
                XaQ, XbQ = gram_apply(A, Q, self.space), gram_apply(B, Q, self.space)
            else:  # N = 1: plain Hutchinson
                Q = XaQ = XbQ = G.new_zeros(self.d, 0)
            est = Estimate(*hutchpp_pair(XaQ, XbQ, Q, ska, skb, G, confidence=self.confidence,
                                         rounding=rounding(A.dtype, self.d)), self.N)
            on_target = est.half is not None and est.half <= self.rel_error * abs(est.value)
            if self.fixed or on_target or self.N >= self.cap:
                self.missed += not (self.fixed or on_target)
                return est, ska, skb
            self.N = min(2 * self.N, self.cap)


def rounding(dtype: torch.dtype, d: int) -> float:
    """Relative rounding allowance of a value computed from products in ``dtype`` (bf16 runs in float32) over a
    ``d``-dimensional space: ``8 eps sqrt(d)`` (6e-5 for float32 at d = 4096, 1e-13 for float64)."""
    eps = torch.finfo(F64 if dtype == F64 else torch.float32).eps
    return 8 * eps * math.sqrt(d)


def exact_pair_flops(shape: tuple[int, int]) -> float:
    """Flops of the exact similarity for one pair, both spaces: the small-side Gram (``D d^2``) and one cross
    product (``2 D d^2``), ``d = min(m, n)``, ``D = max(m, n)``."""
    d, D = min(shape), max(shape)
    return 3.0 * D * d * d


def sketch_layer_flops(shape: tuple[int, int], probes: int) -> float:
    """Flops of the sketch for one layer, both spaces: ``3 N`` applications of ``X`` (``4 m n`` each) per space."""
    m, n = shape
    return 2 * 3 * probes * 4.0 * m * n


def choose(shape: tuple[int, int], mode: str, *, device: str = "cpu") -> tuple[str, str]:
    """``(method, reason)`` for a role of ``shape``: ``mode`` exact/sketch as asked; ``auto`` sketches when the exact
    pair would take more than ``AUTO_SECONDS`` (flops from the shape at ``CPU_FLOPS`` or ``CUDA_FLOPS``) and the sketch
    at ``START_PROBES`` costs under a quarter of it."""
    if mode != "auto":
        return mode, f"--gram {mode}"
    rate = CUDA_FLOPS if device.startswith("cuda") else CPU_FLOPS
    seconds = exact_pair_flops(shape) / rate
    if seconds > AUTO_SECONDS and 4 * sketch_layer_flops(shape, START_PROBES) < exact_pair_flops(shape):
        return "sketch", f"auto: the exact pair would take ~{seconds:.1f} s (> {AUTO_SECONDS} s)"
    return "exact", f"auto: the exact pair takes ~{seconds:.2f} s"


def cap_for(shape: tuple[int, int], mode: str) -> int:
    """Largest probe count the rule may reach: the rank bound ``min(m, n)``, or ``d / AUTO_COST_SHARE`` in auto."""
    side = min(shape)
    return side if mode == "sketch" else max(min(START_PROBES, side), side // AUTO_COST_SHARE)


def sketch_similarity(A: torch.Tensor, B: torch.Tensor, space: str, *, probes: int | None = None,
                      rel_error: float = DEFAULT_REL_ERROR, seed: int = 0, confidence: float = CONFIDENCE) -> Estimate:
    """The sketched similarity of two matrices in ``space`` ("in" or "out"), with its interval (module docstring).

    ``A`` (m n) and ``B`` (m' n') in their own dtype (float64 for tests; float32 as the analyzer runs).
    ``probes`` fixes ``N``; otherwise the rule targets ``rel_error``, capped at the rank bound.
    """
    if space not in ("in", "out"):
        raise FlowgeomError(f"unknown space {space!r}; choose in or out")
    dim = -1 if space == "in" else -2
    if A.shape[dim] != B.shape[dim]:
        raise FlowgeomError(f"{space}-space similarity needs the same {space} dimension; got {tuple(A.shape)} and "
                            f"{tuple(B.shape)}")
    side = min(*A.shape, *B.shape)
    if probes is not None and positive_int(probes, "probes") > side:
        raise FlowgeomError(f"probes={probes} is beyond the side {side} of the {tuple(A.shape)} and {tuple(B.shape)} "
                            f"matrices; use probes <= {side}")
    if not 0 < finite_number(rel_error, "rel_error", fix="a fraction, e.g. 0.02") < 1:
        raise FlowgeomError(f"rel_error must be between 0 and 1 (a fraction: 0.02 = 2%), got {rel_error!r}")
    sk = SpaceSketcher("pair", space, A.shape[dim], seed=seed, probes=probes, rel_error=rel_error, cap=side,
                       confidence=confidence)
    est, _, _ = sk.pair(A, sk.sketch(A), B, sk.sketch(B))
    return est
