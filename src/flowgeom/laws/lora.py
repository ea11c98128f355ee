"""Conservation laws of LoRA adapters (PEFT ``LoraLayer``), per adapted module and adapter.

Layout (PEFT 0.21): for adapter ``a`` of a ``lora.Linear``,
``lora_A[a].weight`` is A (r d_in), ``lora_B[a].weight`` is B (d_out r), and
the layer computes y = W₀x (+ b₀) + s · B A drop(x) (+ b_B with
``lora_bias``), s = ``scaling[a]`` (α/r, or α/√r with ``use_rslora``).
``lora.Embedding`` holds ``lora_embedding_A[a]`` (r n_emb) and
``lora_embedding_B[a]`` (d r): y = E₀[x] + s · (Aᵀ[x]) Bᵀ. ``lora.Conv{1,2,3}d``
holds a conv ``lora_A[a]`` (r c_in k…) and a 1×1 conv ``lora_B[a]`` (c_out r 1…).

**Law.** The output reads A and B only through the product B A: for any
invertible G (r r), A → G A, B → B G⁻¹ leaves it unchanged. The gradient of
any loss then has the form ∇_A L = s Bᵀ M, ∇_B L = s M Aᵀ for the same
M (d_out d_in), so along gradient flow

    d/dt (A Aᵀ − BᵀB) = −s (Bᵀ M Aᵀ + A Mᵀ B) + s (Bᵀ M Aᵀ + A Mᵀ B) = 0:

the r×r symmetric matrix A Aᵀ − BᵀB is conserved, r(r+1)/2 laws per adapted
module and adapter (the upper triangle; independent when r ≤ min(d_in, d_out)).
Conv: the same with A flattened to (r, c_in·k…) and B to (c_out, r); Embedding:
A = ``lora_embedding_A`` (r n_emb), B = ``lora_embedding_B`` (d r).

What keeps it: dropout (acts on x only), rsLoRA (a different constant s),
``lora_bias`` (b_B is outside the product), several adapters (one law per
active, trainable adapter). DoRA (``use_dora``): y = m ⊙ (W₀ + sBA)x / ‖W₀ + sBA‖_c
with the column norm detached — still a function of B A and of m, and the
gradient through ``lora_B(lora_A(x))`` keeps the product form, so the law
survives; the magnitude vector m has no law (measured: ``check`` at round-off,
``count`` equal to r(r+1)/2 on a DoRA layer). Not covered, named in a note:
other LoRA variants (aLoRA, Arrow, VeLoRA, BD-LoRA, MiCA, …), conv LoRA with
``groups > 1``, ``lora.MultiheadAttention``, ``ParamWrapper`` (LoRA on raw
parameters such as fused MoE experts).

**Frozen weights are not laws.** The base weights (``requires_grad=False``)
are trivially constant during fine-tuning; they are never reported. Adapters
that are inactive or frozen are skipped with a note.

**Langevin half.** This is the symmetry ``U → U M, V → M⁻¹ V`` of the LoRA
objective that :mod:`flowgeom.langevin` trains (U = B, V = A): gradient flow
keeps A Aᵀ − BᵀB fixed, so nothing in the loss stops ‖A‖, ‖B‖ from drifting
to infinity along the orbit while B A stays put. The super-quadratic
regulariser R(U) + R(V) breaks exactly this orbit direction, which is why its
norm control is meaningful (and why this law then drifts, at the rate R sets).

Control: ‖B‖²_F (moves at first order away from B = 0; since tr(A Aᵀ − BᵀB)
is conserved, ‖A‖²_F moves by the same amount). At PEFT's default init B = 0
both norms move only at second order in the first step.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from flowgeom.laws.batched import Batch, gram_diff
from flowgeom.laws.law import CatalogueEntry, Law, Params, join, norm_control

# LoRA variants (PEFT ``lora_variant[adapter]`` classes) whose output reads A and B only through B A.
PRODUCT_VARIANTS: tuple[str, ...] = (
    "DoraLinearVariant", "DoraEmbeddingVariant", "DoraConv1dVariant", "DoraConv2dVariant", "DoraConv3dVariant",
)
_UNCOVERED_LAYERS = ("MultiheadAttention", "ParamWrapper")



def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer (duck-typed: ``lora_A``, ``lora_B`` and ``scaling``; PEFT is never imported)."""
    return all(hasattr(module, n) for n in ("lora_A", "lora_B", "scaling")) and isinstance(module.lora_A, nn.ModuleDict)


