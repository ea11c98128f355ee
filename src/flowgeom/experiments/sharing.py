"""Seed 001's design implication, judged with the compression methods the field uses (``continuity.sharing``).

Seed 001: adjacent layers share singular directions, so cross-layer basis
sharing should work in the space where each projection is continuous (Q, K,
Gate, Up: input; O, Down: output), V offers no obvious opportunity, and
continuity should guide which layers to drop. One run = one strategy at one
budget ``b`` = the fraction of the in-scope projection parameters saved
(bases + coefficients counted), scored by held-out perplexity:

* ``svd`` - data-free per-layer truncated SVD (the floor);
* ``whiten`` - SVD-LLM's truncation-aware whitening per layer;
* ``basis-sharing`` - Basis Sharing (Wang et al., ICLR 2025): q, k, v, gate,
  up share a whitened input-space basis over groups of ``group`` layers;
* ``seed-space`` (a) / ``opposite-space`` (b) - whitened sharing of q, k,
  gate, up, o, down in the seed's space / the other one, V per layer;
* ``continuity`` - flowgeom's: spaces, grouping and budget split from the
  measured continuity (:mod:`flowgeom.compress.plan`);
* ``role-input`` / ``role-output`` - one role at a time (config key ``role``),
  whitened sharing in that space, the other six untouched;
* ``prune-bi`` (ShortGPT's Block Influence), ``prune-angular`` (Gromov et
  al.: the n consecutive blocks whose input and output differ least),
  ``prune-continuity`` (the analyzer's adjacent-layer continuity) and
  ``prune-random`` (one order per seed): drop ``n = round(b P / block)``
  blocks, P the in-scope projection parameters;
* ``none`` - the model itself.

All calibrated methods read the same Grams (16,384 KJV train tokens, cached on
disk: one calibration serves the whole grid); perplexity is scored on the
held-out KJV split (:mod:`flowgeom.compress.perplexity`). ``sequential`` (a
config key) calibrates each group on the already-compressed blocks before it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from flowgeom.compress.blocks import angular_drop, bi_drop, drop_count
from flowgeom.compress.arch import HF_NAMES, ROLES, weight_key
from flowgeom.compress.plan import SEED_SPACE
from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.experiments.presets import preset as resolve
from flowgeom.experiments.presets import scales

METHODS = {"svd": ("svd", None), "whiten": ("whiten", None), "basis-sharing": ("basis-sharing", None),
           "seed-space": ("share", "seed"), "opposite-space": ("share", "opposite"),
           "continuity": ("continuity", None)}
ROLE_STRATEGIES = ("role-input", "role-output")
PRUNE = ("prune-bi", "prune-angular", "prune-continuity", "prune-random")
STRATEGIES = ("none",) + tuple(METHODS) + PRUNE

@dataclass(frozen=True)
class SharingPreset:
    """One scale of the sharing grid: which budgets, which comparisons, and how perplexity is scored."""

    budgets: tuple[float, ...]          # fractions saved, every method of METHODS at each
    role_budgets: tuple[float, ...]     # one role at a time, in each space (ROLE_STRATEGIES)
    prune_budgets: tuple[float, ...]    # dropping blocks (PRUNE)
    random_seeds: tuple[int, ...]       # random dropping orders
    tokens: int | None                  # held-out tokens scored (None: the whole split, 47,870)
    context: int = 512                  # tokens per perplexity window
    group: int = 2                      # layers sharing one basis
    calib: str = "kjv"                  # calibration text
    calib_tokens: int = 16384           # calibration tokens (one set of Grams for the whole grid)
    sequential: bool = False            # calibrate each group on the already-compressed blocks before it


# quick: one budget, every method, the four pruning rankings (2 random orders) at 10%, the reference: 12 runs on
#   2,048 held-out tokens. cpu: three budgets, every method, the per-role comparison at 20%, pruning at 10%
#   and 20% with five random orders: 49 runs on 4,096 tokens. full: cpu on the whole held-out split (47,870).
QUICK = SharingPreset(budgets=(0.2,), role_budgets=(), prune_budgets=(0.1,), random_seeds=(0, 1), tokens=2048)
CPU = SharingPreset(budgets=(0.1, 0.2, 0.3), role_budgets=(0.2,), prune_budgets=(0.1, 0.2),
                    random_seeds=(0, 1, 2, 3, 4), tokens=4096)
FULL = dataclasses.replace(CPU, tokens=None)
PRESETS = scales(quick=QUICK, cpu=CPU, full=FULL)


def sharing_grid(preset: str = "quick", *, source: str = "builtin:smollm2", text: str = "kjv",
                 **overrides: Any) -> tuple[dict[str, Any], ...]:
    """The run configs of a preset (plain JSON dicts); ``overrides`` replace preset fields (tests: smaller grids)."""
    p = resolve(PRESETS, preset, what="sharing preset keys", **overrides)
    base = {"source": source, "text": text, **{k: getattr(p, k) for k in ("tokens", "context", "group", "calib",
                                                                           "calib_tokens", "sequential")}}
    runs = [{**base, "strategy": "none", "budget": 0.0, "seed": 0}]
    runs += [{**base, "strategy": s, "budget": b, "seed": 0} for b in p.budgets for s in METHODS]
    runs += [{**base, "strategy": s, "budget": b, "seed": 0, "role": role}
             for b in p.role_budgets for role in ROLES for s in ROLE_STRATEGIES]
    for b in p.prune_budgets:
        runs += [{**base, "strategy": s, "budget": b, "seed": 0} for s in PRUNE[:3]]
        runs += [{**base, "strategy": "prune-random", "budget": b, "seed": s} for s in p.random_seeds]
    return tuple(runs)


# ---------------------------------------------------------------- pruning orders (pure)

def continuity_drop(state: Mapping[str, torch.Tensor], n_layers: int, n: int) -> list[int]:
    """The n most redundant blocks by the analyzer's adjacent-layer continuity (ends protected)."""
    from flowgeom.continuity import AnalyzeConfig, analyze
    from flowgeom.compress.blocks import continuity_scores, drop_order

    six = tuple(SEED_SPACE)
    sub = {weight_key(l, r): state[weight_key(l, r)] for r in six for l in range(n_layers)}
    report = analyze(sub, AnalyzeConfig(roles=six, gram=False, dtype="float32"))
    return sorted(drop_order(continuity_scores(report), protect=(0, n_layers - 1))[:n])


