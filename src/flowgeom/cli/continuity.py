"""`flowgeom continuity ...`: cross-layer singular-vector alignment of checkpoints.

Verbs are added by small ``add_<verb>(verbs)`` functions called from
:func:`register`; the training verbs (``train``, ``ablate``, ``plot``) live in
:mod:`flowgeom.cli.continuity_train` and are added by ``register``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from flowgeom.cli._common import add_device, add_json, add_seed, add_threads, area, command, console, print_json, resolve_device
from flowgeom.cli._common import positive_float, positive_int
from flowgeom.cli.progress import clock

TABLE_METRICS = (("v1", "v1"), ("u1", "u1"), ("subspace_in", "sub in"), ("subspace_out", "sub out"),
                 ("gram_in", "gram in"), ("gram_out", "gram out"))


def _distances(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--distance takes integers like 1 or 1,2,4; got {text!r}") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"--distance takes distinct integers >= 1 like 1 or 1,2,4; got {text!r}")
    return values


class _Progress:
    """The analyze progress callback: matrices done, roles done, elapsed, ETA, as a bar or as plain lines.

    ``analyze`` calls :meth:`start` once with ``{role: (layers, cost)}`` (the relative work of each
    role, :func:`flowgeom.continuity.analyze._role_cost`), then ``self(role, done, total)`` after every
    layer, from worker threads when roles run in parallel. The ETA weighs each finished layer by its
    role's cost per layer (a gate layer of Llama-8B costs ~60 k layers), so it does not swing as the
    large roles, which run first, finish. ``mode``: "bar" (rich, on a terminal) or "lines" (one line
    on stderr every ``every`` seconds and at the end: logs, pipes, benchmarks).
    """

    def __init__(self, mode: str, every: float = 10.0):
        self.mode, self.every = mode, every
        self.lock = threading.Lock()  # roles report from parallel worker threads
        self.plan: dict[str, tuple[int, int]] = {}
        self.done: dict[str, int] = {}
        self.t0 = self.last = time.monotonic()
        self.bar = self.task = None

    def start(self, plan: dict[str, tuple[int, int]]) -> None:
        self.plan, self.t0 = dict(plan), time.monotonic()
        self.last = self.t0
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("continuity analyze", total=sum(n for n, _ in plan.values()))

    def line(self) -> str:
        total = sum(n for n, _ in self.plan.values())
        done = sum(self.done.values())
        roles = sum(self.done.get(r, 0) == n for r, (n, _) in self.plan.items())
        work = sum(c for _, c in self.plan.values())
        worked = sum(c * self.done.get(r, 0) / n for r, (n, c) in self.plan.items())
        elapsed = time.monotonic() - self.t0
        eta = elapsed * (work - worked) / worked if worked else None
        return (f"continuity analyze: {done}/{total} layer matrices, {roles}/{len(self.plan)} roles done, "
                f"{clock(elapsed)} elapsed, ETA {clock(eta) if eta is not None else '?'}")

    def __call__(self, role: str, done: int, total: int) -> None:
        with self.lock:
            self.done[role] = done
            now = time.monotonic()
            if self.bar is not None:
                self.bar.update(self.task, completed=sum(self.done.values()), description=self.line())
            elif self.mode == "lines" and (now - self.last >= self.every or sum(self.done.values()) == sum(
                    n for n, _ in self.plan.values())):
                self.last = now
                print(self.line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _progress(mode: str, json_out: bool) -> _Progress | None:
    """The progress reporter for ``--progress`` (auto: a bar on a terminal unless --json, else none)."""
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() and not json_out else "off"
    if mode == "bar" and not sys.stderr.isatty():
        mode = "lines"  # a bar needs a terminal; lines say the same in a log
    return None if mode == "off" else _Progress(mode)


def print_report(report: dict) -> None:
    """Roles x metrics table: mean ± std over pairs, baseline, ratio; then the verdicts."""
    from rich.markup import escape  # paths and role names are data, never markup: 'a[/]b' prints as is
    from rich.table import Table

    cfg = report["config"]
    table = Table(title=f"{escape(str(report['source']))} ({escape(report['scheme'])} naming, {report['layers']} layers, "
                        f"distance {cfg['distances'][0]}, k={cfg['k']}, {cfg['baseline']} baseline)")
    table.add_column("role")
    table.add_column("shape")
    shown = [(key, label) for key, label in TABLE_METRICS if all(key in r["metrics"] for r in report["roles"].values())]
    for _, label in shown:
        table.add_column(label + "  mean±sd (base, ×)", justify="right")
    table.add_column("verdict")
    for role, r in report["roles"].items():
        cells = []
        for key, _ in shown:
            m = r["metrics"][key]
            ci = m.get("ci", False)  # False: not sketched; None: sketched without an interval (one probe)
            interval = "" if ci is False else " [no interval]" if ci is None else f" [{ci[0]:.3f}, {ci[1]:.3f}]"
            cells.append(escape(f"{m['mean']:.3f}±{m['std']:.3f}{interval} ({m['baseline']:.3f}, {m['ratio']:.1f}×)"))
        label = role + (" (+LoRA)" if r.get("merged_lora") else "")
        table.add_row(escape(label), "×".join(map(str, r["shape"])), *cells, r["verdict"])
    out = console()
    out.print(table)
    out.print(f"verdict: ratio of mean |cos| to its random baseline >= {cfg['threshold']} "
              "(v1 -> input-continuous, u1 -> output-continuous)")
    for line in gram_lines(report):
        out.print(escape(line))
    low = [f"{escape(role)} (min gap {r['min_gap']:.1e})" for role, r in report["roles"].items() if r["min_gap"] < 1e-3]
    if low:
        out.print("near-degenerate sigma_1 ~ sigma_2 in: " + ", ".join(low) + "; their v1/u1 are unstable, "
                  "read the subspace columns")
    if any("layer_spectra" in r for r in report["roles"].values()):
        out.print(spectra_table(report))
    for line in inventory_lines(report):
        out.print(escape(line))


def gram_lines(report: dict) -> list[str]:
    """How the sigma^2-Gram similarity was computed per role (exact or sketched, and why), the sketch's probes,
    and every sketched metric whose 95% ratio interval straddles the verdict threshold."""
    roles = {role: r["gram"] for role, r in report["roles"].items() if "gram" in r}
    sketched = [role for role, g in roles.items() if g["method"] == "sketch"]
    if not sketched:
        return []
    g0 = roles[sketched[0]]
    target = (f"--probes {report['config']['probes']}" if g0["fixed_probes"]
              else f"target ±{g0['rel_error']:.0%} of the value")
    lines = [f"sigma^2-Gram similarity sketched (Hutch++, Rademacher probes, {target}; 95% interval of the mean in "
             f"brackets) for {', '.join(sketched)}: " + "; ".join(f"{role} {roles[role]['why']}, "
                                                                  f"{roles[role]['probes']['in']}/"
                                                                  f"{roles[role]['probes']['out']} probes (in/out)"
                                                                  for role in sketched)]
    exact = [role for role, g in roles.items() if g["method"] == "exact"]
    if exact:
        lines.append(f"exact for {', '.join(exact)}")
    thr = report["config"]["threshold"]
    for role in sketched:
        for key in roles[role]["straddles_threshold"]:
            lo, hi = report["roles"][role]["metrics"][key]["ratio_ci"]
            lines.append(f"{role} {key}: its 95% interval of the ratio to baseline, [{lo:.2f}, {hi:.2f}]×, straddles "
                         f"the threshold {thr:g}; the verdict reads v1/u1, not this metric, but this ratio is "
                         "undecided: lower --rel-error or use --gram exact")
    return lines


def spectra_table(report: dict):
    """Roles x layer-spectra table (``--spectra``): mean±sd [min, max] over the role's layers."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="layer spectra (ESD of W^T W; alpha: weightwatcher 0.7.7's power-law fit; per matrix in --json)")
    for col in ("role", "alpha  mean±sd [min, max]", "stable rank", "entropy", "eigenvalues"):
        table.add_column(col, justify="left" if col in ("role", "eigenvalues") else "right")

    def cell(st, fmt):
        return "-" if st is None else f"{st['mean']:{fmt}}±{st['std']:{fmt}} [{st['min']:{fmt}}, {st['max']:{fmt}}]"

    for role, r in report["roles"].items():
        ls = r["layer_spectra"]
        alpha = cell(ls["alpha"], ".2f") + (f" ({ls['alpha_missing']} not fitted)" if ls["alpha_missing"] else "")
        table.add_row(escape(role), alpha, cell(ls["stable_rank"], ".1f"), cell(ls["entropy"], ".3f"),
                      ", ".join(ls["eigenvalues"]))
    return table


