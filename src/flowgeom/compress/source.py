"""The dense model a compression starts from: any causal-LM family, as role weights.

:func:`load_dense` gives ``(config, state)``: for Llama (a GGUF file,
``builtin:smollm2`` or an HF Llama folder) flowgeom's own config and weights,
read without transformers; for every other family of
:mod:`flowgeom.compress.arch` (an HF folder whose config.json names it) a
transformers config and the folder's safetensors, read by flowgeom's own
checked reader. Either way the projections are role weights
(:func:`flowgeom.compress.arch.role_state`), so every method runs unchanged;
:func:`build_model` gives the runnable model of such a state, and
:func:`family_json` the config.json of what is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowgeom.compress.arch import CAUSAL_FAMILIES, arch_of, check_family, family_state, role_state
from flowgeom.errors import FlowgeomError


def source_path(spec: str) -> Path:
    """The path of a source (``builtin:`` names resolved); a missing one refused with what is accepted."""
    if spec.startswith("builtin:"):
        from flowgeom.io.builtin import builtin_path

        return builtin_path(spec)
    path = Path(spec)
    if not path.exists():
        raise FlowgeomError(f"source {spec} does not exist; pass a Llama .gguf, builtin:smollm2 or an HF folder "
                            f"(config.json + safetensors) of one of: {', '.join(CAUSAL_FAMILIES)}")
    return path


def model_tokenizer(path: Path):
    """The source's tokenizer, or None for an HF folder saved without one (compressing with --method svd needs
    none)."""
    from flowgeom.data.tokens import load_tokenizer

    untokenized = path.is_dir() and not (path / "tokenizer.json").exists() and not any(path.glob("*.gguf"))
    return None if untokenized else load_tokenizer(path)


def check_vocab(tokenizer, cfg, source) -> None:
    """Refuse a tokenizer with more tokens than the model has embedding rows (``vocab_size``): its ids past the
    last row index nothing (a raw IndexError deep in the first forward pass otherwise)."""
    if tokenizer is None:
        return
    tokens, rows = tokenizer.get_vocab_size(), int(cfg.vocab_size)
    if tokens > rows:
        raise FlowgeomError(f"{source}: its tokenizer has {tokens:,} tokens but the model has {rows:,} token "
                            f"embeddings (vocab_size {rows:,}), so ids {rows:,} and above index nothing; put the "
                            "model's own tokenizer.json beside its weights")


def is_native(cfg: Any) -> bool:
    """flowgeom's own LlamaConfig (no transformers needed), as opposed to a transformers config."""
    from flowgeom.nn.llama import LlamaConfig

    return isinstance(cfg, LlamaConfig)


def folder_model_type(path: Path) -> str | None:
    """The ``model_type`` an HF folder's config.json names (None for anything else)."""
    from flowgeom.files import read_json_object

    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return None
    mt = read_json_object(config, fix="save the model again with save_pretrained").get("model_type", "llama")
    return mt if isinstance(mt, str) else None


def transformers_config(config_json: dict):
    """A transformers config object from a config.json object (the ``hf`` extra)."""
    try:
        import transformers
    except ImportError:
        raise FlowgeomError(f"a {config_json.get('model_type')} model needs transformers: pip install "
                            "'flowgeom[hf]'") from None
    kwargs = {k: v for k, v in config_json.items() if k != "model_type"}
    return transformers.AutoConfig.for_model(config_json["model_type"], **kwargs)


def load_dense(spec: str | Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(config, role state)`` of a dense source of any supported family (module docstring)."""
    from flowgeom.nn.llama import check_state, llama_state_dict

    path = Path(spec) if not str(spec).startswith("builtin:") else None
    mt = folder_model_type(path) if path is not None else None
    if mt is None or mt == "llama":
        cfg, state = llama_state_dict(spec)
        check_state(cfg, state)  # every layer, before any work: a disagreeing config.json is refused here
        return cfg, state
    try:
        check_family(mt)
    except FlowgeomError as exc:
        raise FlowgeomError(f"{path}: {exc}") from None
    model = pretrained(path)
    own = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        own.pop("lm_head.weight", None)
    return model.config, role_state(arch_of(model.config), own, model.config.num_hidden_layers)


def pretrained(path: Path, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' own loader on an HF folder (safetensors only: no pickle), refusing what it would only
    warn about: a missing, unexpected or mis-shaped tensor (it would leave random weights in place)."""
    from flowgeom.files import read_json_object

    transformers_config(read_json_object(path / "config.json", fix="save the model again"))  # extra present
    import transformers

    if not any(path.glob("*.safetensors")):
        raise FlowgeomError(f"{path} holds no .safetensors weights; save the model with save_pretrained "
                            "(safe_serialization, the default) — pickled .bin files are not read")
    from transformers.utils import logging as hf_logging

    bar, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # stderr carries flowgeom's own progress and one-line errors
    hf_logging.set_verbosity_error()
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=True, local_files_only=True, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlowgeomError(f"{path}: transformers could not load it: {first}") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)
    bad = {k: list(v)[:3] for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")
           and v}
    if bad:
        raise FlowgeomError(f"{path}: the tensors do not match its config.json ({bad}); re-save the model with "
                            "save_pretrained")
    return model.eval()


def build_model(cfg: Any, state: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The runnable model (eval mode) of a role ``state``."""
    if is_native(cfg):
        from flowgeom.nn.llama import llama_from_state

        return llama_from_state(cfg, state, dtype=dtype)
    import transformers

    tensors = family_state(arch_of(cfg), state, cfg.num_hidden_layers)
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten; leave the global RNG alone
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    try:
        missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise FlowgeomError(f"the tensors do not match the {cfg.model_type} config: {first}") from None
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise FlowgeomError(f"the tensors do not match the {cfg.model_type} config: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def view_model(cfg: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    """The runnable model (eval mode) of a role ``state`` whose parameters *are* ``state``'s tensors (no copy),
    for passes that only read the weights (calibration, calibration gradients): flowgeom's Llama with float32
    contiguous weights; any other source is copied by :func:`build_model`. Writing into the model's weights
    writes into ``state``: a pass that changes them (the sequential variant) takes :func:`build_model`."""
    if not is_native(cfg) or any(t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"
                                 for t in state.values()):
        return build_model(cfg, state)
    from flowgeom.nn.llama import LlamaForCausalLM, check_state

    check_state(cfg, state)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    own = {k: v for k, v in state.items() if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    model.load_state_dict(own, strict=not cfg.tie_word_embeddings, assign=True)  # lm_head: tied just below
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def family_json(cfg: Any) -> dict:
    """The config.json object of a model of ``cfg``."""
    if is_native(cfg):
        return cfg.to_hf()
    out = cfg.to_dict()
    if not out.get("architectures"):
        import transformers

        out["architectures"] = [transformers.AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
    return out
