"""``compress run`` as a library call: calibrate, plan, factorise, write a factored (or dense) folder.

:func:`run_compression` is the one implementation the CLI and the sharing
experiment use. Its steps, each refused up front on bad input (nothing is
written and the source is never touched on any error):

1. load the dense model (a Llama from GGUF, ``builtin:smollm2`` or an HF
   folder; any other family of :mod:`flowgeom.compress.arch` from its HF
   folder) as role weights (:mod:`flowgeom.compress.source`), check it
   (finite float weights, shapes as the config says);
2. calibration ids (:func:`flowgeom.compress.calibrate.calibration_ids`):
   ``calib`` (a shipped text's train split, default ``kjv+pydoc``, the KJV
   and the Python reference's prose chunk for chunk; else a UTF-8 file)
   tokenised by the model's tokenizer, the first ``calib_tokens`` in
   ``seq_len`` sequences;
3. the method: whole blocks dropped (:func:`flowgeom.compress.blocks.drop_blocks`),
   blocks dropped and the rest low rank (:mod:`flowgeom.compress.mixed`), both
   Llama only; or low rank (:mod:`flowgeom.compress.lowrank`): Grams
   (:mod:`flowgeom.compress.calibrate`; cached on disk), the plan of the method
   (:mod:`flowgeom.compress.plan`), the factors (sequential when asked);
4. a factored folder (:mod:`flowgeom.compress.folder`) or, with ``dense`` or
   when no projection is factored, the family's plain weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from flowgeom.compress import plan as C
from flowgeom.compress.arch import ROLES, arch_of, family_state, weight_key
from flowgeom.compress.blocks import drop_blocks
from flowgeom.compress.calibrate import DEFAULT_TOKENS
from flowgeom.compress.folder import save_factored
from flowgeom.compress.lowrank import compress_model
from flowgeom.compress.mixed import METHOD as MIXED
from flowgeom.compress.mixed import compress_mixed
from flowgeom.compress.source import check_vocab, family_json, is_native, load_dense, model_tokenizer, source_path
from flowgeom.compress.write import check_out_folder, save_llama_folder, write_folder
from flowgeom.errors import FlowgeomError, choice_error, positive_int

SPACE_CHOICES = ("auto", "seed", "opposite", "input", "output")
DROP_METHODS = ("drop-angular", "drop-bi")  # whole blocks dropped: Gromov et al.'s angular distance, ShortGPT's BI
STORAGE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
Progress = Callable[[str, int, int], None]  # (stage, done, total)
# The names of the removed ``share`` command's call: an import of one fails naming its new name (no alias).
RENAMED = {"share_model": "run_compression", "ShareConfig": "CompressionConfig", "Shared": "CompressionResult"}


def renamed(module: str, name: str, names: Mapping[str, str] = RENAMED) -> Exception:
    """What ``module.name`` raises: an ImportError naming the new name of a renamed one, else AttributeError."""
    if name in names:
        return ImportError(f"{module}.{name} was renamed: use {module}.{names[name]}")
    return AttributeError(f"module {module!r} has no attribute {name!r}")


def __getattr__(name: str):
    raise renamed(__name__, name)


@dataclass(frozen=True)
class CompressionConfig:
    """The options of ``compress run``, one field per flag, every combination checked when made."""


    method: str = "whiten"
    budget: float | None = 0.2  # fraction of the in-scope projection parameters saved
    rank: int | None = None  # instead of a budget: one rank for every unit
    roles: tuple[str, ...] = ROLES
    group: int = 2
    space: str | None = None  # method share only (SPACE_CHOICES)
    calib: str = "kjv+pydoc"  # two registers of English (data/text.py), neither the out-of-domain judge
    calib_tokens: int = DEFAULT_TOKENS
    seq_len: int = 512
    sequential: bool = False
    refit: bool = False
    dense: bool = False
    cache: bool = True
    dtype: str = "float32"  # storage of a factored folder: float32, float16 or bfloat16
    allocate: str | None = None  # even | loss ranks; None: loss where calibrated (the measured better), else even
    max_flops: float = 1.0  # loss allocation: a factored projection runs at most this fraction of dense flops

    def __post_init__(self):
        if self.method not in C.METHODS + DROP_METHODS + (MIXED,):
            raise choice_error("method", self.method, C.METHODS + DROP_METHODS + (MIXED,))
        self._check_allocate()
        if self.method in DROP_METHODS and (self.rank is not None or self.sequential or self.refit
                                            or self.dtype != "float32"):
            raise FlowgeomError(f"--method {self.method} drops whole blocks at a --budget; --rank, --sequential, "
                                "--refit and --dtype do not apply")
        if (self.budget is None) == (self.rank is None):
            raise FlowgeomError("give exactly one of --budget (fraction saved) and --rank")
        if self.budget is not None and not 0.0 < self.budget < 1.0:
            raise FlowgeomError(f"--budget {self.budget!r} must be a fraction in (0, 1); e.g. 0.2 saves 20%")
        if self.space is not None and self.method != "share":
            raise FlowgeomError(f"--space goes with --method share only; --method {self.method} "
                                + ("chooses spaces itself" if self.method == "continuity" else
                                   "has fixed spaces (input space, per its paper)"))
        if self.space is not None and self.space not in SPACE_CHOICES:
            raise choice_error("space", self.space, SPACE_CHOICES)
        if self.method == "continuity" and self.rank is not None:
            raise FlowgeomError("--method continuity splits a --budget across roles; it takes no --rank")
        if self.method == "svd" and (self.sequential or self.refit):
            raise FlowgeomError("--method svd is data-free; --sequential and --refit need calibration (use whiten)")
        if self.refit and self.method not in ("basis-sharing", "share", "continuity"):
            raise FlowgeomError("--refit re-solves shared coefficients; it goes with basis-sharing, share or "
                                "continuity")
        for name in ("group", "calib_tokens", "seq_len"):
            positive_int(getattr(self, name), f"--{name.replace('_', '-')}")
        if self.dtype not in STORAGE:
            raise choice_error("dtype", self.dtype, STORAGE)
        if self.dense and self.dtype != "float32":
            raise FlowgeomError("--dense writes the family's float32 weights; --dtype applies to factored folders only")
        if not self.roles or any(r not in ROLES for r in self.roles):
            raise FlowgeomError(f"--roles must name roles among {', '.join(ROLES)}, got {list(self.roles)}")

    @property
    def calibrated(self) -> bool:
        return self.method != "svd"

    def _check_allocate(self) -> None:
        if self.allocate is not None and self.allocate not in C.ALLOCATIONS:
            raise choice_error("allocate", self.allocate, C.ALLOCATIONS)
        if self.allocate == "loss" and self.method == "svd":
            raise FlowgeomError("--allocate loss needs calibration gradients; --method svd is data-free: use "
                                "--method whiten (or --allocate even)")
        if self.allocate is not None and self.method in DROP_METHODS:
            raise FlowgeomError(f"--method {self.method} drops whole blocks; --allocate applies to low-rank methods")
        if not 0.0 < self.max_flops <= 1.0:
            raise FlowgeomError(f"--max-flops {self.max_flops!r} must be a fraction in (0, 1]; e.g. 0.7 keeps dense "
                                "every projection whose factors would run more than 70% of its dense flops")
        if self.max_flops < 1.0 and self.allocation != "loss":
            raise FlowgeomError("--max-flops caps the ranks the loss allocation chooses; it goes with --allocate loss "
                                "(the default of calibrated methods)")
        if self.allocate == "loss" and self.rank is not None:
            raise FlowgeomError("--rank fixes every rank; --allocate loss allocates ranks at a --budget")
        if self.method == MIXED and (self.rank is not None or self.sequential or self.refit or self.dense):
            raise FlowgeomError("--method mixed drops blocks and low-ranks the rest at a --budget; --rank, "
                                "--sequential, --refit and --dense do not apply")

    @property
    def allocation(self) -> str:
        """``even`` or ``loss``: as asked, else loss wherever calibration gradients exist and ranks are free."""
        if self.allocate is not None:
            return self.allocate
        return "loss" if self.calibrated and self.rank is None and self.method not in DROP_METHODS else "even"


def for_family(config: CompressionConfig, cfg) -> CompressionConfig:
    """``config`` checked against the source's family: block dropping is Llama-only, and the default roles are
    narrowed to those the family has (GPT-2, NeoX, Falcon: no gate); roles asked for by name are kept, so a
    missing one is refused by the plan with its name."""
    if not is_native(cfg) and config.method in DROP_METHODS + (MIXED,):
        raise FlowgeomError(f"--method {config.method} drops Llama blocks; for a {cfg.model_type} model use a "
                            "low-rank method (whiten, basis-sharing, share, continuity or svd)")
    present = arch_of(cfg).roles
    if config.roles == ROLES and present != ROLES:
        return replace(config, roles=tuple(r for r in ROLES if r in present))
    return config


def check_weights(state: Mapping[str, torch.Tensor], roles: Sequence[str], n_layers: int) -> None:
    """Refuse NaN or Inf in the projections to compress (integer codes were refused when loading:
    :func:`flowgeom.nn.llama.refuse_integer_codes`)."""
    for l in range(n_layers):
        for role in roles:
            key = weight_key(l, role)
            t = state.get(key)
            if t is None:
                continue
            if not torch.isfinite(t).all():
                raise FlowgeomError(f"{key} holds NaN or Inf; the checkpoint is damaged: re-export it")


@dataclass
class CompressionResult:
    """What :func:`run_compression` made: the plan and factors (None when blocks were only dropped), the report
    written beside them and the source's role weights."""

    compressed: C.Compressed | None
    report: dict[str, Any]
    state: dict[str, torch.Tensor] = field(repr=False)


