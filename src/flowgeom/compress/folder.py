"""Factored checkpoints: bases and coefficients on disk, loaded as factored linear layers.

**Folder layout** (what ``flowgeom compress run`` writes)::

    config.json               the dense model's config, with the keys that make plain transformers refuse the folder
                              (flowgeom.compress.auto)
    flowgeom_factored.safetensors
                              every tensor that is not compressed (embeddings, norms, biases, dense projections)
                              + per unit  factored.<role>.<first>-<last>.basis
                              + per layer model.layers.<l>.<module>.coeff
    flowgeom_factored.json    {"format": "flowgeom-factored", "version": 1, "units": [...]}
    tokenizer.json            when the source had one
    flowgeom_share.json       the compression report

Projections are stored as role weights under Llama's names
(``model.layers.<l>.self_attn.q_proj.weight`` ..., :mod:`flowgeom.compress.arch`)
whatever the family; for Llama-like families those are the family's own
names, for fused ones (Phi-3, GPT-2, NeoX, Falcon) the loader puts the roles
back into the fused modules. Every other tensor keeps its family's name.

A unit ``{"role", "space", "layers", "rank", "shape": [m, n], "basis", "coeffs"}``
rebuilds layer l's projection as ``coeff_l @ basis`` (input space: basis (k, n),
coeff (m, k)) or ``basis @ coeff_l`` (output space: basis (m, k), coeff (k, n)).
:func:`read_factored` checks every tensor the JSON names against its shape and
dtype, that no projection is both dense and factored or factored twice, and
that nothing is left over: a hand-edited or truncated folder is one clear error.
Folders written before :data:`WEIGHTS_NAME` keep their tensors in ``model.safetensors``;
:func:`weights_path` finds either.

**Loading.** :func:`factored_llama` gives flowgeom's Llama and
:func:`factored_hf` the family's transformers model, each with
:class:`FactoredLinear` modules in place of the compressed projections (a
:class:`SplitProjection` where a fused module holds a factored role); a
group's basis is one shared parameter. :func:`dense_state` gives the dense
role weights back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from flowgeom.compress.arch import HF_NAMES, arch_of, check_family, fused_weight, weight_key
from flowgeom.compress.plan import Compressed
from flowgeom.compress.source import build_model, is_native, load_dense, transformers_config
from flowgeom.compress.write import write_model_files
from flowgeom.errors import FlowgeomError
from flowgeom.nn.llama import refuse_integer_codes

FORMAT = "flowgeom-factored"
VERSION = 1
JSON_NAME = "flowgeom_factored.json"
WEIGHTS_NAME = "flowgeom_factored.safetensors"  # not model.safetensors: plain transformers must not find it
LEGACY_WEIGHTS = "model.safetensors"  # factored folders written before WEIGHTS_NAME; dense folders
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FIX = "write the factored folder again with `flowgeom compress run`"
# config.json: the keys that make transformers refuse the folder without flowgeom (flowgeom.compress.auto)
FACTORED_TYPE = "flowgeom_factored: load it with flowgeom.compress.load"
LEGACY_TYPE = "flowgeom_factored"  # folders written before the type said how to load them
FACTORED_TYPES = (FACTORED_TYPE, LEGACY_TYPE)
FACTORED_ARCH = "FlowgeomFactoredForCausalLM"
BASE_KEY = "flowgeom_base_model_type"
BASE_ARCH_KEY = "flowgeom_base_architectures"
WEIGHTS_KEY = "transformers_weights"
REFUSAL = "none: a flowgeom factored folder, load it with flowgeom.compress.load"


def factored_config_json(config_json: dict) -> dict:
    """The ``config.json`` object of a factored folder made from the dense model's (or an older factored
    folder's) ``config_json``."""
    base = base_config_json(config_json)
    return {**base, "model_type": FACTORED_TYPE, "architectures": [FACTORED_ARCH], WEIGHTS_KEY: REFUSAL,
            BASE_KEY: base.get("model_type", "llama"), BASE_ARCH_KEY: base.get("architectures") or ["LlamaForCausalLM"]}


def base_config_json(config_json: dict) -> dict:
    """The dense model's config object back from a factored folder's (any other is returned unchanged)."""
    if config_json.get("model_type") not in FACTORED_TYPES:
        return config_json
    out = {k: v for k, v in config_json.items() if k not in (BASE_KEY, BASE_ARCH_KEY, WEIGHTS_KEY)}
    out["model_type"] = config_json.get(BASE_KEY, "llama")
    out["architectures"] = config_json.get(BASE_ARCH_KEY) or ["LlamaForCausalLM"]
    return out