def random_drop(n_layers: int, n: int, seed: int) -> list[int]:
    from flowgeom.compress.blocks import random_drop_order

    return sorted(random_drop_order(n_layers, seed=seed, protect=(0, n_layers - 1))[:n])


# ---------------------------------------------------------------- one run

def _compression_config(config: Mapping[str, Any]):
    from flowgeom.compress.run import CompressionConfig

    strategy = config["strategy"]
    if strategy in ROLE_STRATEGIES:
        role = config.get("role")
        if role not in ROLES:
            raise choice_error("role", role, ROLES)
        method, space, roles = "share", strategy.split("-")[1], (role,)
    else:
        (method, space), roles = METHODS[strategy], ROLES
    return CompressionConfig(method=method, budget=float(config["budget"]), roles=roles, group=int(config["group"]),
                             space=space, calib=config["calib"], calib_tokens=int(config["calib_tokens"]),
                             sequential=bool(config.get("sequential", False)),
                             allocate="even" if method != "svd" else None)  # the seed's question: spaces at equal ranks


def run_sharing(config: Mapping[str, Any], folder, *, resume: bool = False) -> dict[str, Any]:
    """Compress ``config["source"]`` by one strategy, score it; the summary depends only on the config.

    ``folder`` is a :class:`flowgeom.runs.RunFolder` (already started). A run keeps no intermediate state: an
    interrupted run (``resume``) is redone from the start (the calibration comes back from the disk cache).
    """
    import time

    from flowgeom.compress.blocks import block_params, drop_layers
    from flowgeom.compress.calibrate import cached_calibration, calibration_ids
    from flowgeom.compress.perplexity import EvalConfig, perplexity
    from flowgeom.compress.lowrank import compress_model
    from flowgeom.compress.run import role_report
    from flowgeom.compress.source import model_tokenizer, source_path
    from flowgeom.data.text import load_text
    from flowgeom.data.tokens import token_ids
    from flowgeom.nn.llama import llama_from_state, llama_state_dict

    strategy, budget = config["strategy"], float(config["budget"])
    if strategy not in STRATEGIES + ROLE_STRATEGIES:
        raise choice_error("strategy", strategy, STRATEGIES + ROLE_STRATEGIES)
    if strategy != "none" and not 0.0 < budget < 1.0:
        raise FlowgeomError(f"budget {budget!r} must be a fraction in (0, 1); e.g. 0.2 saves 20% of the roles")
    if resume:
        folder.truncate_metrics(after_step=-1)
    t0 = time.perf_counter()
    path = source_path(config["source"])
    cfg, state = llama_state_dict(path)
    tokenizer = model_tokenizer(path)
    L = cfg.num_hidden_layers
    scope_roles = (config["role"],) if strategy in ROLE_STRATEGIES else ROLES
    scope = sum(L * math.prod(state[weight_key(0, r)].shape) for r in scope_roles)
    facts: dict[str, Any] = {"roles": {}, "saved_params": 0}
    new_state, layers = state, L
    if strategy.startswith("prune-"):
        block = block_params(state, 0)
        n = drop_count(budget, scope, block, L)
        if strategy in ("prune-bi", "prune-angular"):
            ids = calibration_ids(path, config["calib"], int(config["calib_tokens"]), 512, tokenizer)
            calib, _ = cached_calibration(llama_from_state(cfg, state), state, ids)
            dropped = (bi_drop(calib.block_influence, n) if strategy == "prune-bi"
                       else angular_drop(calib.angular, n))
        elif strategy == "prune-continuity":
            dropped = continuity_drop(state, L, n)
        else:
            dropped = random_drop(L, n, int(config["seed"]))
        new_state, layers = drop_layers(state, dropped, n_layers=L), L - n
        facts |= {"dropped": dropped, "saved_params": sum(block_params(state, l) for l in dropped)}
    elif strategy != "none":
        compressed, made = compress_model(_compression_config(config), cfg, state, path, tokenizer)
        new_state = compressed.dense_state(state)
        p = compressed.plan
        facts |= {"saved_params": p.dense_params - p.stored_params, "notes": made["notes"],
                  "roles": {r: {"space": v["space"], "ranks": [min(v["ranks"]), max(v["ranks"])],
                                "groups": sorted({len(g) for g in v["groups"]}), "saved_params": v["saved_params"],
                                "saved_fraction": v["saved_fraction"], "rel_error": v["rel_error_mean"]}
                            for r, v in role_report(compressed, state).items()}}
    t1 = time.perf_counter()
    model = llama_from_state(replace(cfg, num_hidden_layers=layers), new_state)
    text = load_text(config["text"], split="test")
    ids = token_ids(text, tokenizer)
    res = perplexity(model, ids, EvalConfig(context=int(config["context"]), max_tokens=config["tokens"]))
    folder.log({"step": 0, "compress_seconds": t1 - t0, "eval_seconds": res["seconds"]})
    return {"strategy": strategy, "budget": budget, "seed": config["seed"], "ppl": res["ppl"], "nll": res["nll"],
            "targets": res["targets"], "layers": layers, "scope_params": scope, **facts,
            "saved_fraction": facts["saved_params"] / scope,
            **({"role": config["role"]} if "role" in config else {})}


