"""The one family table: everything flowgeom knows about each HF ``model_type``.

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
  ``gelu``: two-layer MLP with a GELU; ``moe``: a sparse MoE block);
- **naming** (checkpoint tensor names, for :mod:`flowgeom.continuity.naming`):
  the container of the numbered layers and the block paths, fused layouts
  (:class:`FusedLayout`), per-expert names on disk;
- **laws**: the traits the closed-form counts of :mod:`flowgeom.laws.hf_target`
  read (biases, a LayerNorm after the block, whether the decoder-block count is
  derived), the fused-experts class of the MoE laws;
- **sizes**: the tiny config of :mod:`flowgeom.hf.tiny` and the count-sized
  overrides of ``hf:`` targets (or why a family is not counted).

A new family is one entry here: the monitor, ``laws count hf:`` and
``continuity analyze`` read everything from it.

What varies inside a family (head counts, GQA, head_dim, partial rotary,
biases) is read from ``model.config`` and the modules themselves by
:func:`attention_layout`, never from child names alone.

:func:`fused_rows` turns a family's fused layouts into row indices for a given config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flowgeom.errors import FlowgeomError

ATTENTION_KINDS = ("qkvo", "fused_qkv", "interleaved_qkv", "conv1d", "bert", "falcon")
MLP_KINDS = ("gated", "fused_gated", "gelu", "moe")
BIASES = ("config", "qkv", "all")


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




@dataclass(frozen=True)
class Family:
    """One row of the family table (see the module docstring)."""

    model_type: str
    attention: str                      # one of ATTENTION_KINDS
    attention_classes: tuple[str, ...]  # module class names of an attention block
    weights: Mapping[str, str]          # role (q k v o qkv) -> parameter path inside the block, without .weight
    mlp: str                            # one of MLP_KINDS
    mlp_classes: tuple[str, ...]
    mlp_weights: Mapping[str, str]      # role (gate up gate_up down router) -> path inside the MLP block
    tiny: Mapping[str, Any]             # config kwargs of the tiny test model (transformers 5.23 names)
    positions: str = "rope"             # rope | absolute
    qk_norm: str = "none"               # none | per_head | full
    activation: str = "silu"            # of the gated MLP's gate, or of the 2-layer MLP
    moe_router: str = ""                # "softmax_topk" for the MoE families
    shared_expert: bool = False         # Qwen2-MoE: shared SwiGLU expert with a sigmoid scalar gate
    experts_class: str = ""             # the fused experts module (MoE laws verified on it)
    router_class: str = ""              # the softmax -> top-k router module
    router_renorm: bool | None = None   # the router renormalises the top-k: always (True) or per norm_topk_prob (None)
    # naming of checkpoint tensors
    layers: str = ""                    # container of the numbered layers ("h", "layer"); "" = any prefix
    attention_path: str = ""            # the attention block's path inside a layer
    mlp_path: str = ""                  # the MLP block's path inside a layer
    # path inside a layer (no .weight/.bias) -> layout; Falcon's "falcon" arrangement is resolved from the config
    # by fused_rows (multi-query: concat (H, 1, 1); new architecture: grouped; else per_head)
    fused: Mapping[str, FusedLayout] = field(default_factory=dict)
    expert_files: Mapping[str, str] = field(default_factory=dict)   # part -> per-expert path on disk, {e} the index
    shared_weights: Mapping[str, str] = field(default_factory=dict)  # shared expert: part (gate up down router) -> path
    # laws
    bias: str = "config"                # q/k/v biases: "config" (attention_bias), "qkv" (always), "all" (+ o, MLP)
    post_norm: bool = False             # a LayerNorm after each residual sum (BERT)
    block_laws: bool = False            # the decoder block's count (attention + MLP + 2d) is derived
    # sizes of hf: targets (overrides of tiny); None: not counted, for the reason in not_counted
    count_sizes: Mapping[str, Any] | None = None
    not_counted: str = ""

    def fused_layout(self, path: str) -> FusedLayout | None:
        """The layout of the fused weight whose path (inside a layer) ends with ``path``; None if not fused."""
        return next((layout for p, layout in self.fused.items() if p.endswith(path)), None)


_QKVO = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
_GATED = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MOE = {"router": "gate", "gate_up": "experts.gate_up_proj", "down": "experts.down_proj"}
_QKV_CONCAT = FusedLayout(("q", "k", "v"), 0, "concat", ("H", "G", "G"))
_GATE_UP = FusedLayout(("gate", "up"), 0, "concat", ("half", "half"))
_EXPERTS_GATE_UP = FusedLayout(("gate", "up"), 1, "concat", ("half", "half"))

# Tiny configs: hidden 32, 2 layers, 4 query heads of head_dim 8, 2 K/V heads where the family has
# grouped-query attention, vocab 64, MLP width 64, 4 experts with top-2 routing.
TINY_DECODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, vocab_size=64, max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_TOP2 = dict(num_experts_per_tok=2)
_NEOX_LIKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64, max_position_embeddings=64,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, hidden_dropout=0.0,
                  attention_dropout=0.0)
# Count sizes: hidden 8, 2 heads of head_dim 4, MLP width 6, 3 experts, one layer. initializer_range 0.5
# (HF default 0.02): attention logits of order one, not a near-uniform softmax whose brackets are tiny.
_COUNT = dict(initializer_range=0.5, hidden_size=8, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
              intermediate_size=6, num_hidden_layers=1, vocab_size=16, max_position_embeddings=32)
_COUNT_MOE = dict(_COUNT, intermediate_size=3)
_COUNT_ENCODER = dict(initializer_range=0.5, hidden_size=8, num_attention_heads=2, intermediate_size=12,
                      num_hidden_layers=1, vocab_size=16, max_position_embeddings=32)


def llama_like(mt: str, cls: str, *, tiny: Mapping[str, Any], count: Mapping[str, Any] | None = None,
                mlp: str = "gated", act: str = "silu", qk_norm: str = "none", bias: str = "config",
                shared: bool = False, block_laws: bool = True, expert_files: Mapping[str, str] | None = None,
                renorm: bool | None = None) -> Family:
    """A Llama-style decoder: separate q/k/v/o and gate/up/down (or a sparse MoE), RoPE, RMSNorm."""
    moe = mlp == "moe"
    return Family(mt, "qkvo", (f"{cls}Attention",), _QKVO, mlp,
                  (f"{cls}SparseMoeBlock",) if moe else (f"{cls}MLP",), _MOE if moe else _GATED, tiny,
                  qk_norm=qk_norm, activation=act, moe_router="softmax_topk" if moe else "", shared_expert=shared,
                  experts_class=f"{cls}Experts" if moe else "", router_class=f"{cls}TopKRouter" if moe else "",
                  router_renorm=renorm, attention_path="self_attn", mlp_path="mlp",
                  fused={"mlp.experts.gate_up_proj": _EXPERTS_GATE_UP} if moe else {},
                  expert_files=expert_files or {}, shared_weights=_SHARED if shared else {}, bias=bias,
                  block_laws=block_laws,
                  count_sizes=_COUNT if count is None else count)


_SHARED = {"gate": "shared_expert.gate_proj", "up": "shared_expert.up_proj", "down": "shared_expert.down_proj",
           "router": "shared_expert_gate"}
_PER_EXPERT = {p: f"experts.{{e}}.{p}_proj" for p in ("gate", "up", "down")}  # Qwen2-MoE / OLMoE on disk

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    llama_like("llama", "Llama", tiny=TINY_DECODER),
    llama_like("mistral", "Mistral", tiny=dict(TINY_DECODER, sliding_window=None)),
    llama_like("qwen2", "Qwen2", tiny=dict(TINY_DECODER, use_sliding_window=False), bias="qkv"),
    llama_like("qwen3", "Qwen3", tiny=dict(TINY_DECODER, use_sliding_window=False), qk_norm="per_head"),
    # Gemma's RMSNorm scales by 1 + γ: the block's γ laws are not the 2d derived for the others
    llama_like("gemma", "Gemma", tiny=TINY_DECODER, act="gelu_tanh", block_laws=False),
    llama_like("gemma2", "Gemma2", act="gelu_tanh", block_laws=False,
                tiny=dict(TINY_DECODER, query_pre_attn_scalar=8, sliding_window=64, attn_logit_softcapping=None,
                          final_logit_softcapping=None),
                count=dict(_COUNT, query_pre_attn_scalar=4, sliding_window=32)),
    Family("phi3", "fused_qkv", ("Phi3Attention",), {"qkv": "qkv_proj", "o": "o_proj"}, "fused_gated",
           ("Phi3MLP",), {"gate_up": "gate_up_proj", "down": "down_proj"}, TINY_DECODER,
           attention_path="self_attn", mlp_path="mlp",
           fused={"self_attn.qkv_proj": _QKV_CONCAT, "mlp.gate_up_proj": _GATE_UP}, count_sizes=_COUNT),
    Family("gpt2", "conv1d", ("GPT2Attention",), {"qkv": "c_attn", "o": "c_proj"}, "gelu",
           ("GPT2MLP",), {"up": "c_fc", "down": "c_proj"},
           dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, vocab_size=64, n_positions=64, bos_token_id=1,
                eos_token_id=2, tie_word_embeddings=False),
           positions="absolute", activation="gelu", layers="h", attention_path="attn", mlp_path="mlp",
           fused={"attn.c_attn": FusedLayout(("q", "k", "v"), 1, "concat", ("H", "H", "H"))}, bias="all",
           count_sizes=dict(initializer_range=0.5, n_embd=8, n_head=2, n_inner=12, n_layer=1, vocab_size=16,
                            n_positions=32)),
    Family("bert", "bert", ("BertAttention",), {"q": "self.query", "k": "self.key", "v": "self.value",
                                                 "o": "output.dense"}, "gelu",
           ("BertIntermediate", "BertOutput"), {"up": "intermediate.dense", "down": "output.dense"},
           dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64,
                max_position_embeddings=64, type_vocab_size=2, pad_token_id=0, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, is_decoder=True),
           positions="absolute", activation="gelu", layers="layer", attention_path="attention", bias="all",
           post_norm=True, count_sizes=_COUNT_ENCODER),
    Family("gpt_neox", "interleaved_qkv", ("GPTNeoXAttention",), {"qkv": "query_key_value", "o": "dense"}, "gelu",
           ("GPTNeoXMLP",), {"up": "dense_h_to_4h", "down": "dense_4h_to_h"},
           dict(_NEOX_LIKE, intermediate_size=64,
                rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
           activation="gelu", layers="layers", attention_path="attention", mlp_path="mlp",
           fused={"attention.query_key_value": FusedLayout(("q", "k", "v"), 0, "per_head")}, bias="all",
           count_sizes=_COUNT_ENCODER),
    Family("falcon", "falcon", ("FalconAttention",), {"qkv": "query_key_value", "o": "dense"}, "gelu",
           ("FalconMLP",), {"up": "dense_h_to_4h", "down": "dense_4h_to_h"}, _NEOX_LIKE, activation="gelu",
           layers="h", attention_path="self_attention", mlp_path="mlp",
           fused={"self_attention.query_key_value": FusedLayout(("q", "k", "v"), 0, "falcon")},
           not_counted="its attention takes an ALiBi/rotary switch and casts ALiBi to bfloat16; "
                       "supported by continuity naming only"),
    llama_like("mixtral", "Mixtral", mlp="moe", renorm=True, tiny=dict(TINY_DECODER, num_local_experts=4, **_TOP2),
                count=dict(_COUNT_MOE, num_local_experts=3),
                expert_files={"gate": "block_sparse_moe.experts.{e}.w1", "up": "block_sparse_moe.experts.{e}.w3",
                              "down": "block_sparse_moe.experts.{e}.w2"}),
    llama_like("qwen2_moe", "Qwen2Moe", mlp="moe", shared=True, bias="qkv", expert_files=_PER_EXPERT,
                tiny=dict(TINY_DECODER, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                          decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, **_TOP2),
                count=dict(_COUNT, num_experts=3, moe_intermediate_size=3, shared_expert_intermediate_size=4)),
    # block_laws: the decoder-block count is derived for RMSNorm blocks without QK-norm coupling (not OLMoE)
    llama_like("olmoe", "Olmoe", mlp="moe", qk_norm="full", block_laws=False, expert_files=_PER_EXPERT,
                tiny=dict(TINY_DECODER, num_experts=4, **_TOP2), count=dict(_COUNT_MOE, num_experts=3)),
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
