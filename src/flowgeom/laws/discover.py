"""Discover the quadratic conservation laws of a module numerically.

A polynomial h(θ) = θᵀAθ + bᵀθ (A symmetric) is conserved by gradient flow
for every data set iff its gradient g(θ) = 2Aθ + b is orthogonal to every
field X_{x,c}(θ) at every θ — equivalently (Noether) iff f(x; ·) is invariant
under the linear flow θ̇ = Aθ (+ b). Each (θ, field) pair is one linear
constraint on (A, b); the solution space is the answer.

Solving it directly has D(D+1)/2 + D unknowns (20,300 at D = 200). The
engine shrinks it with the fields themselves: at each point θ_i the law
gradients lie in the small complement N_i = W(θ_i)^⊥ (D × k_i, from a batched
SVD of D + 8 random fields per point, all points in one vmap), so
g(θ_i) = N_i z_i. With D + 1
generic points θ̃_i = (θ_i, 1) the affine map g is fixed by its values:
[2A | b] = [g_0 … g_D] Θ̃⁻¹, and the only remaining condition is that 2A be
symmetric (g is a gradient). With T = Θ̃⁻¹[:, :D] the antisymmetric residual
gives the quadratic form

    ½‖S − Sᵀ‖²_F = zᵀ(G1 − G2)z,  S = [g_i] T,
    G1[(i,a),(j,b)] = (N_iᵀN_j)_{ab} (TTᵀ)_{ij},   G2 = C ⊙ Cᵀ,  C[(i,a),(j,b)] = (T N_i)_{ja},

whose null space (unknowns Σ k_i ≈ (D+1)·k) gives the candidates. A few extra points
confirm them (spurious solutions are projected out), and a reduced row
echelon form makes the basis sparse before it is printed in parameter names.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, InputError, positive_int
from torch.func import vmap

from flowgeom.laws.count import (DEFAULT_TOL, FieldSource, expected_laws, frozen_note, io_estimate, prepare,
                                 probe_output, random_point, require_finite)
from flowgeom.laws.fields import FieldModel, ParamLayout, Sampler, draw_inputs, generator
from flowgeom.memory import require as require_memory


MEMORY_FIX = "use a smaller instance (fewer parameters) or `flowgeom laws count`, which only counts"


@dataclass
class DiscoveredLaw:
    """h(θ) = θᵀ Q θ + bᵀ θ over the flat parameter vector (layout of ``named_parameters``)."""

    formula: str
    quadratic: torch.Tensor  # (D, D) symmetric
    linear: torch.Tensor  # (D,)
    params: tuple[str, ...] = ()  # the parameter tensors h reads, in module order: its symmetry group

    def evaluate(self, theta: torch.Tensor) -> torch.Tensor:
        return theta @ self.quadratic @ theta + self.linear @ theta


@dataclass
class DiscoverResult:
    parameters: int
    laws: list[DiscoveredLaw]
    expected: int | None
    max_violation: float
    seconds: float
    seed: int
    points: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"parameters": self.parameters, "count": len(self.laws), "laws": [law.formula for law in self.laws],
                "groups": [{"params": list(p), "laws": [law.formula for law in self.laws if law.params == p]}
                           for p in dict.fromkeys(law.params for law in self.laws)],
                "expected": self.expected, "max_violation": self.max_violation, "seconds": self.seconds,
                "seed": self.seed, "points": self.points, "notes": self.notes}


def _complements(model: FieldModel, thetas: torch.Tensor, sampler, out_shape, gen, *, tol: float, per_field: int = 16,
                 chunk: int = 16, progress=None, offset: int = 0, total: int = 0) -> list[torch.Tensor]:
    """Orthonormal bases (D, k_i) of W(θ_i)^⊥ for a stack of points ``thetas`` (M, D); law gradients lie there.

    D + 8 random fields per point, vmapped over fields *and* points, then one
    batched SVD of the (M, D + 8, D) field matrices.
    """
    m, d = thetas.shape
    n = d + 8
    fn = vmap(vmap(model.nested(0), in_dims=(None, 0, 0)), in_dims=(0, 0, 0))
    out = []
    for start in range(0, m, chunk):
        th = thetas[start : start + chunk]  # (c, D)
        c = th.shape[0]
        xs = draw_inputs(sampler, c * n, 1, per_field, gen, dtype=th.dtype, device=th.device)
        xs = xs.reshape(c, n, *xs.shape[1:])  # (c, n, 1, p, *sample)
        cs = torch.randn(c, n, 1, per_field, *out_shape, generator=gen, dtype=torch.float64).to(th)
        try:
            vecs, scales = fn(th, xs, cs)  # (c, n, D), (c, n)
        except FlowgeomError:
            raise
        except Exception as exc:  # no vmap rule, or a forward that is not a pure function of (θ, x)
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise FlowgeomError(f"the module failed under torch.func.vmap while drawing fields: {type(exc).__name__}: {msg}; "
                                "discover needs a pure forward that vmap can batch (`flowgeom laws count` falls back "
                                "to a loop)") from None
        require_finite(vecs, "the fields (gradients)")
        rows = vecs / scales.clamp_min(1e-300)[..., None]
        _, sig, vh = torch.linalg.svd(rows, full_matrices=True)  # sig (c, min(n, D)), vh (c, D, D)
        for i in range(c):
            k = int((sig[i] > tol).sum())
            out.append(vh[i, k:].T)  # (D, D - k)
        if progress is not None:
            progress("fields at random points", offset + len(out), total or m)
    return out


def _candidates(ns: list[torch.Tensor], thetas: torch.Tensor, *, rel_tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, b) pairs, (m, D, D) and (m, D), whose gradient field is symmetric and lies in every N_i.

    ``ns``: D + 1 complements (D, k_i); ``thetas`` (D + 1, D).
    """
    d = thetas.shape[1]
    ncat = torch.cat(ns, dim=1)  # (D, n)
    pi = torch.cat([torch.full((n.shape[1],), i, dtype=torch.long) for i, n in enumerate(ns)])  # (n,)
    if ncat.shape[1] == 0:
        return thetas.new_zeros(0, d, d), thetas.new_zeros(0, d)
    tilde = torch.cat([thetas.T, torch.ones(1, d + 1, dtype=thetas.dtype)], dim=0)  # (D+1, D+1) columns (θ_i, 1)
    t = torch.linalg.inv(tilde)  # (D+1, D+1): [2A | b] = G t
    ta = t[:, :d]  # (D+1, D)
    g1 = (ncat.T @ ncat) * (ta @ ta.T)[pi][:, pi]  # (n, n)
    cx = (ta @ ncat)[pi, :].T  # (n, n): cx[(i,a),(j,b)] = (T N_i)[j, a]
    gram = g1 - cx * cx.T
    gram = 0.5 * (gram + gram.T)
    evals, evecs = torch.linalg.eigh(gram)
    scale = max(float(evals.abs().max()), 1e-300)
    z = evecs[:, evals <= rel_tol * scale]  # (n, m)
    require_memory(4 * 8 * z.shape[1] * d * (d + 1), f"storing the {z.shape[1]:,} candidate laws (each a D × D "
                   f"matrix, D = {d})", MEMORY_FIX)
    g = torch.zeros(z.shape[1], d, d + 1, dtype=thetas.dtype)  # (m, D, D+1) values g_i per candidate
    g.index_add_(2, pi, ncat.unsqueeze(0) * z.T.unsqueeze(1))
    u = g @ t  # (m, D, D+1) = [2A | b]
    a = 0.25 * (u[:, :, :d] + u[:, :, :d].transpose(1, 2))
    return a, u[:, :, d]


