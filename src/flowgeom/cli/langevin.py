"""``flowgeom langevin villani|darcy``: the Villani probe and the Darcy-flow experiment (seed ``004_…``)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from flowgeom.cli._common import (
    add_device, add_json, add_scale, add_seed, add_threads, area, bounded_int, comma_list, command,
    console, figure_path, finite_float, nonneg_float, nonneg_int, positive_float, positive_int, print_json,
    resolve_device, step_size,
)

REGS = ("none", "log", "power", "frobenius")


def run_villani(args: argparse.Namespace) -> int:
    from flowgeom.langevin import Regularizer, objective, plot, probe

    if args.target and args.loss:
        from flowgeom.errors import FlowgeomError

        raise FlowgeomError(f"give either a built-in --loss or your own {args.target!r}, not both")
    obj = objective(args.target or args.loss or "attention", seed=args.seed)
    if args.reg != "none":
        obj = obj.with_regularizer(Regularizer(args.reg, lam=args.lam, eps=args.eps))
    _check_probe_memory(obj.dim, args)
    report = probe(obj, temperature=args.temperature, rays=args.rays, r_max=args.r_max, points=args.points,
                   exact_max_dim=args.exact_max_dim, probes=args.probes, seed=args.seed)
    if args.figure:
        plot(report, args.figure)  # atomic; an OS refusal (disk full, permissions) is one error line
    if args.json:
        print_json(asdict(report))
        return 0
    from rich.markup import escape

    out = console()
    out.print(f"[bold]{escape(report.objective)}[/] + reg [bold]{report.regularizer}[/], s={report.temperature:g}, "
              f"D={report.dim}, ΔV {'exact' if report.exact else 'Hutchinson'}: verdict [bold]{report.verdict}[/]")
    for i, p in enumerate(report.paths):
        mid = len(p.radius) // 2
        out.print(f"  {p.kind:5s} {i}: r {p.radius[mid]:.3g}→{p.radius[-1]:.3g}  V {p.value[mid]:.4g}→{p.value[-1]:.4g}  "
                  f"Q {p.villani[mid]:.4g}→{p.villani[-1]:.4g}  → {p.verdict} ({p.reason}{', extended' if p.extended else ''})")
    if report.orbit_integral:
        integral = report.orbit_integral
        if integral["verdict"] == "undefined":
            out.print(f"  ∫exp(−2V/s) along the orbit: no verdict ({integral['reason']})", markup=False)
        else:
            out.print(f"  ∫exp(−2V/s) along the orbit: I(T)={', '.join(f'{x:.3g}' for x in integral['I'])} "
                      f"for T={', '.join(f'{t:.2g}' for t in integral['T'])} → {integral['verdict']}")
    if args.figure:
        out.print(f"  figure: {args.figure}")
    return 0


def _check_probe_memory(dim: int, args: argparse.Namespace) -> None:
    """Refuse a probe that would not fit in memory (the kernel kills it otherwise, with no message)."""
    from flowgeom.langevin.villani import probe_memory
    from flowgeom.memory import require

    need = probe_memory(dim, rays=args.rays, points=args.points, exact=dim <= args.exact_max_dim, probes=args.probes)
    require(need, f"the Villani probe with --rays {args.rays} --points {args.points} --probes {args.probes}",
            "lower --rays (a handful of rays already decides the verdict)")


def run_darcy(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from flowgeom.experiments.darcy import PRESETS, run
    from flowgeom.experiments.presets import preset

    device = str(resolve_device(args.device))
    overrides = {k: getattr(args, k) for k in ("data", "steps", "pretrain_steps", "lr", "temperature", "lam", "eps", "seed")
                 if getattr(args, k) is not None}
    if args.regs:
        overrides["regs"] = args.regs
    cfg = preset(PRESETS, args.scale, **overrides)
    with Progress(disable=args.json or not sys.stderr.isatty(), console=None, transient=True) as bar:
        summary = run(cfg, args.out, resume=args.resume, device=device, progress=bar)
    diverged = [reg for reg, arm in summary["arms"].items() if arm.get("status") != "ok"]
    if args.json:
        print_json(summary)
        _raise_diverged(summary, diverged, args.out)
        return 0
    out = console()
    pre = summary["pretrain"]
    out.print(f"pretrained: test RMSE {pre['test_rmse']:.4f}, rel L2 {pre['test_rel_l2']:.4f}, gap {pre['gap']:+.4f}")
    out.print(f"{'reg':10s} {'test RMSE':>10s} {'rel L2':>8s} {'gap':>8s} {'gap sd':>8s} {'|W_Q| start→end':>18s} {'|W_K| start→end':>18s}")
    for reg, arm in summary["arms"].items():
        if "test_rmse" not in arm or arm.get("status") != "ok":
            step = f" at step {arm['step']}" if "step" in arm else ""
            out.print(f"{reg:10s} {arm.get('status')}{step} (no final numbers)", markup=False)
            continue
        out.print(f"{reg:10s} {arm['test_rmse']:10.4f} {arm['test_rel_l2']:8.4f} {arm['gap']:+8.4f} {arm['gap_std_2nd_half']:8.4f} "
                  f"{arm['wq_norm_start']:8.3f}→{arm['wq_norm']:<8.3f} {arm['wk_norm_start']:8.3f}→{arm['wk_norm']:<8.3f}")
    rate = summary.get("rate", {})
    if rate.get("steps"):
        out.print("steps to train MSE ≤ L*+ε, ε = " + ", ".join(f"{e:.3g}" for e in rate["eps"]))
        for reg, hits in rate["steps"].items():
            out.print(f"  {reg:10s} " + " ".join("—" if h is None else str(h) for h in hits))
    out.print(f"run folder: {args.out} (figures/ holds darcy_norms.png, darcy_errors.png, darcy_rate.png)")
    _raise_diverged(summary, diverged, args.out)
    return 0


def _raise_diverged(summary: dict, diverged: list[str], out: str) -> None:
    """One error line (exit 2) when some Langevin arms blew up: the run is not a complete result."""
    from flowgeom.errors import FlowgeomError

    if diverged:
        first = summary["arms"][diverged[0]]
        raise FlowgeomError(f"{len(diverged)} of {len(summary['arms'])} Langevin arms diverged "
                            f"({', '.join(diverged)}); first, {diverged[0]!r}: {first.get('message')}; "
                            f"the other arms are in {out}")


def run_rate_cmd(args: argparse.Namespace) -> int:
    from flowgeom.experiments.langevin_rate import RateConfig, plot_rate, run_rate

    cfg = RateConfig(loss=args.loss, chains=args.chains, start_radius=args.start_radius, lr=args.lr,
                     temperature=args.temperature, steps=args.steps, regs=args.regs, lam=args.lam,
                     eps=args.eps, seed=args.seed)
    result = run_rate(cfg)
    if args.figure:
        plot_rate(result, args.figure)
    if args.json:
        print_json(result)
        return 0
    out = console()
    out.print(f"{cfg.loss}: {cfg.chains} chains from radius {cfg.start_radius:g}, s={cfg.temperature:g}, "
              f"lr={cfg.lr:g}, L*={result['l_star']:.4g}")
    out.print("τ(ε) in SDE time, ε = " + ", ".join(f"{e:.3g}" for e in result["eps"]))
    for reg, hits in result["tau"].items():
        slope = result["slope"][reg]
        out.print(f"  {reg:10s} " + " ".join("—" if h is None else f"{h:.3g}" for h in hits)
                  + f"   final E[V0]−L* {result['suboptimality'][reg][-1]:.3g}"
                  + ("" if slope is None else f"   dτ/dlog(1/ε) {slope:.3g}"))
    return 0


def _add_common(p: argparse.ArgumentParser, *, figure: str) -> None:
    """Options shared by villani and rate: λ, ε, --figure, --threads, --seed, --json."""
    p.add_argument("--lam", type=positive_float, default=0.01, help="regulariser λ > 0 (default 0.01)")
    p.add_argument("--eps", type=positive_float, default=0.5, help="power regulariser ε > 0 (default 0.5)")
    p.add_argument("--figure", type=figure_path, help=figure)
    add_threads(p)
    add_seed(p)
    add_json(p)


def register(sub) -> None:
    verbs = area(sub, "langevin", "convergent Langevin training: Villani probe, Darcy-flow experiment")

    p = command(verbs, "villani", help="probe the Villani condition of a loss along rays and symmetry orbits",
                example="flowgeom langevin villani --loss attention --reg log --lam 0.01 --figure villani.png\n"
                        "flowgeom langevin villani --loss norm1 --json\n"
                        "flowgeom langevin villani examples/langevin_lora.py:make --reg log   # your own model",
                func=run_villani)
    p.add_argument("target", nargs="?", metavar="FILE.py:NAME",
                   help="your own loss: NAME is a zero-argument factory in FILE.py (or package.module:NAME) returning "
                        "(loss_fn, theta0) or an Objective; PEFT LoRA pairs in theta0 are probed along their orbit "
                        "(docs/langevin.md)")
    p.add_argument("--loss", choices=["attention", "lora", "norm2", "norm1"],
                   help="a built-in potential V (default attention when no FILE.py:NAME is given)")
    p.add_argument("--reg", default="none", choices=REGS, help="regulariser added to V")
    p.add_argument("--temperature", type=positive_float, default=1.0, help="temperature s > 0 (default 1)")
    p.add_argument("--rays", type=positive_int, default=3, help="random rays >= 1 (default 3)")
    p.add_argument("--r-max", type=finite_float(10, 1e29, lo_open=True), default=1e3,
                   help="largest radius probed, in (10, 1e29] (default 1e3)")
    p.add_argument("--points", type=bounded_int(4, 100_000), default=12, help="points per path, >= 4 (default 12)")
    p.add_argument("--exact-max-dim", type=nonneg_int, default=200, help="exact Hessian trace up to this D, else Hutchinson")
    p.add_argument("--probes", type=bounded_int(2, 1_000_000), default=64,
                   help="Hutchinson probe vectors, >= 2 (default 64)")
    _add_common(p, figure="save the V and Q plots to this image (.png, .pdf, .svg, ...)")

    p = command(verbs, "darcy", help="Darcy-flow attention experiment: pretrain, then Langevin on W_Q, W_K (none/log/power)",
                example="flowgeom langevin darcy --quick --out runs/darcy\n"
                        "flowgeom langevin darcy --quick --out runs/darcy --resume --json",
                func=run_darcy)
    add_scale(p, {"quick": "quick config (about a minute on one core)",
                  "cpu": "the same as --full: the whole protocol fits one CPU core",
                  "full": "the full two-phase protocol, bigger model, longer chains (~35 min on one core)"})
    p.add_argument("--out", required=True, help="run folder")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--data", choices=["shipped", "generated"], help="shipped 16x16 set (default) or our FD generator")
    p.add_argument("--steps", type=positive_int(maximum=10**9), help="Langevin steps per arm (>= 1)")
    p.add_argument("--pretrain-steps", type=bounded_int(0, 10**9), help="Adam pretraining steps (>= 0)")
    p.add_argument("--lr", type=step_size, help="Langevin step size in (0, 1e6]")
    p.add_argument("--temperature", type=nonneg_float, help="Langevin temperature s >= 0")
    p.add_argument("--lam", type=positive_float, help="regulariser λ > 0")
    p.add_argument("--eps", type=positive_float, help="power regulariser ε > 0")
    p.add_argument("--regs", type=comma_list(REGS, what="arm"),
                   help="comma-separated arms among none,log,power,frobenius (default none,log,power)")
    add_threads(p, also="this small model usually runs fastest with --threads 1")
    add_seed(p, default=None)
    add_device(p)
    add_json(p)

    p = command(verbs, "rate", help="time to ε-suboptimality vs log(1/ε) for many chains, regularised vs not",
                example="flowgeom langevin rate --loss attention --figure rate.png", func=run_rate_cmd)
    p.add_argument("--loss", default="attention", choices=["attention", "lora"], help="the paper's loss (small task)")
    p.add_argument("--chains", type=positive_int(maximum=10**6), default=128,
                   help="independent chains, 1..10**6 (default 128)")
    p.add_argument("--start-radius", type=positive_float, default=30.0, help="‖θ_0‖ of every chain (default 30)")
    p.add_argument("--lr", type=step_size, default=0.02, help="Langevin step size in (0, 1e6] (default 0.02)")
    p.add_argument("--temperature", type=nonneg_float, default=0.01, help="temperature s >= 0 (default 0.01)")
    p.add_argument("--steps", type=positive_int(maximum=10**9), default=3000, help="steps per arm (default 3000)")
    p.add_argument("--regs", type=comma_list(REGS, what="arm"), default=("none", "log", "power"),
                   help="comma-separated arms (default none,log,power)")
    _add_common(p, figure="save the curves and τ(ε) plot to this PNG")
