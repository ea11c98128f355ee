"""``compress run`` as a library call: calibrate, plan, factorise, write a factored (or dense) folder.

:func:`share_model` is the one implementation the CLI and the sharing
experiment use. Its steps, each refused up front on bad input (nothing is
written and the source is never touched on any error):

1. load the dense model (a Llama from GGUF, ``builtin:smollm2`` or an HF
   folder; any other family of :mod:`flowgeom.compress.arch` from its HF
   folder) as role weights (:mod:`flowgeom.compress.source`), check it
   (finite float weights, shapes as the config says);
2. calibration ids: ``calib`` (a shipped text's train split, default
   ``kjv+pydoc``, the KJV and the Python reference's prose chunk for chunk;
   else a UTF-8 file) tokenised by the model's tokenizer, the first
   ``calib_tokens`` in ``seq_len`` sequences;
3. Grams (:mod:`flowgeom.compress.calibrate`; cached on disk), the plan of
   the method (:mod:`flowgeom.compress.plan`), the factors (sequential
   when asked);
4. a factored folder (:mod:`flowgeom.compress.folder`) or, with ``dense``,
   the family's plain weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flowgeom.compress import plan as C
from flowgeom.compress.calibrate import DEFAULT_TOKENS
from flowgeom.compress.blocks import layer_groups, opposite
from flowgeom.errors import FlowgeomError, choice_error, positive_int

SPACE_CHOICES = ("auto", "seed", "opposite", "input", "output")
DROP_METHODS = ("drop-angular", "drop-bi")  # whole blocks dropped: Gromov et al.'s angular distance, ShortGPT's BI
MIXED = "mixed"  # drop n blocks + low rank on the rest (flowgeom.compress.mixed)
STORAGE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class ShareConfig:
    method: str = "whiten"
    budget: float | None = 0.2  # fraction of the in-scope projection parameters saved
    rank: int | None = None  # instead of a budget: one rank for every unit
    roles: tuple[str, ...] = C.ROLES
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
            raise FlowgeomError("--dense writes float32 Llama weights; --dtype applies to factored folders only")
        if not self.roles or any(r not in C.ROLES for r in self.roles):
            raise FlowgeomError(f"--roles must name roles among {', '.join(C.ROLES)}, got {list(self.roles)}")

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


def resolve_spaces(space: str | None, roles: Sequence[str], evidence: Mapping[str, Mapping] | None
                   ) -> dict[str, str]:
    """Role -> input/output/none for method ``share``: seed (V per layer), opposite, one space, or auto."""
    space = space or "seed"
    if space == "seed":
        return {r: C.SEED_SPACE.get(r, "none") for r in roles}
    if space == "opposite":
        return {r: opposite(C.SEED_SPACE[r]) if r in C.SEED_SPACE else "none" for r in roles}
    if space == "auto":
        return {r: evidence[r]["space"] for r in roles}
    return {r: space for r in roles}


def calibration_ids(source: Path, calib: str, tokens: int, seq_len: int, tokenizer) -> torch.Tensor:
    """(S, seq_len) calibration ids from ``calib``: the train split of a shipped text (``kjv``, ``kjv+pydoc``
    ...), or a UTF-8 file; only the prefix that holds them is tokenised (:func:`flowgeom.data.tokens.leading_ids`)."""
    from flowgeom.compress.calibrate import sequences
    from flowgeom.data.text import check_text, load_text
    from flowgeom.data.tokens import leading_ids

    if tokenizer is None:
        raise FlowgeomError(f"{source} has no tokenizer, so calibration text cannot be tokenised; copy the original "
                            "model's tokenizer.json into it, or use --method svd (data-free)")
    check_text(calib, "--calib")
    text = load_text(calib, split="train")
    if not text.strip():
        raise FlowgeomError(f"--calib {calib} holds no text; pass a UTF-8 text of at least --calib-tokens tokens")
    ids = leading_ids(text, tokenizer, tokens if isinstance(tokens, int) and tokens > 0 else len(text))
    return sequences(ids, tokens, seq_len)


def input_widths(state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Gram key -> width of that input in block 0 (the widest decides how many calibration tokens are needed)."""
    from flowgeom.compress.arch import INPUT_GROUPS

    out = {}
    for key, roles in INPUT_GROUPS.items():
        found = [state[C.weight_key(0, r)] for r in roles if C.weight_key(0, r) in state]
        if found:
            out[key] = int(found[0].shape[1])
    return out


