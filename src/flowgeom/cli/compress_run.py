"""``flowgeom compress run|sweep|evaluate``: compress a model, sweep budgets, judge by perplexity.

``register_verbs(verbs)`` adds the verbs to the ``compress`` area (see
:mod:`flowgeom.cli.compress`, which adds ``heal``). The maths lives in
:mod:`flowgeom.compress.run` and :mod:`flowgeom.compress.perplexity`;
this module parses, validates, calls and prints. See docs/compression.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flowgeom.cli._common import (
    add_device, add_json, add_threads, bounded_int, command, comma_list, console, finite_float,
    positive_int, print_json, resolve_device,
)
from flowgeom.cli.compress_heal import add_heal_flags, heal_config, heal_printer
from flowgeom.cli.progress import stage_progress
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


def _compression_config(args: argparse.Namespace, *, budget: float | None, rank: int | None = None,
                        dense: bool = False):
    from flowgeom.compress.run import CompressionConfig

    return CompressionConfig(method=args.method, budget=budget, rank=rank, roles=args.roles, group=args.group,
                             space=args.space, calib=args.calib, calib_tokens=args.calib_tokens,
                             sequential=args.sequential, refit=args.refit, dense=dense, cache=not args.no_cache,
                             dtype=args.dtype, allocate=args.allocate, max_flops=args.max_flops)


def run_compress(args: argparse.Namespace) -> int:
    from flowgeom.compress.run import run_compression

    if args.heal is not None and args.dense:
        raise FlowgeomError("--heal trains the factors (or the blocks left after dropping): drop --dense, or drop "
                            "--heal")
    budget = None if args.rank is not None else (0.2 if args.budget is None else args.budget)
    config = _compression_config(args, budget=budget, rank=args.rank, dense=args.dense)  # every option checked first
    from flowgeom.compress.stream import stream_by_default, stream_compression  # one block in memory at a time

    stream = stream_by_default(args.source, asked=args.stream, heal=args.heal is not None)
    healing = None
    if args.heal is not None:
        healing = heal_config(args, args.heal)
    with stage_progress(not args.json) as update:
        if stream:
            result = stream_compression(args.source, Path(args.out), config, force=args.force, progress=update)
        else:
            result = run_compression(args.source, Path(args.out), config, force=args.force, progress=update).report
        if healing is not None:
            from flowgeom.compress.heal import heal_folder

            result["heal"] = heal_folder(Path(args.out), Path(args.out), healing, in_place=True,
                                         progress=update, on_eval=heal_printer(not args.json))
    if args.json:
        print_json(result)
    elif "dropped" in result:
        console().print(f"{result['source']} -> {result['out']}: {result['method']} dropped blocks "
                        f"{result['dropped']} ({result['layers']} left): {100 * result['scope_saved_fraction']:.2f}% "
                        f"of the projections saved, asked {100 * result['budget']:g}%; {result['seconds']:.1f} s")
    else:
        _print_run(result)
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    from flowgeom.compress.sweep import sweep_budgets

    from flowgeom.compress.agreement import GenerationConfig

    config = _compression_config(args, budget=args.budgets[0])  # every option checked before any work
    judge = None if args.no_generation else GenerationConfig(prompts=args.prompts)
    healing = None
    if args.heal is not None:
        healing = heal_config(args, args.heal)
    with stage_progress(not args.json) as update:
        result = sweep_budgets(args.source, Path(args.out), config, args.budgets, force=args.force,
                               eval_tokens=args.eval_tokens, progress=update, judge=judge, heal=healing)
    return _show(args, result, _print_sweep)


def _show(args: argparse.Namespace, result: dict, table) -> int:
    """``--json``: the result as JSON on stdout; else its table."""
    if args.json:
        print_json(result)
    else:
        table(result)
    return 0


def _print_run(report: dict) -> None:
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
    judged = result.get("judge") is not None
    cols = ("budget asked", "saved", "ppl", "× reference") + (("top-1 agree", "loops", "distinct-2", "targets")
                                                               if judged else ())
    for col in cols:
        table.add_column(col, justify="right")
    for row in result["points"]:
        cells = [f"{100 * row['budget']:g}%", f"{100 * row['saved_fraction']:.2f}%", f"{row['ppl']:.3f}",
                 f"{row['ppl_ratio']:.3f}"]
        if judged:
            missed = [k for k, ok in row["targets"].items() if k != "all" and not ok]
            cells += [f"{row['agreement']['top1']:.1%}", f"{row['generation']['loop_fraction']:.0%}",
                      f"{row['generation']['distinct2']:.2f}", "met" if not missed else "missed: " + ", ".join(missed)]
        table.add_row(*cells)
    out = console()
    out.print(table)
    if judged:
        j = result["judge"]
        ref = j["reference_generation"]
        out.print(f"judged against the dense model on {escape(j['text'])} ({j['prompts']} prompts x {j['new_tokens']} "
                  f"greedy tokens; dense: loops {ref['loop_fraction']:.0%}, distinct-2 {ref['distinct2']:.2f}); "
                  f"{'healed ' + format(result['healed'], ',') + ' tokens each' if result['healed'] else 'not healed'}"
                  "; targets: top-1 >= 80%, loops <= dense + 10 points, distinct-2 >= 0.9x dense")
        rec = result["recommended"]
        out.print(f"recommended budget: {100 * rec:g}%" if rec is not None else
                  "[bold yellow]no budget meets the targets[/]: heal longer (--heal TOKENS) or sweep smaller budgets")
    out.print(f"curve: {escape(result['json'])}; figure: {escape(result['figure'])}")


# ---------------------------------------------------------------- evaluate

def run_evaluate(args: argparse.Namespace) -> int:
    from flowgeom.compress.evaluate import compare_models
    from flowgeom.compress.perplexity import QUICK_TOKENS, EvalConfig

    from flowgeom.compress.agreement import GenerationConfig

    max_tokens = args.tokens or (None if args.full else QUICK_TOKENS)
    config = EvalConfig(context=args.context, stride=args.stride, max_tokens=max_tokens, batch=args.batch)
    generation = None if args.no_generation else GenerationConfig(prompts=args.prompts, new_tokens=args.new_tokens,
                                                                 text=args.prompt_text)
    with stage_progress(not args.json) as update:
        result = compare_models([args.source, *(args.compare or [])], text=args.text, config=config,
                                device=resolve_device(args.device), out=args.out, progress=update,
                                generation=generation, generate=args.generate or ())
    return _show(args, result, _print_evaluate)


def _print_evaluate(result: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    cfg = result["config"]
    table = Table(title=f"perplexity on {escape(result['text'])} {escape(result['split'])}: "
                        f"{result['models'][0]['targets']:,} targets, context {cfg['context']}, stride {cfg['stride']}")
    for col in ("model", "ppl", "× first", "nll", "params saved", "stored", "weights MB", "× dense bytes",
                "seconds"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for row in result["models"]:
        saved = row.get("saved_params")
        table.add_row(escape(row["model"]), f"{row['ppl']:.3f}", f"{row['ppl_ratio']:.3f}", f"{row['nll']:.4f}",
                      "-" if saved is None else f"{saved:,}", row["stored"], f"{row['weight_bytes'] / 1e6:.0f}",
                      "-" if row["stored"] == "gguf" else f"{row['bytes_ratio']:.3f}", f"{row['seconds']:.1f}")
    console().print(table)
    _print_agreement(result)
    first = result["models"][0]
    console().print(f"× dense bytes: weight files against the first model's {first['params']:,} parameters stored "
                    "densely in the same dtype" + (f"; {escape(first['model'])} itself is a quantised GGUF of "
                                                    f"{first['weight_bytes'] / 1e6:.0f} MB, which a float "
                                                    "compressed folder does not undercut"
                                                    if first["stored"] == "gguf" else ""))


def _print_agreement(result: dict) -> None:
    """Agreement with the first model and generation health; each model's continuation of --generate prompts."""
    from rich.markup import escape
    from rich.table import Table

    rows, gen = result["models"], result.get("generation")
    if gen is not None or len(rows) > 1:
        title = "agreement with the first model (teacher-forced on the same windows)"
        if gen is not None:
            title += (f"; greedy generation: {gen['prompts']} {escape(gen['text'])} prompts x {gen['new_tokens']} "
                      f"tokens, loop = a {gen['loop_ngram']}-gram >= {gen['loop_repeats']} times")
        table = Table(title=title)
        for col in ("model", "top-1 agree", "KL nats", "loops", "distinct-2", "prefix tokens"):
            table.add_column(col, justify="left" if col == "model" else "right")
        for row in rows:
            agree, health = row.get("agreement"), row.get("generation") or {}
            prefix = health.get("prefix_agreement")
            table.add_row(escape(row["model"]), "-" if agree is None else f"{agree['top1']:.1%}",
                          "-" if agree is None else f"{agree['kl']:.3f}",
                          f"{health['loop_fraction']:.0%}" if health else "-",
                          f"{health['distinct2']:.2f}" if health else "-",
                          "-" if prefix is None else f"{prefix:.1f}")
        console().print(table)
    for i, prompt in enumerate(result.get("generate_prompts") or []):
        table = Table(title=f"greedy continuations of {prompt!r}", show_lines=True)
        table.add_column("model")
        table.add_column("continuation")
        for row in rows:
            table.add_row(escape(row["model"]), escape(row["generate"][i]))
        console().print(table)