class FactoredLinear(nn.Module):
    """``y = x B^T C^T`` (input space: basis B (k, n), coeff C (m, k)) or ``y = x C^T B^T`` (output space:
    basis (m, k), coeff (k, n)); no bias. ``basis`` may be shared with other layers' modules."""

    def __init__(self, basis: nn.Parameter, coeff: nn.Parameter, space: str, bias: nn.Parameter | None = None):
        super().__init__()
        self.basis, self.coeff, self.space = basis, coeff, space
        self.bias = bias  # kept dense (Qwen2's q/k/v, GPT-2's projections)

    @property
    def in_features(self) -> int:
        return (self.basis if self.space == "input" else self.coeff).shape[1]

    @property
    def out_features(self) -> int:
        return (self.coeff if self.space == "input" else self.basis).shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.space == "input":
            return F.linear(F.linear(x, self.basis), self.coeff, self.bias)
        return F.linear(F.linear(x, self.coeff), self.basis, self.bias)

    def weight_dense(self) -> torch.Tensor:
        return self.coeff @ self.basis if self.space == "input" else self.basis @ self.coeff

    def extra_repr(self) -> str:
        return f"bias={self.bias is not None}, in={self.in_features}, out={self.out_features}, rank={self.basis.shape[0 if self.space == 'input' else 1]}, space={self.space}"


class SplitProjection(nn.Module):
    """A fused projection (Phi-3's qkv_proj, GPT-2's c_attn, NeoX's query_key_value ...) computed role by
    role: ``parts`` (a :class:`FactoredLinear` or a bias-free ``nn.Linear`` each, in the family's order) are
    concatenated and put back in the fused output order, then the fused bias is added."""

    def __init__(self, parts: dict[str, nn.Module], rows: Sequence[Sequence[int]], bias: nn.Parameter | None):
        super().__init__()
        self.parts = nn.ModuleDict(parts)
        order = torch.tensor([i for r in rows for i in r])
        identity = bool(torch.equal(order, torch.arange(len(order))))
        self.register_buffer("order", None if identity else torch.argsort(order), persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts.values()], dim=-1)
        if self.order is not None:
            y = y.index_select(-1, self.order)
        return y if self.bias is None else y + self.bias


def basis_name(role: str, layers: Sequence[int]) -> str:
    return f"factored.{role}.{layers[0]}-{layers[-1]}.basis"


def coeff_name(layer: int, role: str) -> str:
    return f"model.layers.{layer}.{HF_NAMES[role]}.coeff"


def factored_tensors(compressed: Compressed, state: Mapping[str, torch.Tensor], *, tie: bool,
                     dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors for WEIGHTS_NAME, the flowgeom_factored.json object)`` of a compression; every tensor
    stored in ``dtype`` except the norms' weights (float32: a few thousand numbers that scale whole layers)."""
    tensors = {k: v for k, v in state.items() if not (k == "lm_head.weight" and tie)}
    units = []
    for unit, f in zip(compressed.plan.units, compressed.factors):
        name = basis_name(unit.role, unit.layers)
        tensors[name] = f.basis.float().contiguous()
        coeffs = []
        for l, c in zip(unit.layers, f.coeffs):
            tensors.pop(weight_key(l, unit.role))
            tensors[coeff_name(l, unit.role)] = c.float().contiguous()
            coeffs.append(coeff_name(l, unit.role))
        units.append({"role": unit.role, "space": unit.space, "layers": list(unit.layers), "rank": unit.rank,
                      "shape": list(unit.shape), "basis": name, "coeffs": coeffs})
    stored = {k: (v.float() if k.endswith("norm.weight") else v.to(dtype)).contiguous() for k, v in tensors.items()}
    return stored, {"format": FORMAT, "version": VERSION, "units": units}


def save_factored(folder: Path, config_json: dict, compressed: Compressed, state: Mapping[str, torch.Tensor], *,
                  tokenizer=None, report: dict | None = None, dtype: torch.dtype = torch.float32) -> None:
    """Write the factored folder (module docstring) into ``folder``, tensors in ``dtype``."""
    factored_json = factored_config_json(config_json)
    tensors, meta = factored_tensors(compressed, state, tie=bool(config_json.get("tie_word_embeddings")),
                                     dtype=dtype)
    write_model_files(folder, tensors, factored_json, tokenizer=tokenizer, report=report, extra={JSON_NAME: meta},
                      weights=WEIGHTS_NAME)


def is_factored(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / JSON_NAME).exists()


