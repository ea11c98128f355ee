"""Row layouts of fused projections, head counts, and LoRA scales: what naming needs besides names.

A fused tensor holds several roles' rows in one ``(out, in)`` matrix. Which
rows belong to which role is a property of the architecture, and for
attention it depends on the head counts, which the tensor name and shape do
not always determine:

* ``blocked`` (Phi-3 ``self_attn.qkv_proj``): rows ``q | k | v`` with sizes
  ``H·hd``, ``KV·hd``, ``KV·hd``.
* ``grouped`` (GPT-NeoX ``attention.query_key_value``, Falcon
  ``self_attention.query_key_value``): rows viewed as ``(KV, H/KV + 2, hd)``:
  per key/value group its ``H/KV`` query heads, then its k head, then its v
  head. GPT-NeoX is the case ``KV = H`` (rows ``(H, 3, hd)``: q, k, v of head
  h). Falcon's three layouts are all of this form: the new decoder
  architecture has ``KV = num_kv_heads``; classic multi-query has ``KV = 1``
  (rows ``H·hd`` of q, then ``hd`` of k, then ``hd`` of v); classic
  multi-head has ``KV = H``.
* ``halves`` (Phi-3 ``mlp.gate_up_proj``, transformers-5 fused experts
  ``experts.gate_up_proj (E, 2m, d)``): rows ``gate | up``.
* ``thirds`` (GPT-2 ``attn.c_attn``, after the Conv1D transpose): ``q | k | v``
  of equal size (GPT-2 has no grouped-query attention).

In both attention layouts ``rows = (H + 2 KV)·hd``, so ``hd`` follows from
the tensor once ``H`` and ``KV`` are known. They come from ``--heads`` /
``--kv-heads``, else from the model config (``config.json`` next to the
weights, or ``model.config`` of an in-memory model). Without them the split is
ambiguous and is refused (the tensor is listed as unmatched with the reason),
never guessed.

LoRA (PEFT): the adapted weight is ``W + s·B A`` with ``A (r, in)``,
``B (out, r)`` and ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``); ``alpha_pattern`` entries override ``lora_alpha`` for the
modules whose name ends with the key. An in-memory PEFT model carries its
scales directly (``module.scaling[adapter]``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from flowgeom.errors import FlowgeomError
from flowgeom.files import read_json_object
from flowgeom.limits import file_int

PEFT_PREFIX = "base_model.model."
MAX_LORA_SCALE = 2.0**16  # |lora_alpha / r|: real adapters use ≤ ~10³; far below what overflows s·B·A
Rows = tuple[tuple[int, int], ...]  # row ranges [start, stop) of the (out, in) view, concatenated in order


class LayoutError(ValueError):
    """A fused tensor whose split cannot be determined; the message is the reason shown to the user."""


@dataclass(frozen=True)
class NamingHints:
    """What the naming needs besides tensor names: model config, head counts, LoRA settings."""

    config: Mapping = field(default_factory=dict)  # model config (config.json / model.config.to_dict())
    config_source: str = "none"  # where the config came from, for messages
    heads: int | None = None  # --heads: query heads (overrides the config)
    kv_heads: int | None = None  # --kv-heads: key/value heads (overrides the config)
    adapter_config: Mapping = field(default_factory=dict)  # adapter_config.json (PEFT) or the in-memory LoraConfig
    lora_scaling: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # in memory: module -> {adapter: s}
    merge_lora: bool = False  # analyse W + s·B A instead of W
    lora_adapter: str | None = None  # which adapter to merge when several are present


def strip_peft(name: str) -> str:
    """Tensor/module name without PEFT's wrapping: ``base_model.model.`` prefix and ``.base_layer`` segment."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX):]
    return name.replace(".base_layer.", ".")


def head_counts(hints: NamingHints) -> tuple[int | None, int | None, str]:
    """``(H, KV, where from)``: flags first, then the config (Falcon's layout flags decide its KV)."""
    cfg = {k: v for k, v in (hints.config or {}).items()  # a config.json may hold anything: counts must be ints
           if not k.startswith("num_") and k != "n_head" or (isinstance(v, int) and not isinstance(v, bool) and v > 0)}
    heads = hints.heads or cfg.get("num_attention_heads") or cfg.get("n_head")
    kv = hints.kv_heads
    if kv is None:
        if cfg.get("model_type") == "falcon":
            if cfg.get("new_decoder_architecture"):
                kv = cfg.get("num_kv_heads") or heads
            else:
                kv = 1 if cfg.get("multi_query", True) else heads
        elif cfg.get("model_type") == "gpt_neox":
            kv = heads
        else:
            kv = cfg.get("num_key_value_heads") or (heads if cfg.get("num_attention_heads") else None)
    where = "--heads/--kv-heads" if hints.heads or hints.kv_heads else hints.config_source
    return heads, kv, where