def inventory_lines(report: dict) -> list[str]:
    """What the table does not show: unmatched tensors (layer indices folded to N) and LoRA pairs."""
    import re

    groups: dict[tuple[str, str], int] = {}
    for u in report.get("unmatched", []):
        key = (re.sub(r"(?<=\.)\d+(?=\.)", "N", u["tensor"]), u["reason"])
        groups[key] = groups.get(key, 0) + 1
    lines = [f"not analysed ({len(report.get('unmatched', []))} tensors):"] if groups else []
    lines += [f"  {name}{f' ×{n}' if n > 1 else ''}: {reason}" for (name, reason), n in groups.items()]
    lora = report.get("lora", [])
    if lora:
        merged = sum(e["merged"] for e in lora)
        adapters = sorted({e["adapter"] for e in lora})
        lines.append(f"LoRA: {len(lora)} adapted module(s), adapter(s) {', '.join(adapters)}, {merged} merged "
                     "(W + s·B·A)" + ("" if merged else "; pass --merge-lora to analyse the adapted weights"))
        notes: dict[str, int] = {}
        for e in lora:
            if e.get("note"):
                notes[e["note"]] = notes.get(e["note"], 0) + 1
        lines += [f"  {n} module(s): {note}" for note, n in notes.items()]
    return lines


