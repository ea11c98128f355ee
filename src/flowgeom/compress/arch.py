"""Any causal LM as the compressor sees it: projections by role, blocks run one at a time.

The compressor's maths (plans, whitening, shared bases, rank allocation) works
on *role weights*: per layer, the (out, in) matrix of each role q, k, v, o,
gate, up, down, stored under Llama's names (:func:`weight_key`) whatever the family.
Families differ only in where a role lives, and the one family table
(:mod:`flowgeom.hf.families`) says where:

* Llama, Mistral, Qwen2/3, Gemma: one ``nn.Linear`` per role, already under
  those names (the mapping is the identity);
* Phi-3: q|k|v rows of ``qkv_proj`` and gate|up rows of ``gate_up_proj``;
* GPT-2: ``Conv1D`` weights stored (in, out), q|k|v the columns of ``c_attn``;
  no gate (a two-layer GELU MLP: up, down);
* GPT-NeoX and Falcon: ``query_key_value`` rows head by head (or grouped).

:func:`role_state` splits (and transposes) a family's tensors into role
weights; :func:`family_state` fuses them back, exactly (they only move
numbers). Biases stay as they are, under their own names, and are added after
the projection: a factored projection keeps its bias dense.

:class:`Runner` runs any of these models the way calibration and healing need
it: embeddings, one block at a time, final norm, head. flowgeom's own Llama
runs natively; a transformers model's blocks get the keyword arguments its own
forward gives them (masks, rotary tables), captured once per input shape.
Mixture-of-experts models and encoders are refused with one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, choice_error

# Role -> its module in a Llama layer: the names role weights are stored under, whatever the family
HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
ROLES = tuple(HF_NAMES)
# Gram group -> roles that read its input (the calibration's four inputs of a block)
INPUT_GROUPS = {"attn": ("q", "k", "v"), "o": ("o",), "mlp": ("gate", "up"), "down": ("down",)}
ROLE_GRAM = {role: key for key, roles in INPUT_GROUPS.items() for role in roles}
# Where seed 001 says each role is continuous (V: no clear opportunity, so no entry).
SEED_SPACE = {"q": "input", "k": "input", "gate": "input", "up": "input", "o": "output", "down": "output"}
CAUSAL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox", "falcon")
_BASE = {"gpt2": "transformer", "falcon": "transformer", "gpt_neox": "gpt_neox"}  # else "model"
_FINAL_NORM = {"gpt2": "ln_f", "falcon": "ln_f", "gpt_neox": "final_layer_norm"}  # else "norm"


@dataclass(frozen=True)
class Slot:
    """Where one role lives inside a layer: the module, its rows along a fused output axis (None: all of
    them), and whether the weight is stored (in, out) as GPT-2's ``Conv1D`` does."""

    path: str
    rows: tuple[int, ...] | None = None
    conv1d: bool = False


@dataclass(frozen=True)
class Arch:
    """One family's layout for one config: the layers' container, each role's slot, the final norm."""

    family: str
    layers: str  # path of the numbered layers, e.g. "model.layers", "transformer.h"
    slots: Mapping[str, Slot]
    final_norm: str

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r in ROLES if r in self.slots)

    @property
    def identity(self) -> bool:
        """Role weights are the family's own tensors (separate ``nn.Linear`` under Llama's names)."""
        return self.layers == "model.layers" and all(s.rows is None and not s.conv1d and s.path == HF_NAMES[r]
                                                     for r, s in self.slots.items())

    def modules(self) -> dict[str, tuple[str, ...]]:
        """Module path inside a layer -> the roles it holds, in fused order of appearance."""
        out: dict[str, list[str]] = {}
        for role in self.roles:
            out.setdefault(self.slots[role].path, []).append(role)
        return {p: tuple(r) for p, r in out.items()}

    def input_paths(self) -> dict[str, str]:
        """Gram group -> the module (inside a layer) whose input the group's roles read."""
        return {g: self.slots[next(r for r in roles if r in self.slots)].path
                for g, roles in INPUT_GROUPS.items() if any(r in self.slots for r in roles)}

    def tensor(self, layer: int, role: str, kind: str = "weight") -> str:
        """The family's name of the tensor holding ``role`` in ``layer`` (a fused one for fused roles)."""
        return f"{self.layers}.{layer}.{self.slots[role].path}.{kind}"


def _model_type(config: Any) -> str:
    mt = config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    return mt if isinstance(mt, str) else "llama"  # flowgeom's LlamaConfig has no model_type


def check_family(model_type: str) -> None:
    """Refuse a family the compressor cannot handle, in one line naming the supported ones."""
    from flowgeom.hf.families import FAMILIES

    if model_type in CAUSAL_FAMILIES:
        return
    fam = FAMILIES.get(model_type)
    if fam is not None and fam.mlp == "moe":
        raise FlowgeomError(f"{model_type} is a mixture-of-experts model: flowgeom compresses dense MLPs and "
                            "does not factor experts (neither per expert nor shared); supported: "
                            f"{', '.join(CAUSAL_FAMILIES)}")
    raise FlowgeomError(f"model_type {model_type!r} is not a causal LM family flowgeom compresses; supported: "
                        f"{', '.join(CAUSAL_FAMILIES)}")


