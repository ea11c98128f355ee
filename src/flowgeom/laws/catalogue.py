"""Closed-form conservation laws of gradient flow, for the zoo's layout.

A conservation law h(θ) is constant along θ̇ = −∇L_D(θ) for *every* data
set D, i.e. ⟨∇h(θ), ∇_θ f(x; θ)ᵀc⟩ = 0 for all inputs x and output
directions c (seed 000; Marcotte et al. 2023). Every law here is written
for ``nn.Linear`` weights of shape ``(out, in)`` and HF-Llama names; each
returns its independent scalar components as a vector of length ``count``
(for a symmetric-matrix law, its upper triangle).

| block | law (our layout) | count |
|---|---|---|
| FFN GELU/SiLU/tanh | none | 0 |
| FFN ReLU (relu2) | ‖up[i,:]‖² (+b_i²) − ‖down[:,i]‖² | m |
| FFN identity (linear2) | [up|b][up|b]ᵀ − downᵀdown | r(r+1)/2 |
| SwiGLU | ‖up[i,:]‖² − ‖down[:,i]‖² | m |
| MHA none/sinusoidal, head i | Q_iQ_iᵀ − K_iK_iᵀ ; V_iV_iᵀ − O_iᵀO_i | d_k(d_k+1)/2 + d_v(d_v+1)/2 |
| MHA RoPE, head i, block j | ‖Q_i^(j)‖²_F − ‖K_i^(j)‖²_F ; V/O as above | d_k/2 + d_v(d_v+1)/2 |
| MoE softmax (dense/top-k) | experts' SwiGLU laws ; Σ_e router[e,:] (+Σ_e b_e) | E·m + d (+1) |
| MoE normalised sigmoid | experts' SwiGLU laws only | E·m |
| MoE top-1 (either gate) | experts' laws ; every router weight (g ≡ 1) | E·m + E·d (+E) |
| deep linear chain | W_l W_lᵀ − W_{l+1}ᵀ W_{l+1} per consecutive pair | Σ d_l(d_l+1)/2 |

Here Q_i = ``q_proj.weight[i*d_k:(i+1)*d_k, :]`` is (d_k d_model), so the
paper's Q_iᵀQ_i (Q_i stored as (d_model d_k)) reads Q_iQ_iᵀ in our layout;
O_i = ``o_proj.weight[:, i*d_v:(i+1)*d_v]``. RoPE block j of head i is the
pair of rows (j, j + d_k/2) (HF rotate_half layout).

**Measured correction to the seed.** Seed 000 states that a normalised
sigmoid gate σ(z_i)/Σ_j σ(z_j) keeps the router law Σ_i W_i of the softmax
gate. It does not: softmax is invariant under z → z + ⟨u, x⟩·1 (adding the
same vector u to every router row), the normalised sigmoid is not, and
:func:`flowgeom.laws.check` measures an O(1) violation (the tests pin a
non-zero rate of change under gradient flow for sigmoid, zero for softmax).
The seed's claim is kept here as a *refuted* entry so that the tools can show
the evidence.

Counts are the number of *independent* laws under the generic rank
conditions stated per entry (e.g. r ≤ min(d_in, d_out) for linear2); the
numeric engine (:func:`flowgeom.laws.count`) measures them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flowgeom.laws.batched import Batch, gram_diff, rownorm_diff
from flowgeom.laws.attention import zoo_attention_entry
from flowgeom.laws.law import CatalogueEntry, Law, Params, join, norm_control, upper
from flowgeom.nn.attention import MultiHeadAttention
from flowgeom.nn.feedforward import FeedForward, LinearChain, SwiGLU
from flowgeom.nn.moe import MixtureOfExperts

def _rescale_law(prefix: str, family: str, up: str, down: str, bias: str | None, width: int) -> Law:
    """‖up[i,:]‖² (+ bias_i²) − ‖down[:,i]‖² for each hidden unit i (positive rescaling)."""
    up, down = join(prefix, up), join(prefix, down)
    bias = join(prefix, bias) if bias else None

    def fn(p: Params) -> Tensor:
        h = (p[up] ** 2).sum(1) - (p[down] ** 2).sum(0)  # (width,)
        return h + p[bias] ** 2 if bias else h

    def operands(p: Params) -> tuple[Tensor, ...]:
        a = torch.cat([p[up], p[bias][:, None]], dim=1) if bias else p[up]  # (width, d_in[+1])
        return a[None], p[down].T[None]  # (1, width, ·) each

    b_txt = " + b_i²" if bias else ""
    return Law(
        family=family, name=f"‖{up}[i,:]‖²{b_txt} − ‖{down}[:,i]‖²",
        formula=f"‖{up}[i,:]‖²{b_txt} − ‖{down}[:,i]‖², i < {width}", count=width,
        params=(up, down) + ((bias,) if bias else ()), fn=fn, batch=Batch(rownorm_diff, operands),
    )


def _ffn(m: FeedForward, prefix: str) -> CatalogueEntry:
    controls = (norm_control(prefix, "up_proj.weight", "up_proj.weight"),)
    bias = "up_proj.bias" if m.up_proj.bias is not None else None
    if m.activation == "relu":
        return CatalogueEntry((_rescale_law(prefix, "relu.rescale", "up_proj.weight", "down_proj.weight", bias, m.d_hidden),), controls, ())
    if m.activation == "identity":
        up, down = join(prefix, "up_proj.weight"), join(prefix, "down_proj.weight")
        b = join(prefix, bias) if bias else None
        r = m.d_hidden

        def fn(p: Params) -> Tensor:
            v = torch.cat([p[up], p[b][:, None]], dim=1) if b else p[up]  # (r, d_in[+1])
            return upper(v @ v.T - p[down].T @ p[down])  # (r(r+1)/2,)

        def operands(p: Params) -> tuple[Tensor, ...]:
            v = torch.cat([p[up], p[b][:, None]], dim=1) if b else p[up]  # (r, d_in[+1])
            return v[None], p[down].T[None]

        v_txt = f"[{up} | b]" if b else up
        law = Law(
            family="linear.gram", name=f"{v_txt}·{v_txt}ᵀ − {down}ᵀ·{down}",
            formula=f"V Vᵀ − Uᵀ U (r×r symmetric, r = {r})", count=r * (r + 1) // 2,
            params=(up, down) + ((b,) if b else ()), fn=fn, batch=Batch(gram_diff, operands),
            note="independent when r ≤ min(d_in, d_out)",
        )
        return CatalogueEntry((law,), controls, ())
    return CatalogueEntry((), controls, (), (f"{m.activation} FFN: only constant laws (seed 000, Thm. FFN)",))


def swiglu_laws(prefix: str, m: SwiGLU) -> tuple[Law, ...]:
    """The m rescaling laws of a SwiGLU block whose parameters live under ``prefix``."""
    return (_rescale_law(prefix, "swiglu.up_down", "up_proj.weight", "down_proj.weight", None, m.d_hidden),)


def attention_laws(m: MultiHeadAttention, prefix: str) -> CatalogueEntry:
    """Per-head Q/K (or RoPE block) and V/O laws of ``m``; ``m`` needs only d_k, d_v, n_heads, positions.

    The one attention implementation (:mod:`flowgeom.laws.attention`), with G = H and no bias.
    """
    return zoo_attention_entry(prefix, heads=m.n_heads, d_k=m.d_k, d_v=m.d_v, positions=m.positions)


def _router_sum(m: MixtureOfExperts, prefix: str, status: str) -> Law:
    w = join(prefix, "router.weight")
    b = join(prefix, "router.bias") if m.router.bias is not None else None

    def fn(p: Params) -> Tensor:
        s = p[w].sum(0)  # (d_model,)
        return torch.cat([s, p[b].sum().reshape(1)]) if b else s

    note = ""
    if status == "refuted":
        note = ("seed 000 claims this for the normalised-sigmoid gate; measured: not conserved "
                "(σ(z_i)/Σσ(z_j) is not invariant under a common shift of the logits)")
    return Law(
        family="moe.router_sum", name=f"Σ_e {w}[e,:]" + (" ; Σ_e b_e" if b else ""),
        formula="Σ_e W_e over the router's rows" + (" and Σ_e b_e" if b else ""),
        count=m.d_model + (1 if b else 0), params=(w,) + ((b,) if b else ()), fn=fn, status=status, note=note,
        degree=1,
    )


def _frozen_router(m: MixtureOfExperts, prefix: str) -> Law:
    names = tuple(join(prefix, f"router.{n}") for n, _ in m.router.named_parameters())
    return Law(
        family="moe.router_frozen", name="every router weight (top-1: gate ≡ 1)",
        formula="router.weight[e, j] (and router.bias[e]) for all e, j: top-1 renormalised gates are ≡ 1, "
                "so the router never receives a gradient",
        count=sum(p.numel() for p in m.router.parameters()), params=names,
        fn=lambda p: torch.cat([p[n].reshape(-1) for n in names]), degree=1,
    )


def _moe(m: MixtureOfExperts, prefix: str) -> CatalogueEntry:
    laws = [law for e, expert in enumerate(m.experts) for law in swiglu_laws(join(prefix, f"experts.{e}"), expert)]
    if m.top_k == 1:
        # Renormalising over one selected expert makes g ≡ 1: the router is frozen,
        # whatever the gate function (a degenerate case the seed does not discuss).
        # Control: every expert's gate norm together (a single expert may be selected by no sampled input).
        gates = tuple(join(prefix, f"experts.{e}.gate_proj.weight") for e in range(m.n_experts))
        controls = (Law(family="control", name="Σ_e ‖experts.e.gate_proj.weight‖²_F",
                        formula="Σ_e ‖gate_proj_e‖²_F (not conserved)", count=1, params=gates,
                        fn=lambda p: sum((p[g] ** 2).sum() for g in gates).reshape(1), status="control"),)
        return CatalogueEntry(tuple(laws) + (_frozen_router(m, prefix),), controls, (),
                              ("top-1 routing with renormalised gates: the router weights never move",))
    controls = (norm_control(prefix, "router.weight", "router.weight"),)
    if m.gate == "softmax":
        return CatalogueEntry(tuple(laws) + (_router_sum(m, prefix, "law"),), controls, ())
    return CatalogueEntry(tuple(laws), controls, (_router_sum(m, prefix, "refuted"),),
                          ("normalised-sigmoid gate: router law Σ_e W_e refuted by measurement (seed claims it holds)",))


def _chain(m: LinearChain, prefix: str) -> CatalogueEntry:
    laws = []
    for l in range(len(m.layers) - 1):
        a, b = join(prefix, f"layers.{l}.weight"), join(prefix, f"layers.{l + 1}.weight")
        d = m.widths[l + 1]

        def fn(p: Params, a=a, b=b) -> Tensor:
            return upper(p[a] @ p[a].T - p[b].T @ p[b])  # (d(d+1)/2,)

        laws.append(Law(family="linear.gram", name=f"W_{l}W_{l}ᵀ − W_{l + 1}ᵀW_{l + 1}",
                        formula=f"{a}·{a}ᵀ − {b}ᵀ·{b} ({d}×{d} symmetric)", count=d * (d + 1) // 2, params=(a, b), fn=fn,
                        batch=Batch(gram_diff, lambda p, a=a, b=b: (p[a][None], p[b].T[None]))))
    controls = (norm_control(prefix, "layers.0.weight", "W_0"),)
    return CatalogueEntry(tuple(laws), controls, (), ("independent when each inner width ≤ its neighbours",))


def entry_of_block(block: nn.Module, prefix: str) -> CatalogueEntry | None:
    """The catalogue entry of one zoo block whose parameters live under ``prefix``, or None if ``block`` is
    not a zoo block (FeedForward, SwiGLU, MultiHeadAttention, MixtureOfExperts, LinearChain)."""
    if isinstance(block, FeedForward):
        return _ffn(block, prefix)
    if isinstance(block, SwiGLU):
        return CatalogueEntry(swiglu_laws(prefix, block), (norm_control(prefix, "gate_proj.weight", "gate_proj.weight"),), ())
    if isinstance(block, MultiHeadAttention):
        return attention_laws(block, prefix)
    if isinstance(block, MixtureOfExperts):
        return _moe(block, prefix)
    if isinstance(block, LinearChain):
        return _chain(block, prefix)
    return None


def catalogue(model: nn.Module) -> CatalogueEntry:
    """The catalogue's laws, controls and refuted claims for every zoo block in ``model``.

    Blocks are found anywhere in the module tree (outermost zoo block wins:
    a MoE's experts are covered by the MoE entry). Parameter names carry
    the block's path, so the laws evaluate on ``dict(model.named_parameters())``.
    """
    laws, controls, refuted, notes = [], [], [], []
    covered: list[str] = []
    for name, block in model.named_modules():
        if any(c == "" or name == c or name.startswith(c + ".") for c in covered):
            continue
        entry = entry_of_block(block, name)
        if entry is None:
            continue
        covered.append(name)
        laws += entry.laws
        controls += entry.controls
        refuted += entry.refuted
        notes += entry.notes
    return CatalogueEntry(tuple(laws), tuple(controls), tuple(refuted), tuple(notes))


def laws_of(model: nn.Module) -> list[Law]:
    """The conservation laws of every zoo block in ``model`` (see :func:`catalogue`)."""
    return list(catalogue(model).laws)


def expected_count(model: nn.Module) -> int | None:
    """The catalogue's number of independent laws, or None if ``model`` has no zoo block.

    Only meaningful when ``model`` is exactly one zoo block (laws of separate
    blocks composed in a network are not simply additive).
    """
    if entry_of_block(model, "") is None:
        return None
    return catalogue(model).count


@dataclass(frozen=True)
class Variant:
    """One row of the catalogue table: a zoo architecture with fixed options."""

    label: str
    arch: str
    options: Mapping[str, object]
    count_formula: str


VARIANTS: tuple[Variant, ...] = (
    Variant("FFN GELU", "ffn", {"activation": "gelu"}, "0"),
    Variant("FFN SiLU", "ffn", {"activation": "silu"}, "0"),
    Variant("FFN tanh", "ffn", {"activation": "tanh"}, "0"),
    Variant("SwiGLU", "swiglu", {}, "m"),
    Variant("MHA", "mha", {"positions": "none"}, "H·(d_k(d_k+1)/2 + d_v(d_v+1)/2)"),
    Variant("MHA sinusoidal", "mha", {"positions": "sinusoidal"}, "H·(d_k(d_k+1)/2 + d_v(d_v+1)/2)"),
    Variant("MHA RoPE", "mha", {"positions": "rope", "d_k": 4}, "H·(d_k/2 + d_v(d_v+1)/2)"),
    Variant("MoE softmax dense", "moe", {"gate": "softmax"}, "E·m + d"),
    Variant("MoE softmax top-2", "moe", {"gate": "softmax", "top_k": 2}, "E·m + d"),
    Variant("MoE softmax + bias", "moe", {"gate": "softmax", "router_bias": True}, "E·m + d + 1"),
    Variant("MoE norm-sigmoid dense", "moe", {"gate": "sigmoid"}, "E·m  (seed: E·m + d)"),
    Variant("MoE norm-sigmoid top-2", "moe", {"gate": "sigmoid", "top_k": 2}, "E·m  (seed: E·m + d)"),
    Variant("linear2", "linear2", {}, "r(r+1)/2"),
    Variant("relu2", "relu2", {}, "r"),
    Variant("relu2 + biases", "relu2", {"bias": True}, "r"),
    Variant("deep linear chain", "chain", {}, "Σ_inner d_l(d_l+1)/2"),
)