def run_analyze(args: argparse.Namespace) -> int:
    import torch

    from flowgeom.continuity import AnalyzeConfig, analyze
    from flowgeom.continuity.figure import figure_format, heatmap_bytes
    from flowgeom.continuity.naming import parse_role_option
    from flowgeom.runs import atomic_write_bytes, atomic_write_json, check_out_file

    device = resolve_device(args.device)
    fmt = figure_format(args.figure) if args.figure else None
    for flag, path in (("--out", args.out), ("--figure", args.figure)):  # before minutes of analysis, not after
        if path:
            check_out_file(path, flag, inputs=[args.source])
    custom = dict(parse_role_option(text) for text in args.role) if args.role else None
    config = AnalyzeConfig(
        k=args.k, distances=args.distance, roles=tuple(args.roles.split(",")) if args.roles else None,
        max_layers=args.max_layers, device=str(device), dtype=args.dtype, baseline=args.baseline,
        draws=args.draws, seed=args.seed, batch=args.batch, threshold=args.threshold, solver=args.solver,
        gram=not args.no_gram, gram_method=args.gram, probes=args.probes, rel_error=args.rel_error,
        heads=args.heads, kv_heads=args.kv_heads, merge_lora=args.merge_lora,
        lora_adapter=args.lora_adapter, spectra=args.spectra, workers=args.threads or torch.get_num_threads(),
    )
    progress = _progress(args.progress, args.json)
    try:
        report = analyze(args.source, config, custom_roles=custom, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    for warning in report["warnings"]:  # incomplete role families, fused tensors not split: never silent
        print(f"flowgeom: warning: {warning}", file=sys.stderr)
    # Everything validated and computed: only now write outputs (atomically).
    figure = heatmap_bytes(report, fmt=fmt) if fmt else None
    if args.out:
        atomic_write_json(Path(args.out), report, inputs=[args.source])
    if figure is not None:
        atomic_write_bytes(Path(args.figure), figure, inputs=[args.source], what="the figure")
    if args.json:
        print_json(report)
    else:
        print_report(report)
    return 0


def add_analyze(verbs) -> None:
    p = command(
        verbs, "analyze", help="cross-layer singular-vector alignment of every projection of a checkpoint",
        example="flowgeom continuity analyze builtin:smollm2 --figure smollm2.png\n"
                "flowgeom continuity analyze path/to/hf_folder --json --out report.json\n"
                "flowgeom continuity analyze ckpt.safetensors --role 'wq=blocks\\.(\\d+)\\.wq\\.weight'",
        func=run_analyze,
    )
    p.add_argument("source", help="nn checkpoint: .safetensors, model.safetensors.index.json, .gguf, a model folder, "
                                  "builtin:smollm2 or builtin:minilm")
    add_json(p)
    add_device(p)
    add_seed(p)
    p.add_argument("--figure", metavar="FILE", help="write a roles x layer-pairs heatmap (.png/.pdf/.svg)")
    p.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE (atomically)")
    p.add_argument("--role", action="append", metavar="NAME=REGEX",
                   help="custom role: regex over tensor names with a (\\d+) layer group; repeat per role")
    p.add_argument("--roles", metavar="LIST", help="only these roles, comma-separated (e.g. q,k,down,router,expert0.up)")
    p.add_argument("--heads", type=positive_int, metavar="H", help="query heads, to split fused q|k|v tensors (Phi-3 qkv_proj, "
                                                          "GPT-NeoX/Falcon query_key_value); default: config.json")
    p.add_argument("--kv-heads", type=positive_int, metavar="KV", help="key/value heads for that split (default: config.json)")
    p.add_argument("--merge-lora", action="store_true",
                   help="analyse W + s·B·A for PEFT LoRA-adapted projections (s = lora_alpha/r from "
                        "adapter_config.json, alpha/sqrt(r) with rslora) instead of the frozen base W")
    p.add_argument("--lora-adapter", metavar="NAME", help="which adapter to merge when several are present")
    p.add_argument("--k", type=positive_int, default=8, help="top-k singular pairs for subspace/index metrics (default 8)")
    p.add_argument("--distance", type=_distances, default=(1,), metavar="D[,D...]",
                   help="layer distances (default 1 = adjacent); the first drives table and verdict")
    p.add_argument("--max-layers", type=positive_int, metavar="N", help="only the first N layers of each role")
    p.add_argument("--dtype", default="float32", choices=("float64", "float32"),
                   help="compute dtype (default float32: on SmolLM2 its cosines match a float64 full SVD to 1e-6)")
    p.add_argument("--solver", default="auto", choices=("auto", "krylov", "dense"),
                   help="top-k eigensolver on each small-side Gram: block Krylov, LAPACK tridiagonal + MRRR on the top k (CPU), or "
                        "auto = dense on CPU up to d=1536, else Krylov (default)")
    p.add_argument("--no-gram", action="store_true",
                   help="skip the sigma^2-Gram similarity (its exact off-side cross product is ~30%% of the CPU time "
                        "on SmolLM2; the other metrics then keep no raw matrix between layers)")
    p.add_argument("--gram", default="auto", choices=("auto", "exact", "sketch"),
                   help="sigma^2-Gram similarity: exact (a Gram and a cross product per pair), sketch (Hutch++ with "
                        "Rademacher probes, every value with its 95%% interval), or auto = sketch where an exact pair "
                        "would take more than ~1.5 s (from the shapes), exact elsewhere, and say which (default)")
    p.add_argument("--probes", type=positive_int, metavar="N",
                   help="sketch: N Rademacher probes per matrix and space (N/2 deflate, N/2 sample the rest); "
                        "default: chosen by --rel-error")
    p.add_argument("--rel-error", type=float, metavar="E",
                   help="sketch: target relative half-width of each 95%% interval, 0 < E < 1 (default 0.02); the "
                        "probes double from 32 until it is met or a cap is reached (docs/continuity.md)")
    p.add_argument("--spectra", action="store_true",
                   help="also per-matrix layer spectra: stable rank, spectral entropy and the power-law alpha of the "
                        "eigenvalue distribution (weightwatcher 0.7.7's estimator), from the same eigensolver pass")
    p.add_argument("--baseline", default="analytic", choices=("analytic", "montecarlo"),
                   help="random-matrix baseline: closed form (default) or Gaussian draws of the same shapes")
    p.add_argument("--draws", type=positive_int(maximum=100_000), default=8, help="Monte-Carlo draws (default 8)")
    p.add_argument("--batch", type=positive_int, default=1, help="layers stacked per batched call (default 1 = least memory)")
    add_threads(p, also="N roles are analysed at once, one BLAS thread each (a single role gets them all in BLAS); "
                        "the report is the same for any N, memory grows with it")
    p.add_argument("--threshold", type=positive_float, default=3.0, help="ratio to baseline that counts as continuous (default 3)")
    p.add_argument("--progress", default="auto", choices=("auto", "bar", "lines", "off"),
                   help="progress: layer matrices and roles done, elapsed, ETA; auto = a bar on a terminal unless "
                        "--json (default), lines = one line on stderr every 10 s (logs), e.g. --json --progress lines")


def register(sub) -> None:
    verbs = area(sub, "continuity", "geometric continuity: cross-layer alignment of singular vectors (seed 001)")
    add_analyze(verbs)
    from flowgeom.cli.continuity_train import register_verbs as add_training_verbs

    add_training_verbs(verbs)  # train / ablate / plot: gradient-coherence dynamics (continuity/dynamics.py)
