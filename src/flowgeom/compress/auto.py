"""A factored folder in transformers' own Auto classes, and never silently as a dense model.

A factored folder's ``config.json`` is the dense model's config (any family of
:mod:`flowgeom.compress.arch`) whose ``model_type`` is ``flowgeom_factored``
(the family's type kept in ``flowgeom_base_model_type``, its architectures in
``flowgeom_base_architectures``) and whose ``architectures`` is
``FlowgeomFactoredForCausalLM``. So:

* without flowgeom, ``AutoModelForCausalLM.from_pretrained(folder)`` raises
  transformers' own unknown-model-type error, instead of building a
  model whose compressed projections are random (they are not
  in the file under their dense names);
* after :func:`register_transformers` (called by :func:`flowgeom.compress.load`,
  and when ``flowgeom.compress`` is imported after transformers), the same call
  returns the model with its factored projections, through transformers'
  registration of a custom config and model class (``AutoConfig.register``,
  ``AutoModelForCausalLM.register``): no ``trust_remote_code``, no code in the
  folder.
"""

from __future__ import annotations

import sys

FACTORED_TYPE = "flowgeom_factored"
FACTORED_ARCH = "FlowgeomFactoredForCausalLM"
BASE_KEY = "flowgeom_base_model_type"
BASE_ARCH_KEY = "flowgeom_base_architectures"


def factored_config_json(config_json: dict) -> dict:
    """The ``config.json`` object of a factored folder made from the dense model's ``config_json``."""
    if config_json.get("model_type") == FACTORED_TYPE:
        return dict(config_json)
    base = config_json.get("model_type", "llama")
    arch = config_json.get("architectures") or ["LlamaForCausalLM"]
    return {**config_json, "model_type": FACTORED_TYPE, "architectures": [FACTORED_ARCH], BASE_KEY: base,
            BASE_ARCH_KEY: arch}


def base_config_json(config_json: dict) -> dict:
    """The dense model's config object back from a factored folder's (older folders are returned unchanged)."""
    if config_json.get("model_type") != FACTORED_TYPE:
        return config_json
    out = {k: v for k, v in config_json.items() if k not in (BASE_KEY, BASE_ARCH_KEY)}
    out["model_type"] = config_json.get(BASE_KEY, "llama")
    out["architectures"] = config_json.get(BASE_ARCH_KEY) or ["LlamaForCausalLM"]
    return out


def register_transformers(*, only_if_imported: bool = False) -> bool:
    """Register the factored config and model class with transformers' Auto classes (idempotent).

    ``only_if_imported``: do nothing unless transformers is already imported (importing it costs seconds).
    Returns whether the classes are registered.
    """
    if only_if_imported and "transformers" not in sys.modules:
        return False
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return False
    if FACTORED_TYPE in CONFIG_MAPPING:
        return True

    class FlowgeomFactoredConfig(transformers.PretrainedConfig):
        """Holds a factored folder's config.json; the family's own config is built by the loader."""

        model_type = FACTORED_TYPE

    class FlowgeomFactoredForCausalLM(transformers.PreTrainedModel):
        config_class = FlowgeomFactoredConfig

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
            """flowgeom's loader (:func:`flowgeom.compress.folder.factored_hf`): every tensor checked."""
            import torch

            from flowgeom.compress.folder import factored_hf

            dtype = kwargs.get("torch_dtype", kwargs.get("dtype"))
            dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32  # None / "auto": as computed
            return factored_hf(pretrained_model_name_or_path, dtype=dtype)

    FlowgeomFactoredForCausalLM.__name__ = FACTORED_ARCH
    AutoConfig.register(FACTORED_TYPE, FlowgeomFactoredConfig)
    AutoModelForCausalLM.register(FlowgeomFactoredConfig, FlowgeomFactoredForCausalLM)
    return True
