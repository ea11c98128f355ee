"""``flowgeom conserve run|scaling|drift``: drift of the conservation laws in real training and in saved checkpoints."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flowgeom.cli._common import (
    AppendDistinct, add_device, add_json, add_scale, add_seed, add_threads, area, bounded_int, command,
    console, nonneg_float, positive_int, print_json, resolve_device, step_size,
)
from flowgeom.errors import FlowgeomError

@contextmanager
def _progress(enabled: bool):
    """A rich status line on stderr (silent when stderr is not a terminal)."""
    from rich.console import Console

    if not enabled or not sys.stderr.isatty():
        yield lambda msg: None
        return
    with Console(stderr=True).status("starting") as status:
        yield lambda msg: status.update(msg)


@contextmanager
def _quiet_uncovered():
    """Hold back the FlowgeomWarnings of uncovered blocks: drift_cmd prints them once, after the series."""
    import warnings

    from flowgeom.laws.locate import FlowgeomWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlowgeomWarning)
        yield


def _check_device(args: argparse.Namespace) -> None:
    """Validate --device before any work (one clear error when CUDA is asked for but absent)."""
    resolve_device(args.device)


def _run_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The run-config fields the flags set (one flag, one field); the rest is the preset's."""
    changes = {"optimizer": args.optimizer, "weight_decay": args.weight_decay, "schedule": args.schedule,
               "device": args.device, "dtype": args.dtype, "patch": args.patch}
    for name in ("steps", "batch"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return changes


def run_cmd(args: argparse.Namespace) -> int:
    from flowgeom.experiments.conservation import ARCHS, PRESETS
    from flowgeom.experiments.conservation_grid import run_drift_grid
    from flowgeom.experiments.presets import preset as resolve

    _check_device(args)
    preset = resolve(PRESETS, args.scale)
    if args.arch == ["help"]:  # what the --arch help text promises: the list, then exit 0
        for name, spec in ARCHS.items():
            print(f"{name:24s} {spec['task']:4s} " + ", ".join(f"{k}={v}" for k, v in spec.items() if k != "task"))
        return 0
    archs = args.arch or [a for a in ARCHS if args.task in ("both", ARCHS[a]["task"])]
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise FlowgeomError(f"unknown --arch {unknown[0]!r}; choose from {', '.join(ARCHS)}")
    seeds = [args.seed + i for i in range(preset.seeds if args.seeds is None else args.seeds)]
    if seeds[-1] >= 2**63:
        raise FlowgeomError(f"--seed {args.seed} with --seeds {len(seeds)} reaches seed {seeds[-1]} >= 2**63; "
                            "lower --seed")
    with _progress(not args.json) as say:
        result = run_drift_grid(preset, args.out, archs=archs, lrs=args.lr, seeds=seeds,
                                regimes=None if args.regime == "both" else [args.regime], text=args.text,
                                images=args.images, resume=args.resume, progress=say, **_run_changes(args))
    rows, uncovered = result["runs"], result["uncovered"]
    if uncovered:  # once for the whole grid
        print("flowgeom: warning: not covered by any law, not measured: "
              + "; ".join(f"{u['block'] or '<model>'} ({u['reason']})" for u in uncovered), file=sys.stderr)
    if args.json:
        print_json(result)
    else:
        _print_runs(rows, result["figures"])
        console().print(result["verdict"]["line"], soft_wrap=True)
    diverged = [r for r in rows if r.get("diverged")]
    if diverged:
        raise FlowgeomError(f"{len(diverged)} of {len(rows)} runs diverged (kept, flagged in the table); first: "
                            f"{diverged[0]['message']}")
    return 0


def _print_runs(rows: list[dict[str, Any]], figures: dict[str, str]) -> None:
    from rich.table import Table

    from flowgeom.experiments.conservation_grid import mean_of

    table = Table(title="conservation drift ε at the last step (mean over families)")
    for col in ("regime", "arch", "lr", "seed", "loss", "ε laws", "worst law family", "ε controls", "ε refuted",
                "held"):
        table.add_column(col, justify="right" if col in ("lr", "seed", "loss") or col.startswith("ε") else "left")
    for r in rows:
        if r.get("diverged"):
            table.add_row(r["regime"], r["arch"], f"{r['lr']:g}", str(r["seed"]), "diverged", "", "", "", "", "")
            continue
        fam = {k: v for k, v in r.items() if k.startswith("eps/")}
        worst = max(fam, key=fam.get)
        refuted = mean_of(r, "refuted")
        table.add_row(r["regime"], r["arch"], f"{r['lr']:g}", str(r["seed"]), f"{r['loss']:.3f}",
                      f"{mean_of(r, 'eps'):.2e}", f"{worst[4:]} {fam[worst]:.2e}", f"{mean_of(r, 'control'):.2e}",
                      "" if refuted != refuted else f"{refuted:.2e}",
                      f"{sum(v['verdict'] == 'held' for v in r['verdicts'])}/{len(r['verdicts'])}")
    con = console()
    con.print(table)
    for regime, path in figures.items():
        con.print(f"figure ({regime}): {path}")


def scaling_cmd(args: argparse.Namespace) -> int:
    from flowgeom.experiments.presets import preset as resolve
    from flowgeom.experiments.scaling import PRESETS, run_scaling

    _check_device(args)
    changes: dict[str, Any] = {"seed": args.seed, "device": args.device}
    if args.arch:
        changes["archs"] = tuple(args.arch)
    if args.tau:
        changes["taus"] = tuple(args.tau)
    if args.steps is not None:
        changes["steps"] = args.steps
    if args.text:
        changes["data"] = args.text
    if args.decay_steps is not None:
        changes["decay_steps"] = args.decay_steps
    cfg = resolve(PRESETS, args.scale, **changes)
    with _progress(not args.json) as say:
        result = run_scaling(cfg, args.out, resume=args.resume, progress=say)
    if args.json:
        print_json(result)
    else:
        _print_scaling(result)
    return 0


def _fmt(fit: dict | None) -> str:
    if fit is None:
        return "at round-off (no slope)"
    return f"{fit['slope']:.3f}  95% CI [{fit['low']:.3f}, {fit['high']:.3f}]  (n={fit['n']}, r²={fit['r2']:.4f})"


def _print_scaling(result: dict[str, Any]) -> None:
    from rich.table import Table

    con = console()
    cfg = result["config"]
    table = Table(title=f"log-log slopes: ε vs τ at k={cfg['steps']} (laws ≈ 2, controls ≈ 1); "
                        f"ε vs k at τ={result['k_tau']:g} (≈ 1)")
    for col in ("arch", "quantity", "slope in τ", "slope in k"):
        table.add_column(col)
    for arch, r in result["archs"].items():
        for g, fit in r["tau_fits"].items():
            table.add_row(arch, g, _fmt(fit), _fmt(r["k_fits"].get(g)) if g in r["k_fits"] else "")
    con.print(table)
    s = result["schedules"]
    for name in ("constant", "inverse"):
        row = s[name]
        con.print(f"{s['arch']} τ0={s['tau0']:g} {name:8s}: ε(k/2)={row['eps_half']:.3e} ε(k)={row['eps_end']:.3e}  "
                  f"slope in k over the second half {_fmt(row['k_fit_second_half'])}")
    for arch, row in result["router"].items():
        con.print(f"router sum Σ_e W_e, {arch} ({row['key']}): slope in τ {_fmt(row['tau_fit'])}, "
                  f"max ε {row['max_eps']:.2e}")
    con.print(f"figure: {result['figure']}")


def drift_cmd(args: argparse.Namespace) -> int:
    from flowgeom.integrations.checkpoints import checkpoint_drift

    _check_device(args)
    with _progress(not args.json) as say, _quiet_uncovered():
        result = checkpoint_drift(args.checkpoints, config=args.config, optimizer_kind=args.optimizer,
                                  threshold=args.threshold, figure=args.figure, heads=args.heads,
                                  positions=args.positions, device=args.device, reference=args.reference,
                                  progress=say)
    if result["uncovered"]:
        print("flowgeom: warning: not covered by any law, not measured: "
              + "; ".join(f"{u['block'] or '<model>'} ({u['reason']})" for u in result["uncovered"]), file=sys.stderr)
    if args.json:
        print_json(result)
        return 0
    _print_drift(result)
    return 0


def _print_drift(result: dict[str, Any]) -> None:
    from rich.table import Table

    records = result["records"]
    families = sorted(k[4:] for k in records[-1] if k.startswith("eps/") and "@" not in k)
    table = Table(title=f"{result['model_type']}: ε of each law family against {result['against']} "
                        "(ε_law / ε_control in brackets)")
    table.add_column("step", justify="right")
    table.add_column("checkpoint")
    for fam in families:
        table.add_column(fam, justify="right")
    for r in records:
        cells = []
        for fam in families:
            ratio = r.get(f"ratio/{fam}")
            cells.append(f"{r[f'eps/{fam}']:.2e}" + ("" if ratio is None or ratio != ratio else f" [{ratio:.2g}]"))
        table.add_row(str(r["step"]), Path(r["checkpoint"]).name, *cells)
    con = console()
    con.print(table)
    for v in result["summary"]["verdicts"]:
        if v.get("basis") == "prediction":
            con.print(f"  {v['family']:22s} {v['verdict']:7s} measured ε = {v['eps']:.3e}, predicted (plain SGD, "
                      f"exact) {v['predicted']:.3e}; gap / round-off = {v['excess']:.2g}")
        else:
            con.print(f"  {v['family']:22s} {v['verdict']:7s} ε_law/ε_control = {v['ratio']:.3g}")
    con.print(result["summary"]["line"], soft_wrap=True)
    if "figure" in result:
        con.print(f"figure: {result['figure']}")


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid threshold {text!r}: a number in (0, 1), e.g. 0.1") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"threshold {value:g} must lie in (0, 1), e.g. 0.1")
    return value


SCALE_HELP = {"quick": "laptop-scale defaults (about a minute on 2 cores)",
              "cpu": "the quick models trained 20x longer, SGD only (~1 min a run on one core)",
              "full": "paper-scale configuration (GPU / cluster; give dataset paths)"}
SCALING_HELP = {"quick": "laptop-scale defaults (under a minute on 2 cores)",
                "cpu": "the same as --quick: short runs already resolve the slopes",
                "full": "every LM architecture, 7 step sizes, a 4-layer 128-wide model (GPU)"}


def _common(p: argparse.ArgumentParser, default_out: str, *, steps_type=positive_int(maximum=10**9),
            scale_help: dict[str, str] = SCALE_HELP) -> None:
    add_scale(p, scale_help)
    p.add_argument("--out", default=default_out, help=f"output folder (default {default_out})")
    p.add_argument("--resume", action="store_true", help="continue killed runs from their checkpoints; skip finished ones")
    add_seed(p, help="first random seed, 0 <= seed < 2**63 (default 0)")
    p.add_argument("--steps", type=steps_type, default=None, help="training steps per run (default: preset)")
    p.add_argument("--arch", action=AppendDistinct, help="architecture (repeatable, distinct); see `--arch help`")
    p.add_argument("--text", default=None, help="LM corpus: a text file or a WikiText-103/PTB folder (default: KJV)")
    add_threads(p, also="these small models usually run fastest with --threads 1")
    add_device(p)
    add_json(p)


def register(sub) -> None:
    verbs = area(sub, "conserve", "drift of the conservation laws in real training (seed 000)")
    p = command(verbs, "run", help="train LMs on text and ViTs on images; record ε(k) per law family with controls",
                example="flowgeom conserve run --quick --out runs/conserve\n"
                        "flowgeom conserve run --arch moe-dense-sigmoid --lr 0.1 --regime gd --steps 200\n"
                        "flowgeom conserve run --full --text data/wikitext-103 --images data/imagenet --patch 16 --out runs/paper",
                func=run_cmd)
    _common(p, "runs/conserve")
    p.add_argument("--task", choices=("lm", "vit", "both"), default="both", help="which models (default both)")
    p.add_argument("--lr", type=step_size, action=AppendDistinct,
                   help="step size τ in (0, 1e6] (repeatable, distinct; default: preset grid)")
    p.add_argument("--seeds", type=positive_int(maximum=10_000), default=None,
                   help="number of seeds from --seed, 1..10000 (default: preset)")
    p.add_argument("--regime", choices=("gd", "sgd", "both"), default="both",
                   help="full-batch GD, mini-batch SGD, or both (default)")
    p.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default="sgd",
                   help="sgd (the laws' setting); momentum/adam break the laws (default sgd)")
    p.add_argument("--weight-decay", type=nonneg_float, default=0.0, help="λ; also records the rescaled laws e^{dλt}·h")
    p.add_argument("--schedule", choices=("constant", "inverse"), default="constant", help="τ_k = τ or τ/(k+1)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="training precision (default float32)")
    p.add_argument("--batch", type=positive_int(maximum=65_536), default=None,
                   help="batch size, 1..65536 (= training set for gd; default 32)")
    p.add_argument("--patch", type=positive_int, default=7, help="ViT patch side; must divide the image side (default 7 for "
                                                        "MNIST; e.g. 8 for CIFAR-10, 16 for ImageNet 224)")
    p.add_argument("--images", default=None, help="ViT data: MNIST IDX, CIFAR-10 python or class folder (default: MNIST)")
    p = command(verbs, "scaling", help="fit the O(τ²k) law: slopes of ε in τ and k with 95%% CIs, and the router sums",
                example="flowgeom conserve scaling --quick --out runs/scaling\n"
                        "flowgeom conserve scaling --arch moe-dense-sigmoid --tau 0.04 --tau 0.02 --tau 0.01 --json",
                func=scaling_cmd)
    _common(p, "runs/scaling", steps_type=bounded_int(3, 10**9), scale_help=SCALING_HELP)
    p.add_argument("--tau", type=step_size, action=AppendDistinct,
                   help="step size τ in (0, 1e6] (repeatable, distinct; ≥ 3 values)")
    p.add_argument("--decay-steps", type=bounded_int(4, 10**9), default=None,
                   help="length of the constant vs τ0/(k+1) schedule runs (default: preset)")
    p = command(verbs, "drift", help="ε of the laws at each saved checkpoint against the first, with verdicts; no "
                                     "training code touched",
                example="flowgeom conserve drift out/checkpoint-*\n"
                        "flowgeom conserve drift run/step0 run/step100 --optimizer momentum --figure drift.png\n"
                        "flowgeom conserve drift w0.safetensors w1.safetensors --config config.json --json",
                func=drift_cmd)
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                   help="HF Trainer checkpoint-N folders, save_pretrained folders or .safetensors files (sorted by "
                        "step; measured from the run's θ_0 when its flowgeom_theta0.safetensors is beside them, then "
                        "one is enough, else from the first of ≥ 2, and the verdict line says which)")
    p.add_argument("--reference", default=None, metavar="THETA0",
                   help="the flowgeom_theta0.safetensors a ConservationCallback wrote into the Trainer's output_dir "
                        "(default: the one in the folder holding the checkpoints, if any)")
    p.add_argument("--config", default=None, help="config.json for bare .safetensors files (default: the one beside them)")
    from flowgeom.laws.verdict import HELD_THRESHOLD, KINDS

    p.add_argument("--optimizer", choices=KINDS, default=None,
                   help="how the series was trained, for the expected behaviour (default: read from the monitor "
                        "state a ConservationCallback saved, else none)")
    p.add_argument("--threshold", type=_threshold, default=HELD_THRESHOLD,
                   help=f"held when ε_law/ε_control is below this (default {HELD_THRESHOLD})")
    p.add_argument("--figure", default=None, help="write ε against step (laws, controls) to this PNG/PDF/SVG")
    p.add_argument("--heads", type=positive_int, default=None, help="attention heads, when the model does not say")
    p.add_argument("--positions", choices=("none", "sinusoidal", "rope"), default=None,
                   help="attention positions, when the model does not say")
    add_threads(p, also="these small models usually run fastest with --threads 1")
    add_device(p)
    add_json(p)
