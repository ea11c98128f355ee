"""``flowgeom continuity train|ablate|plot``: where continuity comes from (seed ``001_…``).

``register_verbs(verbs)`` adds the verbs to the ``continuity`` area's verb
sub-parsers (the area itself lives in :mod:`flowgeom.cli.continuity`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from flowgeom.cli._common import (
    add_device, add_json, add_scale, add_seed, add_threads, command, console, figure_path, positive_float,
    positive_int, print_json, resolve_device, step_size,
)
from flowgeom.cli._common import boolean
from flowgeom.cli._common import seed as seed_type
from flowgeom.errors import FlowgeomError


def _overrides(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _parse_sets(items: list[str] | None, config_cls: type) -> dict:
    """``--set KEY=VALUE`` pairs typed from ``config_cls``'s field annotations and checked like the flags.

    ``int`` fields take whole numbers >= 1 (``seed``: 0 <= seed < 2**63),
    ``float`` fields finite numbers > 0, ``bool`` fields true/false, and
    ``X | None`` fields also ``null``/``none``. Unknown keys are refused with
    the list of valid ones.
    """
    import dataclasses
    import typing

    from flowgeom.options import key_values

    hints = typing.get_type_hints(config_cls)
    what = config_cls.__name__.removesuffix("RunConfig") + " run option"  # "MLP run option"
    pairs = key_values(items, flag="--set", example="--set width=64", what=what,
                       known=[f.name for f in dataclasses.fields(config_cls)])
    return {key: _typed_value(key, text, hints[key]) for key, text in pairs.items()}


def _typed_value(key: str, text: str, hint):
    """``text`` converted to the field type ``hint`` (FlowgeomError naming the key, the value and the type)."""
    import types
    import typing

    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else ()
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if optional and text.lower() in ("null", "none"):
        return None
    kind = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}.get(base, str(base))
    kind += " or null" if optional else ""
    try:
        if base is bool:
            return boolean(text)
        if base is int:
            return (seed_type if key == "seed" else positive_int)(text)
        if base is float:
            return positive_float(text)
        if base is str:
            if not text:
                raise argparse.ArgumentTypeError("empty")
            return text
    except argparse.ArgumentTypeError as exc:
        raise FlowgeomError(f"--set {key}={text}: {exc}; {key} takes {kind}") from None
    raise FlowgeomError(f"--set {key}: fields of type {base} cannot be set from the command line")


def _typed_sets(args: argparse.Namespace, config_cls: type) -> dict:
    sets = _parse_sets(args.sets, config_cls)
    if "device" in sets:
        resolve_device(sets["device"])
    return sets


def _shown(row: dict) -> dict:
    """A table row with metrics stored as null (NaN in the run) shown as nan instead of crashing the format."""
    return {k: math.nan if v is None else v for k, v in row.items()}


def _raise_unfinished(summary: dict | None, out: str) -> None:
    """One error line (exit 2) for a run that stopped early (NaN loss, blow-up): no table, no partial result."""
    status = (summary or {}).get("status", "unfinished")
    if status != "finished":
        message = (summary or {}).get("message") or f"the run ended with status {status!r}"
        raise FlowgeomError(f"training stopped at step {(summary or {}).get('step', '?')}: {message}; "
                            f"metrics up to there are in {out}")


def _common_run_options(p: argparse.ArgumentParser) -> None:
    add_scale(p, {"quick": "laptop scale: minutes on 2 cores",
                  "cpu": "fits 2 CPU cores: MLP 16x256 on all MNIST, 8000 steps (~6 min); LM 6.3M params, 1000 steps "
                         "(~30 min)",
                  "full": "the seed's configuration (GPU for the LM)"}, preset_alias=True)
    p.add_argument("--out", required=True, help="run folder (created; refused if it holds a run, unless --resume)")
    p.add_argument("--resume", action="store_true", help="continue a killed run from its last checkpoint")
    p.add_argument("--steps", type=positive_int(maximum=10**9), help="number of updates >= 1 (default: the preset's)")
    p.add_argument("--lr", type=step_size, help="learning rate in (0, 1e6] (default: the preset's)")
    p.add_argument("--optimizer", choices=("sgd", "adam", "adam_b2_0"), help="optimiser (default adam)")
    p.add_argument("--log-every", dest="log_every", type=positive_int, help="measure continuity every N >= 1 steps")
    add_threads(p)
    p.add_argument("--set", dest="sets", action="append", metavar="KEY=VALUE",
                   help="any other config field, e.g. --set width=64 --set train_limit=5000 (repeatable)")
    add_seed(p)
    add_device(p)
    add_json(p)


def train(args: argparse.Namespace) -> int:
    resolve_device(args.device)
    opts = {**_overrides(args, ("steps", "lr", "optimizer", "log_every")), "seed": args.seed, "device": args.device}
    if args.model == "mlp":
        from flowgeom.experiments.continuity_mlp import (
            MLPRunConfig, format_ablation, summarise_run, train_mlp, variant_config,
        )
        from flowgeom.runs import RunFolder

        opts |= _typed_sets(args, MLPRunConfig)
        cfg = variant_config(args.variant, args.scale, **opts, **_overrides(args, ("mnist_path",)))
        summary = train_mlp(cfg, args.out, resume=args.resume)
        _raise_unfinished(summary, args.out)
        row = summarise_run(RunFolder(args.out))
        if args.json:
            print_json({"summary": summary, "row": row})
        else:
            console().print(format_ablation([_shown(row)]), markup=False)
        return 0
    from flowgeom.experiments.continuity_lm import LMRunConfig, lm_config, projection_pattern, train_lm
    from flowgeom.runs import RunFolder

    opts |= _typed_sets(args, LMRunConfig)
    cfg = lm_config(args.scale, **opts, **_overrides(args, ("data", "mlp")))
    summary = train_lm(cfg, args.out, resume=args.resume)
    _raise_unfinished(summary, args.out)
    pattern = projection_pattern(RunFolder(args.out).metrics())
    if args.json:
        print_json({"summary": summary, "pattern": pattern})
    else:
        console().print(format_pattern(pattern), markup=False)
    return 0


def format_pattern(pattern: dict) -> str:
    """Plain-text projection table: final v1/u1 (× chance), verdict vs seed, formation."""
    short = {"input-continuous": "input", "output-continuous": "output", "input+output-continuous": "in+out",
             "neither": "neither"}
    head = (f"{'role':<6}{'v1':>7}{'×':>6}{'u1':>7}{'×':>6}  {'ours':<8}{'seed':<7}"
            f"{'g_v1@0':>8}{'g_u1@0':>8}{'ΔW v1':>7}{'ΔW u1':>7}{'|ΔW|/|W0|':>10}{'step≥1':>8}")
    lines = [head, "-" * len(head)]
    for role, p in pattern.items():
        lines.append(f"{role:<6}{p['v1']:>7.3f}{p['v1_x']:>6.1f}{p['u1']:>7.3f}{p['u1_x']:>6.1f}  {short[p['verdict']]:<8}"
                     f"{p['seed']:<7}{p['grad_v1_init']:>8.3f}{p['grad_u1_init']:>8.3f}{p['delta_v1']:>7.3f}"
                     f"{p['delta_u1']:>7.3f}{p['dw_ratio']:>10.2f}{str(p['step_dw1']):>8}")
    return "\n".join(lines)


def ablate(args: argparse.Namespace) -> int:
    from flowgeom.experiments.continuity_mlp import CORE, VARIANTS, ablation_figure, format_ablation, run_ablation

    resolve_device(args.device)
    if args.variants == "core":
        variants = CORE
    elif args.variants == "all":
        variants = tuple(VARIANTS)
    else:
        variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
        twice = sorted({v for v in variants if variants.count(v) > 1})
        if not variants or twice:
            raise FlowgeomError(f"--variants {args.variants!r}: " + (f"{twice[0]!r} given twice" if twice else "empty")
                                + "; give core, all or distinct names like NoRes,Res+ReLU")
    from flowgeom.experiments.continuity_mlp import MLPRunConfig

    opts = {**_overrides(args, ("steps", "lr", "optimizer", "log_every", "mnist_path")), "seed": args.seed,
            "device": args.device, **_typed_sets(args, MLPRunConfig)}
    rows = run_ablation(args.out, preset=args.scale, variants=variants, resume=args.resume, **opts)
    figure = ablation_figure(args.out, variants, args.figure or Path(args.out) / "ablation.png")
    from flowgeom.runs import atomic_write_json

    atomic_write_json(Path(args.out) / "ablation.json", {"rows": rows, "figure": str(figure)}, root=args.out)
    if args.json:
        print_json({"rows": rows, "figure": str(figure)})
    else:
        console().print(format_ablation([_shown(row) for row in rows]), markup=False)
        console().print(f"figure: {figure}", markup=False)
    stopped = [row for row in rows if row.get("status") != "finished"]
    if stopped:
        named = ", ".join(f"{r['variant']}: {r.get('status')}" for r in stopped)
        raise FlowgeomError(f"{len(stopped)} of {len(rows)} variants stopped early ({named}); their rows are "
                            f"marked in the table, their metrics are under {args.out}")
    return 0


def plot(args: argparse.Namespace) -> int:
    from flowgeom.experiments.continuity_figures import plot_roles
    from flowgeom.runs import RunFolder

    run = RunFolder(args.run)
    records = run.metrics()
    if not any("continuity" in r for r in records):
        raise FlowgeomError(f"{args.run} holds no continuity records; pass a folder written by `continuity train`")
    path = plot_roles(records, args.figure or run.figures / "continuity.png")
    print(path)
    return 0


def register_verbs(verbs) -> None:
    """Add ``train``, ``ablate`` and ``plot`` to the ``continuity`` area's verb sub-parsers."""
    p = command(verbs, "train", help="train a residual MLP (MNIST) or a small Llama LM with continuity tracking",
                example="flowgeom continuity train mlp --variant Res+None --out runs/res_none\n"
                        "flowgeom continuity train lm --quick --out runs/lm --mlp swiglu",
                func=train)
    p.add_argument("model", choices=("mlp", "lm"), help="residual MLP on MNIST or Llama-style LM on text")
    p.add_argument("--variant", default="Res+ReLU", help="MLP ablation variant (see `continuity ablate --help`)")
    p.add_argument("--mnist", dest="mnist_path", help="folder of MNIST IDX files (default: the shipped MNIST)")
    p.add_argument("--data", help="LM corpus: kjv (default) or a text file / WikiText-103 folder")
    p.add_argument("--mlp", choices=("swiglu", "gelu", "relu", "silu", "identity"), help="LM MLP (default swiglu)")
    _common_run_options(p)

    p = command(verbs, "ablate", help="residual-MLP ablation table on MNIST, next to the seed's claims",
                example="flowgeom continuity ablate --out runs/ablation           # core variants, quick\n"
                        "flowgeom continuity ablate --variants all --full --out runs/ablation_full",
                func=ablate)
    p.add_argument("--variants", default="core",
                   help="core | all | comma list of: Res+ReLU, Res+GELU, Res+SiLU, NoRes, Res+None, Res+Radial, Res+Radial-rms, "
                        "Res+ReLU+LN, Res+None+LN, 'Res+ReLU init0.5', 'Res+ReLU init2', 'Res+ReLU SGD', "
                        "'Res+ReLU Adam-b2=0'")
    p.add_argument("--mnist", dest="mnist_path", help="folder of MNIST IDX files (default: the shipped MNIST)")
    p.add_argument("--figure", type=figure_path, help="figure path (default OUT/ablation.png)")
    _common_run_options(p)

    p = command(verbs, "plot", help="plot tracked continuity against steps from a run folder",
                example="flowgeom continuity plot runs/lm --figure lm.png", func=plot)
    p.add_argument("run", help="run folder written by `continuity train`")
    p.add_argument("--figure", type=figure_path, help="output image (default RUN/figures/continuity.png)")


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone ``continuity`` parser with these verbs (tests; the lead wires the real one)."""
    parser = argparse.ArgumentParser(prog="flowgeom continuity")
    register_verbs(parser.add_subparsers(dest="verb", metavar="VERB"))
    return parser
