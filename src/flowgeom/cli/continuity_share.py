"""``flowgeom continuity share|evaluate``: cross-layer basis sharing, judged by perplexity.

``register_verbs(verbs)`` adds the verbs to the ``continuity`` area (see
:mod:`flowgeom.cli.continuity`). The maths lives in
:mod:`flowgeom.compress.run` and :mod:`flowgeom.compress.perplexity`;
this module parses, validates, calls and prints. See docs/continuity-sharing.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flowgeom.cli._common import (
    add_device, add_json, add_threads, bounded_int, command, comma_list, console, finite_float,
    positive_int, print_json, resolve_device,
)
from flowgeom.errors import FlowgeomError
from flowgeom.limits import LIMITS

ROLES = ("q", "k", "v", "o", "gate", "up", "down")
METHODS = ("svd", "whiten", "basis-sharing", "share", "continuity", "drop-angular", "drop-bi", "mixed")
DEFAULT_CALIB_TOKENS = 16384  # flowgeom.compress.calibrate.DEFAULT_TOKENS (kept here: --help imports no torch)
BUDGET_TOL = 0.01  # an obtained saving further than this from --budget is shown loudly
MAX_LAYERS = LIMITS["num_hidden_layers"][1]  # no config may declare more layers, so no --group can be larger


def _budgets(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated fractions in (0, 1)."""
    parse = finite_float(0.0, 1.0, lo_open=True, hi_open=True)
    items = tuple(parse(x.strip()) for x in text.split(",") if x.strip())
    if not items:
        raise argparse.ArgumentTypeError("expected budgets like 0.1,0.2,0.3")
    return items


def _share_config(args: argparse.Namespace):
    from flowgeom.compress.run import ShareConfig

    budget = None if args.rank is not None or args.sweep else (0.2 if args.budget is None else args.budget)
    return ShareConfig(method=args.method, budget=budget if not args.sweep else args.sweep[0], rank=args.rank,
                       roles=args.roles, group=args.group, space=args.space, calib=args.calib,
                       calib_tokens=args.calib_tokens, sequential=args.sequential, refit=args.refit,
                       dense=args.dense, cache=not args.no_cache, dtype=args.dtype, allocate=args.allocate)


def _stage_progress(enabled: bool):
    """A rich progress bar with one task per stage (calibrate, factorise, ...), or (None, None)."""
    if not enabled or not sys.stderr.isatty():
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=True)
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)

    return bar, update