def _confirm(a, b, checks: list[tuple[torch.Tensor, torch.Tensor]], *, tol: float):
    """Keep the combinations of candidates whose gradient lies in N_j at the extra points."""
    if a.shape[0] == 0:
        return a, b
    scale = torch.cat([2 * a @ theta + b for theta, _ in checks], dim=1).norm(dim=1).clamp_min(1e-300)  # (m,)
    a, b = a / scale[:, None, None], b / scale[:, None]  # one scale per candidate: combinations stay meaningful
    gs = [2 * a @ theta + b for theta, _ in checks]  # (m, D) gradients at each extra point
    rows = [g - (g @ n) @ n.T for g, (_, n) in zip(gs, checks)]  # residual outside the complement
    r = torch.cat(rows, dim=1)  # (m, extra*D)
    _, s, vh = torch.linalg.svd(r.T, full_matrices=True)
    s = torch.cat([s, s.new_zeros(vh.shape[0] - s.numel())])
    keep = vh[s <= tol]  # (m', m) combinations with no residual
    return torch.einsum("km,mij->kij", keep, a), keep @ b


def _modulo_products(coef: torch.Tensor, iu: torch.Tensor, tol: float = 1e-8) -> tuple[torch.Tensor, int]:
    """Drop products of linear laws from the law space (rows ``coef`` = [monomial coefs | linear coefs]).

    If bᵢᵀθ and bⱼᵀθ are laws, so is their product; it says nothing new. The
    quotient keeps the law space's part orthogonal to those products.
    """
    n_mono = iu.shape[1]
    if coef.shape[0] == 0:
        return coef, 0
    u, s, _ = torch.linalg.svd(coef[:, :n_mono], full_matrices=True)
    s = torch.cat([s, s.new_zeros(u.shape[1] - s.numel())])
    lin = u[:, s <= tol * max(1.0, float(s.max()) if s.numel() else 1.0)].T @ coef[:, n_mono:]  # (l1, D)
    if lin.shape[0] == 0:
        return coef, 0
    lin = torch.linalg.qr(lin.T)[0].T  # orthonormal linear laws
    i, j = torch.triu_indices(lin.shape[0], lin.shape[0])
    quad = 0.5 * (lin[i, :, None] * lin[j, None, :] + lin[j, :, None] * lin[i, None, :])  # (p, D, D)
    prods = quad[:, iu[0], iu[1]] * torch.where(iu[0] == iu[1], 1.0, 2.0).to(coef)  # (p, n_mono)
    prods = torch.cat([prods, prods.new_zeros(prods.shape[0], coef.shape[1] - n_mono)], dim=1)
    q = torch.linalg.qr(prods.T)[0].T  # (p, n) orthonormal
    rest = coef - (coef @ q.T) @ q
    _, s2, vh = torch.linalg.svd(rest, full_matrices=False)
    return vh[s2 > tol * float(s2.max())], prods.shape[0]