# ---------------------------------------------------------------- registration

def add_method_flags(p: argparse.ArgumentParser) -> None:
    """How to compress: the flags ``run`` and ``sweep`` share (``run`` adds the size, ``--dense`` and ``--heal``)."""
    p.add_argument("source",
                   help="causal LM: .gguf, builtin:smollm2, or an HF folder (config.json + safetensors) of Llama, "
                        "Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Phi-3, GPT-2, GPT-NeoX or Falcon")
    p.add_argument("--method", choices=METHODS, default="whiten",
                   help="svd: data-free per layer (the floor); whiten: SVD-LLM per layer (default: the lowest "
                        "perplexity measured on SmolLM2, docs/compression.md); basis-sharing: Wang et "
                        "al. 2025 (q,k,v,gate,up shared in input space over --group layers); share: whitened "
                        "sharing in --space; continuity: each role's space and which adjacent layers share, "
                        "from the measured continuity; drop-angular / drop-bi: drop whole blocks (Gromov et al. "
                        "2024 / ShortGPT), a plain Llama with fewer layers; mixed: drop n blocks (angular) and "
                        "low-rank the rest to the budget, n chosen by measured calibration loss (drop-*, mixed: "
                        "Llama only)")
    p.add_argument("--roles", type=comma_list(ROLES, what="role"), default=ROLES,
                   help="roles to compress, comma-separated (default all seven)")
    p.add_argument("--group", type=positive_int(maximum=MAX_LAYERS), default=2,
                   help="adjacent layers per shared basis for basis-sharing and share, 1..the model's layers "
                        f"(at most {MAX_LAYERS}; default 2)")
    p.add_argument("--space", choices=("auto", "seed", "opposite", "input", "output"),
                   help="--method share only: seed (q,k,gate,up input; o,down output; v per layer, default), "
                        "opposite, one space for all, or auto (the analyzer's measurement)")
    p.add_argument("--calib", default="kjv+pydoc", metavar="TEXT",
                   help="calibration text: the train split of kjv (the shipped KJV), pydoc (the Python reference's "
                        "prose), a mix of them (default kjv+pydoc: measured better out of domain, "
                        "docs/compression.md), or a UTF-8 file")
    p.add_argument("--calib-tokens", type=positive_int, default=DEFAULT_CALIB_TOKENS,
                   help=f"calibration tokens (default {DEFAULT_CALIB_TOKENS:,}: more than 10x the widest "
                        "projection input of SmolLM2, so every Gram is full rank and well conditioned)")
    p.add_argument("--sequential", action="store_true",
                   help="calibrate each group on the already-compressed earlier layers (SVD-LLM / Basis Sharing)")
    p.add_argument("--allocate", choices=("even", "loss"),
                   help="ranks: even (the rank rule per role) or loss (every whitened singular component scored by "
                        "the calibration loss it costs, selected model-wide at the budget; a projection stays dense "
                        "where factoring saves nothing). Default: loss for calibrated methods (measured better, "
                        "docs/compression.md), even for svd and --rank")
    p.add_argument("--max-flops", type=finite_float(0.0, 1.0, lo_open=True), default=1.0, metavar="FRACTION",
                   help="with loss allocation: keep dense every projection whose factors would run more than "
                        "FRACTION of its dense flops (two thin GEMMs run below one square GEMM's rate); default 1.0")
    p.add_argument("--refit", action="store_true",
                   help="re-solve shared coefficients by least squares against each layer's own Gram")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                   help="storage of the factored folder's tensors (norms stay float32); float16 halves the file "
                        "(default float32)")
    p.add_argument("--no-cache", action="store_true", help="measure the calibration Grams again (not from the cache)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out folder")


