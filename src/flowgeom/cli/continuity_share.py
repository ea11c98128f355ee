"""``flowgeom continuity share|evaluate``: cross-layer basis sharing, judged by perplexity.

``register_verbs(verbs)`` adds the verbs to the ``continuity`` area (see
:mod:`flowgeom.cli.continuity`). The maths lives in
:mod:`flowgeom.continuity.compress` and :mod:`flowgeom.continuity.lm_eval`;
this module parses, validates, calls and prints. See docs/continuity-sharing.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flowgeom.cli._common import (
    add_device, add_json, add_threads, apply_threads, bounded_int, command, comma_list, console, finite_float,
    positive_int, print_json, resolve_device,
)
from flowgeom.errors import FlowgeomError

ROLES = ("q", "k", "v", "o", "gate", "up", "down")
BUDGET_TOL = 0.02  # a role's saved fraction further than this from --budget is named in a note


def _source_path(spec: str) -> Path:
    if spec.startswith("builtin:"):
        from flowgeom.continuity.sources import builtin_path

        return builtin_path(spec)
    path = Path(spec)
    if not path.exists():
        raise FlowgeomError(f"source {spec} does not exist; pass a .gguf, builtin:smollm2 or an HF Llama folder")
    return path


def _progress(enabled: bool, label: str):
    """A rich progress callback on stderr (terminal only) and the bar to open, or (None, None)."""
    if not enabled or not sys.stderr.isatty():
        return None, None
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import Progress

    bar = Progress(console=Console(stderr=True), transient=True)
    task = bar.add_task(escape(label), total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    return bar, update


# ---------------------------------------------------------------- share

def auto_spaces(state: dict, roles: tuple[str, ...], n_layers: int) -> tuple[dict[str, str], dict[str, dict]]:
    """Per role, the space the analyzer measures as continuous (v1/u1 ratio to chance; the larger one
    when both or neither pass the threshold), with the evidence."""
    from flowgeom.continuity import AnalyzeConfig, analyze
    from flowgeom.continuity.compress import HF_NAMES

    sub = {f"model.layers.{l}.{HF_NAMES[r]}.weight": state[f"model.layers.{l}.{HF_NAMES[r]}.weight"]
           for r in roles for l in range(n_layers)}
    report = analyze(sub, AnalyzeConfig(roles=roles, gram=False, dtype="float32"))
    spaces, evidence = {}, {}
    for role in roles:
        r = report["roles"][role]
        verdict = r["verdict"]
        if verdict == "input-continuous":
            space = "input"
        elif verdict == "output-continuous":
            space = "output"
        else:
            space = "input" if r["v1_ratio"] >= r["u1_ratio"] else "output"
        spaces[role] = space
        evidence[role] = {"verdict": verdict, "v1_ratio": r["v1_ratio"], "u1_ratio": r["u1_ratio"]}
    return spaces, evidence


def budget_ranks(state: dict, spaces: dict[str, str], n_layers: int, group: int, budget: float) -> dict[str, int]:
    """Per role, the largest shared rank that saves ``budget`` of that role's parameters in its space."""
    from flowgeom.continuity.compress import HF_NAMES, layer_groups, share_rank_for_budget

    sizes = [len(g) for g in layer_groups(n_layers, group)]
    return {role: share_rank_for_budget(*state[f"model.layers.0.{HF_NAMES[role]}.weight"].shape, sizes, budget, space)
            for role, space in spaces.items()}