def _rref(coef: torch.Tensor, tol: float = 1e-8) -> torch.Tensor:
    """Reduced row echelon form of the rows of ``coef`` (m, n), pivots scaled to 1."""
    m = coef.clone()
    if m.shape[0] == 0:
        return m
    row, floor = 0, tol * float(m.abs().max()) if m.numel() else 0.0
    live = torch.nonzero(m.abs().amax(0) > floor).flatten().tolist()  # columns that can hold a pivot
    for col in live:
        if row == m.shape[0]:
            break
        piv = row + int(m[row:, col].abs().argmax())
        if m[piv, col].abs() <= floor:
            continue
        m[[row, piv]] = m[[piv, row]]
        m[row] /= m[row, col].clone()
        others = torch.arange(m.shape[0]) != row
        m[others] -= m[others, col : col + 1] * m[row]
        row += 1
    return m[:row]


def _sparse_rref(coef: torch.Tensor, iu: torch.Tensor, layout: ParamLayout) -> torch.Tensor:
    """The sparsest of the RREFs of ``coef`` under a few column orders: as laid out, reversed,
    and each parameter tensor's monomials first.

    An RREF's pivots follow the column order. On a LayerNorm MLP, pivoting the hidden units'
    laws on their up_proj columns drags every one of them into the law of LayerNorm
    feature 0 (an 11-term sum); with down_proj's columns first each law keeps its own
    terms. Which tensor to put first depends on the module, so each is tried (one RREF
    per parameter tensor, cheap next to the solve) and the fewest non-zeros win.
    """
    if coef.shape[0] < 2:
        return _rref(coef)
    block = torch.repeat_interleave(torch.arange(len(layout.names)), torch.tensor(layout.numels))  # (D,) tensor of each coordinate
    # each column's tensors: a monomial θ_a θ_b reads block(a) and block(b); a linear term θ_a reads block(a)
    col_a = torch.cat([block[iu[0]], block])
    col_b = torch.cat([block[iu[1]], block])
    n = coef.shape[1]
    orders = [torch.arange(n), torch.arange(n - 1, -1, -1)]
    for p in range(len(layout.names)):
        first = (col_a == p) | (col_b == p)
        orders.append(torch.cat([torch.nonzero(first).flatten(), torch.nonzero(~first).flatten()]))
    best, best_nnz = None, None
    for order in orders:
        reduced = _rref(coef[:, order])
        rows = torch.zeros(reduced.shape[0], n, dtype=coef.dtype)
        rows[:, order] = reduced
        nnz = int((rows.abs() > 1e-8 * float(rows.abs().max())).sum())
        if best_nnz is None or nnz < best_nnz:
            best, best_nnz = rows, nnz
    return best


