"""SmolLM2 continuity analysis vs a full-SVD pass over the same 210 matrices (same process).

    .venv/bin/python benchmarks/continuity_speed.py [--threads 1] [--source builtin:smollm2]

Prints: load time, analyzer time (end to end: dequantise + Grams + Krylov +
all metrics), full-SVD time (dequantise + float64 SVD of every matrix + the
same v1/u1 cosines), the speed-up, and the largest |cos| difference.
Target (issue 5): speed-up >= 10x with the same cosines.
"""

from __future__ import annotations

import argparse
import time

import torch

from flowgeom.continuity import AnalyzeConfig, analyze, open_source
from flowgeom.continuity.analyze import Analyzer


def full_svd_pass(src) -> tuple[dict, float]:
    layout = Analyzer(src, AnalyzeConfig(k=1)).layout
    t0 = time.perf_counter()
    cos = {}
    for role, refs in layout.roles.items():
        prev = None
        cos[role] = []
        for ref in refs:
            U, S, Vh = torch.linalg.svd(ref.extract(src.load(ref.tensor)).double(), full_matrices=False)
            cur = (U[:, 0], Vh[0])
            if prev is not None:
                cos[role].append((float((prev[1] @ cur[1]).abs()), float((prev[0] @ cur[0]).abs())))
            prev = cur
    return cos, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="builtin:smollm2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids LAPACK spin on busy machines)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    src = open_source(args.source)  # parsed once; both passes dequantise every matrix themselves
    t_open = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = analyze(src, AnalyzeConfig(k=args.k, dtype=args.dtype))
    t_fast = time.perf_counter() - t0
    n = sum(len(r["layers"]) for r in report["roles"].values())
    ref, t_svd = full_svd_pass(src)
    diff = max(max(abs(p["v1"] - c[0]), abs(p["u1"] - c[1]))
               for role, r in report["roles"].items() for p, c in zip(r["pairs"], ref[role]))
    print(f"source {args.source}: {n} matrices, threads {args.threads}, open {t_open:.2f}s")
    print(f"analyzer (k={args.k}, {args.dtype}, all metrics, load included): {t_fast:.2f}s")
    print(f"full float64 SVD pass (+ v1/u1 cosines):       {t_svd:.2f}s")
    print(f"speed-up: {t_svd / t_fast:.1f}x   max |cos| difference: {diff:.2e}")
    breakdown(src, args.k)


def breakdown(src, k: int) -> None:
    """Compute only, matrices already in memory (float64): Krylov top-k pairs vs full SVD vs Gram metrics."""
    from flowgeom.continuity.metrics import gram_similarity
    from flowgeom.continuity.spectra import top_singular_pairs

    layout = Analyzer(src, AnalyzeConfig(k=1)).layout
    stacks = [torch.stack([r.extract(src.load(r.tensor)).double() for r in refs]) for refs in layout.roles.values()]
    t0 = time.perf_counter()
    for st in stacks:
        for A in st:
            top_singular_pairs(A, k)
    t_top = time.perf_counter() - t0
    t0 = time.perf_counter()
    for st in stacks:
        for A in st:
            torch.linalg.svd(A, full_matrices=False)
    t_svd = time.perf_counter() - t0
    t0 = time.perf_counter()
    for st in stacks:
        gram_similarity(st[:-1], st[1:], "in"), gram_similarity(st[:-1], st[1:], "out")
    t_gram = time.perf_counter() - t0
    print(f"compute only, in memory: top-{k} pairs (Gram + block Krylov) {t_top:.2f}s vs full SVD {t_svd:.2f}s "
          f"({t_svd / t_top:.1f}x); Gram similarities in+out for all pairs {t_gram:.2f}s")


if __name__ == "__main__":
    main()