def weights_path(folder: str | Path) -> Path:
    """The safetensors file of a folder ``compress run`` wrote: :data:`WEIGHTS_NAME`, or ``model.safetensors``
    in a dense folder or a factored one written before it."""
    folder = Path(folder)
    new, old = folder / WEIGHTS_NAME, folder / LEGACY_WEIGHTS
    return old if old.exists() and not new.exists() else new


@dataclass(frozen=True)
class FactoredUnit:
    role: str
    space: str
    layers: tuple[int, ...]
    rank: int
    shape: tuple[int, int]
    basis: str
    coeffs: tuple[str, ...]


def _bad(folder: Path, what: str) -> FlowgeomError:
    return FlowgeomError(f"{folder}: {what}; the factored folder was edited or truncated: write it again with "
                         "`flowgeom compress run`")


def _units(folder: Path, meta: object, n_layers: int) -> list[FactoredUnit]:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise _bad(folder, f"{JSON_NAME} is not a {FORMAT} v{VERSION} description")
    raw = meta.get("units")
    if not isinstance(raw, list) or not raw:
        raise _bad(folder, f"{JSON_NAME} lists no units")
    units, seen = [], set()
    for i, u in enumerate(raw):
        try:
            role, space, layers, rank, shape = u["role"], u["space"], u["layers"], u["rank"], u["shape"]
            ok = (role in HF_NAMES and space in ("input", "output") and isinstance(layers, list) and layers
                  and all(isinstance(l, int) and not isinstance(l, bool) and 0 <= l < n_layers for l in layers)
                  and isinstance(rank, int) and not isinstance(rank, bool) and isinstance(shape, list)
                  and len(shape) == 2 and all(isinstance(s, int) and s >= 1 for s in shape)
                  and 1 <= rank <= min(shape) and isinstance(u["basis"], str) and isinstance(u["coeffs"], list)
                  and len(u["coeffs"]) == len(layers) and all(isinstance(c, str) for c in u["coeffs"]))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise _bad(folder, f"unit {i} of {JSON_NAME} is malformed")
        for l in layers:
            if (role, l) in seen:
                raise _bad(folder, f"{role} of layer {l} is factored twice")
            seen.add((role, l))
        units.append(FactoredUnit(role, space, tuple(layers), rank, tuple(shape), u["basis"], tuple(u["coeffs"])))
    return units


def folder_config(config_json: dict):
    """flowgeom's LlamaConfig for a Llama, else the family's transformers config (unsupported: refused)."""
    from flowgeom.nn.llama import LlamaConfig

    mt = config_json.get("model_type", "llama")
    if mt == "llama":
        return LlamaConfig.from_hf(config_json)
    check_family(mt)
    return transformers_config(config_json)


def read_factored(folder: str | Path) -> tuple[object, list[FactoredUnit], dict[str, torch.Tensor]]:
    """``(config, units, tensors)`` of a factored folder, every tensor checked against the JSON; the config is
    flowgeom's LlamaConfig for a Llama, else the family's transformers config."""
    from flowgeom.files import read_regular, regular_file
    from flowgeom.io.checkpoints import parse_json
    from flowgeom.io.sources import open_source
    folder = Path(folder)
    weights = weights_path(folder).name
    for name in ("config.json", JSON_NAME, weights):
        if not (folder / name).exists():
            raise _bad(folder, f"{name} is missing")
        regular_file(folder / name, name)
    try:  # read_regular: bounded, and a file swapped for a FIFO after the check cannot block
        cfg = folder_config(base_config_json(parse_json(read_regular(folder / "config.json", "config.json",
                                                                     fix=_FIX), "config.json")))
        meta = parse_json(read_regular(folder / JSON_NAME, JSON_NAME, fix=_FIX), JSON_NAME)
    except FlowgeomError as exc:
        raise FlowgeomError(f"{folder}: {exc}") from None
    units = _units(folder, meta, cfg.num_hidden_layers)
    src = open_source(folder / weights)
    expected: dict[str, tuple[int, ...]] = {}
    for u in units:
        m, n = u.shape
        expected[u.basis] = (u.rank, n) if u.space == "input" else (m, u.rank)
        for c in u.coeffs:
            expected[c] = (m, u.rank) if u.space == "input" else (u.rank, n)
    for name, shape in expected.items():
        if name not in src.shapes:
            raise _bad(folder, f"tensor {name} named in {JSON_NAME} is not in {weights}")
        if tuple(src.shapes[name]) != shape:
            raise _bad(folder, f"tensor {name} has shape {list(src.shapes[name])}, {JSON_NAME} implies {list(shape)}")
    for u in units:
        for l, c in zip(u.layers, u.coeffs):
            if c != coeff_name(l, u.role):
                raise _bad(folder, f"unit {u.role} names coefficient {c} for layer {l}")
            if weight_key(l, u.role) in src.shapes:
                raise _bad(folder, f"{weight_key(l, u.role)} is stored both dense and factored")
    tensors = {name: src.load(name) for name in src.shapes}
    refuse_integer_codes(folder, tensors)  # the rule of every weight file; then the factored format's own types
    for name, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            raise _bad(folder, f"tensor {name} has dtype {str(t.dtype).replace('torch.', '')}, not a float type")
        if not torch.isfinite(t).all():
            raise _bad(folder, f"tensor {name} holds NaN or Inf")
    return cfg, units, tensors