def _sparsify(rows: torch.Tensor, tol: float = 1e-8, max_rounds: int = 20) -> torch.Tensor:
    """An equivalent basis (same span) with fewer non-zero coefficients, greedily.

    The RREF's pivots follow the column order, not the symmetry: on a LayerNorm MLP
    the law of LayerNorm feature 0 comes out as its own law minus every hidden unit's
    rescaling law, an 11-term sum. Here each row r_i is replaced by r_i − c·r_j
    (j ≠ i, so the span and the rank stay) whenever that lowers its count of
    non-zeros; c is the most frequent ratio r_i/r_j over their common support (the
    one that cancels most terms). Rounds repeat until nothing improves. Finding the
    sparsest basis is NP-hard in general; on block-structured laws (per unit, per
    head, per feature) this greedy pass reaches one law per symmetry.
    """
    m = rows.clone()
    if m.shape[0] < 2 or m.shape[0] ** 2 * m.shape[1] > 2e9:  # a pass is m² row operations: keep it to seconds
        return m
    floor = tol * float(m.abs().max())
    m[m.abs() <= floor] = 0
    for _ in range(max_rounds):
        improved = False
        for i in range(m.shape[0]):
            for j in range(m.shape[0]):
                if i == j:
                    continue
                common = (m[i] != 0) & (m[j] != 0)
                if not bool(common.any()):
                    continue
                ratios = (m[i][common] / m[j][common]).double()
                keys = torch.round(ratios * 1e6)  # equal up to rounding: one candidate
                values, counts = torch.unique(keys, return_counts=True)
                c = float(ratios[keys == values[counts.argmax()]].mean())
                cand = m[i] - c * m[j]
                cand[cand.abs() <= floor] = 0
                if 0 < int((cand != 0).sum()) < int((m[i] != 0).sum()):
                    m[i], improved = cand, True
        if not improved:
            break
    for i in range(m.shape[0]):  # canonical scale: largest coefficient 1 in size, first non-zero positive
        nz = torch.nonzero(m[i]).flatten()
        m[i] = m[i] / m[i].abs().max() * (1 if m[i, nz[0]] > 0 else -1)
    return m


def _reads(q: torch.Tensor, b: torch.Tensor, layout: ParamLayout, tol: float = 1e-8) -> tuple[str, ...]:
    """The parameter tensors with a non-zero coefficient in h = θᵀQθ + bᵀθ, in module order."""
    offs = layout.offsets()
    used = (q.abs().amax(0) > tol) | (b.abs() > tol)  # (D,)
    return tuple(name for name, o, n in zip(layout.names, offs, layout.numels) if bool(used[o : o + n].any()))


def _grouped(laws: list[DiscoveredLaw], layout: ParamLayout) -> list[DiscoveredLaw]:
    """Laws ordered by the group of parameter tensors they read (groups in module order), then as found."""
    order = {name: i for i, name in enumerate(layout.names)}
    return sorted(laws, key=lambda law: tuple(order[p] for p in law.params))