def arch_of(config: Any) -> Arch:
    """The layout of ``config`` (a transformers config, flowgeom's LlamaConfig, or a config.json dict)."""
    from flowgeom.hf.families import FAMILIES, fused_rows

    mt = _model_type(config)
    check_family(mt)
    fam = FAMILIES[mt]
    conv1d = fam.attention == "conv1d"
    slots: dict[str, Slot] = {}

    def add(block_path: str, names: Mapping[str, str], fused_roles: dict[str, tuple[str, ...]]) -> None:
        for key, name in names.items():
            path = f"{block_path}.{name}" if block_path else name
            if key in fused_roles:
                layout = fam.fused_layout(path)
                if layout is None:
                    raise FlowgeomError(f"{mt}: the fused weight {path} has no layout in the family table; "
                                        "add its FusedLayout to flowgeom.hf.families")
                rows = fused_rows(layout, config, fam, _fused_size(config, fam, key))
                for role in fused_roles[key]:
                    slots[role] = Slot(path, tuple(int(i) for i in rows[role]), conv1d)
            elif key not in ("router",):
                slots[key] = Slot(path, None, conv1d)

    add(fam.attention_path, fam.weights, {"qkv": ("q", "k", "v")})
    add(fam.mlp_path, fam.mlp_weights, {"gate_up": ("gate", "up")})
    layers = f"{_BASE.get(mt, 'model')}.{fam.layers or 'layers'}"
    return Arch(mt, layers, slots, f"{_BASE.get(mt, 'model')}.{_FINAL_NORM.get(mt, 'norm')}")


def _get(config: Any, *names: str) -> Any:
    for n in names:
        v = config.get(n) if isinstance(config, Mapping) else getattr(config, n, None)
        if v is not None:
            return v
    return None


