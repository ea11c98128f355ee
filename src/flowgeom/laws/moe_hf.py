"""Conservation laws of Hugging Face mixture-of-experts blocks (transformers 5 layouts).

Covered blocks (``mlp`` of a decoder layer), read from the real classes:

- ``MixtralSparseMoeBlock`` (Mixtral), ``OlmoeSparseMoeBlock`` (OLMoE),
  ``Qwen2MoeSparseMoeBlock`` (Qwen2-MoE): a router ``gate`` (``weight``
  (E d), no bias) and fused experts ``experts.gate_up_proj`` (E 2m d) and
  ``experts.down_proj`` (E d m). Expert e computes
  ``down_e (act(gate_e x) ⊙ up_e x)`` with ``gate_e = gate_up_proj[e, :m]``
  and ``up_e = gate_up_proj[e, m:]`` (``.chunk(2, dim=-1)``: gate rows first).
  Qwen2-MoE adds ``shared_expert.{gate,up,down}_proj`` (a SwiGLU of width m_s)
  scaled by ``σ(shared_expert_gate x)`` (``shared_expert_gate.weight`` (1 d)).

Routing. The router takes p = softmax(router·x) (E,), keeps the top-k
experts, and weights them by p_e (``norm_topk_prob=False``) or by
p_e / Σ_{top-k} p (Mixtral always; Qwen2-MoE / OLMoE when
``norm_topk_prob``). The block output is y = Σ_{e ∈ top-k(x)} g_e(x) · f_e(x)
(+ σ(s·x) f_shared(x)).

Laws, derived from the symmetries of the output (seed 000's argument):

1. **Experts.** Scaling hidden unit i of expert e, up_e[i,:] → λ up_e[i,:],
   down_e[:,i] → down_e[:,i] / λ, leaves f_e unchanged for *any* gate
   activation, so h = ‖gate_up_proj[e, m+i, :]‖² − ‖down_proj[e, :, i]‖² is
   conserved: E·m laws. Same for the shared expert (m_s laws).
2. **Router, top-k ≥ 2 or no renormalisation.** softmax is invariant under
   z → z + ⟨u, x⟩·1, i.e. adding one vector u to every router row; the top-k
   *set* and the weights (renormalised or not) only read p, so the output is
   invariant and the gradient of every router row sums to the same vector:
   Σ_e router[e, :] is conserved (d laws).
3. **Router, top-1 with renormalisation.** g ≡ 1 for the selected expert: the
   router never receives a gradient, every router weight is conserved (E·d).
4. **Shared expert gate** σ(s·x): no continuous symmetry moves s (σ is not
   homogeneous and its output multiplies a fixed f_shared): no law.

Total: E·m + d (+ m_s), or E·m + E·d (+ m_s) for renormalised top-1.

**Almost everywhere.** top-k selection is piecewise constant in θ; the laws
are exact on every open region where no input sits on a tie between the
k-th and (k+1)-th probability (a measure-zero set), which is where the
gradient exists. The numeric checks (``flowgeom.laws.check`` and ``count``)
see generic points and are exact there.

**Precision.** These routers compute softmax in float32 even for a float64
model (``softmax(..., dtype=torch.float)``): laws involving the router hold
to ~1e-7 relative, not to float64 round-off. The expert laws are exact.

Controls (quantities that move at first order, to see the monitor fail when
it should): ‖router‖²_F (except top-1 renormalised, where the router is
frozen), Σ_e ‖gate_up_proj[e, :m]‖²_F (every expert's gate slice: a single
expert may see no token in a batch), and for Qwen2-MoE
‖shared_expert_gate.weight‖²_F.

Not covered (the matcher returns a note, never a guess): routers of other
classes (sigmoid / grouped / biased routers: DeepSeek, GPT-OSS, …), experts
with biases, transposed or interleaved gate/up storage, a ModuleList of
per-expert modules (older or other families), LoRA on the experts.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from torch import nn

from flowgeom.hf.families import FAMILIES
from flowgeom.laws.batched import Batch, col_sum, flat, rownorm_diff, sq_norm
from flowgeom.laws.law import CatalogueEntry, Law, Params, join, norm_control

# From the one family table. Router classes whose forward is exactly softmax → top-k → (optional)
# renormalise (True = always renormalises, None = reads ``norm_topk_prob``); fused-expert classes
# checked to compute down_e(act(gate_e x) ⊙ up_e x) with gate rows first.
SOFTMAX_TOPK_ROUTERS: dict[str, bool | None] = {f.router_class: f.router_renorm for f in FAMILIES.values()
                                                if f.moe_router == "softmax_topk"}
FUSED_EXPERTS: tuple[str, ...] = tuple(f.experts_class for f in FAMILIES.values() if f.experts_class)



@dataclass(frozen=True)
class MoELayout:
    """What a fused HF MoE block holds: E experts of width m, hidden size d, top-k routing."""

    experts: int     # E
    width: int       # m (per-expert intermediate size)
    hidden: int      # d
    top_k: int       # k
    renormalise: bool
    shared_width: int | None = None  # m_s, Qwen2-MoE's shared expert


def fused_expert_laws(prefix: str, n_experts: int, width: int) -> tuple[Law, ...]:
    """One law per expert e: ‖gate_up_proj[e, m+i, :]‖² − ‖down_proj[e, :, i]‖², i < m.

    ``prefix`` is the experts module path (``…mlp.experts``); the up rows are
    the second half of ``gate_up_proj`` (transformers' ``.chunk(2, -1)``).
    """
    gu, down = join(prefix, "gate_up_proj"), join(prefix, "down_proj")
    laws = []
    for e in range(n_experts):
        def fn(p: Params, e=e) -> torch.Tensor:
            up = p[gu][e, width:]  # (m, d)
            return (up ** 2).sum(1) - (p[down][e] ** 2).sum(0)  # (m,)

        laws.append(Law(
            family="moe.expert_up_down", name=f"expert {e}: ‖up_{e}[i,:]‖² − ‖down_{e}[:,i]‖²",
            formula=f"‖{gu}[{e}, {width}+i, :]‖² − ‖{down}[{e}, :, i]‖², i < {width}",
            count=width, params=(gu, down), fn=fn,
            batch=Batch(rownorm_diff, lambda p, e=e: (p[gu][e, width:][None], p[down][e].T[None])),  # (1, m, d) each
        ))
    return tuple(laws)


def router_law(prefix: str, layout: MoELayout) -> Law:
    """Σ_e router[e, :] (d laws), or every router weight when top-1 renormalised (E·d laws)."""
    w = join(prefix, "weight")
    if layout.top_k == 1 and layout.renormalise:
        return Law(
            family="moe.router_frozen", name=f"every {w}[e, j] (top-1 renormalised: gate ≡ 1)",
            formula=f"{w}[e, j] for all e, j: the selected expert's weight is p_e/p_e ≡ 1, the router gets no gradient",
            count=layout.experts * layout.hidden, params=(w,), fn=lambda p: p[w].reshape(-1),
            batch=Batch(flat, lambda p: (p[w],)), degree=1,
        )
    return Law(
        family="moe.router_sum", name=f"Σ_e {w}[e,:]",
        formula="Σ_e router[e, :] (softmax is invariant to adding one vector to every router row)",
        count=layout.hidden, params=(w,), fn=lambda p: p[w].sum(0), batch=Batch(col_sum, lambda p: (p[w],)), degree=1,
        note="router softmax runs in float32 in transformers: holds to ~1e-7 relative",
    )


def _gate_slices_control(prefix: str, width: int) -> Law:
    gu = join(prefix, "gate_up_proj")
    return Law(
        family="norm.expert_gates", name=f"Σ_e ‖{gu}[e, :{width}]‖²_F",
        formula="Σ_e ‖gate_e‖²_F over every expert's gate rows (not conserved)", count=1, params=(gu,),
        fn=lambda p: (p[gu][:, :width] ** 2).sum().reshape(1), status="control",
        batch=Batch(sq_norm, lambda p: (p[gu][:, :width][None],)),
    )


def _shared_expert_law(prefix: str, width: int) -> Law:
    up, down = join(prefix, "up_proj.weight"), join(prefix, "down_proj.weight")
    return Law(
        family="moe.shared_up_down", name=f"‖{up}[i,:]‖² − ‖{down}[:,i]‖²",
        formula=f"‖{up}[i,:]‖² − ‖{down}[:,i]‖², i < {width} (shared expert, any gate activation)",
        count=width, params=(up, down),
        fn=lambda p: (p[up] ** 2).sum(1) - (p[down] ** 2).sum(0),
        batch=Batch(rownorm_diff, lambda p: (p[up][None], p[down].T[None])),
    )


def moe_layout(block: nn.Module) -> MoELayout | str:
    """The layout of a covered HF MoE block, or a one-line reason why it is not covered."""
    router, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    rname, ename = type(router).__name__, type(experts).__name__
    if isinstance(experts, nn.ModuleList):
        return f"per-expert ModuleList experts under router {rname}: layout not verified, no laws claimed"
    if rname not in SOFTMAX_TOPK_ROUTERS:
        return f"router {rname} is not a verified softmax-top-k router ({', '.join(SOFTMAX_TOPK_ROUTERS)})"
    if ename not in FUSED_EXPERTS:
        return f"experts {ename} are not a verified fused layout ({', '.join(FUSED_EXPERTS)})"
    odd = [a for a, ok in (("has_bias", False), ("is_transposed", False), ("has_gate", True),
                           ("is_concatenated", True), ("has_post_expert_norm", False))
           if getattr(experts, a, ok) != ok]
    if odd:
        return f"experts {ename} with {', '.join(odd)} changed: not the verified gate|up layout"
    E, two_m, d = experts.gate_up_proj.shape
    renorm = SOFTMAX_TOPK_ROUTERS[rname]
    renorm = bool(getattr(router, "norm_topk_prob", False)) if renorm is None else renorm
    shared = getattr(block, "shared_expert", None)
    shared_width = None
    if shared is not None:
        gate = getattr(block, "shared_expert_gate", None)
        if not (all(isinstance(getattr(shared, n, None), nn.Linear) and getattr(shared, n).bias is None
                    for n in ("gate_proj", "up_proj", "down_proj")) and isinstance(gate, nn.Linear)):
            return "shared expert without bias-free gate/up/down_proj and a shared_expert_gate: not verified"
        shared_width = shared.up_proj.out_features
    return MoELayout(E, two_m // 2, d, int(router.top_k), renorm, shared_width)


def moe_entry(block: nn.Module, prefix: str) -> CatalogueEntry:
    """Laws, controls and notes of the HF MoE ``block`` at module path ``prefix``.

    An uncovered block gives an entry with no laws and one note saying why
    (use :func:`is_moe_block` to decide whether to call this).
    """
    layout = moe_layout(block)
    if isinstance(layout, str):
        return CatalogueEntry((), (), (), (f"{prefix}: MoE block not covered — {layout}",))
    laws = list(fused_expert_laws(join(prefix, "experts"), layout.experts, layout.width))
    laws.append(router_law(join(prefix, "gate"), layout))
    controls = [_gate_slices_control(join(prefix, "experts"), layout.width)]
    notes = [f"{prefix}: top-{layout.top_k} routing — laws hold almost everywhere (away from routing ties)"]
    if layout.top_k == 1 and layout.renormalise:
        notes.append(f"{prefix}: top-1 renormalised routing — the router weights never move")
    else:
        controls.insert(0, replace(norm_control(prefix, "gate.weight", "router.weight"), family="norm.router"))
    if layout.shared_width is not None:
        laws.append(_shared_expert_law(join(prefix, "shared_expert"), layout.shared_width))
        controls.append(replace(norm_control(prefix, "shared_expert_gate.weight", "shared_expert_gate.weight"),
                                family="norm.shared_expert_gate"))
        notes.append(f"{prefix}: shared_expert_gate (sigmoid scalar gate) has no law")
    return CatalogueEntry(tuple(laws), tuple(controls), (), tuple(notes))


def is_moe_block(module: nn.Module) -> bool:
    """True for a module with a router child ``gate`` (with ``top_k``) and an ``experts`` child."""
    router = getattr(module, "gate", None)
    return isinstance(getattr(module, "experts", None), nn.Module) and isinstance(router, nn.Module) and (
        hasattr(router, "top_k") or hasattr(module, "top_k"))


def expected_moe_count(layout: MoELayout) -> int:
    """E·m + d (+ m_s), or E·m + E·d (+ m_s) for renormalised top-1."""
    router = layout.experts * layout.hidden if layout.top_k == 1 and layout.renormalise else layout.hidden
    return layout.experts * layout.width + router + (layout.shared_width or 0)


class MoEBlockModule(nn.Module):
    """An HF MoE block as a module of one plain tensor (B, T, d) -> (B, T, d), for ``count``/``check``.

    Holds a deep copy of ``block`` whose experts run transformers'
    ``batched_mm`` implementation (the same maths as eager: a gather of each
    token's expert weights, no data-dependent loop, so ``torch.func.vmap``
    works; ``grouped_mm`` refuses float64). ``sample_input`` draws
    N(0, scale²) tokens, ``tokens`` per sample, so each draw routes to
    several experts.
    """

    def __init__(self, block: nn.Module, *, tokens: int = 8, scale: float = 1.0,
                 experts_implementation: str = "batched_mm"):
        super().__init__()
        self.block = copy.deepcopy(block)
        experts = self.block.experts
        if getattr(experts, "config", None) is not None:
            experts.config = copy.copy(experts.config)  # the model's config stays untouched
            experts.config._experts_implementation = experts_implementation
        self.tokens, self.scale = tokens, scale
        self.hidden = self.block.gate.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)  # (B, T, d)

    def sample_input(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        dtype = self.block.gate.weight.dtype
        return self.scale * torch.randn(batch, self.tokens, self.hidden, generator=generator, dtype=dtype)