def role_report(compressed: C.Compressed, state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """:func:`role_table` with each factored layer's relative error ``||W - W'||_F / ||W||_F`` (float64)."""
    errors = {}
    for unit, f in zip(compressed.plan.units, compressed.factors):
        for l, w in zip(unit.layers, f.dense().double()):
            orig = state[weight_key(l, unit.role)].double()
            errors[(l, unit.role)] = float(torch.linalg.matrix_norm(orig - w) / torch.linalg.matrix_norm(orig))
    return role_table(compressed.plan, errors)


def role_table(plan_: C.Plan, errors: Mapping[tuple[int, str], float]) -> dict[str, dict[str, Any]]:
    """Per role: spaces, groups, ranks, parameters and the relative errors ``errors[(layer, role)]``."""
    out = plan_.by_role()
    for unit in plan_.units:
        out[unit.role].setdefault("rel_error", []).extend(errors[(l, unit.role)] for l in unit.layers)
    for r in out.values():
        r["dense_params"], r["stored_params"] = r.pop("dense"), r.pop("stored")
        r["saved_params"] = r["dense_params"] - r["stored_params"]
        r["rel_error_mean"] = sum(r["rel_error"]) / len(r["rel_error"])
        r["rank"] = r["ranks"][0] if len(set(r["ranks"])) == 1 else None
        r["rank_range"] = [min(r["ranks"]), max(r["ranks"])]
    return out


def build_report(source, out, config: CompressionConfig, cfg, state, made: tuple, tokenizer) -> dict[str, Any]:
    """The report written beside the weights (``flowgeom_share.json``) of what the method ``made``: ``(config,
    state, compressed, facts)`` of the new model (``compressed`` None: whole blocks dropped); the savings are
    counted against the source's ``cfg`` and ``state``, dropped blocks included."""
    new_cfg, new_state, compressed, facts = made
    total, tok = model_params(cfg, state), None if tokenizer is None else "tokenizer.json"
    head = {"source": str(source), "out": str(out), "method": config.method, "budget": config.budget}
    if compressed is None:
        return {**head, "format": "dense", "layers": new_cfg.num_hidden_layers, **facts, "model_params": total,
                "saved_fraction": facts["saved_params"] / total, "tokenizer": tok, "notes": []}
    roles = role_report(compressed, new_state)
    for role, ev in facts.get("evidence", {}).items():
        if role in roles:
            roles[role]["auto"] = ev
    p = compressed.plan
    scope = facts.get("scope_params", p.dense_params)  # mixed: the blocks it dropped are in scope and saved
    saved = facts.get("mixed_saved_params", p.dense_params - p.stored_params)
    factored = bool(p.units) and not config.dense  # mixed: dense when the best split only drops blocks
    report = {
        **head, "rank": config.rank, "group": config.group, "space": config.space, "sequential": config.sequential,
        "refit": config.refit, "format": "factored" if factored else "dense", "dtype": config.dtype,
        "scope_params": scope, "scope_saved_params": saved, "scope_saved_fraction": saved / scope,
        "roles": roles, "model_params": total, "saved_params": saved, "saved_fraction": saved / total,
        "params_after": total - saved, **{k: v for k, v in facts.items() if k != "notes"},
        "notes": list(facts.get("notes", [])), "tokenizer": tok,
    }
    if tokenizer is None:
        report["notes"].append("the source has no tokenizer.json, so none was written; evaluate the result with "
                               "--compare next to a reference model that has one")
    return report


def model_params(cfg, state: Mapping[str, torch.Tensor]) -> int:
    """Numbers the model stores (a tied head counted once)."""
    return sum(t.numel() for k, t in state.items() if k != "lm_head.weight" or not cfg.tie_word_embeddings)


def run_compression(source: str, out: Path, config: CompressionConfig, *, force: bool = False,
                    progress: Progress | None = None) -> CompressionResult:
    """Compress ``source`` into the folder ``out`` (module docstring); returns the factors and the report."""
    t0 = time.perf_counter()
    path = source_path(source)
    check_out_folder(path, out, force=force)  # before any work
    cfg, state = load_dense(path)
    config = for_family(config, cfg)
    check_weights(state, config.roles, cfg.num_hidden_layers)
    tokenizer = model_tokenizer(path)
    check_vocab(tokenizer, cfg, source)  # every method writes the tokenizer beside the weights
    if config.method in DROP_METHODS:
        new_cfg, new_state, facts = drop_blocks(config, cfg, state, path, tokenizer, progress=progress)
        made = (new_cfg, new_state, None, facts)
    elif config.method == MIXED:
        made = compress_mixed(config, cfg, state, path, tokenizer, progress=progress)
    else:
        made = (cfg, state, *compress_model(config, cfg, state, path, tokenizer, progress=progress))
    report = build_report(source, out, config, cfg, state, made, tokenizer)
    new_cfg, new_state, compressed, _ = made

    config_json = family_json(new_cfg)

    def fill(tmp: Path) -> None:
        if report["format"] == "factored":
            save_factored(tmp, config_json, compressed, new_state, tokenizer=tokenizer, report=report,
                          dtype=STORAGE[config.dtype])
        else:
            weights = new_state if compressed is None or not config.dense else compressed.dense_state(new_state)
            save_llama_folder(tmp, config_json, family_state(arch_of(new_cfg), weights, new_cfg.num_hidden_layers),
                              tokenizer=tokenizer, report=report)

    write_folder(out, fill, force=force)
    report["seconds"] = time.perf_counter() - t0
    return CompressionResult(compressed, report, state)