def register_verbs(verbs) -> None:
    """Add ``run``, ``sweep`` and ``evaluate`` to the ``compress`` area's verb sub-parsers."""
    p = command(verbs, "run", help="compress a model's projections (calibrated low rank, shared bases, dropped "
                                   "blocks) into a new folder, optionally healed",
                example="flowgeom compress run builtin:smollm2 --out runs/c20 --budget 0.2     # whiten, loss ranks\n"
                        "flowgeom compress run builtin:smollm2 --out runs/c20 --budget 0.2 --heal 102400\n"
                        "flowgeom compress run builtin:smollm2 --out runs/bs --method basis-sharing --budget 0.2\n"
                        "flowgeom compress run model.gguf --out runs/w --method whiten --budget 0.2 --sequential",
                func=run_compress)
    add_method_flags(p)
    p.add_argument("--out", required=True, help="new folder for the checkpoint (refused inside the source)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--budget", type=finite_float(0.0, 1.0, lo_open=True, hi_open=True), metavar="FRACTION",
                      help="fraction of the roles' parameters to save, bases + coefficients counted (default 0.2)")
    size.add_argument("--rank", type=positive_int, help="instead of --budget: one rank for every basis")
    p.add_argument("--dense", action="store_true", help="write the family's plain weights (a standard folder) instead of bases + coefficients")
    p.add_argument("--stream", action="store_true",
                   help="compress a Llama larger than memory one decoder block at a time (an HF folder of sharded "
                        "safetensors; --method svd or whiten, even ranks); the default when the model's float32 "
                        "size exceeds the available memory")
    p.add_argument("--heal", type=positive_int, metavar="TOKENS",
                   help="then heal the result by distillation on TOKENS healing tokens (flowgeom compress heal; "
                        "its options below)")
    add_heal_flags(p, tokens_flag=None)
    add_threads(p)
    add_json(p)

    p = command(verbs, "sweep", help="compress at several budgets with one calibration and plot held-out "
                                     "perplexity against parameters saved",
                example="flowgeom compress sweep builtin:smollm2 --out runs/sweep --budgets 0.1,0.2,0.3\n"
                        "flowgeom compress sweep builtin:smollm2 --out runs/drop --method drop-angular "
                        "--budgets 0.1,0.2",
                func=run_sweep)
    add_method_flags(p)
    p.add_argument("--out", required=True, help="new folder for the curve (sweep.json, sweep.png)")
    p.add_argument("--budgets", type=_budgets, required=True, metavar="B1,B2,...",
                   help="fractions of the roles' parameters to save, one point each")
    p.add_argument("--eval-tokens", type=bounded_int(2), default=4096,
                   help="held-out KJV tokens scored per point, and out-of-domain tokens for agreement (default 4096)")
    p.add_argument("--prompts", type=bounded_int(1, 4096), default=24, metavar="N",
                   help="out-of-domain prompts whose greedy continuations judge each point (default 24)")
    p.add_argument("--no-generation", action="store_true", help="perplexity only: no agreement, no generation")
    p.add_argument("--heal", type=positive_int, metavar="TOKENS",
                   help="write each point to OUT-b<budget>/ and heal it on TOKENS tokens before judging it")
    add_heal_flags(p, tokens_flag=None)
    add_threads(p)
    add_json(p)

    p = command(verbs, "evaluate", help="perplexity, agreement with the first model and generation health of models "
                                         "on held-out text (KJV test split by default)",
                example="flowgeom compress evaluate builtin:smollm2 --compare runs/c20     # quick, ~4k tokens\n"
                        "flowgeom compress evaluate builtin:smollm2 --compare runs/c20 --text fortunes --full\n"
                        "flowgeom compress evaluate builtin:smollm2 --full --context 1024 --json\n"
                        "flowgeom compress evaluate builtin:smollm2 --compare runs/c20 --generate 'Once upon a time'",
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
                        "(out-of-domain English quotes, 660k tokens), pydoc (its test split) or a text file")
    p.add_argument("--prompts", type=bounded_int(1, 4096), default=24, metavar="N",
                   help="held-out prompts (the first 8 words of paragraphs of --prompt-text) continued greedily "
                        "to judge generation: loops, distinct-2, prefix shared with the first model (default 24)")
    p.add_argument("--no-generation", action="store_true", help="skip the generation health (perplexity and "
                   "teacher-forced agreement only)")
    p.add_argument("--new-tokens", type=bounded_int(1, 4096), default=48, metavar="N",
                   help="greedy tokens per prompt (default 48)")
    p.add_argument("--prompt-text", default="fortunes", metavar="TEXT",
                   help="where the prompts come from (default fortunes: out of domain, never calibrated or "
                        "healed on)")
    p.add_argument("--generate", action="append", metavar="PROMPT",
                   help="print every model's greedy continuation of PROMPT side by side (repeatable)")
    p.add_argument("--out", metavar="FILE", help="also write the JSON result to FILE (atomically)")
    add_device(p)
    add_threads(p, also="on a shared, loaded machine --threads 1 can be many times faster")
    add_json(p)