def to_latex(formula: str) -> str:
    r"""A law's formula (as printed) in LaTeX math: ‖x‖² → \lVert x \rVert^2, names in \mathtt."""
    import re

    def name(m: re.Match) -> str:
        return r"\mathtt{" + m.group(0).replace("_", r"\_") + "}"

    out = re.sub(r"[A-Za-z_][A-Za-z0-9_.]*(?![A-Za-z0-9_.])", name, formula)
    # ‖ opens and closes in turn
    parts = out.split("‖")
    out = "".join(p + ((r"\lVert " if k % 2 == 0 else r" \rVert") if k < len(parts) - 1 else "") for k, p in enumerate(parts))
    for old, new in (("²", "^2"), ("−", "-"), ("Σ ", r"\sum "), ("⟨", r"\langle "), ("⟩", r" \rangle"),
                     ("·", r" \cdot "), ("…", r"\dots")):
        out = out.replace(old, new)
    return out


def _num(c: float, first: bool) -> str:
    sign = "−" if c < 0 else ("" if first else "+")
    mag = abs(c)
    body = "" if abs(mag - 1) < 1e-6 else (f"{round(mag)}·" if abs(mag - round(mag)) < 1e-6 else f"{mag:.4g}·")
    return (sign + (" " if sign and not first else "") + body) if not first else (sign + body)


def _index(shape, i, axis) -> str:
    if len(shape) == 0:
        return ""
    if len(shape) == 1:
        return f"[{i}]"
    return f"[{i},:]" if axis == "row" else f"[:,{i}]"


def format_law(q: torch.Tensor, b: torch.Tensor, layout: ParamLayout, tol: float = 1e-8) -> str:
    """h = θᵀQθ + bᵀθ written with parameter names: norms, Gram entries, sums, else coefficients."""
    terms: list[tuple[float, str]] = []
    offs, names, shapes = layout.offsets(), layout.names, layout.shapes
    mats = [(s[0], s[1]) if len(s) == 2 else (s[0] if s else 1, int(torch.tensor(s[1:]).prod()) if len(s) > 1 else 1)
            for s in shapes]
    for p in range(len(names)):
        for r in range(p, len(names)):
            blk = q[offs[p] : offs[p] + layout.numels[p], offs[r] : offs[r] + layout.numels[r]]
            blk = blk if p == r else 2 * blk
            if blk.abs().max() <= tol:
                continue
            (rp, cp), (rr, cr) = mats[p], mats[r]
            b4 = blk.reshape(rp, cp, rr, cr)
            options = []
            if cp == cr:  # row Gram: blk[i,k,j,l] = M[i,j] δ_kl
                mm = b4[:, 0, :, 0]
                if (b4 - mm[:, None, :, None] * torch.eye(cp, dtype=q.dtype)[None, :, None, :]).abs().max() <= tol:
                    options.append(_gram_terms(mm, names[p], names[r], shapes[p], p == r, "row", tol))
            if rp == rr:  # column Gram: blk[i,k,j,l] = δ_ij M[k,l]
                mm = b4[0, :, 0, :]
                if (b4 - torch.eye(rp, dtype=q.dtype)[:, None, :, None] * mm[None, :, None, :]).abs().max() <= tol:
                    options.append(_gram_terms(mm, names[p], names[r], shapes[p], p == r, "col", tol))
            done = bool(options)
            if options:
                terms += min(options, key=len)
            if not done:
                terms += _monomials(blk, p, r, layout, tol)
    for p, name in enumerate(names):
        v = b[offs[p] : offs[p] + layout.numels[p]].reshape(mats[p])
        if v.abs().max() <= tol:
            continue
        cols = v.abs().amax(0) > tol
        if v.shape[0] > 1 and ((v - v[:1]).abs().max() <= tol):  # constant down each column: column sums
            terms += [(float(v[0, k]), f"Σ {name}[:,{k}]" if len(shapes[p]) > 1 else f"Σ {name}") for k in torch.nonzero(cols).flatten().tolist()]
        else:
            terms += [(float(v.flatten()[i]), f"{name}{list(layout.coordinate(offs[p] + i)[1]) if shapes[p] else ''}")
                      for i in torch.nonzero(v.flatten().abs() > tol).flatten().tolist()]
    if not terms:
        return "0"
    scale = max(abs(c) for c, _ in terms)
    return " ".join(_num(c / scale, i == 0) + t for i, (c, t) in enumerate(terms))