def qkv_rows(layout: str, part: str, out_rows: int, hints: NamingHints) -> Rows:
    """Rows of ``part`` (q, k or v) in a fused attention tensor with ``out_rows`` rows (see module docstring)."""
    index = "qkv".index(part)
    if layout == "thirds":
        if out_rows % 3:
            raise LayoutError(f"{out_rows} rows do not split into equal q, k, v thirds")
        n = out_rows // 3
        return ((index * n, (index + 1) * n),)
    heads, kv, where = head_counts(hints)
    if layout == "interleaved":  # GPT-NeoX: one k and one v head per query head, rows (H, 3, hd)
        if hints.kv_heads and heads and hints.kv_heads != heads:
            raise LayoutError(f"--kv-heads {hints.kv_heads} differs from --heads {heads}, but this layout has one "
                              "k and v head per query head")
        kv, layout = heads, "grouped"
    if not heads or not kv:
        raise LayoutError("splitting a fused q|k|v tensor needs the numbers of query and key/value heads, and no "
                          "config.json or model config gives them; pass --heads H --kv-heads KV")
    if heads % kv or out_rows % (heads + 2 * kv):
        raise LayoutError(f"{heads} query heads and {kv} key/value heads (from {where}) do not fit {out_rows} fused "
                          f"rows = (H + 2·KV)·head_dim; fix --heads/--kv-heads")
    hd = out_rows // (heads + 2 * kv)
    cfg_hd = (hints.config or {}).get("head_dim")
    if isinstance(cfg_hd, int) and not (hints.heads or hints.kv_heads) and cfg_hd != hd:
        raise LayoutError(f"config head_dim {cfg_hd} disagrees with {out_rows} fused rows / (H + 2·KV) = {hd}")
    if layout in ("blocked", "grouped"):  # q | k | v, or rows (KV, H/KV + 2, hd)
        from flowgeom.hf.families import qkv_ranges

        return qkv_ranges(layout, part, heads, kv, hd)
    raise LayoutError(f"unknown fused layout {layout!r}")  # pragma: no cover - patterns name known layouts


CONFIG_CHECKED = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "granite")