def dense_state(units: Sequence[FactoredUnit], tensors: Mapping[str, torch.Tensor], *,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Dense role weights in ``dtype``: every factored projection rebuilt densely (the product taken in
    float64, so it is the stored factorisation's exact reconstruction), factor tensors dropped."""
    factor_names = {u.basis for u in units} | {c for u in units for c in u.coeffs}
    out = {k: v.to(dtype) for k, v in tensors.items() if k not in factor_names}
    for u in units:
        basis = tensors[u.basis].double()
        for l, c in zip(u.layers, u.coeffs):
            coeff = tensors[c].double()
            out[weight_key(l, u.role)] = (coeff @ basis if u.space == "input" else basis @ coeff).to(dtype)
    return out


def _install(model: nn.Module, arch, units: Sequence[FactoredUnit], tensors: Mapping[str, torch.Tensor],
             dtype: torch.dtype) -> tuple[set[str], set[str]]:
    """Replace every projection module of ``model`` holding a factored role: a :class:`FactoredLinear` (one
    basis parameter shared by a unit's layers), or a :class:`SplitProjection` for a fused module. Returns
    ``(tensor names now held by the new modules, module paths replaced)``."""
    factored = {}
    used: set[str] = set()
    for u in units:
        basis = nn.Parameter(tensors[u.basis].to(dtype), requires_grad=False)
        used.add(u.basis)
        for l, c in zip(u.layers, u.coeffs):
            factored[(l, u.role)] = (basis, c, u.space)

    def part(l: int, role: str, bias: nn.Parameter | None) -> nn.Module:
        if (l, role) in factored:
            basis, c, space = factored[(l, role)]
            used.add(c)
            return FactoredLinear(basis, nn.Parameter(tensors[c].to(dtype), requires_grad=False), space, bias)
        w = tensors[weight_key(l, role)]
        used.add(weight_key(l, role))
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(w.to(dtype), requires_grad=False)
        return linear

    replaced = set()
    n_layers = 1 + max((l for l, _ in factored), default=-1)
    for l in range(n_layers):
        for path, roles in arch.modules().items():
            if not any((l, r) in factored for r in roles):
                continue
            full = f"{arch.layers}.{l}.{path}"
            bias = None
            if f"{full}.bias" in tensors:
                bias = nn.Parameter(tensors[f"{full}.bias"].to(dtype), requires_grad=False)
                used.add(f"{full}.bias")
            module = (part(l, roles[0], bias) if len(roles) == 1 else
                      SplitProjection({r: part(l, r, None) for r in roles}, [arch.slots[r].rows for r in roles], bias))
            parent, _, attr = full.rpartition(".")
            setattr(model.get_submodule(parent), attr, module)
            replaced.add(full)
    return used, replaced


def _rest(arch, tensors: Mapping[str, torch.Tensor], used: set[str], replaced: set[str], n_layers: int
          ) -> dict[str, torch.Tensor]:
    """The tensors not held by replaced modules, role weights of intact modules back in the family's layout."""
    rest = {k: v for k, v in tensors.items() if k not in used}
    if arch.identity:
        return rest
    for l in range(n_layers):
        for path, roles in arch.modules().items():
            if f"{arch.layers}.{l}.{path}" in replaced:
                continue
            keys = [weight_key(l, r) for r in roles]
            if all(k in rest for k in keys):
                rest[f"{arch.layers}.{l}.{path}.weight"] = fused_weight(arch, path, {r: rest.pop(k)
                                                                                    for r, k in zip(roles, keys)})
    return rest


def _fill(model: nn.Module, folder: Path, rest: Mapping[str, torch.Tensor], replaced: set[str], tied: bool,
          dtype: torch.dtype) -> None:
    """Copy ``rest`` into ``model`` strictly: every other parameter must be there, nothing may be left over."""
    own = model.state_dict()
    expected = {k for k in own if not any(k.startswith(p + ".") for p in replaced)} - (
        {"lm_head.weight"} if tied else set())
    missing, unexpected = sorted(expected - set(rest)), sorted(set(rest) - expected)
    if missing or unexpected:
        raise _bad(folder, f"tensors do not match the config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    with torch.no_grad():
        for name, t in rest.items():
            if tuple(t.shape) != tuple(own[name].shape):
                raise _bad(folder, f"tensor {name} has shape {list(t.shape)}, the config implies "
                                   f"{list(own[name].shape)}")
            own[name].copy_(t.to(dtype))


def factored_llama(folder: str | Path, *, dtype: torch.dtype = torch.float32):
    """flowgeom's :class:`~flowgeom.nn.llama.LlamaForCausalLM` with factored projections, in eval mode."""
    from flowgeom.nn.llama import LlamaForCausalLM

    cfg, units, tensors = read_factored(folder)
    if not is_native(cfg):
        raise FlowgeomError(f"{folder} is a factored {cfg.model_type} model; load it with flowgeom.compress.load "
                            "(transformers)")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    arch = arch_of(cfg)
    used, replaced = _install(model, arch, units, tensors, dtype)
    _fill(model, Path(folder), _rest(arch, tensors, used, replaced, cfg.num_hidden_layers), replaced,
          cfg.tie_word_embeddings, dtype)
    return model.to(dtype).eval()


def factored_hf(folder: str | Path, *, dtype: torch.dtype = torch.float32):
    """The family's ``transformers`` causal LM (the ``hf`` extra) with factored projections, in eval mode."""
    try:
        import transformers
    except ImportError:
        raise FlowgeomError("loading into transformers needs the hf extra: pip install 'flowgeom[hf]'") from None
    cfg, units, tensors = read_factored(folder)
    if is_native(cfg):
        cfg = transformers_config({**cfg.to_hf(), "model_type": "llama"})
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten; leave the global RNG alone
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    arch = arch_of(cfg)
    used, replaced = _install(model, arch, units, tensors, dtype)
    _fill(model, Path(folder), _rest(arch, tensors, used, replaced, cfg.num_hidden_layers), replaced,
          cfg.tie_word_embeddings, dtype)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained = MethodType(_refuse_save_pretrained, model)  # this instance only, not the family class
    return model.to(dtype).eval()


def _refuse_save_pretrained(model, *args, **kwargs):
    """A factored model saved by transformers names its factors under the family's own config: plain
    transformers would load that folder with its compressed projections random. Refused, with the ways that
    keep the factors."""
    raise FlowgeomError("save_pretrained would write a folder that plain transformers loads with random "
                        "projections (the factors are not under the dense names); keep the factored folder "
                        "`flowgeom compress run`/`heal` wrote, or write a dense one with `flowgeom compress run "
                        "--dense`")


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32):
    """The runnable model of a factored folder (flowgeom's Llama for a Llama, else the family's transformers
    model with factored modules) or of any dense source :func:`flowgeom.compress.source.load_dense` reads."""
    if is_factored(path):
        from flowgeom.files import read_json_object

        base = base_config_json(read_json_object(Path(path) / "config.json", fix=_FIX)).get("model_type", "llama")
        return (factored_llama if base == "llama" else factored_hf)(path, dtype=dtype)
    config = Path(path) / "config.json"
    if Path(path).is_dir() and config.is_file() and any(t.encode() in config.read_bytes()[:1 << 20]
                                                        for t in FACTORED_TYPES):
        raise _bad(Path(path), f"config.json says {LEGACY_TYPE} but {JSON_NAME} is missing")
    cfg, state = load_dense(path)
    return build_model(cfg, state, dtype=dtype)


def projection_bytes(folder: str | Path) -> tuple[int, int]:
    """``(bytes of the factor tensors on disk, bytes the same projections take dense in float32)``."""
    from flowgeom.files import read_json_object
    from flowgeom.io.checkpoints import read_safetensors_header

    header = read_safetensors_header(weights_path(folder))
    meta = read_json_object(Path(folder) / JSON_NAME, fix=_FIX)
    factored = dense = 0
    for u in meta["units"]:
        for name in [u["basis"], *u["coeffs"]]:
            factored += header[name].end - header[name].start
        dense += len(u["layers"]) * u["shape"][0] * u["shape"][1] * 4
    return factored, dense
