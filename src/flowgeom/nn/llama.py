"""A Llama decoder in one file (nanoGPT style), with HF parameter names so weights copy key by key.

Architecture (Llama / SmolLM2), pre-norm residual blocks::

    h_0 = E[ids]                                         # (B, T, d)
    a   = h + o_proj(Attn(RMSNorm(h)))                   # causal GQA, RoPE on q and k
    h'  = a + down_proj(silu(gate_proj(x)) * up_proj(x)),  x = RMSNorm(a)
    logits = lm_head(RMSNorm(h_L))                       # lm_head = E when embeddings are tied

* RMSNorm: ``x / sqrt(mean(x^2) + eps) * w``, computed in float32 (as HF does) and cast back.
* RoPE, HF "rotate_half" layout: with ``inv_freq_i = theta^(-2i/hd)`` and
  ``emb = [freqs, freqs]``, ``q' = q cos + rotate_half(q) sin`` where
  ``rotate_half([x1, x2]) = [-x2, x1]`` over the two halves of the head dim.
  llama.cpp rotates interleaved pairs instead, which is why GGUF files store
  the q/k rows permuted (undone in :func:`gguf_state_dict`).
* GQA: ``n_kv`` key/value heads, each shared by ``n_heads / n_kv`` query heads.

Parameter names (``(out, in)`` like ``nn.Linear``)::

    model.embed_tokens.weight                     (vocab d)
    model.layers.{l}.input_layernorm.weight       (d)
    model.layers.{l}.self_attn.{q,k,v,o}_proj.weight   q/o: (H hd, d) / (d, H hd); k,v: (KV hd, d)
    model.layers.{l}.post_attention_layernorm.weight   (d)
    model.layers.{l}.mlp.{gate,up}_proj.weight    (m d); down_proj: (d m)
    model.norm.weight                             (d)
    lm_head.weight                                (vocab d), absent on disk when tied

Loading: :func:`load_llama` takes a GGUF (``builtin:smollm2`` included) or an
HF-layout folder (``config.json`` + safetensors, what ``compress run``
writes). The forward is checked against ``transformers.LlamaForCausalLM``
(tests/compress/test_share_evaluate.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flowgeom.errors import FlowgeomError, positive_int
from flowgeom.files import read_json_object
from flowgeom.io import local_path, open_source
from flowgeom.limits import LIMITS, file_float, file_int


_REQUIRED_HF = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 49152  # token ids
    hidden_size: int = 576  # residual width d
    intermediate_size: int = 1536  # SwiGLU hidden width m
    num_hidden_layers: int = 30  # decoder blocks L
    num_attention_heads: int = 9  # query heads H
    num_key_value_heads: int = 3  # key/value heads KV (GQA), divides H
    head_dim: int = 64  # per-head width hd (H hd need not equal d)
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 100000.0  # RoPE base
    max_position_embeddings: int = 8192  # longest context the model was trained for
    tie_word_embeddings: bool = True  # lm_head shares the embedding matrix

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                positive_int(value, f"Llama config {f.name}")
            if f.name in LIMITS:  # before any module is built: 2e9 layers would loop, 4e9 tokens allocate
                file_int(value, f.name, where="Llama config", fix="fix config.json (or the GGUF metadata)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise FlowgeomError(f"Llama config: {self.num_attention_heads} query heads are not a multiple of "
                                f"{self.num_key_value_heads} key/value heads; fix config.json")
        if self.head_dim % 2:
            raise FlowgeomError(f"Llama config head_dim {self.head_dim} must be even for RoPE")
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise FlowgeomError(f"Llama config needs rms_norm_eps > 0 and rope_theta > 0, got {self.rms_norm_eps}, "
                                f"{self.rope_theta}")

    @classmethod
    def from_hf(cls, cfg: dict) -> LlamaConfig:
        """From an HF ``config.json`` dict (model_type llama; unknown keys ignored, rope scaling refused).

        The shape fields are required: a missing one is refused, never filled from SmolLM2's defaults.
        """
        if not isinstance(cfg, dict):
            raise FlowgeomError(f"config.json holds a JSON {type(cfg).__name__}, not an object of Llama fields; "
                                "re-export it")
        if cfg.get("model_type", "llama") != "llama":
            raise FlowgeomError(f"config.json says model_type {cfg.get('model_type')!r}; only llama is supported")
        missing = [name for name in _REQUIRED_HF if cfg.get(name) is None]
        if missing:
            raise FlowgeomError(f"config.json is missing the Llama field(s) {', '.join(missing)}; re-export it "
                                "(every HF Llama config.json has them)")
        for f in fields(cls):  # wrong JSON types name the field, before any arithmetic on them
            value = cfg.get(f.name)
            if value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if (f.type == "int" and not (number and float(value).is_integer())) or (f.type == "float" and not number) \
                    or (f.type == "bool" and not isinstance(value, bool)):
                raise FlowgeomError(f"config.json field {f.name} must be {'an' if f.type == 'int' else 'a'} "
                                    f"{f.type}, got {value!r}; fix config.json")
        for key in ("rope_scaling", "rope_parameters"):  # transformers 5 moved rope_theta into rope_parameters
            if not isinstance(cfg.get(key) or {}, dict):
                raise FlowgeomError(f"config.json {key} must be an object, got {cfg[key]!r}; fix config.json")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or rope
        if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
            raise FlowgeomError(f"rope scaling {scaling} is not supported; only plain RoPE")
        theta = cfg["rope_theta"] if cfg.get("rope_theta") is not None else rope.get("rope_theta", 10000.0)
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise FlowgeomError("config.json asks for attention/MLP biases; this Llama forward has none")
        types = {f.name: f.type for f in fields(cls)}
        kwargs = {k: int(v) if types[k] == "int" else v for k, v in cfg.items() if k in types and v is not None}
        if not isinstance(theta, (int, float)) or isinstance(theta, bool):
            raise FlowgeomError(f"config.json rope_theta must be a number, got {theta!r}; fix config.json")
        kwargs["rope_theta"] = float(theta)
        # max(…, 1): a head count < 1 reaches __post_init__, which refuses it by name
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // max(kwargs["num_attention_heads"], 1))
        kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise FlowgeomError(f"config.json has Llama fields this forward cannot use ({exc}); re-export it") from None

    def to_hf(self) -> dict:
        """An HF ``config.json`` dict that ``transformers.LlamaConfig`` reads back as this model."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(self), "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False, "rope_scaling": None, "torch_dtype": "float32",
                "bos_token_id": 1, "eos_token_id": 2}


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(cfg: LlamaConfig, T: int, *, dtype: torch.dtype, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape (T, hd): angles ``t theta^(-2i/hd)``, duplicated over the two halves.

    Angles are computed in float32 whatever ``dtype`` is, exactly as HF Llama
    does (the model was trained with those tables; a float64 table moves
    float64 logits by ~1e-7).
    """
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device)
                                        / cfg.head_dim)  # (hd/2,)
    freqs = torch.arange(T, dtype=torch.float32, device=device)[:, None] * inv_freq  # (T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        H, KV, hd, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(d, H * hd, bias=False)
        self.k_proj = nn.Linear(d, KV * hd, bias=False)
        self.v_proj = nn.Linear(d, KV * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``past``: this layer's ``[k, v]`` (B, KV, P, hd) of the P tokens before ``x``, extended in place (an
        empty list on the first call); ``cos, sin`` are then the tables of positions P..P+T-1."""
        B, T, _ = x.shape
        H, KV, hd = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        q = self.q_proj(x).view(B, T, H, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v_proj(x).view(B, T, KV, hd).transpose(1, 2)  # (B, KV, T, hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        causal = True
        if past is not None:
            if past:
                if T != 1:
                    raise FlowgeomError("a cached forward takes one new token at a time after the prompt")
                k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # (B, KV, P+1, hd)
                causal = False  # the one new query sees every cached key
            past[:] = [k, v]
        k = k.repeat_interleave(H // KV, dim=1)  # (B, H, S, hd): query head h reads kv head h // (H/KV)
        v = v.repeat_interleave(H // KV, dim=1)  # (B, H, S, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=1.0 / math.sqrt(hd))  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))  # (B, T, d)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d, m = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, m, bias=False)
        self.up_proj = nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, d)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                past: list[torch.Tensor] | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, past)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KVCache:
    """Keys and values of the tokens decoded so far, one ``[k, v]`` (B, KV, length, hd) per layer."""

    def __init__(self):
        self.length = 0
        self._layers: list[list[torch.Tensor]] = []

    def layers(self, n: int) -> list[list[torch.Tensor]]:
        if not self._layers:
            self._layers = [[] for _ in range(n)]
        return self._layers


class LlamaForCausalLM(nn.Module):
    """``forward(ids (B, T)) -> logits (B, T, vocab)``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """``cache``: a :class:`KVCache` for incremental decoding (the prompt first, then one token per call)."""
        P = 0 if cache is None else cache.length
        T = P + ids.shape[1]
        if T > self.config.max_position_embeddings:
            raise FlowgeomError(f"a context of {T} tokens exceeds the model's {self.config.max_position_embeddings} "
                                "positions; use a shorter --context")
        h = self.model.embed_tokens(ids)  # (B, T - P, d)
        cos, sin = rope_tables(self.config, T, dtype=h.dtype, device=h.device)  # (T, hd) each
        cos, sin = cos[P:], sin[P:]  # (T - P, hd): the new tokens' positions
        pasts = [None] * len(self.model.layers) if cache is None else cache.layers(len(self.model.layers))
        # RMSNorm squares h: beyond sqrt(max/d) the mean square overflows, the norm returns 0 (or NaN) and the
        # logits turn uniform, a confident perplexity equal to the vocabulary size. Track the peak (one sync).
        peak = h.detach().abs().amax()
        for layer, past in zip(self.model.layers, pasts):
            h = layer(h, cos, sin, past)
            peak = torch.maximum(peak, h.detach().abs().amax())
        if cache is not None:
            cache.length = T
        limit = math.sqrt(torch.finfo(h.dtype).max / self.config.hidden_size)
        if not bool(peak <= limit):  # False for NaN too
            raise FlowgeomError(f"the forward overflowed {str(h.dtype).replace('torch.', '')}: hidden states reach "
                                f"|h| = {float(peak):.3g}, beyond the {limit:.3g} RMSNorm can square, so the logits "
                                "would be meaningless; the weights are broken or wildly scaled: check the checkpoint")
        return self.lm_head(self.model.norm(h))  # (B, T, vocab)

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF-named state dict key by key (``lm_head.weight`` optional when tied); strict otherwise."""
        own = self.state_dict()
        check_state(self.config, state, {k: tuple(v.shape) for k, v in own.items()})
        with torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor)


# ---------------------------------------------------------------- GGUF -> HF names and layout

GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def check_state(cfg: LlamaConfig, state: Mapping[str, torch.Tensor],
                shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """Refuse ``state`` unless it holds every tensor ``cfg`` implies, in every layer, with its shape.

    The one check of loaded weights against a config (evaluate, share, load): ``lm_head.weight`` is optional
    when tied. ``shapes`` (name: shape) defaults to a model of ``cfg`` built on ``meta`` (nothing allocated).
    """
    if shapes is None:
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    expected = set(shapes) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - set(shapes))
    if missing or unexpected:
        raise FlowgeomError(f"Llama weights do not match the config: missing {missing[:5]}, unexpected "
                            f"{unexpected[:5]}; the checkpoint is not a {cfg.num_hidden_layers}-layer Llama of this "
                            "shape")
    for name in sorted(state):
        if tuple(state[name].shape) != tuple(shapes[name]):
            raise FlowgeomError(f"tensor {name} has shape {list(state[name].shape)}, the config implies "
                                f"{list(shapes[name])}; fix config.json or the checkpoint")


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``transformers``' ``_reverse_permute_weights``).

    llama.cpp's converter stores rows of head h in the order ``(hd/2, 2)``
    (pairs interleaved) where HF has ``(2, hd/2)`` (halves); reading as
    ``(n_head, hd/2, 2, in)`` and swapping the middle axes restores HF's rows.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # (rows, in)


def gguf_config(meta: dict, tensors) -> LlamaConfig:
    """The :class:`LlamaConfig` a llama-architecture GGUF's metadata describes."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise FlowgeomError(f"GGUF architecture {arch!r} is not supported; only llama (SmolLM2, Llama, Mistral)")
    fix = "the file is corrupt or forged: re-download or re-convert it"

    def number(key: str, field: str, default: object = None) -> int:
        if key not in meta and default is None:
            raise FlowgeomError(f"GGUF metadata lacks {key!r}; the file is not a complete llama GGUF")
        return file_int(meta.get(key, default), key, where="GGUF metadata", fix=fix, limits=LIMITS[field])

    def real(key: str, default: object = None) -> float:
        if key not in meta and default is None:
            raise FlowgeomError(f"GGUF metadata lacks {key!r}; the file is not a complete llama GGUF")
        return file_float(meta.get(key, default), key, where="GGUF metadata", fix=fix)

    d, H = number("llama.embedding_length", "hidden_size"), number("llama.attention.head_count", "num_attention_heads")
    return LlamaConfig(
        vocab_size=number("llama.vocab_size", "vocab_size", len(meta.get("tokenizer.ggml.tokens", ()))),
        hidden_size=d, intermediate_size=number("llama.feed_forward_length", "intermediate_size"),
        num_hidden_layers=number("llama.block_count", "num_hidden_layers"), num_attention_heads=H,
        num_key_value_heads=number("llama.attention.head_count_kv", "num_key_value_heads", H),
        head_dim=number("llama.rope.dimension_count", "head_dim", max(d // H, 1)),
        rms_norm_eps=real("llama.attention.layer_norm_rms_epsilon"),
        rope_theta=real("llama.rope.freq_base", 10000.0),
        max_position_embeddings=number("llama.context_length", "max_position_embeddings", 2048),
        tie_word_embeddings="output.weight" not in tensors,
    )


def gguf_state_dict(path: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """``(config, HF-named float32 state dict)`` of a llama GGUF: dequantised, q/k rows unpermuted."""
    src = open_source(Path(path))  # one header walk: validated tensor table, metadata decoded as read
    cfg = gguf_config(src.metadata, src.shapes)
    state = {}
    for name in src.shapes:
        parts = name.split(".")
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key = "lm_head.weight"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_NAMES and parts[1].isdigit():
            key = f"model.layers.{int(parts[1])}.{GGUF_NAMES[parts[2]]}.weight"
        elif name.startswith("rope_freqs"):
            raise FlowgeomError(f"{path} holds {name} (scaled RoPE); only plain RoPE is supported")
        else:
            raise FlowgeomError(f"{path}: unexpected tensor {name!r} for a llama GGUF")
        w = float_weights(path, {name: src.load(name)})[name]  # integer codes refused as in HF folders
        if parts[2:3] == ["attn_q"]:
            w = unpermute_rope_rows(w, cfg.num_attention_heads)
        elif parts[2:3] == ["attn_k"]:
            w = unpermute_rope_rows(w, cfg.num_key_value_heads)
        state[key] = w
    return cfg, state


def hf_state_dict(folder: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """``(config, state dict)`` of an HF-layout folder: ``config.json`` + safetensors (validated by flowgeom)."""
    folder = Path(folder)
    raw = read_json_object(folder / "config.json", what="config.json",
                           fix="an HF Llama folder needs config.json next to its safetensors")
    try:
        cfg = LlamaConfig.from_hf(raw)
    except FlowgeomError as exc:
        raise FlowgeomError(f"{folder}: {exc}") from None
    src = open_source(folder)
    return cfg, float_weights(folder, {name: src.load(name) for name in src.shapes})


def refuse_integer_codes(where: str | Path, state: Mapping[str, torch.Tensor]) -> None:
    """The one rule for every weight file flowgeom loads (HF folders, GGUF, factored folders): no integer tensors.

    int8/int4 codes cast to float would be scored as a different model (GGUF's own quantised types are
    dequantised by the reader and arrive here as floats).
    """
    codes = [name for name, t in state.items() if not t.is_floating_point()]
    if codes:
        raise FlowgeomError(f"{where}: {codes[0]} has dtype {str(state[codes[0]].dtype).replace('torch.', '')} (and "
                            f"{len(codes) - 1} more integer tensors): a quantised checkpoint; dequantise it to "
                            "float (e.g. save_pretrained of the dequantised model) first")


def float_weights(where: str | Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as float32, refusing integer tensors (:func:`refuse_integer_codes`)."""
    refuse_integer_codes(where, state)
    return {name: t.float() for name, t in state.items()}


def llama_state_dict(spec: str | Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """``(config, state dict)`` from a GGUF file, ``builtin:smollm2`` or an HF-layout folder."""
    path = local_path(spec)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").exists() or not ggufs:
            return hf_state_dict(path)
        if len(ggufs) > 1:
            raise FlowgeomError(f"folder {path} holds {len(ggufs)} .gguf files; pass the one you mean")
        path = ggufs[0]
    if path.suffix == ".gguf" and path.is_file():
        return gguf_state_dict(path)
    raise FlowgeomError(f"{spec} is neither a .gguf file, builtin:smollm2, nor a folder with config.json and "
                        "safetensors; pass one of those")


def load_llama(spec: str | Path, *, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A :class:`LlamaForCausalLM` in eval mode with the weights of ``spec`` (see :func:`llama_state_dict`)."""
    cfg, state = llama_state_dict(spec)
    return llama_from_state(cfg, state, dtype=dtype)


def llama_from_state(cfg: LlamaConfig, state: dict[str, torch.Tensor], *,
                     dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A model built on the meta device (no random init: ~3 s saved on SmolLM2) and filled from ``state``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_hf_state_dict(state)
    return model.to(dtype).eval()
