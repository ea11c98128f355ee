"""Find the laws of every block of a model: zoo blocks, Hugging Face blocks, LoRA adapters.

One path for everything: :func:`locate_blocks` walks ``model.named_modules()``
and asks the matchers of :data:`BLOCK_MATCHERS`, in order, about each module.
A matcher returns ``None`` (not mine) or a :class:`Match` (laws, controls,
notes, and blocks it could not cover). A matched module's subtree is not
visited again (a MoE's experts belong to the MoE).

- **zoo**: :mod:`flowgeom.nn` classes, through :func:`flowgeom.laws.catalogue`;
- **lora**: PEFT LoRA layers (:mod:`flowgeom.laws.lora`),
  visited everywhere, also inside an attention block;
- **moe**: HF sparse-MoE blocks (:mod:`flowgeom.laws.moe_hf`);
- **hf_attention** / **hf_mlp**: modules whose *class* is in the family table
  (:mod:`flowgeom.hf.families`) of the ``model_type`` of the nearest
  ``config``; head counts, GQA, head_dim, partial rotary from the config,
  biases and QK-norm from the modules (:mod:`flowgeom.laws.attention`);
- **named**: other modules with ``nn.Linear`` children ``q_proj k_proj v_proj
  o_proj`` (no biases, as many K/V as query heads; head counts from attributes
  or ``heads=``/``head_dim=``; positions from ``positions=`` or a
  ``rotary_emb`` child) or ``gate_proj up_proj down_proj`` (no biases);
- **unknown**: any other module whose class name says attention / MLP /
  experts in a model we do not recognise.

**Never wrong, never silent.** A block no law covers (unknown family,
unverified layout, partly frozen parameters, ...) is never given laws: it is
returned in :attr:`Located.uncovered` as ``(block, reason)`` and warned about
once (:class:`FlowgeomWarning`); every other block is still measured. Blocks
whose parameters are all frozen (``requires_grad=False``, e.g. the base
weights under LoRA) are constant during training: no laws, a note.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.hf.families import FAMILIES, Family, attention_heads, fused_rows, rotary_dims
from flowgeom.laws.attention import AttentionSpec, GatedMLPSpec, OutProj, Proj, attention_entry, gated_mlp_entry
from flowgeom.laws.catalogue import CatalogueEntry, attention_laws, entry_of_block, norm_control, swiglu_laws
from flowgeom.nn.attention import POSITIONS


class FlowgeomWarning(UserWarning):
    """A block of the model has no verified law: it is not measured (named in ``uncovered``)."""


@dataclass(frozen=True)
class Uncovered:
    block: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return {"block": self.block, "reason": self.reason}


@dataclass
class Match:
    """What a matcher found at one module."""

    entry: CatalogueEntry = field(default_factory=lambda: CatalogueEntry((), (), ()))
    uncovered: tuple[Uncovered, ...] = ()


@dataclass(frozen=True)
class Located:
    entry: CatalogueEntry
    uncovered: tuple[Uncovered, ...]


@dataclass
class Context:
    """What matchers may read: the model, its parameter names, options, ancestor configs."""

    model: nn.Module
    heads: int | None
    head_dim: int | None
    positions: str | None
    names: dict[int, str]          # id(parameter) -> full name
    configs: dict[str, Any]        # module path -> config with a model_type

    def param(self, tensor: torch.Tensor) -> str:
        return self.names[id(tensor)]

    def config_of(self, path: str) -> Any:
        best = None
        for p, c in self.configs.items():
            if (p == "" or path == p or path.startswith(p + ".")) and (best is None or len(p) > len(best)):
                best = p
        return None if best is None else self.configs[best]


Matcher = Callable[[nn.Module, str, Context], Match | None]


# ------------------------------------------------------------------------------------------ zoo


def _zoo(module: nn.Module, name: str, ctx: Context) -> Match | None:
    entry = entry_of_block(module, name)
    return None if entry is None else Match(entry)


# ------------------------------------------------------------------ LoRA and MoE


def _lora(module: nn.Module, name: str, ctx: Context) -> Match | None:
    """PEFT LoRA layers (:mod:`flowgeom.laws.lora`). Notes with "not covered" become uncovered blocks."""
    from flowgeom.laws.lora import is_lora_layer, lora_entry

    if not is_lora_layer(module):
        return None
    entry = lora_entry(module, name)
    return _split_not_covered(entry, name)


def _moe(module: nn.Module, name: str, ctx: Context) -> Match | None:
    """HF sparse-MoE blocks (:mod:`flowgeom.laws.moe_hf`)."""
    from flowgeom.laws.moe_hf import is_moe_block, moe_entry

    if not is_moe_block(module):
        return None
    frozen = _frozen_state(module)
    if frozen != "trainable":
        return _frozen_match(name, frozen)
    return _split_not_covered(moe_entry(module, name), name)


def _split_not_covered(entry: CatalogueEntry, name: str) -> Match:
    bad = tuple(n for n in entry.notes if "not covered" in n)
    uncovered = tuple(Uncovered(name, n.split(" — ", 1)[-1] if " — " in n else n) for n in bad)
    keep = tuple(n for n in entry.notes if n not in bad)
    return Match(CatalogueEntry(entry.laws, entry.controls, entry.refuted, keep), uncovered)


# --------------------------------------------------------------------------------- HF families


def _frozen_state(module: nn.Module) -> str:
    """'trainable' (all parameters train), 'frozen' (none), 'mixed'; LoRA adapters inside are ignored."""
    flags = {p.requires_grad for n, p in module.named_parameters() if "lora_" not in n}
    if flags == {False}:
        return "frozen"
    return "mixed" if len(flags) == 2 else "trainable"


def _frozen_match(name: str, state: str) -> Match:
    if state == "frozen":
        return Match(CatalogueEntry((), (), (), (f"{name}: all parameters frozen (requires_grad=False) — constant, "
                                                 "no laws of this training",)))
    return Match(uncovered=(Uncovered(name, "some parameters frozen, some trained: the block's laws need all of "
                                            "them to follow the gradient flow"),))


def _linear_like(module: nn.Module | None) -> bool:
    """nn.Linear, GPT-2 Conv1D, Falcon's Linear subclass, or a PEFT layer around one (``base_layer``)."""
    if module is None:
        return False
    base = getattr(module, "base_layer", module)
    return isinstance(base, nn.Linear) or type(base).__name__ == "Conv1D"