def run_share(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from flowgeom.compress.run import share_model

    if args.sweep and (args.rank is not None or args.budget is not None or args.dense):
        raise FlowgeomError("--sweep takes its budgets itself: drop --budget/--rank/--dense (or drop --sweep)")
    if args.heal is not None and (args.sweep or args.dense):
        raise FlowgeomError("--heal trains the factors (or the blocks left after dropping): drop --sweep/--dense, "
                            "or drop --heal")
    config = _share_config(args)  # every option checked before any work
    healing = None
    if args.heal is not None:
        from flowgeom.cli.compress import heal_config, heal_printer

        healing = heal_config(args, args.heal)
    bar, update = _stage_progress(not args.json)
    with bar if bar is not None else nullcontext():
        if args.sweep:
            from flowgeom.compress.sweep import sweep_budgets

            result = sweep_budgets(args.source, Path(args.out), config, args.sweep, force=args.force,
                                   eval_tokens=args.eval_tokens, progress=update)
        else:
            result = share_model(args.source, Path(args.out), config, force=args.force, progress=update).report
            if healing is not None:
                from flowgeom.compress.heal import heal_folder

                result["heal"] = heal_folder(Path(args.out), Path(args.out), healing, in_place=True,
                                             progress=update, on_eval=heal_printer(not args.json))
    if args.json:
        print_json(result)
    elif args.sweep:
        _print_sweep(result)
    elif "dropped" in result:
        console().print(f"{result['source']} -> {result['out']}: {result['method']} dropped blocks "
                        f"{result['dropped']} ({result['layers']} left): {100 * result['scope_saved_fraction']:.2f}% "
                        f"of the projections saved, asked {100 * result['budget']:g}%; {result['seconds']:.1f} s")
    else:
        _print_share(result)
    return 0


def _print_share(report: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    how = (f"rank {report['rank']}" if report["budget"] is None else f"budget {100 * report['budget']:g}% asked")
    table = Table(title=f"{escape(report['source'])} -> {escape(report['out'])} ({report['format']}): "
                        f"{report['method']}, {how}")
    for col in ("role", "space", "shape", "groups", "rank", "dense", "stored", "saved", "rel. error"):
        table.add_column(col, justify="left" if col in ("role", "space") else "right")
    for role, r in report["roles"].items():
        sizes = sorted({len(g) for g in r["groups"]})
        rank = str(r["rank"]) if r["rank"] is not None else "{}-{}".format(*r["rank_range"])
        table.add_row(role, r["space"], "×".join(map(str, r["shape"])), "/".join(map(str, sizes)) + " layers",
                      rank, f"{r['dense_params']:,}", f"{r['stored_params']:,}",
                      f"{100 * r['saved_fraction']:.1f}%", f"{r['rel_error_mean']:.3f}")
    out = console()
    out.print(table)
    got = report["scope_saved_fraction"]
    if report["budget"] is not None:
        line = f"asked {100 * report['budget']:.1f}%, obtained {100 * got:.2f}% of the projections"
        if abs(got - report["budget"]) > BUDGET_TOL:
            out.print(f"[bold red]BUDGET NOT MET[/]: {line} (rank steps of these shapes); see the per-role column")
        else:
            out.print(line)
        off = [f"{role} {100 * r['saved_fraction']:.1f}%" for role, r in report["roles"].items()
               if report["method"] != "continuity" and abs(r["saved_fraction"] - report["budget"]) > BUDGET_TOL]
        if off:
            out.print(f"[bold yellow]per role, asked {100 * report['budget']:g}% but obtained:[/] {', '.join(off)}")
    for note in report["notes"]:
        out.print(f"note: {escape(note)}")
    if report.get("calib"):
        out.print(f"calibration: {report['calib_tokens']:,} tokens of {escape(report['calib'])}"
                  f"{' (cached)' if report['calib_cached'] else ''}, {report['calib_seconds']:.1f} s")
    out.print(f"parameters saved: {report['saved_params']:,} of {report['model_params']:,} "
              f"({100 * report['saved_fraction']:.1f}% of the model; bases + coefficients counted); "
              f"{report['seconds']:.1f} s")


def _print_sweep(result: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"{escape(result['source'])}: {result['method']} sweep, held-out ppl "
                        f"({result['eval_tokens']:,} tokens; reference {result['reference_ppl']:.3f})")
    for col in ("budget asked", "saved", "ppl", "× reference"):
        table.add_column(col, justify="right")
    for row in result["points"]:
        table.add_row(f"{100 * row['budget']:g}%", f"{100 * row['saved_fraction']:.2f}%", f"{row['ppl']:.3f}",
                      f"{row['ppl_ratio']:.3f}")
    out = console()
    out.print(table)
    out.print(f"curve: {escape(result['json'])}; figure: {escape(result['figure'])}")


# ---------------------------------------------------------------- evaluate

def run_evaluate(args: argparse.Namespace) -> int:
    from contextlib import nullcontext

    from flowgeom.compress.evaluate import compare_models
    from flowgeom.compress.perplexity import QUICK_TOKENS, EvalConfig

    max_tokens = args.tokens or (None if args.full else QUICK_TOKENS)
    config = EvalConfig(context=args.context, stride=args.stride, max_tokens=max_tokens, batch=args.batch)
    bar, update = _stage_progress(not args.json)
    with bar if bar is not None else nullcontext():
        result = compare_models([args.source, *(args.compare or [])], text=args.text, config=config,
                                device=resolve_device(args.device), out=args.out, progress=update)
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
    for col in ("model", "ppl", "× first", "nll", "params saved", "MB on disk", "seconds"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for row in result["models"]:
        saved = row.get("saved_params")
        table.add_row(escape(row["model"]), f"{row['ppl']:.3f}", f"{row['ppl_ratio']:.3f}", f"{row['nll']:.4f}",
                      "-" if saved is None else f"{saved:,}", f"{row['bytes_on_disk'] / 1e6:.0f}",
                      f"{row['seconds']:.1f}")
    console().print(table)


# ---------------------------------------------------------------- registration

def register_verbs(verbs) -> None:
    """Add ``share`` and ``evaluate`` to the ``continuity`` area's verb sub-parsers."""
    p = command(verbs, "share", help="compress a Llama's projections (calibrated low rank, shared bases) into a "
                                     "factored checkpoint",
                example="flowgeom continuity share builtin:smollm2 --out runs/w20 --budget 0.2     # whiten\n"
                        "flowgeom continuity share builtin:smollm2 --out runs/c20 --method continuity --budget 0.2\n"
                        "flowgeom continuity share builtin:smollm2 --out runs/bs --method basis-sharing --budget 0.2\n"
                        "flowgeom continuity share model.gguf --out runs/w --method whiten --budget 0.2 --sequential\n"
                        "flowgeom continuity share builtin:smollm2 --out runs/sw --sweep 0.1,0.2,0.3",
                func=run_share)
    p.add_argument("source",
                   help="Llama checkpoint: .gguf, builtin:smollm2, or an HF folder (config.json + safetensors)")
    p.add_argument("--out", required=True, help="new folder for the checkpoint (refused inside the source)")
    p.add_argument("--method", choices=METHODS, default="whiten",
                   help="svd: data-free per layer (the floor); whiten: SVD-LLM per layer (default: the lowest "
                        "perplexity measured on SmolLM2, docs/continuity-sharing.md); basis-sharing: Wang et "
                        "al. 2025 (q,k,v,gate,up shared in input space over --group layers); share: whitened "
                        "sharing in --space; continuity: each role's space and which adjacent layers share, "
                        "from the measured continuity; drop-angular / drop-bi: drop whole blocks (Gromov et al. "
                        "2024 / ShortGPT), a plain Llama with fewer layers; mixed: drop n blocks (angular) and "
                        "low-rank the rest to the budget, n chosen by measured calibration loss")
    p.add_argument("--roles", type=comma_list(ROLES, what="role"), default=ROLES,
                   help="roles to compress, comma-separated (default all seven)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--budget", type=finite_float(0.0, 1.0, lo_open=True, hi_open=True), metavar="FRACTION",
                      help="fraction of the roles' parameters to save, bases + coefficients counted (default 0.2)")
    size.add_argument("--rank", type=positive_int, help="instead of --budget: one rank for every basis")
    p.add_argument("--sweep", type=_budgets, metavar="B1,B2,...",
                   help="compress at each budget, score held-out perplexity, write the curve (sweep.json, "
                        "sweep.png) to --out instead of a checkpoint")
    p.add_argument("--eval-tokens", type=bounded_int(2), default=4096,
                   help="held-out KJV tokens scored per --sweep point (default 4096)")
    p.add_argument("--group", type=positive_int(maximum=MAX_LAYERS), default=2,
                   help="adjacent layers per shared basis for basis-sharing and share, 1..the model's layers "
                        f"(at most {MAX_LAYERS}; default 2)")
    p.add_argument("--space", choices=("auto", "seed", "opposite", "input", "output"),
                   help="--method share only: seed (q,k,gate,up input; o,down output; v per layer, default), "
                        "opposite, one space for all, or auto (the analyzer's measurement)")
    p.add_argument("--calib", default="kjv", metavar="TEXT",
                   help="calibration text: kjv (train split of the shipped KJV, default) or a UTF-8 file")
    p.add_argument("--calib-tokens", type=positive_int, default=DEFAULT_CALIB_TOKENS,
                   help=f"calibration tokens (default {DEFAULT_CALIB_TOKENS:,}: more than 10x the widest "
                        "projection input of SmolLM2, so every Gram is full rank and well conditioned)")
    p.add_argument("--sequential", action="store_true",
                   help="calibrate each group on the already-compressed earlier layers (SVD-LLM / Basis Sharing)")
    p.add_argument("--allocate", choices=("even", "loss"),
                   help="ranks: even (the rank rule per role) or loss (every whitened singular component scored by "
                        "the calibration loss it costs, selected model-wide at the budget; a projection stays dense "
                        "where factoring saves nothing). Default: loss for calibrated methods (measured better, "
                        "docs/continuity-sharing.md), even for svd and --rank")
    p.add_argument("--refit", action="store_true",
                   help="re-solve shared coefficients by least squares against each layer's own Gram")
    p.add_argument("--dense", action="store_true", help="write plain Llama weights instead of bases + coefficients")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="storage of the factored folder's tensors (norms stay float32); float16 halves the file "
                        "(default float32)")
    p.add_argument("--no-cache", action="store_true", help="measure the calibration Grams again (not from the cache)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out folder")
    p.add_argument("--heal", type=positive_int, metavar="TOKENS",
                   help="then heal the result by distillation on TOKENS healing tokens (flowgeom compress heal; "
                        "its options below)")
    from flowgeom.cli.compress import add_heal_flags

    add_heal_flags(p, tokens_flag=None)
    add_threads(p)
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
    p.add_argument("--text", default="kjv", help="kjv (held-out split: last 5%% of verses, default), fortunes "
                        "(out-of-domain English quotes, 660k tokens) or a text file")
    p.add_argument("--out", metavar="FILE", help="also write the JSON result to FILE (atomically)")
    add_device(p)
    add_threads(p, also="on a shared, loaded machine --threads 1 can be many times faster")
    add_json(p)