def _gram_terms(mm, pn, rn, shape, same, axis, tol) -> list[tuple[float, str]]:
    out = []
    for i in range(mm.shape[0]):
        for j in range(mm.shape[1]):
            if same and j < i:
                continue
            c = float(mm[i, j]) * (2 if same and i != j else 1)
            if abs(c) <= tol:
                continue
            if same and i == j:
                base = f"{pn}{_index(shape, i, axis)}"
                out.append((c, f"{base}²" if len(shape) <= 1 else f"‖{base}‖²"))
            else:
                out.append((c, f"⟨{pn}{_index(shape, i, axis)}, {rn}{_index(shape, j, axis)}⟩"))
    return out


def _monomials(blk, p, r, layout, tol, limit=12) -> list[tuple[float, str]]:
    offs = layout.offsets()
    idx = torch.nonzero(blk.abs() > tol).tolist()
    out = []
    for i, j in idx:
        if p == r and j < i:
            continue
        c = float(blk[i, j]) * (2 if p == r and i != j else 1)
        (n1, k1), (n2, k2) = layout.coordinate(offs[p] + i), layout.coordinate(offs[r] + j)
        a1, a2 = (f"{n}{list(k)}" if k else n for n, k in ((n1, k1), (n2, k2)))
        out.append((c, f"{a1}²" if (p == r and i == j) else f"{a1}·{a2}"))
    return out[:limit] + ([(0.0, f"… ({len(out) - limit} more terms)")] if len(out) > limit else [])


def complements_memory(d: int, points: int, sampler: Sampler, out_shape, *, chunk: int = 16, per_field: int = 16) -> int:
    """Bytes of :func:`_complements`: one chunk's inputs, fields and batched SVD, plus every N_i at worst (D, D)."""
    n = d + 8  # fields per point
    c = min(chunk, points)
    io = io_estimate(sampler, out_shape, c * n * per_field)
    return io + 8 * (c * (3 * n * d + n * n + d * d) + points * d * d)


def _violation(laws, model, sampler, out_shape, gen, *, dtype, device) -> float:
    """Independent check: max |⟨∇h, X⟩| / (‖∇h‖ ‖X‖) over fresh points and fields."""
    worst = 0.0
    for _ in range(2):
        theta = model.layout.flatten(random_point(model.module, gen)).to(device=device, dtype=dtype)
        fields = FieldSource(model, theta, sampler, out_shape, gen, per_field=4, dtype=dtype, device=device).block(0, 32)[0]
        for law in laws:
            grad = 2 * law.quadratic.to(theta) @ theta + law.linear.to(theta)
            dots = (fields @ grad).abs() / (fields.norm(dim=1) * grad.norm()).clamp_min(1e-300)
            worst = max(worst, float(dots.max()))
    return worst


