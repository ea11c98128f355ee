"""``flowgeom laws count|discover TARGET``: the numeric law engine on the command line.

TARGET is a zoo name with size options (``--d-model`` …), ``path/to/file.py:NAME``
or ``package.module:NAME``. :func:`register_verbs` adds the two verbs to the
``flowgeom laws`` area (wired by :mod:`flowgeom.cli.laws`).
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

from rich.markup import escape

from flowgeom.cli._common import (add_device, add_json, add_seed, bounded_int, command, console, finite_float,
                                  positive_int, print_json, resolve_device)
from flowgeom.cli.zoo_options import add_size_options, size_options

DTYPES = ("float64", "float32")
_TARGET_HELP = ("zoo name (ffn, swiglu, mha, moe, linear2, relu2, chain) with size options, path/to/file.py:NAME, "
                "package.module:NAME or hf:MODEL_TYPE:PART (e.g. hf:llama:attention; needs transformers)")


MAX_DEPTH = 16  # = flowgeom.laws.count.MAX_DEPTH (not imported: the parser stays torch-free)
MAX_PARAMETERS = 20_000  # discover's system has about (D + 1)·k unknowns; memory is estimated again before solving


def input_shape(text: str) -> tuple[int, ...]:
    """argparse type: ``4,8`` -> (4, 8), checked by :func:`flowgeom.laws.target.parse_shape`."""
    from flowgeom.errors import FlowgeomError
    from flowgeom.laws.target import parse_shape

    try:
        return parse_shape(text)
    except FlowgeomError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--input-shape ")) from None


def relative_tol(text: str) -> float:
    """argparse type: a relative singular-value tolerance, a finite number in the open interval (0, 1)."""
    try:
        return finite_float(0.0, 1.0, lo_open=True, hi_open=True)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a relative tolerance, a finite number in (0, 1) such as 1e-9, got {text!r}") from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="TARGET", help=_TARGET_HELP)
    p.add_argument("--input-shape", type=input_shape, default=None,
                   help="shape of ONE input without the batch dimension, e.g. 4,8 for inputs (batch, 4, 8); for modules "
                        "without sample_input(batch, generator) (docs/own-module.md)")
    p.add_argument("--dtype", default="float64", choices=DTYPES, help="arithmetic (default float64)")
    add_size_options(p)
    p.add_argument("--config", action="append", default=None, metavar="KEY=VALUE",
                   help="hf: targets: change the tiny transformers config (repeatable), e.g. --config num_key_value_heads=1")
    p.add_argument("--keep-casts", action="store_true",
                   help="hf: targets: keep the model's float32 casts (eager softmax, RMSNorm) instead of running them in --dtype")
    add_json(p)
    add_seed(p)
    add_device(p)


def _resolve(args: argparse.Namespace):
    import torch

    from flowgeom.laws.target import resolve

    device = resolve_device(args.device)
    target = resolve(args.target, size_options=size_options(args), input_shape=args.input_shape, seed=args.seed,
                     hf_config=args.config, keep_casts=args.keep_casts)
    return target, device, getattr(torch, args.dtype)


@contextmanager
def engine_progress(enabled: bool, *, after: float = 2.0):
    """A ``progress(stage, done, total)`` callback drawing a transient bar on stderr, or None.

    Only on a terminal and without --json; the bar appears once the work has run
    ``after`` seconds (a count of a small module finishes before that, silently).
    """
    import sys
    import time

    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    t0, task = time.monotonic(), None

    def update(stage: str, done: int, total: int) -> None:
        nonlocal task
        if task is None:
            if time.monotonic() - t0 < after:
                return
            bar.start()
            task = bar.add_task(stage, total=total)
        bar.update(task, description=stage, completed=done, total=total)

    try:
        yield update
    finally:
        if task is not None:
            bar.stop()


@contextmanager
def cli_input_errors():
    """The engine's input errors name ``input_shape=``; here the fix is the ``--input-shape`` flag."""
    from flowgeom.errors import InputError

    try:
        yield
    except InputError as exc:
        raise exc.for_cli() from None


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.1e}" for v in values) or "-"


