"""The sketched sigma^2-Gram similarity at the papers' shapes: ``--gram auto`` against exact, per role (issue 41).

    # 8B shapes, all 32 layers (writes the synthetic checkpoint first when DIR holds none; ~16 GB, minutes)
    .venv/bin/python benchmarks/sketch_scale.py --shape 8b --dir /work/scratch/llama8b
    # 70B shapes on 4 layers, per-layer times extrapolated to 80
    .venv/bin/python benchmarks/sketch_scale.py --shape 70b --layers 4 --dir /work/scratch/llama70b
    # the smoke run (tiny Llama shapes, 2 layers; --gram sketch, since auto keeps tiny roles exact)
    .venv/bin/python benchmarks/sketch_scale.py --shape tiny --layers 2 --dir /tmp/sketch-tiny --compare sketch

The checkpoint is benchmarks/continuity_scale.py's (sharded bf16, one shard per layer, HF index and
config.json, planted: q, k, gate, up share drifting input directions, o and down output ones, v none), written
by its own ``write``. Each role is analysed in this process twice, interleaved ``--reps`` times (best time
kept): once with ``--gram exact`` and once with ``--compare`` (default ``auto``), one role at a time, one
BLAS thread (``--threads``), ``--k`` top pairs, ``--max-layers`` of the written layers. Printed per role: the
method ``auto`` chose and why, seconds per layer for both and their ratio, the probe counts, the sketched
gram_in/gram_out against the exact ones (relative difference, and whether the exact value lies in the stated
95% interval, per pair and for the role mean), and whether the verdicts agree. ``--results DIR`` also writes
``sketch_scale.json`` with all of it, the command, the machine and its load before and after.

Not measured here: the end-to-end wall time and peak RSS of the whole command (``continuity_scale.py run``
does that through the CLI, and now runs the default ``auto``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from flowgeom.continuity import AnalyzeConfig, analyze

HERE = Path(__file__).resolve().parent


def _continuity_scale():
    """benchmarks/continuity_scale.py as a module (benchmarks/ is not a package): its shapes and writer."""
    spec = importlib.util.spec_from_file_location("continuity_scale", HERE / "continuity_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SHAPES.setdefault("tiny", (2, 256, 4, 2, 64, 512))  # layers, hidden, heads, kv heads, head dim, MLP
    return module


def ensure_checkpoint(cs, shape: str, folder: Path, layers: int | None, seed: int) -> int:
    """Write ``layers`` layers of ``shape`` into ``folder`` unless a checkpoint is there; returns its layer count."""
    config = folder / "config.json"
    if config.exists():
        cfg = json.loads(config.read_text())
        if cfg["hidden_size"] != cs.SHAPES[shape][1]:
            raise SystemExit(f"{folder} holds a hidden size {cfg['hidden_size']} checkpoint, not {shape}; "
                             "pass another --dir")
        return cfg["num_hidden_layers"]
    cs.write(shape, folder, layers, seed)
    return layers or cs.SHAPES[shape][0]


def run_role(folder: Path, role: str, gram: str, k: int, max_layers: int | None, seed: int) -> tuple[dict, float]:
    config = AnalyzeConfig(k=k, roles=(role,), dtype="float32", gram_method=gram, workers=1, seed=seed,
                           max_layers=max_layers)
    t0 = time.perf_counter()
    report = analyze(str(folder), config)
    return report, time.perf_counter() - t0


def compare(exact: dict, other: dict) -> dict:
    """How the sketched numbers of ``other`` stand against ``exact`` (one role's report entries)."""
    out = {"verdict_equal": exact["verdict"] == other["verdict"], "method": other.get("gram", {}).get("method"),
           "why": other.get("gram", {}).get("why"), "probes": other.get("gram", {}).get("probes")}
    for key in ("gram_in", "gram_out"):
        e, s = exact["metrics"][key], other["metrics"][key]
        rel = abs(s["mean"] - e["mean"]) / abs(e["mean"])
        pairs = [(p, q) for p, q in zip(other["pairs"], exact["pairs"]) if p.get(f"{key}_ci")]
        held = sum(p[f"{key}_ci"][0] <= q[key] <= p[f"{key}_ci"][1] for p, q in pairs)
        out[key] = {"exact": e["mean"], "other": s["mean"], "rel_diff": rel, "ci": s.get("ci"),
                    "mean_in_ci": None if not s.get("ci") else s["ci"][0] <= e["mean"] <= s["ci"][1],
                    "pairs_in_ci": f"{held}/{len(pairs)}" if pairs else None,
                    "max_pair_rel_diff": max((abs(p[key] - q[key]) / abs(q[key])
                                              for p, q in zip(other["pairs"], exact["pairs"])), default=None)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("8b", "70b", "tiny"), default="8b")
    ap.add_argument("--dir", type=Path, required=True, help="the checkpoint folder (written first when empty; "
                                                             "never inside the repository)")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers to write (default: all of the model; 70B: e.g. 4, times are extrapolated to 80)")
    ap.add_argument("--max-layers", type=int, default=None, help="analyse only the first N written layers")
    ap.add_argument("--roles", default="q,k,v,o,gate,up,down")
    ap.add_argument("--compare", choices=("auto", "sketch"), default="auto", help="the method set against exact")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions, best time kept")
    ap.add_argument("--threads", type=int, default=1, help="BLAS threads (one role at a time)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=None, help="folder for sketch_scale.json")
    args = ap.parse_args()

    from threadpoolctl import threadpool_limits

    cs = _continuity_scale()
    written = ensure_checkpoint(cs, args.shape, args.dir, args.layers, args.seed)
    analysed = min(written, args.max_layers or written)
    total = cs.SHAPES[args.shape][0]
    machine = {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
               "load_before": os.getloadavg(), "torch": torch.__version__}
    rows = {}
    torch.set_num_threads(1)
    with threadpool_limits(limits=args.threads, user_api="blas"):
        for role in args.roles.split(","):
            best = {"exact": float("inf"), args.compare: float("inf")}
            reports = {}
            for _ in range(args.reps):
                for gram in ("exact", args.compare):
                    report, seconds = run_role(args.dir, role, gram, args.k, args.max_layers, args.seed)
                    best[gram] = min(best[gram], seconds)
                    reports[gram] = report["roles"][role]
            row = compare(reports["exact"], reports[args.compare])
            row.update(shape=reports["exact"]["shape"], exact_s_per_layer=best["exact"] / analysed,
                       other_s_per_layer=best[args.compare] / analysed,
                       ratio=best["exact"] / best[args.compare], verdict=reports[args.compare]["verdict"],
                       planted=cs.PLANTED[cs.SHARED[role]])
            rows[role] = row
            print(f"{role:>5s} {'x'.join(map(str, row['shape'])):>11s} {row['method'] or '-':>6s} "
                  f"exact {row['exact_s_per_layer']:7.2f} s/layer, {args.compare} {row['other_s_per_layer']:7.2f} "
                  f"s/layer, exact/{args.compare} {row['ratio']:5.2f}x | gram_in {row['gram_in']['rel_diff']:.1e} "
                  f"(pairs in 95% CI {row['gram_in']['pairs_in_ci']}), gram_out {row['gram_out']['rel_diff']:.1e} "
                  f"(pairs in CI {row['gram_out']['pairs_in_ci']}) | verdict {row['verdict']} "
                  f"{'==' if row['verdict_equal'] else '!='} exact, planted {row['planted']}", flush=True)
    machine["load_after"] = os.getloadavg()
    exact_s = sum(r["exact_s_per_layer"] for r in rows.values())
    other_s = sum(r["other_s_per_layer"] for r in rows.values())
    summary = {
        "command": " ".join([sys.executable, *sys.argv]), "shape": args.shape, "layers_written": written,
        "layers_analysed": analysed, "layers_model": total, "compare": args.compare, "k": args.k,
        "threads": args.threads, "reps": args.reps, "machine": machine,
        "exact_s_per_layer": exact_s, "other_s_per_layer": other_s, "ratio": exact_s / other_s,
        "extrapolated_model_s": {"exact": exact_s * total, args.compare: other_s * total},
        "roles": rows,
    }
    print(f"all roles: exact {exact_s:.2f} s/layer, {args.compare} {other_s:.2f} s/layer, "
          f"ratio {exact_s / other_s:.2f}x; "
          f"x {total} layers: exact {exact_s * total / 60:.1f} min, {args.compare} {other_s * total / 60:.1f} min "
          f"(one BLAS thread each, {'measured on all layers' if analysed == total else f'from {analysed} layers'}; "
          f"load {machine['load_before'][0]:.1f} -> {machine['load_after'][0]:.1f})")
    if args.results:
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "sketch_scale.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