def gram_law(a_name: str, b_name: str, rank: int, *, label: str) -> Law:
    """A Aᵀ − BᵀB (r×r upper triangle) for A = params[a_name] (r …), B = params[b_name] (… r …), flattened."""

    def fn(p: Params) -> torch.Tensor:
        A = p[a_name].reshape(rank, -1)  # (r, d_in·k…)
        B = p[b_name].reshape(p[b_name].shape[0], rank)  # (d_out, r)
        g = A @ A.T - B.T @ B  # (r, r)
        i, j = torch.triu_indices(rank, rank)
        return g[i, j]

    def operands(p: Params) -> tuple[torch.Tensor, torch.Tensor]:
        A = p[a_name].reshape(rank, -1)  # (r, d_in·k…)
        B = p[b_name].reshape(p[b_name].shape[0], rank)  # (d_out, r)
        return A[None], B.T[None]  # (1, r, ·) each

    return Law(
        family="lora.gram", name=f"{label}: A Aᵀ − BᵀB",
        formula=f"A Aᵀ − BᵀB, A = {a_name} (r={rank}), B = {b_name} (r×r symmetric)",
        count=rank * (rank + 1) // 2, params=(a_name, b_name), fn=fn, batch=Batch(gram_diff, operands),
        note="independent when r ≤ min(d_in, d_out)",
    )


def _active(module: nn.Module) -> list[str]:
    names = getattr(module, "active_adapters", None)
    if names is None:
        names = getattr(module, "active_adapter", None)
    if isinstance(names, str):
        names = [names]
    return list(names) if names is not None else list(module.lora_A.keys())


def _pair(module: nn.Module, adapter: str) -> tuple[str, str, nn.Parameter, nn.Parameter] | str:
    """(A name, B name, A, B) relative to the layer, or a reason the pair is not covered."""
    if adapter in module.lora_A:
        a_mod, b_mod = module.lora_A[adapter], module.lora_B[adapter]
        if isinstance(b_mod, nn.modules.conv._ConvNd):
            if b_mod.groups != 1 or any(k != 1 for k in b_mod.kernel_size):
                return f"conv LoRA with groups={b_mod.groups}, kernel {b_mod.kernel_size}: B is not a full 1×1 mix"
        elif not isinstance(b_mod, nn.Linear):
            return f"lora_B is a {type(b_mod).__name__}, not Linear/Conv"
        return (f"lora_A.{adapter}.weight", f"lora_B.{adapter}.weight", a_mod.weight, b_mod.weight)
    emb_a, emb_b = getattr(module, "lora_embedding_A", {}), getattr(module, "lora_embedding_B", {})
    if adapter in emb_a and adapter in emb_b:
        return (f"lora_embedding_A.{adapter}", f"lora_embedding_B.{adapter}", emb_a[adapter], emb_b[adapter])
    return f"adapter {adapter!r} has no lora_A/lora_B (or embedding) pair"


def lora_entry(module: nn.Module, prefix: str) -> CatalogueEntry:
    """The A Aᵀ − BᵀB law and ‖B‖²_F control of every active, trainable adapter of a PEFT LoRA layer."""
    kind = type(module).__name__
    if kind in _UNCOVERED_LAYERS:
        return CatalogueEntry((), (), (), (f"{prefix}: LoRA {kind} layer not covered (no verified law)",))
    laws, controls, notes = [], [], []
    variants = getattr(module, "lora_variant", {}) or {}
    for adapter in _active(module):
        where = f"{prefix} [{adapter}]"
        pair = _pair(module, adapter)
        if isinstance(pair, str):
            notes.append(f"{where}: LoRA not covered — {pair}")
            continue
        a_rel, b_rel, A, B = pair
        if not (A.requires_grad and B.requires_grad):
            notes.append(f"{where}: adapter frozen (requires_grad=False): constant, not a law of this training")
            continue
        variant = variants.get(adapter)
        if variant is not None and type(variant).__name__ not in PRODUCT_VARIANTS:
            notes.append(f"{where}: LoRA variant {type(variant).__name__} not covered (output not verified to read B·A only)")
            continue
        rank = A.shape[0]
        laws.append(gram_law(join(prefix, a_rel), join(prefix, b_rel), rank, label=where))
        controls.append(replace(norm_control(prefix, b_rel, f"lora_B[{adapter}]"), family="norm.lora_B"))
        if variant is not None:
            notes.append(f"{where}: DoRA — the A/B law holds; the magnitude vector has no law")
    return CatalogueEntry(tuple(laws), tuple(controls), (), tuple(notes))


def lora_laws(model: nn.Module) -> CatalogueEntry:
    """LoRA laws, controls and notes of every PEFT LoRA layer in ``model`` (module paths as prefixes)."""
    laws, controls, notes = [], [], []
    uncovered: list[str] = []  # LoRA layers nested in an uncovered one (MHA's out_proj) belong to it
    for name, module in model.named_modules():
        if any(name.startswith(u + ".") for u in uncovered):
            continue
        if is_lora_layer(module):
            if type(module).__name__ in _UNCOVERED_LAYERS:
                uncovered.append(name)
            entry = lora_entry(module, name)
            laws += entry.laws
            controls += entry.controls
            notes += entry.notes
    return CatalogueEntry(tuple(laws), tuple(controls), (), tuple(notes))


