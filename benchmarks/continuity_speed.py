"""SmolLM2 continuity analysis vs full-SVD passes over the same 210 matrices, in the same process.

    .venv/bin/python benchmarks/continuity_speed.py [--threads 1] [--source builtin:smollm2] [--k 8]

Every pass starts from the opened source and dequantises each matrix itself
(GGUF Q4_1 for SmolLM2), so "end to end" includes the same load in all rows;
the load-only pass is timed too and subtracted for the "compute" column.

Rows:
* analyzer, all metrics (the CLI default: float32, solver auto = dense
  ?syevr on the small-side Gram at this size, sigma^2-Gram similarity);
* analyzer ``--no-gram`` (v1, u1, top-k subspace, index-matched: what a full
  SVD pass gives);
* analyzer with ``--solver krylov`` (block Krylov in float64);
* full SVD pass in float64 and in float32 (``torch.linalg.svd`` of every
  matrix, then the same adjacent-layer v1/u1 cosines).

Prints the speed-up of each analyzer row against both SVD passes and the
largest |cos| difference between the analyzer and the float64 SVD.
Target (issue 5): >= 10x against a full-SVD pass with the same cosines.
"""

from __future__ import annotations

import argparse
import time

import torch
from threadpoolctl import threadpool_limits

from flowgeom.continuity import AnalyzeConfig, analyze, open_source
from flowgeom.continuity.analyze import Analyzer


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def load_pass(src, layout) -> None:
    for refs in layout.roles.values():
        for ref in refs:
            ref.extract(src.load(ref.tensor)).float()


def full_svd_pass(src, layout, dtype: torch.dtype) -> dict[str, list[tuple[float, float]]]:
    """Adjacent-layer (v1, u1) |cos| per role from a full SVD of every matrix."""
    cos = {}
    for role, refs in layout.roles.items():
        prev, cos[role] = None, []
        for ref in refs:
            U, _, Vh = torch.linalg.svd(ref.extract(src.load(ref.tensor)).to(dtype), full_matrices=False)
            cur = (U[:, 0].double(), Vh[0].double())
            if prev is not None:
                cos[role].append((float((prev[1] @ cur[1]).abs()), float((prev[0] @ cur[0]).abs())))
            prev = cur
    return cos


def report_cos(report: dict) -> dict[str, list[tuple[float, float]]]:
    return {role: [(p["v1"], p["u1"]) for p in r["pairs"]] for role, r in report["roles"].items()}


def max_cos_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for role in a for pa, pb in zip(a[role], b[role]) for x, y in zip(pa, pb))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="builtin:smollm2")
    ap.add_argument("--threads", type=int, default=1, help="torch and BLAS threads (1 avoids LAPACK spin on busy machines)")
    ap.add_argument("--k", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    threadpool_limits(limits=args.threads, user_api="blas")
    src, t_open = timed(lambda: open_source(args.source))
    layout = Analyzer(src, AnalyzeConfig(k=1)).layout
    n = sum(len(refs) for refs in layout.roles.values())
    _, t_load = timed(lambda: load_pass(src, layout))
    rows = {}
    for label, cfg in (("analyzer, all metrics (default)", AnalyzeConfig(k=args.k, dtype="float32")),
                       ("analyzer --no-gram", AnalyzeConfig(k=args.k, dtype="float32", gram=False)),
                       ("analyzer --solver krylov", AnalyzeConfig(k=args.k, dtype="float32", solver="krylov"))):
        rows[label] = timed(lambda cfg=cfg: analyze(src, cfg))
    svd64, t64 = timed(lambda: full_svd_pass(src, layout, torch.float64))
    svd32, t32 = timed(lambda: full_svd_pass(src, layout, torch.float32))

    print(f"source {args.source}: {n} matrices, k={args.k}, threads {args.threads}, open {t_open:.2f}s, "
          f"load (dequantise all) {t_load:.2f}s")
    print(f"{'pass':34s} {'end to end':>10s} {'compute':>8s} {'vs SVD64':>9s} {'vs SVD32':>9s} "
          f"{'compute vs 64/32':>17s} {'max|dcos| vs SVD64':>19s}")
    for label, t in (("full SVD, float64", t64), ("full SVD, float32", t32)):
        print(f"{label:34s} {t:9.2f}s {t - t_load:7.2f}s")
    for label, (report, t) in rows.items():
        c = t - t_load
        print(f"{label:34s} {t:9.2f}s {c:7.2f}s {t64 / t:8.1f}x {t32 / t:8.1f}x "
              f"{(t64 - t_load) / c:8.1f}x/{(t32 - t_load) / c:.1f}x {max_cos_diff(report_cos(report), svd64):19.1e}")
    print(f"float32 SVD vs float64 SVD: max |dcos| {max_cos_diff(svd32, svd64):.1e}")


if __name__ == "__main__":
    main()
