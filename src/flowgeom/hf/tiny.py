"""Tiny random Hugging Face models, one per supported family (tests and examples).

Every config (``Family.tiny`` in the one family table,
:mod:`flowgeom.hf.families`) is small enough for float64 autograd and the
numeric law counter: hidden 32, 2 layers, 4 query heads of head_dim 8, 2 K/V
heads where the family has grouped-query attention, vocab 64, MLP width 64, 4
experts with top-2 routing for the MoE families, eager attention. Nothing is ever
downloaded: configs come from ``AutoConfig.for_model`` and weights from the
seeded ``from_config`` initialisation.

``transformers`` is imported lazily, so flowgeom works without it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.hf.families import FAMILIES

_NO_DROPOUT = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")

SUPPORTED: tuple[str, ...] = tuple(sorted(FAMILIES))


def require_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise FlowgeomError("flowgeom.hf needs transformers; install the extra: pip install 'flowgeom[hf]'") from exc
    return transformers


def _check(model_type: str) -> None:
    if model_type not in FAMILIES:
        raise FlowgeomError(f"unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED)}")


def tiny_config(model_type: str, **overrides: Any):
    """A small ``transformers`` config of ``model_type`` (eager attention, no dropout).

    ``overrides`` replace or extend the family defaults (config keyword names),
    e.g. ``tiny_config("llama", num_key_value_heads=4, attention_bias=True)``.
    """
    _check(model_type)
    transformers = require_transformers()
    kwargs = {**FAMILIES[model_type].tiny, **overrides}
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