def _sub(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _weight_bias(module: nn.Module, path: str, ctx: Context) -> tuple[str, str | None, int]:
    """(weight name, bias name or None, output axis) of the linear-like child at ``path``."""
    lin = _sub(module, path)
    base = getattr(lin, "base_layer", lin)
    axis = 1 if type(base).__name__ == "Conv1D" else 0
    bias = ctx.param(base.bias) if getattr(base, "bias", None) is not None else None
    return ctx.param(base.weight), bias, axis


def _hf_family(module: nn.Module, name: str, ctx: Context) -> tuple[Family, Any] | None:
    config = getattr(module, "config", None)
    if getattr(config, "model_type", None) is None:
        config = ctx.config_of(name)
    fam = FAMILIES.get(getattr(config, "model_type", None))
    return None if fam is None else (fam, config)


def _attention_spec(module: nn.Module, name: str, fam: Family, config: Any, ctx: Context) -> AttentionSpec | str:
    """The AttentionSpec of an HF attention block, or why it is not covered."""
    H, G, hd = attention_heads(config, fam)
    w = fam.weights
    if not all(_linear_like(_sub(module, p)) for p in w.values()):
        return f"{fam.model_type} attention without the linear layers {', '.join(w.values())}"
    if getattr(module, "is_cross_attention", False):
        return "cross-attention (keys from another sequence): laws not verified"
    heads = torch.arange(H * hd).view(H, hd)  # (H, d_k) rows of each query head, head-major
    kv = torch.arange(G * hd).view(G, hd)
    if "qkv" in w:
        wname, bname, axis = _weight_bias(module, w["qkv"], ctx)
        layout = fam.fused_layout(w["qkv"])
        if layout is None:
            return f"{fam.model_type}: the family table has no fused layout for {w['qkv']}"
        size = dict(ctx.model.named_parameters())[wname].shape[axis]
        rows = fused_rows(layout, config, fam, size)
        q = Proj(wname, rows["q"].view(H, hd), axis, bname)
        k = Proj(wname, rows["k"].view(G, hd), axis, bname)
        v = Proj(wname, rows["v"].view(G, hd), axis, bname)
    else:
        q, k, v = (Proj(*_reorder(_weight_bias(module, w[r], ctx), n)) for r, n in (("q", heads), ("k", kv), ("v", kv)))
    oname, _, oaxis = _weight_bias(module, w["o"], ctx)
    o = OutProj(oname, heads, 1 if oaxis == 0 else 0)
    qk_norm, qn, kn, eps = fam.qk_norm, None, None, 0.0
    if qk_norm != "none":
        qn_mod, kn_mod = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
        if qn_mod is None or kn_mod is None or "RMSNorm" not in type(qn_mod).__name__:
            return f"{fam.model_type} attention without RMSNorm q_norm/k_norm"
        qn, kn = ctx.param(qn_mod.weight), ctx.param(kn_mod.weight)
        eps = max(float(getattr(m, "variance_epsilon", getattr(m, "eps", 0.0)) or 0.0) for m in (qn_mod, kn_mod))
    elif hasattr(module, "q_norm") or hasattr(module, "k_norm") or hasattr(module, "q_layernorm"):
        return "QK-norm in a family whose table entry has none: layout not verified"
    return AttentionSpec(name, q, k, v, o, H, G, hd, rotary=rotary_dims(config, hd, fam), qk_norm=qk_norm,
                         q_norm=qn, k_norm=kn, norm_eps=eps)


def _reorder(wba: tuple[str, str | None, int], rows: torch.Tensor) -> tuple[str, torch.Tensor, int, str | None]:
    wname, bname, axis = wba
    return wname, rows, axis, bname


def _hf_attention(module: nn.Module, name: str, ctx: Context) -> Match | None:
    found = _hf_family(module, name, ctx)
    if found is None or type(module).__name__ not in found[0].attention_classes:
        return None
    fam, config = found
    state = _frozen_state(module)
    if state != "trainable":
        return _frozen_match(name, state)
    spec = _attention_spec(module, name, fam, config, ctx)
    if isinstance(spec, str):
        return Match(uncovered=(Uncovered(name, spec),))
    return Match(attention_entry(spec))


def _hf_mlp(module: nn.Module, name: str, ctx: Context) -> Match | None:
    found = _hf_family(module, name, ctx)
    if found is None or type(module).__name__ not in found[0].mlp_classes:
        return None
    fam, config = found
    if fam.mlp == "gelu":
        return Match(CatalogueEntry((), (), (), (f"{name}: two-layer {fam.activation} MLP — no conservation law "
                                                 "(seed 000, Thm. FFN)",)))
    if fam.mlp not in ("gated", "fused_gated"):
        return None  # MoE blocks go to the moe slot
    state = _frozen_state(module)
    if state != "trainable":
        return _frozen_match(name, state)
    w = fam.mlp_weights
    if not all(_linear_like(_sub(module, p)) for p in w.values()):
        return Match(uncovered=(Uncovered(name, f"{fam.model_type} MLP without linear {', '.join(w.values())}"),))
    paths = [_weight_bias(module, p, ctx) for p in w.values()]
    if any(b is not None for _, b, _ in paths):
        return Match(uncovered=(Uncovered(name, "gated MLP with biases: laws not verified"),))
    down = _weight_bias(module, w["down"], ctx)[0]
    if "gate_up" in w:
        layout = fam.fused_layout(w["gate_up"])
        if layout is None:
            return Match(uncovered=(Uncovered(name, f"{fam.model_type}: the family table has no fused layout for "
                                                    f"{w['gate_up']}"),))
        gu = _weight_bias(module, w["gate_up"], ctx)[0]
        size = dict(ctx.model.named_parameters())[gu].shape[0]
        rows = fused_rows(layout, config, fam, size)
        spec = GatedMLPSpec(name, gu, gu, down, rows["gate"], rows["up"])
    else:
        gate, up = _weight_bias(module, w["gate"], ctx)[0], _weight_bias(module, w["up"], ctx)[0]
        m = _sub(module, w["up"])
        m = getattr(m, "base_layer", m).out_features
        spec = GatedMLPSpec(name, gate, up, down, torch.arange(m), torch.arange(m))
    return Match(gated_mlp_entry(spec))


# ----------------------------------------------------------------------- named (non-HF) blocks

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_HEADS = ("num_heads", "n_heads", "num_attention_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")


def _has_linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _has_bias(module: nn.Module, names: tuple[str, ...]) -> bool:
    return any(getattr(module, n).bias is not None for n in names)


def _attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for source in (module, getattr(module, "config", None)):
        for n in names:
            value = getattr(source, n, None)
            if isinstance(value, int):
                return value
    return None


def _attention_layout(module: nn.Module, name: str, heads: int | None, head_dim: int | None) -> tuple[int, int]:
    """(H, d_k) of a named attention block, validated against the weight shapes."""
    H = heads or _attr(module, _HEADS)
    q_out = module.q_proj.out_features
    if H is None and head_dim:
        H = q_out // head_dim
    if H is None:
        raise FlowgeomError(
            f"attention block {name!r} has no head count attribute (num_heads / n_heads / num_attention_heads); "
            "pass heads= to locate() or ConservationMonitor(heads=...)"
        )
    if q_out % H:
        raise FlowgeomError(f"attention block {name!r}: q_proj has {q_out} rows, not divisible by heads={H}; pass the right heads=")
    d_k = head_dim or q_out // H
    if H * d_k != q_out or module.k_proj.out_features != q_out:
        raise FlowgeomError(f"attention block {name!r}: q_proj/k_proj rows {q_out}/{module.k_proj.out_features} "
                            f"do not match heads={H} × head_dim={d_k}; pass the right heads=/head_dim=")
    return H, d_k


def _named(module: nn.Module, name: str, ctx: Context) -> Match | None:
    if _has_linears(module, _ATTN):
        if _has_bias(module, _ATTN):
            return _named_skip(name, "attention with biases outside the family table — laws not catalogued")
        H, d_k = _attention_layout(module, name, ctx.heads, ctx.head_dim)
        kv = _attr(module, _KV_HEADS)
        if kv is not None and kv != H:
            return _named_skip(name, f"grouped-query attention ({H} query heads, {kv} K/V heads) outside the family "
                                     "table — laws not catalogued")
        pos = ctx.positions or ("rope" if hasattr(module, "rotary_emb") else "none")
        if pos == "rope" and d_k % 2:
            raise FlowgeomError(f"{name}: RoPE needs an even head dim, got {d_k}")
        shim = SimpleNamespace(d_k=d_k, d_v=module.v_proj.out_features // H, n_heads=H, positions=pos)
        return Match(attention_laws(shim, name))
    if _has_linears(module, _MLP):
        if _has_bias(module, _MLP):
            return _named_skip(name, "gated MLP with biases — laws not catalogued")
        shim = SimpleNamespace(d_hidden=module.up_proj.out_features)
        return Match(CatalogueEntry(swiglu_laws(name, shim), (norm_control(name, "gate_proj.weight", "gate_proj.weight"),), ()))
    return None


def _named_skip(name: str, reason: str) -> Match:
    return Match(CatalogueEntry((), (), (), (f"{name}: {reason}, skipped",)), (Uncovered(name, reason),))


# ------------------------------------------------------------------------------- unknown blocks

_BLOCKISH = re.compile(r"(Attention|MLP|SparseMoe|MoeBlock|Experts|FeedForward)$")


def _unknown(module: nn.Module, name: str, ctx: Context) -> Match | None:
    """A module that looks like a block (class name) and owns parameters, in no family we know."""
    if not _BLOCKISH.search(type(module).__name__) or not any(True for _ in module.parameters()):
        return None
    config = ctx.config_of(name)
    mt = getattr(config, "model_type", None)
    why = (f"model_type {mt!r} is not in the family table ({', '.join(sorted(FAMILIES))})" if mt not in FAMILIES
           else f"{type(module).__name__} is not a {mt} block class of the family table")
    if _frozen_state(module) == "frozen":
        return _frozen_match(name, "frozen")
    return Match(uncovered=(Uncovered(name, why),))


# The dispatch table: first matcher that answers wins; its module's subtree is then skipped
# (except by the LoRA slot, which runs on every module first).
BLOCK_MATCHERS: list[tuple[str, Matcher]] = [
    ("zoo", _zoo),
    ("moe", _moe),            # flowgeom.laws.moe_hf
    ("hf_attention", _hf_attention),
    ("hf_mlp", _hf_mlp),
    ("named", _named),
    ("unknown", _unknown),
]
LORA_MATCHER: tuple[str, Matcher] = ("lora", _lora)  # flowgeom.laws.lora


def _context(model: nn.Module, heads, head_dim, positions) -> Context:
    names = {id(p): n for n, p in model.named_parameters()}
    configs = {n: m.config for n, m in model.named_modules()
               if isinstance(getattr(getattr(m, "config", None), "model_type", None), str)}
    return Context(model, heads, head_dim, positions, names, configs)


def locate_blocks(model: nn.Module, *, heads: int | None = None, head_dim: int | None = None,
                  positions: str | None = None, warn: bool = True) -> Located:
    """Laws, controls, notes and uncovered blocks of ``model`` (see the module docstring).

    ``warn``: one :class:`FlowgeomWarning` per uncovered block.
    """
    if positions is not None and positions not in POSITIONS:
        raise choice_error("positions", positions, POSITIONS)
    ctx = _context(model, heads, head_dim, positions)
    laws, controls, refuted, notes, uncovered = [], [], [], [], []
    covered: list[str] = []

    def add(m: Match, block: str) -> None:
        def own(group):  # each law remembers the block it was found at (a LoRA law: the adapted module)
            return [law if law.block else replace(law, block=block) for law in group]

        laws.extend(own(m.entry.laws))
        controls.extend(own(m.entry.controls))
        refuted.extend(own(m.entry.refuted))
        notes.extend(m.entry.notes)
        uncovered.extend(m.uncovered)

    for name, module in model.named_modules():
        lora = LORA_MATCHER[1](module, name, ctx)
        if lora is not None:
            add(lora, name)
            continue
        if any(c == "" or name == c or name.startswith(c + ".") for c in covered):
            continue
        for _, matcher in BLOCK_MATCHERS:
            match = matcher(module, name, ctx)
            if match is not None:
                add(match, name)
                covered.append(name)
                break
    seen = set()
    unique = [u for u in uncovered if not (u in seen or seen.add(u))]
    if warn:
        for u in unique:
            warnings.warn(f"flowgeom: block {u.block or '<model>'} is not covered by any law ({u.reason}); "
                          "it is not measured", FlowgeomWarning, stacklevel=3)
    return Located(CatalogueEntry(tuple(laws), tuple(controls), tuple(refuted), tuple(notes)), tuple(unique))


def locate(model: nn.Module, *, heads: int | None = None, head_dim: int | None = None,
           positions: str | None = None, warn: bool = True) -> CatalogueEntry:
    """Laws, controls and refuted claims of every block of ``model`` (:func:`locate_blocks` without the list
    of uncovered blocks, which are warned about and named in the notes)."""
    found = locate_blocks(model, heads=heads, head_dim=head_dim, positions=positions, warn=warn)
    extra = tuple(f"{u.block}: not covered — {u.reason}" for u in found.uncovered
                  if not any(n.startswith(f"{u.block}: ") and u.reason in n for n in found.entry.notes))
    e = found.entry
    return CatalogueEntry(e.laws, e.controls, e.refuted, e.notes + extra)