def _count(args: argparse.Namespace) -> int:
    from flowgeom.laws.count import count

    target, device, dtype = _resolve(args)
    with cli_input_errors(), engine_progress(not args.json) as progress:
        res = count(target.module, target.sampler, seed=args.seed, dtype=dtype, device=device, max_depth=args.max_depth,
                    tol=args.tol, progress=progress, expected=target.expected)
    hf_config = target.config  # hf: targets: the tiny config values used
    payload = {"target": target.label} | ({"config": hf_config} if hf_config else {}) | res.to_dict()
    if args.json:
        print_json(payload)
        return 0
    out = console()
    out.print(f"[bold]{escape(target.label)}[/bold]: D = {res.parameters} parameters ({res.dtype}, {res.device}, seed {res.seed})",
              emoji=False)  # hf:llama:attention is not an emoji
    if hf_config:
        out.print("config: " + escape(", ".join(f"{k}={v}" for k, v in hf_config.items())))
    out.print("rank of Lie(W)(θ) by bracket depth: " + " → ".join(str(r) for r in res.ranks_by_depth))
    line = f"[bold]{res.laws}[/bold] independent conservation laws (D − rank = {res.parameters} − {res.rank})"
    if res.expected is not None:
        match = "[green]matches[/green]" if res.expected == res.laws else "[red]differs from[/red]"
        line += f"; {match} the {'closed form' if hf_config else 'catalogue'}'s {res.expected}"
    out.print(line)
    gap = res.gap
    ratio = f"{gap['ratio']:.1e}" if gap["ratio"] else "-"
    out.print(f"gap: smallest kept σ {_fmt(gap['smallest_kept'])} | tolerance {gap['tolerance']:.0e} | "
              f"largest dropped σ {_fmt(gap['largest_dropped'])} (ratio {ratio})")
    prec = res.precision
    if prec:
        flag = "[red]reduced[/red]" if prec["reduced"] else "[green]full[/green]"
        out.print(f"precision: {flag} — the fields carry {prec['effective']} rounding (noise {prec['noise']:.1e}) in a "
                  f"{prec['dtype']} count")
    trouble = (prec and prec["reduced"]) or any(n.startswith("unclear rank gap") for n in res.notes)
    if gap["smallest_kept"] and gap["smallest_kept"][0] < 1e-4 and not trouble:
        out.print(f"[yellow]near-law:[/yellow] a direction kept with σ = {gap['smallest_kept'][0]:.1e} is broken only weakly "
                  "(e.g. by a normalisation eps); it is counted as not conserved")
    for note in res.notes:
        out.print(f"note: {escape(note)}")
    out.print(f"{res.draws} random fields and brackets, {res.seconds:.2f} s")
    return 0


def _discover(args: argparse.Namespace) -> int:
    from flowgeom.laws.discover import discover

    target, device, dtype = _resolve(args)
    with cli_input_errors(), engine_progress(not args.json) as progress:
        res = discover(target.module, target.sampler, degree=args.degree, seed=args.seed, dtype=dtype, device=device,
                       max_parameters=args.max_parameters, progress=progress, expected=target.expected)
    if args.json:
        print_json({"target": target.label} | res.to_dict())
        return 0
    out = console()
    if args.latex:  # one align* environment, a line per law, ready to paste into a paper
        from flowgeom.laws.discover import to_latex

        if not res.laws:
            print(f"% {target.label}: no polynomial law of degree <= {args.degree} (only constants are conserved)")
            return 0
        print("\\begin{align*}")
        print(" \\\\\n".join(f"  h_{{{i + 1}}} &= {to_latex(law.formula)}" for i, law in enumerate(res.laws)))
        print("\\end{align*}")
        return 0
    out.print(f"[bold]{escape(target.label)}[/bold]: D = {res.parameters}; {len(res.laws)} polynomial laws of degree ≤ {args.degree}"
              + (f" (catalogue: {res.expected})" if res.expected is not None else ""), emoji=False)
    group = None
    for i, law in enumerate(res.laws):
        if law.params != group:  # laws come grouped by the parameter tensors they read
            group = law.params
            n = sum(other.params == group for other in res.laws)
            out.print(f"  reads {escape(', '.join(group))}: {n} law{'s' if n > 1 else ''}", style="bold")
        out.print(f"  {i + 1:>3}. {escape(law.formula)}")
    if not res.laws:
        out.print("  (none: only constant functions of degree ≤ 2 are conserved)")
    out.print(f"independent check: max relative |⟨∇h, X⟩| = {res.max_violation:.1e}; {res.points} points, {res.seconds:.2f} s")
    for note in res.notes:
        out.print(f"note: {escape(note)}")
    return 0


