"""Compressed models in transformers: every route works once flowgeom is imported, and refuses loudly without it.

A factored folder's ``config.json`` is the dense model's config (any family of
:mod:`flowgeom.compress.arch`; its type kept in ``flowgeom_base_model_type``, its
architectures in ``flowgeom_base_architectures``) with three keys that keep a loader
that does not know the format from building the family's model with the compressed
projections left random (they are not in the file under their dense names):

* ``model_type`` is :data:`~flowgeom.compress.folder.FACTORED_TYPE`, ``"flowgeom_factored: load it with
  flowgeom.compress.load"``. ``AutoModelForCausalLM``, ``pipeline(...)`` and
  ``AutoConfig`` resolve the type first and raise transformers' ``ValueError``
  "... has model type `flowgeom_factored: load it with flowgeom.compress.load` but
  Transformers does not recognize this architecture";
* ``transformers_weights`` (the weights file transformers reads when a config.json
  names one) is :data:`~flowgeom.compress.folder.REFUSAL`, which is no file name. The family's own class
  (``LlamaForCausalLM.from_pretrained(folder)``, ``Qwen2ForCausalLM`` ...), which only
  warns about a foreign ``model_type``, raises ``ValueError`` "The transformers file in
  the config seems to be incorrect: ...: none: a flowgeom factored folder, load it
  with flowgeom.compress.load" before it reads a tensor;
* the tensors are in ``flowgeom_factored.safetensors``
  (:data:`flowgeom.compress.folder.WEIGHTS_NAME`), a name transformers never looks
  for: a version that ignores ``transformers_weights``, or a call given its own
  ``config=``, ends in "no file named model.safetensors", not in random projections.

Checked on transformers 5.23 (the hf extra's pin) by ``tests/compress/test_load_routes.py``.
Rejected: a ``quantization_config`` with an unknown ``quant_method`` only warns and
loads the random projections; ``auto_map`` would ask the user to trust remote code.

**With flowgeom.** ``import flowgeom`` (so any ``flowgeom.*`` import) installs two
post-import hooks (:mod:`flowgeom.after_import`) and imports no transformers: right
after ``transformers.models.auto.configuration_auto`` has run,
:func:`register_config` registers a config class for the type with ``AutoConfig``;
right after ``transformers.models.auto.modeling_auto``, :func:`register_model`
registers with ``AutoModelForCausalLM`` a class whose ``from_pretrained`` is
flowgeom's loader (:func:`flowgeom.compress.folder.factored_hf`, every tensor
checked). A module imported before flowgeom is registered with at once. So in either
import order ``AutoModelForCausalLM.from_pretrained(folder)`` and
``pipeline("text-generation", model=folder)`` give the family's own model with
factored projections: no ``trust_remote_code``, no code in the folder. The family's
own class still refuses (it cannot hold factored modules). Folders written before
these keys (``model_type`` ``flowgeom_factored``, tensors in ``model.safetensors``)
load the same way.

:func:`load` is the same model without the Auto classes, and the dense model of
every other source ``compress run`` reads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowgeom.compress.arch import CAUSAL_FAMILIES, check_family
from flowgeom.compress.folder import FACTORED_TYPES, factored_hf, is_factored
from flowgeom.compress.source import (build_model, folder_model_type, is_native, load_dense, pretrained, source_path,
                                      transformers_config)
from flowgeom.errors import FlowgeomError

_CONFIGS: dict[str, type] = {}  # model type -> the config class registered with AutoConfig
_MODELS: set[str] = set()  # model types registered with AutoModelForCausalLM


def register_config() -> None:
    """``AutoConfig`` learns the factored types (the hook run after transformers' configuration_auto)."""
    from transformers.configuration_utils import PreTrainedConfig
    from transformers.models.auto.configuration_auto import AutoConfig

    for model_type in FACTORED_TYPES:
        if model_type in _CONFIGS:
            continue

        class FlowgeomFactoredConfig(PreTrainedConfig):
            """A factored folder's config.json as it is; flowgeom's loader builds the family's own config."""

        FlowgeomFactoredConfig.model_type = model_type
        AutoConfig.register(model_type, FlowgeomFactoredConfig)
        _CONFIGS[model_type] = FlowgeomFactoredConfig


def register_model() -> None:
    """``AutoModelForCausalLM`` learns the factored types (the hook run after transformers' modeling_auto)."""
    from transformers.models.auto.modeling_auto import AutoModelForCausalLM

    register_config()
    for model_type, config_class in _CONFIGS.items():
        if model_type not in _MODELS:
            AutoModelForCausalLM.register(config_class, _model_class(config_class))
            _MODELS.add(model_type)


def _model_class(config_class: type) -> type:
    class FlowgeomFactoredForCausalLM:
        """What transformers' Auto classes hand a factored folder to: flowgeom's loader gives the family's own
        transformers model with factored projections (never an instance of this class)."""

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
            dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
            dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32  # None / "auto": as computed
            return factored_hf(pretrained_model_name_or_path, dtype=dtype)

    FlowgeomFactoredForCausalLM.config_class = config_class
    return FlowgeomFactoredForCausalLM


def declares_factored(path: Path) -> bool:
    """Whether ``path`` is a folder whose config.json names a factored type (with or without its JSON)."""
    try:
        return folder_model_type(Path(path)) in FACTORED_TYPES
    except FlowgeomError:  # an unreadable config.json: reported by the reader that needs it
        return False


def load(source: str | Path, *, dtype: torch.dtype | None = None):
    """The ``transformers`` causal LM (the hf extra), in its family's own class, of every source ``flowgeom
    compress run`` reads; computed in ``dtype`` (default float32), in eval mode:

    * a factored folder (``compress run``'s default, or healed): the model with
      :class:`~flowgeom.compress.folder.FactoredLinear` projections, every tensor checked against
      ``flowgeom_factored.json`` (:func:`~flowgeom.compress.folder.factored_hf`);
    * a folder with dropped blocks, or any HF folder (config.json + safetensors) of a family of
      :mod:`flowgeom.compress.arch`: the dense model, a missing, unexpected or mis-shaped tensor refused;
    * a Llama ``.gguf`` file (or a folder holding one) and ``builtin:smollm2``: the dense model, dequantised
      by flowgeom's reader as ``compress run`` reads it.

    Anything else raises :class:`~flowgeom.errors.FlowgeomError` naming the source and what is accepted.
    ``AutoModelForCausalLM.from_pretrained(folder)`` gives the same factored model once flowgeom is imported
    (module docstring); without flowgeom every transformers route refuses a factored folder.
    """
    path = source_path(str(source))  # builtin: resolved; a missing path refused with what is accepted
    dtype = torch.float32 if dtype is None else dtype
    if is_factored(path) or declares_factored(path):  # without its JSON: read_factored says which file is missing
        return factored_hf(path, dtype=dtype)
    gguf = path.suffix == ".gguf" if path.is_file() else any(path.glob("*.gguf"))
    if not (gguf or (path / "config.json").is_file()):
        raise FlowgeomError(f"{source} is not a model flowgeom.compress.load reads; pass a folder written by "
                            "`flowgeom compress run` (factored or with dropped blocks), an HF folder (config.json + "
                            f"safetensors) of one of: {', '.join(CAUSAL_FAMILIES)}, a Llama .gguf or builtin:smollm2")
    model_type = folder_model_type(path)
    if model_type not in (None, "llama"):
        try:
            check_family(model_type)
        except FlowgeomError as exc:
            raise FlowgeomError(f"{source}: {exc}") from None
        return pretrained(path, dtype=dtype)
    cfg, state = load_dense(path)
    if is_native(cfg):
        cfg = transformers_config({**cfg.to_hf(), "model_type": "llama"})
    return build_model(cfg, state, dtype=dtype)
