"""``hf:MODEL_TYPE:PART`` targets: one block of a real ``transformers`` family, ready for the law engine.

``flowgeom laws count hf:qwen3:attention`` builds the tiny random model of
:mod:`flowgeom.hf.tiny` (shrunk further for counting: hidden 8, 2 heads of
head_dim 4, MLP width 6, 3 experts, one layer), takes layer 0's PART and wraps
it in :class:`HFPart`, whose forward takes a plain ``(B, T, d)`` tensor:

- attention: the family's attention class called as the decoder layer calls it,
  with the rotary ``position_embeddings`` (cos, sin) computed once by the
  family's own rotary class (on the model, not a child of attention) and the
  causal mask as an additive ``(1, 1, T, T)`` tensor (BERT too: the tiny BERT is
  a decoder);
- mlp / moe: the layer's MLP or sparse-MoE block (MoE blocks return the
  hidden states only; experts run transformers' ``batched_mm`` implementation,
  the same function as the eager loop, which ``vmap`` cannot batch);
- block: the whole decoder layer (norms, residuals, attention, MLP or MoE).

Which part is which comes from the one family table,
:mod:`flowgeom.hf.families` (module classes, not child names); this module
only keeps the count-sized config overrides (:data:`SIZES`).

Precision. Eager attention computes ``softmax(..., dtype=float32)``, the
RMSNorms upcast to float32 and MoE routers call ``.float()``: inside a
float64 module the fields would carry float32 rounding and the float64
tolerance would miscount. :class:`HFPart` runs its forward inside
:class:`flowgeom.laws.precision.keep_dtype`, which makes those down-casts
no-ops: a cast is the identity in exact arithmetic, so the function, its
symmetries and its laws are unchanged; only the rounding is (``keep_casts``
turns this off, to see the engine detect the reduced precision instead).

Closed forms (:func:`closed_form`, per K/V group g with head_dim d_h, r rotary
dims of which r/2 rotation pairs, u = d_h − r unrotated dims; derivations in
``docs/laws-engine.md``):

- RoPE attention (Llama, Mistral, Gemma, Gemma2, Phi-3, Mixtral):
  Σ_g [r/2 + u(u+1)/2 + d_h(d_h+1)/2]; q/k/v biases (Qwen2, ``attention_bias``)
  enter augmented, same count, plus u trivially conserved k-bias coordinates
  per group when some dims are not rotated;
- per-head QK-norm with RoPE (Qwen3): d_h/2 (γ_q, γ_k pairs) + Σ_g d_h(d_h+1)/2,
  plus H + n_kv scale laws ‖Q_i‖², ‖K_g‖² when ``rms_norm_eps`` = 0;
- full-width QK-norm (OLMoE): n_kv·d_h/2 + Σ_g d_h(d_h+1)/2, plus ‖W_Q‖², ‖W_K‖²
  when eps = 0;
- no positions with biases (GPT-2): H·(d_h(d_h+1)/2 + d_h + d_h(d_h+1)/2), the
  middle term being the k bias, whose gradient is identically zero; BERT adds
  H·d_h + 1 (the LayerNorm after the output dense ignores c·1); GPT-NeoX
  (partial rotary, biases): H·(r/2 + u(u+1)/2 + u + d_h(d_h+1)/2);
- gated MLP (SwiGLU / GeGLU): intermediate_size; GELU MLP (GPT-2, GPT-NeoX): 0;
  BERT: intermediate_size + 1;
- softmax top-k MoE: d (router rows' sum) + E·m (+ the shared expert's width
  for Qwen2-MoE; its sigmoid gate has none);
- RMSNorm decoder block (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE,
  OLMoE not included): attention + MLP/MoE + 2d (each norm weight γ_i against
  column i of every projection reading that norm's output).
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.hf.families import FAMILIES, Family, attention_heads, rotary_dims
from flowgeom.laws.precision import keep_dtype
from flowgeom.limits import file_int
from flowgeom.options import boolean, key_values

PARTS = ("attention", "mlp", "moe", "block")
SEQ_LEN = 4  # tokens per sampled input

# Count-sized overrides of the tiny configs and the families not counted: both from the one family table.
SIZES: dict[str, dict[str, Any]] = {mt: dict(f.count_sizes) for mt, f in FAMILIES.items() if f.count_sizes is not None}
NOT_COUNTED: dict[str, str] = {mt: f.not_counted for mt, f in FAMILIES.items() if f.not_counted}
SUPPORTED = tuple(sorted(SIZES))
_REFUSED_IMPL = ("attn_implementation", "_attn_implementation", "experts_implementation", "_experts_implementation")


def _has_moe(model_type: str) -> bool:
    return FAMILIES[model_type].mlp == "moe"


def parts_of(model_type: str) -> tuple[str, ...]:
    """The parts of ``model_type``: attention and block always, then mlp or moe (per the family table)."""
    return ("attention", "moe" if _has_moe(model_type) else "mlp", "block")


def parse_target(target: str) -> tuple[str, str]:
    """``hf:MODEL_TYPE:PART`` -> (model_type, part); FlowgeomError listing the supported ones."""
    bits = target.split(":")
    if len(bits) != 3 or bits[0] != "hf":
        raise FlowgeomError(f"malformed target {target!r}; expected hf:MODEL_TYPE:PART, e.g. hf:llama:attention")
    _, model_type, part = bits
    if model_type in NOT_COUNTED:
        raise FlowgeomError(f"hf:{model_type} is not counted: {NOT_COUNTED[model_type]}; supported: {', '.join(SUPPORTED)}")
    if model_type not in SIZES:
        raise FlowgeomError(f"unknown model_type {model_type!r} in {target!r}; supported: {', '.join(SUPPORTED)}")
    if part not in PARTS:
        raise FlowgeomError(f"unknown part {part!r} in {target!r}; parts: {', '.join(PARTS)}")
    if part not in parts_of(model_type):
        others = ", ".join(m for m in SUPPORTED if part in parts_of(m))
        raise FlowgeomError(f"{model_type} has no {part} block (its parts: {', '.join(parts_of(model_type))}); "
                            f"pick one of those, or a family with a {part} block: {others}")
    return model_type, part


def _typed(key: str, text: str, current: Any) -> Any:
    """``text`` converted to the type of the config's ``current`` value; FlowgeomError naming the key."""
    def bad(kind: str) -> FlowgeomError:
        return FlowgeomError(f"--config {key}={text}: expected {kind} (the config's value is {current!r})")

    low = text.strip().lower()
    if isinstance(current, bool):
        return boolean(text, f"--config {key}")  # the one vocabulary: true/false, yes/no, on/off, 1/0
    if isinstance(current, int):
        try:
            return int(text)
        except ValueError:
            raise bad("an integer") from None
    if isinstance(current, float):
        try:
            value = float(text)
        except ValueError:
            raise bad("a number") from None
        if not math.isfinite(value):
            raise bad("a finite number")
        return value
    if isinstance(current, str):
        return text
    if current is None and low in ("none", "null"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        if current is None:
            return text
        raise bad(f"JSON for a {type(current).__name__}") from None
    if current is not None and not isinstance(value, type(current)):
        raise bad(f"a {type(current).__name__} in JSON")
    return value


def config_overrides(model_type: str, items: list[str] | None) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` -> typed overrides of the count-sized tiny config of ``model_type``."""
    from flowgeom.hf.tiny import tiny_config

    if not items:
        return {}
    base = tiny_config(model_type, **SIZES[model_type])
    known = base.to_dict()
    out = {}
    for key, text in key_values(items, flag="--config", example="--config num_key_value_heads=1").items():
        if key in _REFUSED_IMPL:
            raise FlowgeomError(f"--config {key}={text}: hf: targets count with eager attention and experts only "
                                "(sdpa/flash/grouped-mm kernels have no forward-mode AD in float64); drop it")
        if key not in known:
            keys = ", ".join(sorted(k for k in known if not k.startswith("_")))
            raise FlowgeomError(f"--config {key}: {model_type} configs have no key {key!r}; keys: {keys}")
        out[key] = _typed(key, text, known[key])
    return out


def _check_heads(model_type: str, config: Any) -> None:
    """Head counts that transformers accepts but that fail later in the forward as a bare shape error."""
    heads, kv, _ = attention_heads(config, FAMILIES[model_type])
    if heads % kv:
        raise FlowgeomError(f"--config: {heads} query heads are not a multiple of {kv} key/value heads; pick "
                            f"num_key_value_heads among {[d for d in range(1, heads + 1) if heads % d == 0]}")


def _layer_parts(model: nn.Module, model_type: str) -> tuple[nn.Module, str, tuple[str, ...], nn.Module | None]:
    """(layer 0, its attention child's name, its MLP/MoE children's names, the model's rotary module or None).

    Found by module class (the family table's attention/MLP classes), not by
    child names; the rotary embedding is the model's ``*RotaryEmbedding``
    module outside the layers (transformers 5 keeps it on the model).
    """
    fam = FAMILIES[model_type]
    for layer in model.modules():
        kids = dict(layer.named_children())
        attn = [n for n, c in kids.items() if type(c).__name__ in fam.attention_classes]
        if attn:
            order = {cls: i for i, cls in enumerate(fam.mlp_classes)}
            mlp = sorted((n for n, c in kids.items() if type(c).__name__ in order), key=lambda n: order[type(kids[n]).__name__])
            rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
            return layer, attn[0], tuple(mlp), rotary
    raise FlowgeomError(f"no {' or '.join(fam.attention_classes)} found in the tiny {model_type} model; "
                        "the family table and this transformers version disagree")


def _causal_mask(t: int) -> torch.Tensor:
    """(1, 1, T, T) additive mask: 0 on and below the diagonal, −1e30 above (finite in float32 too)."""
    upper = torch.ones(t, t, dtype=torch.bool).triu(1)
    return torch.zeros(1, 1, t, t, dtype=torch.float64).masked_fill(upper, -1e30)


class HFPart(nn.Module):
    """One part of a transformers layer as ``f(x)``, x (B, T, d) -> (B, T, d); see the module docstring.

    Parameters keep the transformers names under the layer's attribute
    (``self_attn.q_proj.weight``, ``mlp.experts.gate_up_proj`` …; ``layer.`` for
    a whole block).
    """

    def __init__(self, modules: dict[str, nn.Module], *, part: str, hidden: int, seq_len: int,
                 rope: tuple[torch.Tensor, torch.Tensor] | None, causal: bool, keep_casts: bool = False):
        super().__init__()
        self.part, self.hidden, self.seq_len, self.keep_casts = part, hidden, seq_len, keep_casts
        self.names = tuple(modules)
        for name, module in modules.items():
            self.add_module(name, module)
        self.register_buffer("mask", _causal_mask(seq_len) if causal else None, persistent=False)
        self.register_buffer("rope_cos", rope[0] if rope else None, persistent=False)  # (1, T, r)
        self.register_buffer("rope_sin", rope[1] if rope else None, persistent=False)
        self.register_buffer("position_ids", torch.arange(seq_len).unsqueeze(0), persistent=False)  # (1, T)

    def _kwargs(self) -> dict:
        kw = {"attention_mask": self.mask}
        if self.rope_cos is not None:
            kw["position_embeddings"] = (self.rope_cos, self.rope_sin)
        return kw

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, T, d)
        with contextlib.nullcontext() if self.keep_casts else keep_dtype():
            first = getattr(self, self.names[0])
            if self.part == "attention":
                out = first(hidden_states=x, **self._kwargs())
            elif self.part == "block":
                out = first(x, position_ids=self.position_ids, **self._kwargs())
            elif len(self.names) == 2:  # BERT: intermediate (dense, GELU), then output (dense, LayerNorm(· + x))
                out = getattr(self, self.names[1])(first(x), x)
            else:
                out = first(x)
        return out[0] if isinstance(out, tuple) else out  # (B, T, d)

    def sample_input(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(batch, self.seq_len, self.hidden, generator=generator, dtype=torch.float64)  # (B, T, d)


def closed_form(model_type: str, part: str, config: Any) -> int | None:
    """The law count derived for this family and part (module docstring), None where none is derived.

    Read from the family's traits, never from its name: positions and QK-norm,
    biases, a LayerNorm after the residual sum, the MLP kind, the shared expert.
    """
    fam, cfg = FAMILIES[model_type], config
    d = cfg.hidden_size
    heads, kv, hd = attention_heads(cfg, fam)
    r = rotary_dims(cfg, hd, fam)
    r -= r % 2
    u = hd - r
    vo = kv * hd * (hd + 1) // 2
    bias = fam.bias != "config" or bool(getattr(cfg, "attention_bias", False))
    exact_norm = getattr(cfg, "rms_norm_eps", None) == 0  # scale laws of the QK-norm only hold without eps

    def attention() -> int:
        if fam.qk_norm == "per_head":  # γ_q, γ_k pairs; ‖Q_i‖², ‖K_g‖² when eps = 0
            return hd // 2 + vo + (heads + kv if exact_norm else 0)
        if fam.qk_norm == "full":  # γ pairs per K/V group; ‖W_Q‖², ‖W_K‖² when eps = 0
            return kv * (hd // 2) + vo + (2 if exact_norm else 0)
        # rotation pairs, the unrotated dims' GL(u) and, with biases, their trivially conserved k-bias coordinates
        count = kv * (r // 2 + u * (u + 1) // 2 + (u if bias else 0)) + vo
        # LayerNorm(O·a + b_o + x) is blind to adding c·1: Σ b_o and O's column sums
        return count + (heads * hd + 1 if fam.post_norm else 0)

    def mlp() -> int:
        gated = cfg.intermediate_size if fam.mlp in ("gated", "fused_gated") else 0  # a GELU MLP has none
        return gated + (cfg.intermediate_size + 1 if fam.post_norm else 0)

    def moe() -> int:
        experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        shared = cfg.shared_expert_intermediate_size if fam.shared_expert else 0  # its sigmoid gate has none
        return d + experts * width + shared

    if part == "attention":
        return attention()
    if part in ("mlp", "moe"):
        return moe() if fam.mlp == "moe" else mlp()
    if fam.block_laws:  # each norm weight γ_i against column i of every projection reading that norm's output
        return attention() + (moe() if fam.mlp == "moe" else mlp()) + 2 * d
    return None


MAX_MODEL_PARAMETERS = 20_000_000  # the whole tiny model is built (160 MB in float64) before layer 0 is taken


def _too_large(model_type: str, kwargs: dict[str, Any], size: int, how: str) -> FlowgeomError:
    return FlowgeomError(f"a {model_type} with {kwargs} has {how}{size:,} parameters, more than the "
                         f"{MAX_MODEL_PARAMETERS:,} a tiny model for counting may have; lower hidden_size, "
                         "num_hidden_layers, vocab_size or the expert count with --config")


def parameters_at_least(config: Any, fam: Family) -> int:
    """A lower bound on the parameters of ``fam`` under ``config``, by arithmetic on the config alone.

    Token embeddings (and an untied head), a norm weight per residual branch and a final one, the
    q/k/v/o projections and the MLP's matrices (a MoE layer: the smaller of its experts + router and a
    dense MLP, for families that mix both); biases and any other norm are left out, so the bound never
    exceeds the real count (tested against the meta build for every family).
    """
    d = _cfg_int(config, "hidden_size")
    heads, kv, hd = attention_heads(config, fam)
    vocab, layers = _cfg_int(config, "vocab_size"), _cfg_int(config, "num_hidden_layers")
    width = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * d
    attention = d * (heads + 2 * kv) * hd + heads * hd * d
    mlp = (3 if fam.mlp in ("gated", "fused_gated", "moe") else 2) * d * width
    if fam.mlp == "moe":
        experts = getattr(config, "num_local_experts", None) or config.num_experts
        sparse = experts * (3 * d * (getattr(config, "moe_intermediate_size", None) or width) + d)
        # Qwen2-MoE may leave layers dense (mlp_only_layers, decoder_sparse_step): then the smaller of the two
        mixed = getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1
        mlp = min(mlp, sparse) if mixed else sparse
    head = vocab * d if getattr(config, "tie_word_embeddings", True) is False else 0
    return vocab * d + head + d + layers * (2 * d + attention + mlp)


def _cfg_int(config: Any, name: str) -> int:
    value = getattr(config, name)
    return file_int(value, name, where="--config", fix=f"lower {name}")


def _check_size(model_type: str, kwargs: dict[str, Any]) -> None:
    """Refuse a model above MAX_MODEL_PARAMETERS: first by arithmetic on the config (nothing built), then
    from 1- and 2-layer builds on the meta device, then from the whole model on meta (no memory).

    A layer count like 200000 is refused by its bound; a size like 4000 layers × width 64 by
    :func:`parameters_at_least` before any module is built.
    """
    import transformers

    from flowgeom.hf.tiny import tiny_config

    def parameters(config) -> int:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                                     experts_implementation="eager")
        return sum(p.numel() for p in model.parameters())

    config = tiny_config(model_type, **kwargs)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int):
        file_int(layers, "num_hidden_layers", where="--config", fix="lower num_hidden_layers")
    least = parameters_at_least(config, FAMILIES[model_type])
    if least > MAX_MODEL_PARAMETERS:
        raise _too_large(model_type, kwargs, least, "at least ")
    if isinstance(layers, int) and layers > 2:
        # what the bound leaves out (biases, extra norms): extrapolate arithmetically from 1- and 2-layer builds,
        # P(L) = P(1) + (L - 1)(P(2) - P(1)), before building L layers
        small = [tiny_config(model_type, **kwargs) for _ in (1, 2)]
        try:
            for n, cfg in enumerate(small, start=1):
                cfg.num_hidden_layers = n
                if isinstance(getattr(cfg, "layer_types", None), list):
                    cfg.layer_types = cfg.layer_types[:n]
            one, two = (parameters(cfg) for cfg in small)
        except Exception:  # noqa: BLE001 - a family whose layers cannot be cut: the full build decides
            one = two = 0
        estimate = one + (layers - 1) * (two - one)
        if estimate > MAX_MODEL_PARAMETERS:
            raise _too_large(model_type, kwargs, estimate, "about ")
    total = parameters(config)
    if total > MAX_MODEL_PARAMETERS:
        raise _too_large(model_type, kwargs, total, "")


@dataclass
class HFBuild:
    """What :func:`build` made: the wrapped part, the config values used, the closed-form count."""

    module: HFPart
    model_type: str
    part: str
    config: dict
    expected: int | None
    label: str = ""


def build(model_type: str, part: str, *, overrides: dict[str, Any] | None = None, seed: int = 0,
          keep_casts: bool = False) -> HFBuild:
    """Tiny random ``model_type`` (float64, eager), its layer-0 ``part`` wrapped as :class:`HFPart`."""
    from flowgeom.hf.tiny import require_transformers, tiny_model

    require_transformers()  # a missing extra is its own one-line error, not a bad --config
    kwargs = {**SIZES[model_type], **(overrides or {})}
    try:
        _check_size(model_type, kwargs)
        model = tiny_model(model_type, seed=seed, dtype=torch.float64, **kwargs)
        _check_heads(model_type, model.config)
    except FlowgeomError:
        raise
    except Exception as exc:  # transformers rejects the combination (e.g. heads not dividing hidden)
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlowgeomError(f"building a tiny {model_type} with {kwargs} failed: {type(exc).__name__}: {msg}; "
                            "change the --config values") from None
    config = model.config
    for sub in model.modules():  # the eager experts loop over nonzero() (no vmap); batched_mm gathers: same function
        sub_config = getattr(sub, "config", None)
        if getattr(sub_config, "_experts_implementation", None) == "eager":
            sub_config._experts_implementation = "batched_mm"
    layer, attn_name, mlp_names, rotary = _layer_parts(model, model_type)
    hidden = config.hidden_size
    rope = None
    if rotary is not None and part in ("attention", "block"):
        probe = torch.zeros(1, SEQ_LEN, hidden, dtype=torch.float64)
        with torch.no_grad():
            cos, sin = rotary(probe, torch.arange(SEQ_LEN).unsqueeze(0))  # (1, T, r) each
        rope = (cos.to(torch.float64), sin.to(torch.float64))
    if part == "block":
        modules = {"layer": layer}
    elif part == "attention":
        modules = {attn_name: getattr(layer, attn_name)}
    else:
        modules = {n: getattr(layer, n) for n in mlp_names}
    causal = model_type != "bert" or bool(getattr(config, "is_decoder", False))  # the tiny BERT is a decoder
    expected = closed_form(model_type, part, config)
    wrapped = HFPart(modules, part=part, hidden=hidden, seq_len=SEQ_LEN, rope=rope, causal=causal,
                     keep_casts=keep_casts).to(torch.float64).eval()
    shown = {k: getattr(config, k) for k in kwargs if hasattr(config, k)}
    if _has_moe(model_type):
        shown["_experts_implementation"] = getattr(config, "_experts_implementation", None)
    shown.update(_attn_implementation=config._attn_implementation, dtype="float64", seq_len=SEQ_LEN,
                 casts="kept (module's own float32 ops)" if keep_casts else "run in float64 (keep_dtype)")
    return HFBuild(module=wrapped, model_type=model_type, part=part, config=shown, expected=expected)


def resolve_hf(target: str, *, config_items: list[str] | None = None, seed: int = 0, keep_casts: bool = False) -> HFBuild:
    """``hf:MODEL_TYPE:PART`` -> :class:`HFBuild`; ``config_items`` are ``KEY=VALUE`` strings (``--config``).

    :func:`flowgeom.laws.target.resolve` turns it into a ``Target``; this module
    does not import that one (no import circle).
    """
    model_type, part = parse_target(target)
    overrides = config_overrides(model_type, config_items)
    built = build(model_type, part, overrides=overrides, seed=seed, keep_casts=keep_casts)
    built.label = target + "".join(f" --config {k}={v}" for k, v in overrides.items())
    return built