def run_share(args: argparse.Namespace) -> int:
    from flowgeom.continuity.checkpoint_out import check_out_folder, save_llama_folder, write_folder
    from flowgeom.continuity.compress import check_share, share_state_dict
    from flowgeom.data.tokens import load_tokenizer
    from flowgeom.nn.llama import llama_state_dict

    apply_threads(args.threads)
    t0 = time.perf_counter()
    source = _source_path(args.source)
    out = Path(args.out)
    check_out_folder(source, out, force=args.force)  # before any work
    cfg, state = llama_state_dict(source)
    check_share(state, args.roles, n_layers=cfg.num_hidden_layers, group=args.group, rank=args.rank)  # before any SVD
    # sharing needs no tokenizer: an HF folder saved without one gives a folder without one (said in the report)
    untokenized = source.is_dir() and not (source / "tokenizer.json").exists() and not any(source.glob("*.gguf"))
    tokenizer = None if untokenized else load_tokenizer(source)
    if args.space == "auto":
        spaces, evidence = auto_spaces(state, args.roles, cfg.num_hidden_layers)
    else:
        spaces, evidence = {r: args.space for r in args.roles}, {}
    ranks = args.rank if args.budget is None else budget_ranks(state, spaces, cfg.num_hidden_layers, args.group,
                                                                args.budget)
    n_groups = -(-cfg.num_hidden_layers // args.group)
    bar, update = _progress(not args.json, f"share {','.join(spaces)}: {len(spaces)} roles x {n_groups} groups")
    if bar is not None:
        with bar:
            new_state, results = share_state_dict(state, spaces, n_layers=cfg.num_hidden_layers, group=args.group,
                                                  rank=ranks, progress=update)
    else:
        new_state, results = share_state_dict(state, spaces, n_layers=cfg.num_hidden_layers, group=args.group,
                                              rank=ranks)
    total = sum(t.numel() for k, t in state.items() if k != "lm_head.weight" or not cfg.tie_word_embeddings)
    saved = sum(r.saved for r in results)
    report = {
        "source": str(args.source), "out": str(out), "strategy": "shared-basis", "group": args.group,
        "rank": args.rank, "budget": args.budget, "space": args.space,
        "roles": {r.role: {"space": r.space, **({"auto": evidence[r.role]} if r.role in evidence else {}),
                           "shape": list(r.shape), "groups": r.groups, "rank": r.rank, "dense_params": r.dense_params,
                           "stored_params": r.stored_params, "saved_params": r.saved,
                           "saved_fraction": r.saved / r.dense_params,
                           "rel_error_mean": sum(r.rel_error) / len(r.rel_error), "rel_error": r.rel_error}
                  for r in results},
        "model_params": total, "saved_params": saved, "saved_fraction": saved / total,
        "params_after": total - saved,
        "tokenizer": None if tokenizer is None else "tokenizer.json",
    }
    write_folder(out, lambda tmp: save_llama_folder(tmp, cfg.to_hf(), new_state, tokenizer=tokenizer, report=report),
                 force=args.force)
    report["seconds"] = time.perf_counter() - t0
    if args.json:
        print_json(report)
    else:
        _print_share(report)
    return 0


def _print_share(report: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    how = (f"rank {report['rank']}" if report["budget"] is None else
           f"budget {100 * report['budget']:g}% of each role")
    table = Table(title=f"{escape(report['source'])} -> {escape(report['out'])}: groups of {report['group']}, {how}")
    for col in ("role", "space", "shape", "rank", "dense", "stored", "saved", "rel. error"):
        table.add_column(col, justify="left" if col in ("role", "space") else "right")
    for role, r in report["roles"].items():
        why = f" ({r['auto']['verdict']})" if "auto" in r else ""
        table.add_row(role, r["space"] + why, "×".join(map(str, r["shape"])), str(r["rank"]), f"{r['dense_params']:,}",
                      f"{r['stored_params']:,}", f"{r['saved_params']:,} ({100 * r['saved_fraction']:.1f}%)",
                      f"{r['rel_error_mean']:.3f}")
    out = console()
    out.print(table)
    if report["budget"] is not None:
        off = [f"{role} {100 * r['saved_fraction']:.1f}% ("
               + (f"rank at its bound {r['rank']}" if r["rank"] in (1, min(r["shape"])) else "coarse rank steps") + ")"
               for role, r in report["roles"].items() if abs(r["saved_fraction"] - report["budget"]) > BUDGET_TOL]
        if off:
            out.print(f"note: saved more or less than the budget: {', '.join(off)}")
    if report["tokenizer"] is None:
        out.print("note: the source has no tokenizer.json, so none was written; evaluate the result with "
                  "--compare next to a reference model that has one")
    out.print(f"parameters saved: {report['saved_params']:,} of {report['model_params']:,} "
              f"({100 * report['saved_fraction']:.1f}%; basis + per-layer coefficients counted); "
              f"{report['seconds']:.1f} s")
    if report["saved_params"] < 0:
        out.print("note: the rank is too high for this group size: the factors store more than the dense matrices")


# ---------------------------------------------------------------- evaluate

def run_evaluate(args: argparse.Namespace) -> int:
    import torch

    from flowgeom.continuity.lm_eval import QUICK_TOKENS, EvalConfig, perplexity, windows
    from flowgeom.data.text import load_text
    from flowgeom.data.tokens import cached_ids, load_tokenizer
    from flowgeom.nn.llama import load_llama
    from flowgeom.runs import check_out_file

    apply_threads(args.threads)
    device = resolve_device(args.device)
    if args.out:
        check_out_file(args.out)  # before any model is loaded
    max_tokens = args.tokens or (None if args.full else QUICK_TOKENS)
    config = EvalConfig(context=args.context, stride=args.stride, max_tokens=max_tokens, batch=args.batch)
    specs = [args.source] + list(args.compare or [])
    paths = [_source_path(s) for s in specs]  # every path checked before any model is loaded
    tokenizer = load_tokenizer(paths[0])
    text = load_text(args.text, split="test") if args.text == "kjv" else load_text(args.text)
    ids = torch.from_numpy(cached_ids(text, tokenizer).astype("int64"))
    n = len(ids) if max_tokens is None else min(len(ids), max_tokens)
    windows(n, config.context, config.stride or config.context)  # text too short: one line, exit 2, nothing loaded
    rows = []
    for spec, path in zip(specs, paths):
        t0 = time.perf_counter()
        model = load_llama(path).to(device)
        load_seconds = time.perf_counter() - t0
        if model.config.vocab_size < tokenizer.get_vocab_size():
            raise FlowgeomError(f"{spec} has {model.config.vocab_size} token embeddings but the tokenizer of "
                                f"{specs[0]} has {tokenizer.get_vocab_size()} tokens; compare models that share it")
        bar, update = _progress(not args.json, f"{spec}")
        if bar is not None:
            with bar:
                res = perplexity(model, ids.to(device), config, progress=update)
        else:
            res = perplexity(model, ids.to(device), config)
        eval_seconds = res.pop("seconds")
        row = {"model": spec, **res, "params": sum(p.numel() for p in model.parameters()),
               "load_seconds": load_seconds, "eval_seconds": eval_seconds, "seconds": time.perf_counter() - t0}
        share = path / "flowgeom_share.json" if path.is_dir() else None
        if share is not None and share.is_file():
            from flowgeom.runs import read_json_object

            info = read_json_object(share, fix="re-run continuity share")
            row["saved_params"] = info.get("saved_params")
        rows.append(row)
        del model
    base = rows[0]["ppl"]
    for row in rows:
        row["ppl_ratio"] = row["ppl"] / base
    result = {"text": args.text, "split": "test (last 5% of verses)" if args.text == "kjv" else "whole file",
              "tokens_in_split": len(ids), "config": {"context": config.context,
                                                      "stride": config.stride or config.context,
                                                      "max_tokens": max_tokens}, "models": rows}
    if args.out:
        from flowgeom.runs import atomic_write_json

        atomic_write_json(Path(args.out), result)
    if args.json:
        print_json(result)
    else:
        _print_evaluate(result)
    return 0


def _print_evaluate(result: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    cfg = result["config"]
    table = Table(title=f"perplexity on {escape(result['text'])} {escape(result['split'])}: "
                        f"{result['models'][0]['targets']:,} targets, context {cfg['context']}, stride {cfg['stride']}")
    for col in ("model", "ppl", "× first", "nll", "params saved", "seconds"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for row in result["models"]:
        saved = row.get("saved_params")
        table.add_row(escape(row["model"]), f"{row['ppl']:.3f}", f"{row['ppl_ratio']:.3f}", f"{row['nll']:.4f}",
                      "-" if saved is None else f"{saved:,}", f"{row['seconds']:.1f}")
    console().print(table)


# ---------------------------------------------------------------- registration

def register_verbs(verbs) -> None:
    """Add ``share`` and ``evaluate`` to the ``continuity`` area's verb sub-parsers."""
    p = command(verbs, "share", help="replace each group of adjacent layers' projections by one shared rank-r basis",
                example="flowgeom continuity share builtin:smollm2 --out runs/shared --roles q,k,gate,up "
                        "--group 2 --rank 256\n"
                        "flowgeom continuity share model.gguf --out runs/s --roles o,down --space output --rank 192\n"
                        "flowgeom continuity share builtin:smollm2 --out runs/q10 --roles q --budget 0.1",
                func=run_share)
    p.add_argument("source",
                   help="Llama checkpoint: .gguf, builtin:smollm2, or an HF folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="new folder for the HF-layout checkpoint (refused inside the source)")
    p.add_argument("--roles", type=comma_list(ROLES, what="role"), default=("q", "k", "gate", "up", "o", "down"),
                   help="roles to share, comma-separated (default q,k,gate,up,o,down)")
    p.add_argument("--group", type=positive_int, default=2, help="adjacent layers per shared basis (default 2)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--rank", type=positive_int, help="rank r of each shared basis (one rank for every role)")
    size.add_argument("--budget", type=finite_float(0.0, 1.0, hi_open=True), metavar="FRACTION",
                      help="instead of --rank: per role, the largest rank that saves this fraction of the role's "
                           "parameters (bases + coefficients counted), e.g. 0.1")
    p.add_argument("--space", choices=("auto", "input", "output"), default="auto",
                   help="input: W V V^T; output: U U^T W; auto: the space the analyzer measures as continuous "
                        "per role (default)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    add_threads(p, default=1, help="torch CPU threads (default 1: on a shared, loaded machine 2 threads made share "
                                   "15x slower; try 2 on an idle one)")
    add_json(p)

    p = command(verbs, "evaluate", help="perplexity of Llama checkpoints on the held-out KJV text",
                example="flowgeom continuity evaluate builtin:smollm2 --compare runs/shared     # quick, ~4k tokens\n"
                        "flowgeom continuity evaluate builtin:smollm2 --full --context 1024 --json",
                func=run_evaluate)
    p.add_argument("source", help="reference model (its tokenizer is used for all): .gguf, builtin:smollm2, HF folder")
    p.add_argument("--compare", nargs="+", metavar="DIR", help="more models to evaluate on the same tokens")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the first 4,096 tokens of the split (default)")
    size.add_argument("--full", action="store_true", help="the whole held-out split (47,870 tokens on SmolLM2)")
    size.add_argument("--tokens", type=bounded_int(2), help="the first N tokens of the split")
    p.add_argument("--context", type=bounded_int(2, 1 << 20), default=512, help="tokens per window (default 512)")
    p.add_argument("--stride", type=positive_int, help="window step <= --context (default: --context, no overlap)")
    p.add_argument("--batch", type=positive_int(maximum=1024), default=1, help="windows per forward call (default 1)")
    p.add_argument("--text", default="kjv", help="kjv (held-out split: last 5%% of verses, default) or a text file")
    p.add_argument("--out", metavar="FILE", help="also write the JSON result to FILE (atomically)")
    add_device(p)
    add_threads(p, default=1, help="torch CPU threads (default 1: on a shared, loaded machine 2 threads made share "
                                   "15x slower; try 2 on an idle one)")
    add_json(p)