def for_family(config: ShareConfig, cfg) -> ShareConfig:
    """``config`` checked against the source's family: block dropping is Llama-only, and the default roles are
    narrowed to those the family has (GPT-2, NeoX, Falcon: no gate); roles asked for by name are kept, so a
    missing one is refused by the plan with its name."""
    from dataclasses import replace as replace_

    from flowgeom.compress.arch import arch_of
    from flowgeom.compress.source import is_native

    if not is_native(cfg) and config.method in DROP_METHODS + (MIXED,):
        raise FlowgeomError(f"--method {config.method} drops Llama blocks; for a {cfg.model_type} model use a "
                            "low-rank method (whiten, basis-sharing, share, continuity or svd)")
    present = arch_of(cfg).roles
    if config.roles == C.ROLES and present != C.ROLES:
        return replace_(config, roles=tuple(r for r in C.ROLES if r in present))
    return config


def family_tensors(cfg, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Role weights back in the family's own names and layouts (a plain folder any tool loads)."""
    from flowgeom.compress.arch import arch_of, family_state

    return family_state(arch_of(cfg), state, cfg.num_hidden_layers)


def check_weights(state: Mapping[str, torch.Tensor], roles: Sequence[str], n_layers: int) -> None:
    """Refuse NaN or Inf in the projections to compress (integer codes were refused when loading:
    :func:`flowgeom.nn.llama.refuse_integer_codes`)."""
    for l in range(n_layers):
        for role in roles:
            key = C.weight_key(l, role)
            t = state.get(key)
            if t is None:
                continue
            if not torch.isfinite(t).all():
                raise FlowgeomError(f"{key} holds NaN or Inf; the checkpoint is damaged: re-export it")


@dataclass
class Shared:
    """What :func:`share_model` made: the plan, the factors and the report written beside them."""

    compressed: C.Compressed
    report: dict[str, Any]
    state: dict[str, torch.Tensor] = field(repr=False)


def compress_model(config: ShareConfig, cfg, state, source: Path, tokenizer, *, progress: Progress | None = None,
                   calib_cache: dict | None = None) -> tuple[C.Compressed, dict[str, Any]]:
    """Plan + factors of one budget (the calibration shared through ``calib_cache`` across a sweep)."""
    from flowgeom.compress.calibrate import cached_calibration, calibrate, check_rank
    from flowgeom.compress.source import build_model, view_model
    from flowgeom.compress.store import GramFiles, TensorFiles

    L = cfg.num_hidden_layers
    if config.method in ("basis-sharing", "share"):
        layer_groups(L, config.group)  # --group within 1..L, refused before the calibration (minutes on a real model)
    facts: dict[str, Any] = {"notes": []}
    calib = None
    cache = calib_cache if calib_cache is not None else {}
    if config.calibrated:
        if "ids" not in cache:
            check_vocab(tokenizer, cfg, source)
            cache["ids"] = calibration_ids(source, config.calib, config.calib_tokens, config.seq_len, tokenizer)
            check_rank(input_widths(state), config.calib_tokens)
        ids = cache["ids"]
        if "calib" not in cache:
            model = view_model(cfg, state)  # read only: the weights are not copied
            step = (lambda d, t: progress("calibrate", d, t)) if progress else None
            t0 = time.perf_counter()
            if config.cache:
                cache["calib"], hit = cached_calibration(model, state, ids, progress=step)
            else:  # the Grams wait on disk, block by block, all the same (flowgeom.compress.store)
                store = GramFiles(TensorFiles.temporary(), cfg.num_hidden_layers)
                cache["calib"], hit = calibrate(model, ids, progress=step, store=store), False
            cache["calib_seconds"], cache["calib_cached"] = time.perf_counter() - t0, hit
            del model
        calib = cache["calib"]
        facts |= {"calib": config.calib, "calib_tokens": int(ids.numel()), "calib_cached": cache["calib_cached"],
                  "calib_seconds": cache["calib_seconds"]}
    evidence = None
    if config.method == "continuity" or config.space == "auto":
        if "evidence" not in cache:
            cache["evidence"] = C.continuity_evidence(state, config.roles, L)
        evidence = cache["evidence"]
        facts["evidence"] = {r: {k: v for k, v in e.items() if k != "pairs"} for r, e in evidence.items()}
        guessed = [r for r, e in evidence.items() if e["guessed"]]
        if guessed:
            facts["notes"].append(f"the analyzer measured no clear space for {', '.join(guessed)}; the larger of "
                                  "the v1/u1 ratios chose it")
    spaces = resolve_spaces(config.space, config.roles, evidence) if config.method == "share" else None
    ratio = config.budget if config.budget is not None else 0.5  # with --rank the ratio only names the plan
    p = C.plan(config.method, state, n_layers=L, ratio=ratio, roles=config.roles, group=config.group, spaces=spaces,
               calib=calib, continuity=evidence)
    if config.rank is not None:
        p = C.with_rank(p, config.rank)
    facts["allocate"] = config.allocation
    facts["max_flops"] = config.max_flops
    if config.allocation == "loss":
        p, facts["allocation"] = _loss_ranks(config, cfg, state, p, calib, cache, progress)
    facts["notes"] += list(p.notes)
    step = (lambda d, t: progress("factorise", d, t)) if progress else None
    if config.sequential:
        model = build_model(cfg, state)
        compressed, _ = C.compress_sequential(p, model, cache["ids"], refit=config.refit, progress=step,
                                              state=state)
        del model
    else:
        compressed = C.compress(p, state, calib, refit=config.refit, progress=step,
                                full=cache.get("sensitivity", {}).get("full"))
    facts["notes"] += compressed.notes
    return compressed, facts


def _loss_ranks(config: ShareConfig, cfg, state, p: C.Plan, calib, cache: dict, progress: Progress | None):
    """``p`` with ranks allocated by the calibration loss (:func:`flowgeom.compress.plan.allocate_by_loss`)."""
    from flowgeom.compress.calibrate import GRAD_TOKENS
    from flowgeom.compress.source import view_model

    ids = cache["ids"][: max(1, GRAD_TOKENS // config.seq_len)]
    step = (lambda d, t: progress("gradients", d, t)) if progress else None
    return C.allocate_by_loss(p, state, calib, lambda: view_model(cfg, state), ids, progress=step,
                              cache=cache.setdefault("sensitivity", {}), flops=config.max_flops)


def drop_blocks(config: ShareConfig, cfg, state, source: Path, tokenizer, *, progress: Progress | None = None,
                calib_cache: dict | None = None) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """``(config, state, facts)`` of the model without the blocks ``config.method`` ranks first: as many as
    save ``config.budget`` of the in-scope projection parameters (the calibration pass gives BI and angles)."""
    from dataclasses import replace as replace_

    from flowgeom.compress.calibrate import cached_calibration
    from flowgeom.compress.blocks import angular_drop, bi_drop, block_params, drop_count, drop_layers
    from flowgeom.compress.source import view_model

    cache = calib_cache if calib_cache is not None else {}
    if "ids" not in cache:
        check_vocab(tokenizer, cfg, source)
        cache["ids"] = calibration_ids(source, config.calib, config.calib_tokens, config.seq_len, tokenizer)
    if "calib" not in cache:
        step = (lambda d, t: progress("calibrate", d, t)) if progress else None
        cache["calib"], _ = cached_calibration(view_model(cfg, state), state, cache["ids"], progress=step)
    L = cfg.num_hidden_layers
    C._shapes(state, config.roles, L)
    scope = sum(L * state[C.weight_key(0, r)].numel() for r in config.roles)
    n = drop_count(config.budget, scope, block_params(state, 0), L)
    calib = cache["calib"]
    dropped = angular_drop(calib.angular, n) if config.method == "drop-angular" else bi_drop(calib.block_influence, n)
    saved = sum(block_params(state, l) for l in dropped)
    return (replace_(cfg, num_hidden_layers=L - n), drop_layers(state, dropped, n_layers=L),
            {"dropped": dropped, "scope_params": scope, "saved_params": saved, "scope_saved_fraction": saved / scope})


def role_report(compressed: C.Compressed, state: Mapping[str, torch.Tensor],
                calib=None) -> dict[str, dict[str, Any]]:
    """Per role: spaces, groups, ranks, parameters and the relative errors (weights, and whitened when ``calib``)."""
    out = compressed.plan.by_role()
    for unit, f in zip(compressed.plan.units, compressed.factors):
        r = out[unit.role]
        dense = f.dense().double()
        for l, w in zip(unit.layers, dense):
            orig = state[C.weight_key(l, unit.role)].double()
            r.setdefault("rel_error", []).append(float(torch.linalg.matrix_norm(orig - w)
                                                       / torch.linalg.matrix_norm(orig)))
    for role, r in out.items():
        r["dense_params"], r["stored_params"] = r.pop("dense"), r.pop("stored")
        r["saved_params"] = r["dense_params"] - r["stored_params"]
        r["rel_error_mean"] = sum(r["rel_error"]) / len(r["rel_error"])
        ranks = r["ranks"]
        r["rank"] = ranks[0] if len(set(ranks)) == 1 else None
        r["rank_range"] = [min(ranks), max(ranks)]
    return out


def share_model(source: str, out: Path, config: ShareConfig, *, force: bool = False,
                progress: Progress | None = None) -> Shared:
    """Compress ``source`` into the folder ``out`` (module docstring); returns the factors and the report."""
    from flowgeom.compress.write import check_out_folder, save_llama_folder, write_folder
    from flowgeom.compress.folder import save_factored
    from flowgeom.compress.source import family_json, load_dense

    t0 = time.perf_counter()
    path = source_path(source)
    check_out_folder(path, out, force=force)  # before any work
    cfg, state = load_dense(path)
    config = for_family(config, cfg)
    check_weights(state, config.roles, cfg.num_hidden_layers)
    tokenizer = model_tokenizer(path)
    check_vocab(tokenizer, cfg, source)  # every method writes the tokenizer beside the weights
    if config.method in DROP_METHODS:
        return _share_by_dropping(source, out, config, cfg, state, path, tokenizer, force=force, progress=progress,
                                  t0=t0)
    if config.method == MIXED:
        from flowgeom.compress.mixed import share_mixed

        return share_mixed(source, out, config, cfg, state, path, tokenizer, force=force, progress=progress, t0=t0)
    compressed, facts = compress_model(config, cfg, state, path, tokenizer, progress=progress)
    report = build_report(source, out, config, cfg, state, compressed, facts)
    report["tokenizer"] = None if tokenizer is None else "tokenizer.json"
    if tokenizer is None:
        report["notes"].append("the source has no tokenizer.json, so none was written; evaluate the result with "
                               "--compare next to a reference model that has one")
    new_state = compressed.dense_state(state) if config.dense else None

    def fill(tmp: Path) -> None:
        if config.dense:
            save_llama_folder(tmp, family_json(cfg), family_tensors(cfg, new_state), tokenizer=tokenizer,
                              report=report)
        else:
            save_factored(tmp, family_json(cfg), compressed, state, tokenizer=tokenizer, report=report,
                          dtype=STORAGE[config.dtype])

    write_folder(out, fill, force=force)
    report["seconds"] = time.perf_counter() - t0
    return Shared(compressed, report, state)


def _share_by_dropping(source, out, config, cfg, state, path, tokenizer, *, force, progress, t0) -> Shared:
    from flowgeom.compress.write import save_llama_folder, write_folder

    new_cfg, new_state, facts = drop_blocks(config, cfg, state, path, tokenizer, progress=progress)
    total = sum(t.numel() for k, t in state.items() if k != "lm_head.weight" or not cfg.tie_word_embeddings)
    report = {"source": str(source), "out": str(out), "method": config.method, "budget": config.budget,
              "format": "dense", "layers": new_cfg.num_hidden_layers, **facts, "model_params": total,
              "saved_fraction": facts["saved_params"] / total,
              "tokenizer": None if tokenizer is None else "tokenizer.json", "notes": []}
    write_folder(out, lambda tmp: save_llama_folder(tmp, new_cfg.to_hf(), new_state, tokenizer=tokenizer,
                                                    report=report), force=force)
    report["seconds"] = time.perf_counter() - t0
    return Shared(None, report, state)


def build_report(source, out, config: ShareConfig, cfg, state, compressed: C.Compressed,
                 facts: Mapping[str, Any]) -> dict[str, Any]:
    roles = role_report(compressed, state)
    for role, ev in facts.get("evidence", {}).items():
        if role in roles:
            roles[role]["auto"] = ev
    total = sum(t.numel() for k, t in state.items() if k != "lm_head.weight" or not cfg.tie_word_embeddings)
    p = compressed.plan
    saved = p.dense_params - p.stored_params
    return {
        "source": str(source), "out": str(out), "method": config.method, "budget": config.budget,
        "rank": config.rank, "group": config.group, "space": config.space, "sequential": config.sequential,
        "refit": config.refit, "format": "dense" if config.dense else "factored", "dtype": config.dtype,
        "scope_params": p.dense_params, "scope_saved_params": saved, "scope_saved_fraction": saved / p.dense_params,
        "roles": roles, "model_params": total, "saved_params": saved, "saved_fraction": saved / total,
        "params_after": total - saved, **{k: v for k, v in facts.items() if k != "notes"},
        "notes": list(facts.get("notes", [])),
    }


def source_path(spec: str) -> Path:
    if spec.startswith("builtin:"):
        from flowgeom.io.builtin import builtin_path

        return builtin_path(spec)
    path = Path(spec)
    if not path.exists():
        from flowgeom.compress.arch import CAUSAL_FAMILIES

        raise FlowgeomError(f"source {spec} does not exist; pass a Llama .gguf, builtin:smollm2 or an HF folder "
                            f"(config.json + safetensors) of one of: {', '.join(CAUSAL_FAMILIES)}")
    return path


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


def model_tokenizer(path: Path):
    """The source's tokenizer, or None for an HF folder saved without one (sharing with --method svd needs none)."""
    from flowgeom.data.tokens import load_tokenizer

    untokenized = path.is_dir() and not (path / "tokenizer.json").exists() and not any(path.glob("*.gguf"))
    return None if untokenized else load_tokenizer(path)
