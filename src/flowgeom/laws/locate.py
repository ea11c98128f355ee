"""Find the catalogue's laws in any model: zoo blocks and HF-named blocks.

:func:`flowgeom.laws.catalogue` recognises the zoo's classes. Models built
elsewhere (a Llama-style module tree, a user's own attention) are matched by
*names* instead:

- an **attention** block is any module with ``nn.Linear`` children
  ``q_proj k_proj v_proj o_proj`` (no biases). Its head layout comes from the
  module's attributes (``num_heads``/``n_heads``/``num_attention_heads``,
  ``head_dim``, ``num_key_value_heads``) or from the ``heads=``/``head_dim=``
  arguments; positions (``none``/``sinusoidal``/``rope``) from ``positions=``
  or a ``rotary_emb`` child. The laws are those of
  :class:`~flowgeom.nn.MultiHeadAttention` for the same layout (weights
  ``(out, in)``, head i = rows ``i*d_k:(i+1)*d_k``; RoPE in the HF
  rotate_half layout);
- a **Llama MLP** is any module with ``nn.Linear`` children ``gate_proj
  up_proj down_proj`` (no biases): the SwiGLU laws ‖up[i,:]‖² − ‖down[:,i]‖².

Blocks the laws do not cover are skipped with a note rather than given wrong
laws: grouped-query attention (K/V heads shared by several Q heads), biases.
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.laws.catalogue import CatalogueEntry, attention_laws, norm_control, swiglu_laws, catalogue
from flowgeom.nn.attention import POSITIONS

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_HEADS = ("num_heads", "n_heads", "num_attention_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")


def _has_linears(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def _has_bias(module: nn.Module, names: tuple[str, ...]) -> bool:
    return any(getattr(module, n).bias is not None for n in names)


def _attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for n in names:
        value = getattr(module, n, None)
        if isinstance(value, int):
            return value
    config = getattr(module, "config", None)
    for n in names:
        value = getattr(config, n, None)
        if isinstance(value, int):
            return value
    return None


def _attention_layout(module: nn.Module, name: str, heads: int | None, head_dim: int | None) -> tuple[int, int]:
    """(H, d_k) of an HF-named attention block, validated against the weight shapes."""
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


def locate(model: nn.Module, *, heads: int | None = None, head_dim: int | None = None,
           positions: str | None = None) -> CatalogueEntry:
    """Laws, controls and refuted claims of every zoo **or** HF-named block in ``model``.

    Zoo blocks come from :func:`catalogue`; other modules are matched by the
    child names listed in the module docstring. ``positions`` (default: rope
    when the block has a ``rotary_emb`` child, else none) applies to every
    HF-named attention block.
    """
    if positions is not None and positions not in POSITIONS:
        raise choice_error("positions", positions, POSITIONS)
    base = catalogue(model)
    covered = {law.params[0] for law in base.laws + base.controls + base.refuted}
    covered |= {n for law in base.laws for n in law.params}
    laws, controls, notes = list(base.laws), list(base.controls), list(base.notes)
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if _has_linears(module, _ATTN) and f"{prefix}q_proj.weight" not in covered:
            if _has_bias(module, _ATTN):
                notes.append(f"{name}: attention with biases — laws not catalogued, skipped")
                continue
            H, d_k = _attention_layout(module, name, heads, head_dim)
            kv = _attr(module, _KV_HEADS)
            if kv is not None and kv != H:
                notes.append(f"{name}: grouped-query attention ({H} query heads, {kv} K/V heads) — laws not catalogued, skipped")
                continue
            pos = positions or ("rope" if hasattr(module, "rotary_emb") else "none")
            if pos == "rope" and d_k % 2:
                raise FlowgeomError(f"{name}: RoPE needs an even head dim, got {d_k}")
            d_v = module.v_proj.out_features // H
            shim = SimpleNamespace(d_k=d_k, d_v=d_v, n_heads=H, positions=pos)
            entry = attention_laws(shim, name)
            laws += entry.laws
            controls += entry.controls
        elif _has_linears(module, _MLP) and f"{prefix}up_proj.weight" not in covered:
            if _has_bias(module, _MLP):
                notes.append(f"{name}: gated MLP with biases — laws not catalogued, skipped")
                continue
            shim = SimpleNamespace(d_hidden=module.up_proj.out_features)
            laws += swiglu_laws(name, shim)
            controls.append(norm_control(name, "gate_proj.weight", "gate_proj.weight"))
    return CatalogueEntry(tuple(laws), tuple(controls), base.refuted, tuple(notes))