def print_count_table(rows: list[dict] | None = None) -> None:
    """Rich table of :func:`count_rows`; the normalised-sigmoid rows are marked as the seed's refuted claim."""
    from rich.table import Table

    if rows is None:
        from flowgeom.laws.describe import count_rows

        rows = count_rows()
    table = Table(title="catalogue count vs numeric count (float64, D − dim Lie(W) at a random point)")
    for col in ("architecture", "formula", "D", "catalogue", "numeric", "ranks by depth", "gap", "s", "verdict"):
        table.add_column(col, justify="left" if col in ("architecture", "formula", "verdict") else "right")
    for r in rows:
        verdict = "[green]agree[/green]" if r["match"] else "[red]DIFFER[/red]"
        if r["finding"]:
            verdict += "; [yellow]seed claims +d (router law): refuted[/yellow]"
        gap = f"{r['gap_ratio']:.0e}" if r["gap_ratio"] else "-"
        table.add_row(r["label"], r["formula"], str(r["parameters"]), str(r["catalogue"]), str(r["numeric"]),
                      "→".join(map(str, r["ranks_by_depth"])), gap, f"{r['seconds']:.2f}", verdict)
    console().print(table)


def register_verbs(verbs) -> None:
    """Add ``count`` and ``discover`` to the ``flowgeom laws`` verb sub-parsers."""
    p = command(verbs, "count", help="count the conservation laws of any module numerically (D − dim Lie(W))",
                example="flowgeom laws count relu2 --d-in 12 --width 18 --d-out 9\n"
                        "flowgeom laws count mha --heads 2 --d-k 4 --positions rope --json\n"
                        "flowgeom laws count my_block.py:Block --input-shape 4,8   # one input, without the batch dimension",
                func=_count)
    _common(p)
    p.add_argument("--tol", type=relative_tol, default=None,
                   help="relative singular-value tolerance in (0, 1) (default 1e-9 in float64, 1e-4 in float32)")
    p.add_argument("--max-depth", type=bounded_int(0, MAX_DEPTH), default=6,
                   help=f"deepest Lie bracket level, 0..{MAX_DEPTH} (default 6; 0 = no brackets, an upper bound)")
    p = command(verbs, "discover", help="find a readable basis of the quadratic conservation laws of a module",
                example="flowgeom laws discover swiglu --d-model 3 --d-hidden 2\n"
                        "flowgeom laws discover examples/own_block.py:LayerNormMLP --latex\n"
                        "flowgeom laws discover moe --d-model 3 --d-hidden 2 --experts 2 --json",
                func=_discover)
    _common(p)
    p.add_argument("--degree", type=int, default=2, choices=(1, 2), help="largest polynomial degree (default 2)")
    p.add_argument("--latex", action="store_true", help="print the laws as a LaTeX align* environment")
    p.add_argument("--max-parameters", type=positive_int(maximum=MAX_PARAMETERS), default=300,
                   help=f"refuse larger D, 1..{MAX_PARAMETERS} (default 300)")