def discover(
    module: nn.Module,
    sample_input: Sampler | None = None,
    *,
    degree: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    extra_points: int = 4,
    max_parameters: int = 300,
    input_shape: Sequence[int] | None = None,
    progress=None,
    expected: int | None = None,
) -> DiscoverResult:
    """A sparse basis of the polynomial laws θᵀAθ + bᵀθ (``degree`` 2) or bᵀθ (``degree`` 1).

    Inputs as in :func:`flowgeom.laws.count.count`: ``input_shape`` (one input, without the
    batch dimension), a ``sample_input(n, generator)`` callable, or the module's own method.
    ``progress(stage, done, total)`` is called as the points' fields are drawn.
    """
    start = time.perf_counter()
    if degree not in (1, 2):
        raise FlowgeomError(f"degree {degree!r} is not supported; choose 1 (linear) or 2 (quadratic) laws")
    positive_int(extra_points, "extra_points")
    positive_int(max_parameters, "max_parameters")
    generator(seed)  # a bad seed is refused before any work
    device = torch.device(device)
    work, sampler, frozen = prepare(module, sample_input, dtype=dtype, device=device, input_shape=input_shape)
    model = FieldModel(work)
    d = model.layout.size
    if d > max_parameters:
        raise InputError(f"discover solves for (D+1)·laws unknowns with D + 1 law counts; D = {d:,} exceeds the "
                         f"limit of {max_parameters} parameters",
                         python_fix=f"pass max_parameters={d} (the solve grows as D³), use a smaller instance, or "
                                    "count() the laws instead",
                         cli_fix=f"pass --max-parameters {d} (the solve grows as D³), use a smaller instance, or "
                                 "`flowgeom laws count`")
    gen = torch.Generator().manual_seed(seed)
    tol = DEFAULT_TOL.get(dtype, 1e-6)
    theta0 = model.layout.flatten(random_point(work, gen)).to(device=device, dtype=dtype)
    out_shape = probe_output(model, theta0, sampler, gen, dtype=dtype, device=device)
    n_points = (d + 1 if degree == 2 else 1) + extra_points
    require_memory(complements_memory(d, n_points, sampler, out_shape),
                   f"computing the field complements of D = {d:,} parameters", MEMORY_FIX, device=device)
    thetas = torch.stack([theta0] + [model.layout.flatten(random_point(work, gen)).to(device=device, dtype=dtype)
                                     for _ in range(n_points - 1)])  # (M, D)
    ns = _complements(model, thetas[:16], sampler, out_shape, gen, tol=tol, progress=progress,
                      total=n_points)  # first chunk: the size of the system
    system = f"solving the symmetry system of about {{:,}} unknowns (D + 1 = {d + 1} points × the complement of W(θ))"
    if degree == 2:  # k_i is generic: the first points predict Σ k_i before the other D + 1 - 16 are drawn
        guess = (d + 1) * max(n.shape[1] for n in ns)
        require_memory(8 * 8 * guess**2, system.format(guess), MEMORY_FIX)
    ns += _complements(model, thetas[16:], sampler, out_shape, gen, tol=tol, progress=progress, offset=16,
                       total=n_points) if n_points > 16 else []
    if progress is not None:
        progress("solving the symmetry system", n_points, n_points)
    if degree == 2:
        unknowns = sum(n.shape[1] for n in ns[: d + 1])
        require_memory(8 * 8 * unknowns**2, system.format(unknowns), MEMORY_FIX)
        a, b = _candidates([n.cpu() for n in ns[: d + 1]], thetas[: d + 1].cpu(), rel_tol=1e-10)
    else:  # linear laws: b in the span of N_0, A = 0
        b = ns[0].T.cpu()
        a = b.new_zeros(b.shape[0], d, d)
    checks = [(th.cpu(), n.cpu()) for th, n in zip(thetas[-extra_points:], ns[-extra_points:])]
    a, b = _confirm(a, b, checks, tol=1e-7)
    iu = torch.triu_indices(d, d)
    mono = a[:, iu[0], iu[1]] * torch.where(iu[0] == iu[1], 1.0, 2.0).to(a)  # (m, D(D+1)/2) monomial coefficients
    coef, n_products = _modulo_products(torch.cat([mono, b], dim=1), iu)
    basis = _sparsify(_sparse_rref(coef, iu, model.layout))
    laws = []
    for row in basis:
        q = torch.zeros(d, d, dtype=row.dtype)
        q[iu[0], iu[1]] = row[: iu.shape[1]] / torch.where(iu[0] == iu[1], 1.0, 2.0).to(row)
        q = q + q.triu(1).T
        lin = row[iu.shape[1] :]
        laws.append(DiscoveredLaw(format_law(q, lin, model.layout), q, lin, _reads(q, lin, model.layout)))
    laws = _grouped(laws, model.layout)
    worst = _violation(laws, model, sampler, out_shape, gen, dtype=dtype, device=device) if laws else 0.0
    notes = frozen_note(frozen)
    if worst >= 1e-6:
        notes.append(f"largest violation {worst:.1e}: some laws may be approximate (near-laws)")
    if n_products:
        notes.append(f"{n_products} products of linear laws (also conserved) are left out of the basis")
    return DiscoverResult(parameters=d, laws=laws, expected=expected_laws(module, expected), max_violation=worst,
                          seconds=time.perf_counter() - start, seed=seed, points=n_points, notes=notes)