def config_shapes(hints: NamingHints) -> dict[str, tuple[int, int]]:
    """``{role: (out, in)}`` that the model config implies for q k v o gate up down (empty when it implies none).

    Only for the dense Llama-layout families of ``CONFIG_CHECKED``, whose config fully fixes these shapes:
    ``q (H hd, d)``, ``k, v (KV hd, d)``, ``o (d, H hd)``, ``gate, up (I, d)``, ``down (d, I)`` with ``d =
    hidden_size``, ``I = intermediate_size``, ``hd = head_dim`` (default ``d / H``).
    """
    cfg = hints.config or {}
    if cfg.get("model_type") not in CONFIG_CHECKED:
        return {}
    heads, kv, _ = head_counts(hints)
    d, mlp = cfg.get("hidden_size"), cfg.get("intermediate_size")
    hd = cfg.get("head_dim") or (d // heads if isinstance(d, int) and isinstance(heads, int) and heads else None)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (d, mlp, heads, kv, hd)):
        return {}
    return {"q": (heads * hd, d), "k": (kv * hd, d), "v": (kv * hd, d), "o": (d, heads * hd), "gate": (mlp, d),
            "up": (mlp, d), "down": (d, mlp)}


def check_config_shapes(roles: Mapping[str, list], hints: NamingHints) -> None:
    """Refuse a matrix whose shape disagrees with the model config (:func:`config_shapes`), naming both."""
    want = config_shapes(hints)
    for role, refs in roles.items():
        for ref in refs if role in want else ():
            if tuple(ref.shape) != want[role]:
                cfg = hints.config
                raise FlowgeomError(
                    f"{ref.tensor} (role {role}, layer {ref.layer}) has shape {list(ref.shape)} but {hints.config_source} "
                    f"implies {list(want[role])} (hidden_size {cfg.get('hidden_size')}, intermediate_size "
                    f"{cfg.get('intermediate_size')}, heads {head_counts(hints)[0]}/{head_counts(hints)[1]}, head_dim "
                    f"{cfg.get('head_dim')}); the weights and their config disagree: use the config.json saved with "
                    "these weights, or re-export the checkpoint")


def half_rows(part: int, out_rows: int) -> Rows:
    """Rows of half ``part`` (0 = gate, 1 = up) of a fused gate|up tensor."""
    if out_rows % 2:
        raise LayoutError(f"{out_rows} rows do not split into gate | up halves")
    n = out_rows // 2
    return ((part * n, (part + 1) * n),)


def lora_scale(module: str, adapter: str, rank: int, hints: NamingHints) -> float:
    """``s`` of ``W + s·B A`` for LoRA ``module`` (PEFT-stripped name), adapter ``adapter``, rank ``rank``."""
    for name, per_adapter in hints.lora_scaling.items():
        if strip_peft(name) == module and adapter in per_adapter:
            return float(per_adapter[adapter])
    cfg = hints.adapter_config
    if not cfg or "lora_alpha" not in cfg:
        raise FlowgeomError(f"--merge-lora needs the LoRA scale of {module}: put the adapter's adapter_config.json "
                            "(lora_alpha, r, use_rslora) next to its weights")
    alpha, r = cfg["lora_alpha"], cfg.get("r")
    for pattern, into in (("alpha_pattern", "alpha"), ("rank_pattern", "r")):  # PEFT's per-module overrides
        overrides = cfg.get(pattern) or {}
        if not isinstance(overrides, Mapping):
            raise FlowgeomError(f"adapter_config.json {pattern} must be an object {{module: value}}, got "
                                f"{type(overrides).__name__}; fix it")
        for key, value in overrides.items():
            if module == key or module.endswith("." + key):
                alpha, r = (value, r) if into == "alpha" else (alpha, value)
    for name, value in (("lora_alpha", alpha), ("r", r)):  # r may be absent (the tensors give it), lora_alpha not
        if (value is not None or name == "lora_alpha") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                            or not math.isfinite(value)):
            raise FlowgeomError(f"adapter_config.json {name} of {module} must be a number, got {value!r}; fix it")
    if r is not None:
        file_int(r, "r", where=f"adapter_config.json (module {module})", fix="fix it")
    if rank < 1:  # s = alpha / r would divide by zero
        raise FlowgeomError(f"the lora_A/lora_B of {module} have rank {rank}: an empty adapter, nothing to merge; "
                            "drop --merge-lora or use the adapter's real weights")
    if r is not None and r != rank:
        raise FlowgeomError(f"adapter_config.json says r = {r!r} for {module} but its lora_A/lora_B have rank {rank}: "
                            "the config is not this adapter's (PEFT itself would refuse to load it); use the "
                            "adapter_config.json saved with these weights")
    rslora = bool(cfg.get("use_rslora"))
    scale = float(alpha) / (math.sqrt(rank) if rslora else rank)
    if not abs(scale) <= MAX_LORA_SCALE:
        raise FlowgeomError(f"adapter_config.json lora_alpha = {alpha:g} gives {module} the LoRA scale s = "
                            f"{scale:.3g} (lora_alpha / {'sqrt(r)' if rslora else 'r'}), beyond ±{MAX_LORA_SCALE:g}: "
                            "W + s·B·A would overflow (no real adapter is scaled so); fix lora_alpha")
    return scale


def _read_json(path: Path) -> dict:
    return read_json_object(path, fix="fix or remove it")


def hints_for(spec, **options) -> NamingHints:
    """:class:`NamingHints` for a source spec (module, mapping, path): its model config and LoRA settings.

    A folder (or the folder of a file) may hold ``config.json`` and, for a
    PEFT adapter, ``adapter_config.json``; an ``nn.Module`` gives its
    ``config`` (``to_dict()``), a PEFT model its ``peft_config`` and each LoRA
    layer's ``scaling``. ``options`` are the remaining :class:`NamingHints` fields.
    """
    config, where, adapter, scaling = {}, "none", {}, {}
    to_dict = getattr(getattr(spec, "config", None), "to_dict", None)
    if callable(to_dict):
        config, where = dict(to_dict()), f"{type(spec).__name__}.config"
    peft_cfg = getattr(spec, "peft_config", None)
    if isinstance(peft_cfg, Mapping):
        adapters = {name: c.to_dict() if hasattr(c, "to_dict") else dict(vars(c)) for name, c in peft_cfg.items()}
        if len(adapters) == 1:
            adapter = next(iter(adapters.values()))
    if hasattr(spec, "named_modules"):
        for name, module in spec.named_modules():
            s = getattr(module, "scaling", None)
            if isinstance(s, Mapping) and hasattr(module, "lora_A"):
                scaling[name] = dict(s)
    elif isinstance(spec, (str, os.PathLike)) and not str(spec).startswith("builtin:"):
        path = Path(spec)
        folder = path if path.is_dir() else path.parent
        if os.path.lexists(folder / "config.json"):  # a FIFO, device or folder is refused, not skipped
            config, where = _read_json(folder / "config.json"), str(folder / "config.json")
        if os.path.lexists(folder / "adapter_config.json"):
            adapter = _read_json(folder / "adapter_config.json")
    return NamingHints(config=config, config_source=where, adapter_config=adapter, lora_scaling=scaling, **options)
