"""Tiny random Hugging Face models, one per supported family (tests and examples).

Every config is small enough for float64 autograd and the numeric law
counter: hidden 32, 2 layers, 4 query heads of head_dim 8, 2 K/V heads where
the family has grouped-query attention, vocab 64, MLP width 64, 4 experts
with top-2 routing for the MoE families, eager attention. Nothing is ever
downloaded: configs come from ``AutoConfig.for_model`` and weights from the
seeded ``from_config`` initialisation.

``transformers`` is imported lazily, so flowgeom works without it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flowgeom.errors import FlowgeomError

# Per family: config keyword arguments (transformers 5.23 names).
_DECODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, vocab_size=64, max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_MOE = dict(num_experts_per_tok=2)

_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_DECODER),
    "mistral": dict(_DECODER, sliding_window=None),
    "qwen2": dict(_DECODER, use_sliding_window=False),
    "qwen3": dict(_DECODER, use_sliding_window=False),
    "gemma": dict(_DECODER),
    "gemma2": dict(_DECODER, query_pre_attn_scalar=8, sliding_window=64, attn_logit_softcapping=None,
                   final_logit_softcapping=None),
    "phi3": dict(_DECODER),
    "mixtral": dict(_DECODER, num_local_experts=4, **_MOE),
    "qwen2_moe": dict(_DECODER, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                      decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False, **_MOE),
    "olmoe": dict(_DECODER, num_experts=4, **_MOE),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_inner=64, vocab_size=64, n_positions=64,
                 bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
    "bert": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64,
                 max_position_embeddings=64, type_vocab_size=2, pad_token_id=0, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, is_decoder=True),
    "gpt_neox": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64,
                     max_position_embeddings=64, pad_token_id=0,
                     rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5), bos_token_id=1,
                     eos_token_id=2, tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64, max_position_embeddings=64,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                   hidden_dropout=0.0, attention_dropout=0.0),
}
_NO_DROPOUT = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")

SUPPORTED: tuple[str, ...] = tuple(sorted(_CONFIGS))


def require_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise FlowgeomError("flowgeom.hf needs transformers; install the extra: pip install 'flowgeom[hf]'") from exc
    return transformers


def _check(model_type: str) -> None:
    if model_type not in _CONFIGS:
        raise FlowgeomError(f"unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED)}")


def tiny_config(model_type: str, **overrides: Any):
    """A small ``transformers`` config of ``model_type`` (eager attention, no dropout).

    ``overrides`` replace or extend the family defaults (config keyword names),
    e.g. ``tiny_config("llama", num_key_value_heads=4, attention_bias=True)``.
    """
    _check(model_type)
    transformers = require_transformers()
    kwargs = {**_CONFIGS[model_type], **overrides}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    for name in _NO_DROPOUT:
        if isinstance(getattr(config, name, None), float) and name not in overrides:
            setattr(config, name, 0.0)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the grouped-mm kernels refuse float64
    return config


def tiny_model(model_type: str, *, seed: int, dtype: torch.dtype = torch.float64, **overrides: Any) -> nn.Module:
    """A tiny randomly initialised causal LM of ``model_type`` (``torch.manual_seed``-free: a local seed).

    BERT is built as ``BertLMHeadModel`` (``is_decoder=True``). The model is in
    eval mode (no dropout anywhere), cast to ``dtype``.
    """
    config = tiny_config(model_type, **overrides)
    transformers = require_transformers()
    devices = []  # fork_rng restores the global RNG afterwards: the seed stays local
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                                 experts_implementation="eager")
    return model.to(dtype).eval()