# ---------------------------------------------------------------- verdict (pure) and figure

BROKEN = 10.0  # a model with ppl over BROKEN x the reference is called broken


def _by(rows: Sequence[Mapping[str, Any]], strategy: str, role: str | None = None) -> dict[float, list]:
    out: dict[float, list] = {}
    for r in rows:
        if r["strategy"] == strategy and r.get("role") == role:
            out.setdefault(float(r["budget"]), []).append(r)
    return out


def _ppl(rows: Sequence[Mapping[str, Any]]) -> float:
    """Perplexity of a set of runs (random seeds): exp of the mean NLL."""
    return math.exp(sum(r["nll"] for r in rows) / len(rows))


def per_role(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[float, dict[str, float]]]:
    """``{role: {budget: {"input": ppl, "output": ppl}}}`` where both spaces ran."""
    out: dict[str, dict[float, dict[str, float]]] = {}
    for role in ROLES:
        a, b = _by(rows, "role-input", role), _by(rows, "role-output", role)
        for x in sorted(set(a) & set(b)):
            out.setdefault(role, {})[x] = {"input": _ppl(a[x]), "output": _ppl(b[x])}
    return out


def judge(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The verdict from finished-run summaries: ``{"measured", "verdict", "how", "table"}``.

    The seed's claim is judged per role when the per-role runs exist ("reproduced" when the seed's space beats
    the opposite space for all six roles that have one, "not reproduced" for none, "differs" otherwise), else
    on the all-roles runs (seed-space against opposite-space at every budget). ``how`` also reports the best
    method per budget against the reference, continuity-guided against Basis Sharing, V's two spaces and the
    pruning rankings against the random ones.
    """
    ref = [r["ppl"] for r in rows if r["strategy"] == "none"]
    ref_ppl = ref[0] if ref else None
    parts = [f"reference ppl {ref_ppl:.2f}"] if ref else []
    notes: list[str] = []
    by_method = {m: _by(rows, m) for m in METHODS}
    budgets = sorted({b for d in by_method.values() for b in d})
    for b in budgets:
        cells = {m: _ppl(d[b]) for m, d in by_method.items() if b in d}
        parts.append(f"{100 * b:g}% saved: " + ", ".join(f"{m} {p:.4g}" for m, p in cells.items()))
        best = min(cells, key=cells.get)
        notes.append(f"best at {100 * b:g}%: {best} ({cells[best]:.4g}"
                     + (f", {cells[best] / ref_ppl:.2f}x the reference" if ref_ppl else "") + ")")
        if "continuity" in cells and "basis-sharing" in cells:
            notes.append(f"continuity-guided {'beats' if cells['continuity'] < cells['basis-sharing'] else 'loses to'}"
                         f" Basis Sharing at {100 * b:g}% ({cells['continuity']:.4g} vs {cells['basis-sharing']:.4g})")
    a, o = by_method["seed-space"], by_method["opposite-space"]
    pairs = sorted(set(a) & set(o))
    wins = [_ppl(a[x]) < _ppl(o[x]) for x in pairs]
    table_roles = per_role(rows)
    role_wins = []
    for role, cells in table_roles.items():
        seed = SEED_SPACE.get(role)
        text = "; ".join(f"{100 * x:g}%: input {c['input']:.4g}, output {c['output']:.4g}" for x, c in cells.items())
        parts.append(f"{role}{f' (seed: {seed})' if seed else ''} {text}")
        if seed is None:
            best = ["input" if c["input"] <= c["output"] else "output" for c in cells.values()]
            notes.append(f"V: the {'/'.join(sorted(set(best)))} space is better; the seed says V offers no obvious "
                         "opportunity: compare its loss with the other roles' in the table")
            continue
        other = "output" if seed == "input" else "input"
        won = [c[seed] < c[other] for c in cells.values()]
        role_wins.append(all(won))
        notes.append(f"{role}: the seed's {seed} space {'wins' if all(won) else 'loses' if not any(won) else 'mixed'}"
                     f" ({sum(won)} of {len(won)} budgets)")
    for b in sorted(set(_by(rows, "prune-random")) | set(_by(rows, "prune-bi"))):
        cells = {s: _by(rows, s).get(b) for s in PRUNE}
        rand = [r["ppl"] for r in cells["prune-random"] or []]
        shown = [f"{s[6:]} {_ppl(v):.4g}" for s, v in cells.items() if v and s != "prune-random"]
        if rand:
            shown.append(f"random mean {_ppl(cells['prune-random']):.4g} (min {min(rand):.4g}, max {max(rand):.4g}, "
                         f"{len(rand)} orders)")
        parts.append(f"drop {100 * b:g}%: " + ", ".join(shown))
        if rand and cells["prune-continuity"]:
            c = _ppl(cells["prune-continuity"])
            notes.append(f"continuity-ranked dropping at {100 * b:g}% beats {sum(p > c for p in rand)} of "
                         f"{len(rand)} random orders")
    compressed = [_ppl(d[b]) for d in by_method.values() for b in d]
    if ref_ppl and compressed and min(compressed) > BROKEN * ref_ppl:
        notes.append(f"every compressed model is broken (ppl over {BROKEN:g}x the reference)")
    table = tuple({"strategy": r["strategy"], "role": r.get("role", "-"), "budget": r["budget"], "seed": r["seed"],
                   "saved %": round(100 * r["saved_fraction"], 2), "layers": r["layers"], "ppl": r["ppl"]}
                  for r in sorted(rows, key=lambda r: (r["strategy"], r.get("role", ""), r["budget"], r["seed"])))
    measured = "; ".join(parts) or "no run"
    if role_wins:
        verdict = "reproduced" if all(role_wins) else ("not reproduced" if not any(role_wins) else "differs")
        first = f"per role, whitened, the seed's space beats the opposite space for {sum(role_wins)} of " \
                f"{len(role_wins)} roles"
    elif pairs:
        verdict = "reproduced" if all(wins) else ("not reproduced" if not any(wins) else "differs")
        first = f"all six roles, whitened: the seed's space beats the opposite space at {sum(wins)} of {len(wins)} " \
                "budgets"
    else:
        return {"measured": measured, "verdict": "not run",
                "how": "the grid lacks seed-space and opposite-space runs at a common budget", "table": table}
    if role_wins and pairs:
        notes.insert(0, f"all six roles at once: the seed's space wins at {sum(wins)} of {len(wins)} budgets")
    return {"measured": measured, "verdict": verdict, "how": "; ".join([first] + notes), "table": table}


LABELS = {"svd": "plain SVD (data-free)", "whiten": "SVD-LLM (whitened, per layer)",
          "basis-sharing": "Basis Sharing (whitened, input space)", "seed-space": "(a) whitened, seed's spaces",
          "opposite-space": "(b) whitened, opposite spaces", "continuity": "flowgeom continuity-guided"}


def sharing_figure(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Perplexity (log) against projection parameters saved (%), a line per method, pruning as markers,
    the reference as a dashed line; with per-role runs a second panel (seed space filled)."""
    from matplotlib.figure import Figure

    from flowgeom.runs import atomic_write_figure

    single = [r for r in rows if "role" in r]
    fig = Figure(figsize=(6.4, 3.8) if not single else (12.0, 3.8))
    axes = fig.subplots(1, 2 if single else 1, squeeze=False)[0]
    ref = [r["ppl"] for r in rows if r["strategy"] == "none"]
    ax = axes[0]
    for strategy, label in LABELS.items():
        pts = sorted((100 * r["saved_fraction"], r["ppl"]) for r in rows if r["strategy"] == strategy
                     and "role" not in r)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=4, label=label)
    for strategy, marker in zip(PRUNE, "v^sx"):
        pts = [(100 * r["saved_fraction"], r["ppl"]) for r in rows if r["strategy"] == strategy]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker, ms=5, label=f"drop blocks: {strategy[6:]}")
    if ref:
        ax.axhline(ref[0], color="k", ls="--", lw=1, label=f"uncompressed ({ref[0]:.2f})")
    ax.set_yscale("log")
    ax.set_xlabel("projection parameters saved (%)")
    ax.set_ylabel("perplexity (held-out KJV)")
    ax.legend(fontsize=6)
    if single:
        ax = axes[1]
        for k, space in enumerate(("input", "output")):
            for i, role in enumerate(ROLES):
                found = [r for r in single if r["strategy"] == f"role-{space}" and r["role"] == role]
                if found:
                    ax.plot([i + (k - 0.5) * 0.3], [_ppl(found)], "o", color=("tab:blue", "tab:orange")[k],
                            fillstyle="full" if SEED_SPACE.get(role) == space else "none",
                            label=f"{space} space" if i == 0 else None)
        if ref:
            ax.axhline(ref[0], color="k", ls="--", lw=1)
        ax.set_xticks(range(len(ROLES)), [f"{r}\n({SEED_SPACE.get(r, 'none')})" for r in ROLES], fontsize=7)
        ax.set_yscale("log")
        ax.set_title("one role at a time, whitened (filled: the seed's space)", fontsize=9)
        ax.legend(fontsize=6)
    return atomic_write_figure(path, fig, format="png", dpi=110, bbox_inches="tight")


__all__ = ["HF_NAMES", "METHODS", "PRESETS", "PRUNE", "ROLE_STRATEGIES", "STRATEGIES", "SharingPreset", "angular_drop",
           "bi_drop", "judge", "run_sharing", "sharing_figure", "sharing_grid"]