def _fused_size(config: Any, fam, key: str) -> int:
    """Length of the fused output axis of ``key`` (qkv or gate_up) under ``config``."""
    from flowgeom.hf.families import attention_heads

    if key == "gate_up":
        return 2 * int(_get(config, "intermediate_size"))
    H, G, hd = attention_heads(config, fam)
    if fam.model_type == "falcon":
        if _get(config, "new_decoder_architecture"):
            return G * (H // G + 2) * hd
        return (H + 2) * hd if _get(config, "multi_query") else 3 * H * hd
    if fam.attention == "interleaved_qkv" or fam.model_type == "gpt2":
        return 3 * H * hd
    return (H + 2 * G) * hd


# ---------------------------------------------------------------- role weights <-> family tensors


def _as_rows(w: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The (out, in) rows of ``slot`` from the module's stored weight."""
    w = w.T if slot.conv1d else w
    return w if slot.rows is None else w[list(slot.rows)]


def weight_key(layer: int, role: str) -> str:
    return f"model.layers.{layer}.{HF_NAMES[role]}.weight"


def role_shapes(state: Mapping[str, torch.Tensor], roles: Sequence[str], n_layers: int) -> dict[str, tuple[int, int]]:
    """Role -> the (out, in) shape of its weight, the same in every layer (refused otherwise: bases are shared)."""
    shapes = {}
    for role in roles:
        if role not in HF_NAMES:
            raise choice_error("role", role, ROLES)
        seen = {tuple(state[weight_key(l, role)].shape) for l in range(n_layers) if weight_key(l, role) in state}
        missing = [l for l in range(n_layers) if weight_key(l, role) not in state]
        if missing:
            raise FlowgeomError(f"role {role} ({HF_NAMES[role]}) is missing in layer(s) {missing[:5]}; pass roles "
                                f"the model has")
        if len(seen) != 1:
            raise FlowgeomError(f"role {role} has different shapes across layers ({sorted(seen)}); every layer of "
                                "a role must have the same shape to share bases")
        shapes[role] = seen.pop()
    return shapes


def role_state(arch: Arch, state: Mapping[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """``state`` with every projection weight replaced by its role weights (Llama names, (out, in),
    contiguous); everything else (biases included) kept under its own name."""
    if arch.identity:
        return dict(state)
    out = dict(state)
    for l in range(n_layers):
        for path, roles in arch.modules().items():
            name = f"{arch.layers}.{l}.{path}.weight"
            if name not in state:
                raise FlowgeomError(f"{name} is missing; the checkpoint does not match its {arch.family} config")
            w = out.pop(name)
            for role in roles:
                out[weight_key(l, role)] = _as_rows(w, arch.slots[role]).contiguous()
    return out


def fused_weight(arch: Arch, path: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The module weight at ``path`` (as the family stores it) from its roles' (out, in) weights."""
    roles = arch.modules()[path]
    first = parts[roles[0]]
    slot = arch.slots[roles[0]]
    if slot.rows is None:
        w = first
    else:
        size = sum(len(arch.slots[r].rows) for r in roles)
        w = first.new_empty((size, first.shape[1]))
        for r in roles:
            w[list(arch.slots[r].rows)] = parts[r]
    return (w.T if slot.conv1d else w).contiguous()


def family_state(arch: Arch, state: Mapping[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`role_state`: the family's own tensor names and layouts."""
    if arch.identity:
        return dict(state)
    out = dict(state)
    for l in range(n_layers):
        for path, roles in arch.modules().items():
            parts = {r: out.pop(weight_key(l, r)) for r in roles}
            out[f"{arch.layers}.{l}.{path}.weight"] = fused_weight(arch, path, parts)
    return out


def set_role_weight(model: nn.Module, arch: Arch, layer: int, role: str, w: torch.Tensor) -> None:
    """Write role ``role``'s (out, in) weight ``w`` into ``model``'s own (possibly fused) parameter."""
    slot = arch.slots[role]
    param = model.get_submodule(f"{arch.layers}.{layer}.{slot.path}").weight
    with torch.no_grad():
        target = param.T if slot.conv1d else param
        if slot.rows is None:
            target.copy_(w)
        else:
            target[list(slot.rows)] = w.to(param.dtype)


# ---------------------------------------------------------------- running blocks one at a time


class _Stop(Exception):
    """Raised by a capture hook to end a forward pass early."""


class Runner:
    """A causal LM run piece by piece: ``embed(ids)`` -> ``block(l, h)`` for each layer -> ``head(h)``.

    For flowgeom's Llama the blocks take RoPE tables; for a transformers model they take what its own
    forward passes them (attention masks, rotary tables, ALiBi), captured once per (batch, length) by a
    forward on those shapes with ``use_cache=False`` (nothing cached, so replaying them is exact).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.native = not hasattr(model, "get_output_embeddings")
        self.arch = arch_of(model.config)
        self.layers = model.get_submodule(self.arch.layers)
        self.norm = model.get_submodule(self.arch.final_norm)
        self.lm_head = model.lm_head if self.native else model.get_output_embeddings()
        self.embedding = model.model.embed_tokens if self.native else model.get_input_embeddings()
        self._inputs: dict[tuple, list[dict]] = {}

    def __len__(self) -> int:
        return len(self.layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The hidden states entering block 0, (B, T, d)."""
        if self.native:
            return self.model.model.embed_tokens(ids)
        found = {}

        def hook(_m, args, kwargs):
            found["h"] = args[0] if args else kwargs["hidden_states"]
            raise _Stop

        handle = self.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
        try:
            self.model(input_ids=ids, use_cache=False)
        except _Stop:
            pass
        finally:
            handle.remove()
        return found["h"]

    def prepare(self, batch: int, length: int, dtype: torch.dtype, device=None) -> None:
        """Capture the blocks' arguments for inputs of (batch, length). The capture is a forward pass, which
        fires every hook on the model: call this before registering hooks that must see only real data."""
        if not self.native:
            self._layer_inputs(torch.empty(batch, length, 1, dtype=dtype, device=device))

    def _layer_inputs(self, h: torch.Tensor) -> list[tuple[tuple, dict]]:
        key = (tuple(h.shape[:2]), h.dtype, h.device)
        if key not in self._inputs:
            seen: list[tuple[tuple, dict]] = []  # per layer: the arguments after the hidden states
            handles = [layer.register_forward_pre_hook(
                lambda _m, args, kwargs: seen.append((tuple(args[1:]), dict(kwargs))), with_kwargs=True)
                for layer in self.layers]
            try:
                with torch.no_grad():
                    self.model(input_ids=torch.zeros(h.shape[:2], dtype=torch.long, device=h.device),
                               use_cache=False)
            finally:
                for handle in handles:
                    handle.remove()
            self._inputs[key] = seen
        return self._inputs[key]

    def block(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Block ``layer`` applied to ``h`` (B, T, d)."""
        if self.native:
            from flowgeom.nn.llama import rope_tables

            cos, sin = rope_tables(self.model.config, h.shape[1], dtype=h.dtype, device=h.device)
            return self.layers[layer](h, cos, sin)
        args, kwargs = self._layer_inputs(h)[layer]
        out = self.layers[layer](h, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    @property
    def softcap(self) -> float | None:
        """Gemma 2's final logit soft-capping ``c tanh(z / c)`` (None: plain logits)."""
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        return float(cap) if cap else None

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of the last hidden states (final norm, the output embedding, the family's soft cap)."""
        z = self.lm_head(self.norm(h))
        cap = self.softcap
        return z if cap is None else torch.tanh(z / cap) * cap


def runner(model: nn.Module) -> Runner:
    """The :class:`Runner` of ``model``, kept on it: its captured block arguments serve every later step."""
    found = model.__dict__.get("_flowgeom_runner")
    if found is None:
        found = Runner(model)
        model.__dict__["_flowgeom_runner"] = found  # not an nn.Module attribute: no state_dict entry
    return found


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, vocab) logits of flowgeom's Llama or a transformers causal LM."""
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits
