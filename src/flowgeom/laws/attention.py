"""Conservation laws of attention (the zoo's MHA and every Hugging Face family) and gated-MLP blocks.

One implementation: the zoo's :class:`~flowgeom.nn.attention.MultiHeadAttention`
is the case G = H, no bias, d_v possibly ≠ d_k, full or no RoPE, of the same
:class:`AttentionSpec`; only its labels (per head, the catalogue's own
wording) differ (:func:`zoo_attention_entry`).

Notation (weights ``(out, in)``; a GPT-2 ``Conv1D`` stores ``(in, out)`` and
is read transposed). H query heads in G = ``num_key_value_heads`` groups of
H/G; head i uses K/V head g(i) = i // (H/G). Q_i, K_g, V_g are the
(d_k × d_model) row blocks of the projections, O_i the (d_model × d_v)
column block of the output projection. A bias is a column on the constant
input: Q̃_i = [Q_i | bq_i], Ṽ_g = [V_g | bv_g].

**Q/K, no RoPE (GQA).** Scores are q_iᵀk_g = x̃ᵀQ̃_iᵀK̃_g ỹ. For any
invertible M (d_k × d_k), K̃_g → M K̃_g with Q̃_i → M^{-T} Q̃_i for *all* i ∈ g
leaves the block unchanged. Its generator A gives ⟨∇L, δθ⟩ = 0, i.e.
G_K K̃ᵀ = Σ_{i∈g} Q̃_i G_{Q_i}ᵀ, hence d/dt (Σ_{i∈g} Q̃_iQ̃_iᵀ − K̃_gK̃_gᵀ) = 0:
d_k(d_k+1)/2 laws per group. The **k bias** adds q_iᵀbk_g to every key's
score, a constant under the softmax: its gradient is identically zero, so
bk_g is conserved component by component (d_k trivial laws per group, family
``attn.k_bias``) and K_g enters the matrix law without it.

**Q/K with RoPE.** q, k are rotated by R(pos) (rotate_half layout: pair j is
dims (j, j + r/2) of the r rotated dims). Only M commuting with every R(pos)
survives: on each pair, aI + bJ (J the 2×2 rotation generator). The
symmetric part aI gives Σ_{i∈g}‖Q̃_i^(j)‖² − ‖K̃_g^(j)‖² (r/2 laws per group);
the skew part gives nothing. **Partial rotary** (GPT-NeoX, Phi-3 with
``partial_rotary_factor`` < 1): the d_k − r unrotated dims keep the full
matrix law on that sub-block (M block-diagonal), and there the k bias is again
a constant shift (trivially conserved components).

**V/O.** The block's output is Σ_i O_i Σ_t a_{it} Ṽ_{g(i)} ỹ_t (+ bo), since
Σ_t a_{it} = 1 carries the v bias. Ṽ_g → M Ṽ_g, O_i → O_i M^{-1} (i ∈ g):
Ṽ_gṼ_gᵀ − Σ_{i∈g} O_iᵀO_i, d_v(d_v+1)/2 laws per group. bo: no law.

**Per-head QK-norm** (Qwen3: q = γ_q ⊙ RMSNorm(Q_i x) over the head's d_k,
then RoPE). RMSNorm is scale invariant, so ‖Q_i‖²_F (per query head) and
‖K_g‖²_F (per group) are conserved — they can *not* serve as controls; the
Q–K matrix / block laws die (M must preserve the per-head norm). The norm
weights, shared by all heads, obey per rotation pair j
‖γ_q^(j)‖² − ‖γ_k^(j)‖² (d_k/2 laws; per unrotated dim d, γ_q[d]² − γ_k[d]²).
**Full-width QK-norm** (OLMoE: RMSNorm over all H·d_k query dims, and over
the G·d_k key dims): ‖W_Q‖²_F and ‖W_K‖²_F whole, and per group g and pair j
Σ_{i∈g}‖γ_q^(i,j)‖² − ‖γ_k^(g,j)‖². The scale laws are exact only for
RMSNorm eps = 0 (broken at relative order eps/mean(q²) otherwise): they are
claimed only when the norms' eps is 0; the γ laws hold for any eps.

**Precision.** Laws whose orthogonality rests on a softmax shift or a norm's
scale invariance (k bias, the unrotated Q–K sub-block, the QK-norm scale
laws) hold in float64 only up to float32 rounding in transformers' eager code
(softmax and RMSNorm upcast to float32: ~1e-9 relative); run the module under
:func:`flowgeom.laws.precision.keep_dtype` to see them at round-off.

**Gated MLP** (SwiGLU, GeGLU, Phi-3 fused ``gate_up_proj``: out =
down(act(gate x) ⊙ up x)): scaling up[i,:] by s and down[:,i] by 1/s is a
symmetry for any activation, so ‖up[i,:]‖² − ‖down[:,i]‖² per hidden unit
(m laws). A two-layer GELU MLP has none (seed 000).

Controls (not conserved, must move at first order): ‖W_Q‖²_F of the query
rows (Q side; ‖γ_q‖² with QK-norm), ‖V_0‖²_F of the first K/V head (V/O
side; its first row under MQA), ‖gate‖²_F for the MLP. Not ‖W_V‖²_F whole:
with a norm on the attention output (Gemma2's sandwich
``post_attention_layernorm``) V → sV is a symmetry up to the norm's eps, so
‖W_V‖²_F (and ‖W_O‖²_F) are conserved up to O(eps) there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from flowgeom.errors import FlowgeomError
from flowgeom.laws.batched import Batch, flat, gram_diff, rownorm_diff, sq_norm
from flowgeom.laws.law import CatalogueEntry, Law, Params, join, norm_control, upper


def _contiguous(idx: Tensor) -> bool:
    """True when the (heads, d) index grid is one increasing run start, start+1, …"""
    run = idx.reshape(-1)
    return run.numel() > 0 and int(run[-1] - run[0]) == run.numel() - 1 and bool((run.diff() == 1).all())


def _plan(rows: Tensor) -> tuple[int, int] | Tensor:
    """How to take ``rows`` (heads, d) from a weight: (start, stop) of a slice when contiguous, else the index."""
    return (int(rows[0, 0]), int(rows[-1, -1]) + 1) if _contiguous(rows) else rows


def _key(which: slice, dims: slice | None) -> tuple:
    # slices, not index tensors: the key is built on every evaluation, so it must be cheap
    return which.start, which.stop, which.step, None if dims is None else (dims.start, dims.stop, dims.step)


@dataclass(frozen=True)
class Proj:
    """The per-head rows of one projection inside a (possibly fused) weight.

    ``rows``: (heads, d_k) indices along the weight's output axis ``axis``
    (0 for ``nn.Linear``, 1 for GPT-2 ``Conv1D``); ``bias`` indexed the same way.
    """

    weight: str
    rows: Tensor
    axis: int = 0
    bias: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "_plans", {})  # (which, dims) -> (rows, slice bounds or index), computed once

    def _rows(self, which: slice, dims: slice | None) -> tuple[Tensor, tuple[int, int] | Tensor]:
        key = _key(which, dims)
        if key not in self._plans:
            rows = self.rows[which] if dims is None else self.rows[which][:, dims]  # (heads, d)
            self._plans[key] = (rows, _plan(rows))
        return self._plans[key]

    def heads(self, p: Params, *, with_bias: bool = True, dims: slice | None = None, which: slice = slice(None)
              ) -> Tensor:
        """(heads, d, d_in[+1]) matrices of the heads ``which``, restricted to ``dims`` of each head."""
        rows, plan = self._rows(which, dims)
        w = p[self.weight] if self.axis == 0 else p[self.weight].T  # (out, in)
        if isinstance(plan, tuple):  # a view, no gather (the common separate-projection case)
            m = w[plan[0]:plan[1]].reshape(*rows.shape, w.shape[1])  # (heads, d, d_in)
        else:
            m = w[rows]  # (heads, d, d_in)
        if with_bias and self.bias is not None:
            m = torch.cat([m, p[self.bias][rows][..., None]], dim=-1)  # (heads, d, d_in + 1)
        return m

    def taker(self, *, with_bias: bool = True, dims: slice | None = None, which: slice = slice(None)
              ) -> Callable[[Params], Tensor]:
        """``p -> self.heads(p, ...)`` with the plan fixed once: a law evaluates it every step."""
        rows, plan = self._rows(which, dims)
        if self.axis == 0 and (self.bias is None or not with_bias) and isinstance(plan, tuple):
            name, (a, b), shape = self.weight, plan, rows.shape
            return lambda p: p[name][a:b].reshape(*shape, -1)  # (heads, d, d_in): a view
        return lambda p: self.heads(p, with_bias=with_bias, dims=dims, which=which)

    @property
    def params(self) -> tuple[str, ...]:
        return (self.weight,) + ((self.bias,) if self.bias else ())


@dataclass(frozen=True)
class OutProj:
    """The per-head input columns of the output projection: ``cols`` (heads, d_v)."""

    weight: str
    cols: Tensor
    axis: int = 1  # axis of the weight holding the input features (1 Linear, 0 Conv1D)

    def __post_init__(self):
        object.__setattr__(self, "_plans", {})

    def heads(self, p: Params, which: slice = slice(None)) -> Tensor:
        """(heads, d_model, d_v) blocks O_i of the heads ``which``."""
        w = p[self.weight] if self.axis == 1 else p[self.weight].T  # (out, in)
        key = _key(which, None)
        if key not in self._plans:
            self._plans[key] = (self.cols[which], _plan(self.cols[which]))
        cols, plan = self._plans[key]  # (heads, d_v)
        if isinstance(plan, tuple):
            return w[:, plan[0]:plan[1]].reshape(w.shape[0], *cols.shape).permute(1, 0, 2)
        return w[:, cols].permute(1, 0, 2)  # (heads, d_model, d_v)

    def taker(self, which: slice = slice(None)) -> Callable[[Params], Tensor]:
        """``p -> self.heads(p, which)`` with the plan fixed once."""
        cols = self.cols[which]
        plan = _plan(cols)
        if self.axis == 1 and isinstance(plan, tuple):
            name, (a, b), shape = self.weight, plan, cols.shape
            return lambda p: p[name][:, a:b].reshape(-1, *shape).permute(1, 0, 2)  # (heads, d_model, d_v)
        return lambda p: self.heads(p, which)


@dataclass(frozen=True)
class AttentionSpec:
    """Everything the laws need about one attention block (built by ``locate``).

    ``rotary``: rotated dims per head (0: none); ``qk_norm``: none | per_head |
    full with the norm weights ``q_norm``/``k_norm`` ((d_k,) per head, or
    (H·d_k,), (G·d_k,) full width).
    """

    block: str
    q: Proj
    k: Proj
    v: Proj
    o: OutProj
    heads: int
    kv_heads: int
    head_dim: int
    rotary: int = 0
    qk_norm: str = "none"
    q_norm: str | None = None
    k_norm: str | None = None
    norm_eps: float = 0.0  # the QK RMSNorms' eps: the scale laws ‖Q‖², ‖K‖² are claimed only at eps = 0
    v_dim: int | None = None  # per-head V/O width (the zoo's d_v); None: head_dim
    labels: str = "group"  # "group": per K/V group (HF); "head": the zoo catalogue's per-head wording

    @property
    def d_v(self) -> int:
        return self.head_dim if self.v_dim is None else self.v_dim

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise FlowgeomError(f"{self.block}: {self.heads} query heads are not a multiple of {self.kv_heads} K/V heads")
        if self.rotary % 2 or not 0 <= self.rotary <= self.head_dim:
            raise FlowgeomError(f"{self.block}: rotary dims {self.rotary} must be even and ≤ head_dim {self.head_dim}")
        if self.qk_norm not in ("none", "per_head", "full"):
            raise FlowgeomError(f"{self.block}: unknown qk_norm {self.qk_norm!r}; choose none, per_head or full")


def _law(family: str, name: str, formula: str, count: int, params: tuple[str, ...], fn, status: str = "law",
         batch: Batch | None = None, degree: int = 2) -> Law:
    return Law(family=family, name=name, formula=formula, count=count, params=tuple(dict.fromkeys(params)), fn=fn,
               status=status, batch=batch, degree=degree)


def _groups(s: AttentionSpec, x: Tensor) -> Tensor:
    """(H, ...) -> (G, H/G, ...)."""
    return x.reshape(s.kv_heads, s.heads // s.kv_heads, *x.shape[1:])


def _qs(s: AttentionSpec, g: int) -> slice:
    """The query heads of K/V group g."""
    n = s.heads // s.kv_heads
    return slice(g * n, (g + 1) * n)


def _qk_laws(s: AttentionSpec, g: int) -> list[Law]:
    """The Q/K laws of K/V group g: per rotation pair, the matrix law on the unrotated dims, the k bias."""
    d, r = s.head_dim, s.rotary
    half = r // 2
    rot, free = slice(0, r), slice(r, d)  # the rotated and the unrotated dims of each head
    laws: list[Law] = []
    qk = s.q.params + s.k.params
    if r:
        q_rot, k_rot = s.q.taker(dims=rot, which=_qs(s, g)), s.k.taker(dims=rot, which=slice(g, g + 1))

        def block_law(p: Params) -> Tensor:
            qn = (q_rot(p) ** 2).sum(-1).sum(0)  # (r,) Σ_i row norms
            kn = (k_rot(p)[0] ** 2).sum(-1)  # (r,)
            h = qn - kn
            return h[:half] + h[half:]  # pair j = dims (j, j + r/2)

        def block_ops(p: Params) -> tuple[Tensor, Tensor]:
            return q_rot(p), k_rot(p)

        if s.labels == "head":
            q, k = s.q.weight, s.k.weight
            name, formula = (f"head {g}: ‖Q_{g}^(j)‖²_F − ‖K_{g}^(j)‖²_F",
                             f"‖{q}[rows j, j+{half} of head {g}]‖²_F − same for {k}, j < {half}")
        else:
            name, formula = (f"{s.block} group {g}: Σ_i∈g ‖Q̃_i^(j)‖² − ‖K̃_g^(j)‖²",
                             f"per rotation pair j < {half} (with biases as a column)")
        laws.append(_law("attn.qk_rope", name, formula, half, qk, block_law, batch=Batch(rownorm_diff, block_ops, (half,))))
    if d - r:
        n = d - r
        q_free = s.q.taker(dims=free, which=_qs(s, g))  # (H/G, n, d_in[+1])
        k_free = s.k.taker(with_bias=False, dims=free, which=slice(g, g + 1))  # (1, n, d_in)

        def matrix_law(p: Params) -> Tensor:
            Q, K = q_free(p), k_free(p)[0]
            return upper((Q @ Q.transpose(-1, -2)).sum(0) - K @ K.T)

        def matrix_ops(p: Params) -> tuple[Tensor, Tensor]:
            return q_free(p), k_free(p)

        where = "" if not r else f" on the {n} unrotated dims"
        if s.labels == "head":
            rows = s.q.rows[g]
            name, formula = (f"head {g}: Q_{g}Q_{g}ᵀ − K_{g}K_{g}ᵀ",
                             f"Q_iQ_iᵀ − K_iK_iᵀ, Q_i = {s.q.weight}[{int(rows[0])}:{int(rows[-1]) + 1}, :] "
                             "(paper: Q_iᵀQ_i − K_iᵀK_i)")
        else:
            name, formula = (f"{s.block} group {g}: Σ_i∈g Q̃_iQ̃_iᵀ − K_gK_gᵀ{where}",
                             "Σ_i∈g [Q_i|bq_i][Q_i|bq_i]ᵀ − K_gK_gᵀ")
        laws.append(_law("attn.qk", name, formula, n * (n + 1) // 2, qk, matrix_law, batch=Batch(gram_diff, matrix_ops)))
        if s.k.bias is not None:
            kb = s.k.bias

            def kbias(p: Params) -> Tensor:
                return p[kb][s.k.rows[g, free]]  # (n,)

            laws.append(_law("attn.k_bias", f"{s.block} group {g}: bk_g{where} (softmax shift, gradient ≡ 0)",
                             "bk_g component by component", n, (kb,), kbias,
                             batch=Batch(flat, lambda p, f=kbias: (f(p),)), degree=1))
    return laws


def _qk_norm_laws(s: AttentionSpec) -> list[Law]:
    """Scale invariance of the normalised projections and the γ_q/γ_k rescalings."""
    d, r, H, G = s.head_dim, s.rotary, s.heads, s.kv_heads
    half = r // 2
    laws: list[Law] = []
    qn, kn = s.q_norm, s.k_norm
    exact = s.norm_eps == 0
    if s.qk_norm == "per_head" and exact:
        laws.append(_law("attn.q_scale", f"{s.block}: ‖Q_i‖²_F per query head (RMSNorm scale invariance)",
                         "‖Q_i‖²_F, i < H", H, s.q.params, lambda p: (s.q.heads(p, with_bias=False) ** 2).sum((1, 2)),
                         batch=Batch(sq_norm, lambda p: (s.q.heads(p, with_bias=False),))))
        laws.append(_law("attn.k_scale", f"{s.block}: ‖K_g‖²_F per K/V head (RMSNorm scale invariance)",
                         "‖K_g‖²_F, g < G", G, s.k.params, lambda p: (s.k.heads(p, with_bias=False) ** 2).sum((1, 2)),
                         batch=Batch(sq_norm, lambda p: (s.k.heads(p, with_bias=False),))))
    if s.qk_norm == "per_head":
        def gamma(p: Params) -> Tensor:
            h = p[qn] ** 2 - p[kn] ** 2  # (d,)
            return torch.cat([h[:half] + h[half:r], h[r:]])

        laws.append(_law("attn.qk_norm_gamma", f"{s.block}: ‖γ_q^(j)‖² − ‖γ_k^(j)‖²",
                         "per rotation pair j (and per unrotated dim)", half + d - r, (qn, kn), gamma,
                         batch=Batch(rownorm_diff, lambda p: (p[qn].reshape(1, d, 1), p[kn].reshape(1, d, 1)),
                                     (half,))))
        return laws
    if exact:  # full width
        laws.append(_law("attn.q_scale", f"{s.block}: ‖W_Q‖²_F (full-width RMSNorm scale invariance)", "‖W_Q‖²_F", 1,
                         s.q.params, lambda p: (s.q.heads(p, with_bias=False) ** 2).sum().reshape(1),
                         batch=Batch(sq_norm, lambda p: (s.q.heads(p, with_bias=False)[None],))))
        laws.append(_law("attn.k_scale", f"{s.block}: ‖W_K‖²_F (full-width RMSNorm scale invariance)", "‖W_K‖²_F", 1,
                         s.k.params, lambda p: (s.k.heads(p, with_bias=False) ** 2).sum().reshape(1),
                         batch=Batch(sq_norm, lambda p: (s.k.heads(p, with_bias=False)[None],))))

    def gamma_full(p: Params) -> Tensor:
        gq = (_groups(s, p[qn].reshape(H, d)) ** 2).sum(1)  # (G, d) Σ_i∈g γ_q²
        h = gq - p[kn].reshape(G, d) ** 2  # (G, d)
        return torch.cat([h[:, :half] + h[:, half:r], h[:, r:]], dim=1).reshape(-1)

    laws.append(_law("attn.qk_norm_gamma", f"{s.block}: Σ_i∈g ‖γ_q^(i,j)‖² − ‖γ_k^(g,j)‖²",
                     "per group and rotation pair j (and per unrotated dim)", G * (half + d - r), (qn, kn), gamma_full))
    return laws


def _vo_law(s: AttentionSpec, g: int) -> Law:
    """Ṽ_gṼ_gᵀ − Σ_i∈g O_iᵀO_i of K/V group g."""
    d = s.d_v
    v_g, o_g = s.v.taker(which=slice(g, g + 1)), s.o.taker(which=_qs(s, g))

    def vo(p: Params) -> Tensor:
        V, O = v_g(p)[0], o_g(p)  # (d_v, d_in[+1]), (H/G, d_model, d_v)
        return upper(V @ V.T - (O.transpose(-1, -2) @ O).sum(0))

    def vo_ops(p: Params) -> tuple[Tensor, Tensor]:
        return v_g(p), o_g(p).transpose(-1, -2)

    if s.labels == "head":
        a, b = int(s.v.rows[g, 0]), int(s.v.rows[g, -1]) + 1
        name, formula = (f"head {g}: V_{g}V_{g}ᵀ − O_{g}ᵀO_{g}",
                         f"V_iV_iᵀ − O_iᵀO_i, V_i = {s.v.weight}[{a}:{b}, :], O_i = {s.o.weight}[:, {a}:{b}]")
    else:
        name, formula = f"{s.block} group {g}: Ṽ_gṼ_gᵀ − Σ_i∈g O_iᵀO_i", "[V_g|bv_g][V_g|bv_g]ᵀ − Σ_i∈g O_iᵀO_i"
    return _law("attn.vo", name, formula, d * (d + 1) // 2, s.v.params + (s.o.weight,), vo,
                batch=Batch(gram_diff, vo_ops))


def _attention_laws(s: AttentionSpec) -> list[Law]:
    """Per K/V group its Q/K laws then its V/O law; with a QK-norm, the norm laws then every V/O law."""
    if s.qk_norm != "none":
        return _qk_norm_laws(s) + [_vo_law(s, g) for g in range(s.kv_heads)]
    return [law for g in range(s.kv_heads) for law in _qk_laws(s, g) + [_vo_law(s, g)]]


def zoo_attention_entry(prefix: str, *, heads: int, d_k: int, d_v: int, positions: str) -> CatalogueEntry:
    """The catalogue entry of the zoo's MHA (``q_proj`` … ``o_proj`` under ``prefix``): G = H, no bias,
    full RoPE or none; control ‖W_Q‖²_F."""
    def rows(width: int) -> Tensor:
        return torch.arange(heads * width).view(heads, width)  # (H, width) head-major

    names = {r: join(prefix, f"{r}_proj.weight") for r in "qkvo"}
    spec = AttentionSpec(prefix, Proj(names["q"], rows(d_k)), Proj(names["k"], rows(d_k)), Proj(names["v"], rows(d_v)),
                         OutProj(names["o"], rows(d_v)), heads, heads, d_k, rotary=d_k if positions == "rope" else 0,
                         v_dim=d_v, labels="head")
    return CatalogueEntry(tuple(_attention_laws(spec)), (norm_control(prefix, "q_proj.weight", "W_Q"),), (),
                          ("counts independent when d_k, d_v < d_model",))


def attention_entry(s: AttentionSpec) -> CatalogueEntry:
    """Laws and controls of one attention block (see the module docstring)."""
    laws = _attention_laws(s)
    if s.qk_norm == "none":
        q_ctl = _law("norm.W_Q", f"{s.block}: ‖W_Q‖²_F", "‖W_Q‖²_F (not conserved)", 1, (s.q.weight,),
                     lambda p: (s.q.heads(p, with_bias=False) ** 2).sum().reshape(1), "control",
                     Batch(sq_norm, lambda p: (s.q.heads(p, with_bias=False)[None],)))
    else:
        q_ctl = _law("norm.q_norm", f"{s.block}: ‖γ_q‖²", "‖γ_q‖² (not conserved)", 1, (s.q_norm,),
                     lambda p: (p[s.q_norm] ** 2).sum().reshape(1), "control",
                     Batch(sq_norm, lambda p: (p[s.q_norm][None],)))
    # V side: one K/V head (one row under MQA), not all of W_V — a norm after the attention output
    # (Gemma2's post_attention_layernorm) makes ‖W_V‖²_F itself conserved up to its eps.
    v_rows = slice(None) if s.kv_heads > 1 else slice(0, 1)
    what = "‖V_0‖²_F" if s.kv_heads > 1 else "‖V_0[0,:]‖²"
    v_ctl = _law("norm.W_V", f"{s.block}: {what}", f"{what} (not conserved)", 1, (s.v.weight,),
                 lambda p: (s.v.heads(p, with_bias=False, which=slice(0, 1))[0, v_rows] ** 2).sum().reshape(1),
                 "control", Batch(sq_norm, lambda p: (s.v.heads(p, with_bias=False, which=slice(0, 1))[:, v_rows],)))
    notes = ()
    if s.qk_norm != "none" and s.norm_eps:
        notes = (f"{s.block}: QK RMSNorm eps = {s.norm_eps:g} — the scale laws ‖Q‖²_F, ‖K‖²_F hold only up to "
                 "O(eps): neither claimed as laws nor used as controls",)
    return CatalogueEntry(tuple(laws), (q_ctl, v_ctl), (), notes)


def attention_count(s: AttentionSpec) -> int:
    """The catalogue's number of laws of one attention block (sum of the families' counts)."""
    return attention_entry(s).count


@dataclass(frozen=True)
class GatedMLPSpec:
    """A gated MLP down(act(gate x) ⊙ up x): row indices of gate and up in their (maybe fused) weights."""

    block: str
    gate: str
    up: str
    down: str
    gate_rows: Tensor
    up_rows: Tensor


def gated_mlp_entry(s: GatedMLPSpec) -> CatalogueEntry:
    """‖up[i,:]‖² − ‖down[:,i]‖² per hidden unit; control ‖gate‖²_F."""
    m = s.up_rows.numel()

    def fn(p: Params) -> Tensor:
        return (p[s.up][s.up_rows] ** 2).sum(1) - (p[s.down] ** 2).sum(0)  # (m,)

    up_plan, gate_plan = _plan(s.up_rows[None]), _plan(s.gate_rows[None])

    def take(w: Tensor, plan: tuple[int, int] | Tensor) -> Tensor:
        return w[plan[0]:plan[1]] if isinstance(plan, tuple) else w[plan[0]]  # (rows, d_in), a view when contiguous

    def ops(p: Params) -> tuple[Tensor, Tensor]:
        return take(p[s.up], up_plan)[None], p[s.down].T[None]  # (1, m, d_in), (1, m, d_model)

    law = _law("mlp.gated", f"{s.block}: ‖up[i,:]‖² − ‖down[:,i]‖²", f"per hidden unit i < {m}", m, (s.up, s.down), fn,
               batch=Batch(rownorm_diff, ops))
    ctl = _law("norm.gate", f"{s.block}: ‖gate‖²_F", "‖gate‖²_F (not conserved)", 1, (s.gate,),
               lambda p: (p[s.gate][s.gate_rows] ** 2).sum().reshape(1), "control",
               Batch(sq_norm, lambda p: (take(p[s.gate], gate_plan)[None],)))
    return CatalogueEntry((law,), (ctl,), ())
