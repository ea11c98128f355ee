"""The one family table: which blocks each HF ``model_type`` has, and their layout.

Each :class:`Family` says, for one ``model_type`` of ``transformers`` 5.23:

- **attention**: the module classes that are attention blocks, the kind of
  projection layout (``qkvo``: separate ``q/k/v/o`` ``nn.Linear``;
  ``fused_qkv``: Phi-3 ``qkv_proj`` rows q|k|v; ``interleaved_qkv``: GPT-NeoX
  ``query_key_value`` rows viewed as (H, 3, d_k); ``conv1d``: GPT-2
  ``c_attn`` (in, out) columns q|k|v; ``bert``: ``self.{query,key,value}`` and
  ``output.dense``; ``falcon``), the paths of the q/k/v/o weights inside the
  block, the positions (``rope`` / ``absolute``) and the QK-norm
  (``none`` / ``per_head`` Qwen3 / ``full`` OLMoE);
- **mlp**: the module classes and kind (``gated``: act(gate)·up then down,
  SwiGLU or GeGLU; ``fused_gated``: Phi-3 ``gate_up_proj`` rows gate|up;
  ``gelu``: two-layer MLP with a GELU; ``moe``: a sparse MoE block).

What varies inside a family (head counts, GQA, head_dim, partial rotary,
biases) is read from ``model.config`` and the modules themselves by
:func:`attention_layout`, never from child names alone.

:data:`FUSED` is the data the continuity side needs to split fused
projections into per-role matrices (:func:`fused_rows` turns it into row
indices for a given config).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowgeom.errors import FlowgeomError

ATTENTION_KINDS = ("qkvo", "fused_qkv", "interleaved_qkv", "conv1d", "bert", "falcon")
MLP_KINDS = ("gated", "fused_gated", "gelu", "moe")


@dataclass(frozen=True)
class Family:
    """One row of the family table (see the module docstring)."""

    model_type: str
    attention: str                      # one of ATTENTION_KINDS
    attention_classes: tuple[str, ...]  # module class names of an attention block
    weights: Mapping[str, str]          # role (q k v o qkv) -> parameter path inside the block, without .weight
    mlp: str                            # one of MLP_KINDS
    mlp_classes: tuple[str, ...]
    mlp_weights: Mapping[str, str]      # role (gate up gate_up down) -> path inside the MLP block
    positions: str = "rope"             # rope | absolute
    qk_norm: str = "none"               # none | per_head | full
    activation: str = "silu"            # of the gated MLP's gate, or of the 2-layer MLP
    moe_router: str = ""                # "softmax_topk" for the MoE families
    shared_expert: bool = False         # Qwen2-MoE: shared SwiGLU expert with a sigmoid scalar gate


_QKVO = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_GATED = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MOE = {"router": "gate", "gate_up": "experts.gate_up_proj", "down": "experts.down_proj"}


def _llama_like(mt: str, cls: str, *, mlp: str = "gated", act: str = "silu", qk_norm: str = "none",
                shared: bool = False) -> Family:
    moe = mlp == "moe"
    return Family(mt, "qkvo", (f"{cls}Attention",), _QKVO, mlp,
                  (f"{cls}SparseMoeBlock",) if moe else (f"{cls}MLP",), _MOE if moe else _GATED,
                  qk_norm=qk_norm, activation=act, moe_router="softmax_topk" if moe else "", shared_expert=shared)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    _llama_like("llama", "Llama"),
    _llama_like("mistral", "Mistral"),
    _llama_like("qwen2", "Qwen2"),
    _llama_like("qwen3", "Qwen3", qk_norm="per_head"),
    _llama_like("gemma", "Gemma", act="gelu_tanh"),
    _llama_like("gemma2", "Gemma2", act="gelu_tanh"),
    Family("phi3", "fused_qkv", ("Phi3Attention",), {"qkv": "qkv_proj", "o": "o_proj"}, "fused_gated",
           ("Phi3MLP",), {"gate_up": "gate_up_proj", "down": "down_proj"}),
    Family("gpt2", "conv1d", ("GPT2Attention",), {"qkv": "c_attn", "o": "c_proj"}, "gelu",
           ("GPT2MLP",), {"up": "c_fc", "down": "c_proj"}, positions="absolute", activation="gelu"),
    Family("bert", "bert", ("BertAttention",), {"q": "self.query", "k": "self.key", "v": "self.value",
                                                 "o": "output.dense"}, "gelu",
           ("BertIntermediate", "BertOutput"), {"up": "intermediate.dense", "down": "output.dense"}, positions="absolute",
           activation="gelu"),
    Family("gpt_neox", "interleaved_qkv", ("GPTNeoXAttention",), {"qkv": "query_key_value", "o": "dense"}, "gelu",
           ("GPTNeoXMLP",), {"up": "dense_h_to_4h", "down": "dense_4h_to_h"}, activation="gelu"),
    Family("falcon", "falcon", ("FalconAttention",), {"qkv": "query_key_value", "o": "dense"}, "gelu",
           ("FalconMLP",), {"up": "dense_h_to_4h", "down": "dense_4h_to_h"}, activation="gelu"),
    _llama_like("mixtral", "Mixtral", mlp="moe"),
    _llama_like("qwen2_moe", "Qwen2Moe", mlp="moe", shared=True),
    _llama_like("olmoe", "Olmoe", mlp="moe", qk_norm="full"),
)}


def family(model_type: str) -> Family:
    """The table row of ``model_type`` (FlowgeomError listing the supported ones)."""
    if model_type not in FAMILIES:
        raise FlowgeomError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def family_of(model: nn.Module) -> Family | None:
    """The table row of an HF model (from ``model.config.model_type``), or None for other modules."""
    config = getattr(model, "config", None)
    mt = getattr(config, "model_type", None)
    return FAMILIES.get(mt) if isinstance(mt, str) else None


# ---------------------------------------------------------------- layouts from the config


@dataclass(frozen=True)
class AttentionLayout:
    """Head layout of one attention block, read from the config (and checked against the weights).

    ``rotary`` is the number of rotated dims per head (0 without RoPE,
    ``head_dim`` for full RoPE, ``head_dim · partial_rotary_factor`` else);
    the rotated pairs are (j, j + rotary/2), j < rotary/2 (rotate_half layout).
    """

    heads: int
    kv_heads: int
    head_dim: int
    rotary: int
    bias: Mapping[str, bool]  # role q k v o -> has a bias

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.heads // self.kv_heads


def _cfg(config: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def rotary_dims(config: Any, head_dim: int, fam: Family) -> int:
    """Rotated dims per head: 0 for absolute positions, else head_dim·partial_rotary_factor."""
    if fam.positions != "rope" or (fam.model_type == "falcon" and getattr(config, "alibi", False)):
        return 0
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, Mapping) else None
    factor = factor if factor is not None else _cfg(config, "partial_rotary_factor", "rotary_pct", default=1.0)
    return int(head_dim * factor)


def attention_heads(config: Any, fam: Family) -> tuple[int, int, int]:
    """(H, KV heads, head_dim) of ``fam`` under ``config``."""
    H = _cfg(config, "num_attention_heads", "n_head")
    d = _cfg(config, "hidden_size", "n_embd")
    hd = getattr(config, "head_dim", None) if fam.model_type != "falcon" else d // H
    hd = hd or d // H
    if fam.model_type == "falcon":
        kv = (_cfg(config, "num_kv_heads", default=H) if config.new_decoder_architecture
              else 1 if config.multi_query else H)
    else:
        kv = _cfg(config, "num_key_value_heads", default=H)
    return int(H), int(kv), int(hd)


# --------------------------------------------------------------- fused projections (data)


@dataclass(frozen=True)
class FusedLayout:
    """How one fused weight splits into roles.

    ``axis``: the weight axis that holds the fused outputs (0 for ``nn.Linear``
    rows, 1 for GPT-2 ``Conv1D`` columns; the bias always on axis 0 of its
    own). ``arrangement``: ``concat`` (role blocks one after the other, sizes
    from ``units`` in head_dim units: "H" query heads, "G" K/V heads, or
    "half" of the axis), ``per_head`` (viewed as (H, 3, head_dim): q, k, v of
    head h), ``grouped`` (Falcon new architecture: (G, H/G + 2, head_dim)).
    MoE experts (E, 2m, d) fuse gate|up on axis 1, experts on axis 0.
    """

    roles: tuple[str, ...]
    axis: int
    arrangement: str
    units: tuple[str, ...] = ()


_QKV_CONCAT = FusedLayout(("q", "k", "v"), 0, "concat", ("H", "G", "G"))
_GATE_UP = FusedLayout(("gate", "up"), 0, "concat", ("half", "half"))
_EXPERTS_GATE_UP = FusedLayout(("gate", "up"), 1, "concat", ("half", "half"))

FUSED: dict[str, dict[str, FusedLayout]] = {
    "phi3": {"self_attn.qkv_proj": _QKV_CONCAT, "mlp.gate_up_proj": _GATE_UP},
    "gpt2": {"attn.c_attn": FusedLayout(("q", "k", "v"), 1, "concat", ("H", "H", "H"))},
    "gpt_neox": {"attention.query_key_value": FusedLayout(("q", "k", "v"), 0, "per_head")},
    "falcon": {"self_attention.query_key_value": FusedLayout(("q", "k", "v"), 0, "falcon")},
    "mixtral": {"mlp.experts.gate_up_proj": _EXPERTS_GATE_UP},
    "qwen2_moe": {"mlp.experts.gate_up_proj": _EXPERTS_GATE_UP},
    "olmoe": {"mlp.experts.gate_up_proj": _EXPERTS_GATE_UP},
}
"""model_type -> {path inside a decoder layer (without .weight/.bias): layout}. Falcon's
``falcon`` arrangement is resolved by :func:`fused_rows` from the config (multi-query:
concat (H, 1, 1); new architecture: grouped; else per_head)."""


def qkv_ranges(arrangement: str, part: str, heads: int, kv: int, head_dim: int) -> tuple[tuple[int, int], ...]:
    """Row ranges ``[start, stop)`` of ``part`` (q, k or v) along a fused q|k|v axis, in head order.

    ``blocked``: q | k | v, sizes (H, KV, KV)·head_dim (Phi-3, GPT-2's columns,
    Falcon multi-query). ``grouped``: (KV, H/KV + 2, head_dim), each K/V group
    holding its query heads, then k, then v (Falcon's new architecture;
    GPT-NeoX is the case KV = H). The one place both the laws and the
    continuity naming read fused attention rows from.
    """
    index = "qkv".index(part)
    if arrangement == "blocked":
        start = (0, heads * head_dim, (heads + kv) * head_dim)[index]
        return ((start, start + (heads, kv, kv)[index] * head_dim),)
    if arrangement == "grouped":
        per = heads // kv + 2
        lo, hi = ((0, per - 2), (per - 2, per - 1), (per - 1, per))[index]
        return tuple((g * per * head_dim + lo * head_dim, g * per * head_dim + hi * head_dim) for g in range(kv))
    raise FlowgeomError(f"unknown fused q|k|v arrangement {arrangement!r}; choose blocked or grouped")


def _indices(ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges])


def fused_rows(layout: FusedLayout, config: Any, fam: Family, size: int) -> dict[str, torch.Tensor]:
    """Indices along ``layout.axis`` of each role, for a fused axis of length ``size``.

    For attention the roles' indices are ordered head by head (q: head 0's
    head_dim indices, then head 1's, ...), i.e. as the separate q/k/v
    projections of a Llama block would hold them.
    """
    arrangement, units = layout.arrangement, layout.units
    if "half" in units:
        if size % 2:
            raise FlowgeomError(f"fused gate|up axis of odd length {size}")
        idx = torch.arange(size)
        return {"gate": idx[: size // 2], "up": idx[size // 2:]}
    H, G, hd = attention_heads(config, fam)
    if arrangement == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            arrangement = "grouped"
        elif getattr(config, "multi_query", False):
            arrangement, units = "concat", ("H", "G", "G")
        else:
            arrangement = "per_head"
    if arrangement == "concat":
        n = {"H": H, "G": G}
        sizes = [n[u] * hd for u in units]
        if sum(sizes) != size:
            raise FlowgeomError(f"fused q|k|v axis has {size} entries, config says {sum(sizes)} ({H} heads, {G} K/V, "
                                f"head_dim {hd}); the config does not match the weights")
        kv = n[units[1]]
        return {r: _indices(qkv_ranges("blocked", r, H, kv, hd)) for r in layout.roles}
    if arrangement == "per_head":  # (H, 3, head_dim): grouped with one K/V head per query head
        if 3 * H * hd != size:
            raise FlowgeomError(f"interleaved q|k|v axis has {size} entries, expected 3·{H}·{hd}")
        return {r: _indices(qkv_ranges("grouped", r, H, H, hd)) for r in layout.roles}
    if arrangement == "grouped":
        per = H // G + 2
        if G * per * hd != size:
            raise FlowgeomError(f"grouped q|k|v axis has {size} entries, expected {G}·{per}·{hd}")
        return {r: _indices(qkv_ranges("grouped", r, H, G, hd)) for r in ("q", "k", "v")}
    raise FlowgeomError(f"unknown fused arrangement {arrangement!r}")
