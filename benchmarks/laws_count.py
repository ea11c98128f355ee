"""Benchmark of ``flowgeom.laws.count`` against a naive baseline in the same process.

Baseline: the textbook route — one Python call per field and per bracket (no
vmap), then a dense SVD of everything drawn so far at each depth. The engine:
vmapped blocks of fields, block rank updates, complement tracking from depth 1.

    .venv/bin/python benchmarks/laws_count.py            # targets of issue 3
    .venv/bin/python benchmarks/laws_count.py --scale 60  # largest D within 60 s
    .venv/bin/python benchmarks/laws_count.py --device cuda --scale 60

Targets: relu2 12-18-9 (D = 378) < 2 s; SwiGLU d=16, m=32, out 16 (D = 1,536)
< 5 s; the largest D counted within 60 s (target ≥ 10,000).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from flowgeom.laws.count import count, random_point
from flowgeom.laws.fields import FieldModel, draw_inputs, module_sampler
from flowgeom.nn import build


def naive_count(module, *, seed: int = 0, max_depth: int = 6, tol: float = 1e-9) -> tuple[int, list[int]]:
    """Per-vector loop + dense SVD of all vectors at each depth (float64)."""
    module = module.double()
    model = FieldModel(module)
    gen = torch.Generator().manual_seed(seed)
    theta = model.layout.flatten(random_point(module, gen))
    d = theta.numel()
    sampler = module_sampler(module)
    out_shape = model.output(theta, draw_inputs(sampler, 1, 1, 1, gen, dtype=torch.float64, device="cpu")[0, 0, 0]).shape
    rows, ranks = [], []
    for depth in range(max_depth + 1):
        fn = model.nested(depth)
        n = d + 8 if depth == 0 else max(8, d - ranks[-1] + 8)
        xs = draw_inputs(sampler, n, depth + 1, 16 if depth == 0 else 2, gen, dtype=torch.float64, device="cpu")
        cs = torch.randn(n, depth + 1, xs.shape[2], *out_shape, generator=gen, dtype=torch.float64)
        for i in range(n):  # one Python call per vector
            v, scale = fn(theta, xs[i], cs[i])
            rows.append(v / scale if scale > 0 else v)
        s = torch.linalg.svdvals(torch.stack(rows))  # dense SVD of everything so far
        ranks.append(int((s > tol).sum()))
        if ranks[-1] == d or (depth and ranks[-1] == ranks[-2]):
            break
    return d - ranks[-1], ranks


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def compare(label: str, name: str, opts: dict, target_s: float | None) -> None:
    module = build(name, seed=0, **opts)
    res, t_engine = timed(lambda: count(module, seed=0))
    (laws_naive, ranks_naive), t_naive = timed(lambda: naive_count(build(name, seed=0, **opts)))
    verdict = "" if target_s is None else ("  (target < %.0f s: %s)" % (target_s, "met" if t_engine < target_s else "MISSED"))
    print(f"{label:<34} D={res.parameters:>6}  laws={res.laws:>4} (naive {laws_naive:>4}, catalogue {res.expected})  "
          f"engine {t_engine:7.2f} s  naive {t_naive:7.2f} s  speed-up ×{t_naive / t_engine:5.1f}{verdict}")
    assert res.laws == laws_naive, (res.ranks_by_depth, ranks_naive)


def scale(budget: float, device: str) -> None:
    """Largest full-rank SwiGLU (the O(D³) worst case: every direction is kept) counted within ``budget`` s."""
    print(f"\nlargest D within {budget:.0f} s on {device} (SwiGLU d=m/2=out, {os.cpu_count()} CPUs visible):")
    best = None
    for m in (32, 48, 64, 80, 88, 96, 104, 112, 128, 160, 192, 256):
        d = m // 2
        module = build("swiglu", seed=0, d_model=d, d_hidden=m)
        res, t = timed(lambda: count(module, seed=0, device=device))
        print(f"  swiglu d={d:>3} m={m:>3}: D={res.parameters:>7}  laws={res.laws:>4} (expected {res.expected})  {t:7.2f} s")
        if t > budget:
            break
        best = res.parameters
    print(f"largest D counted within {budget:.0f} s: {best}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=None, help="also find the largest D counted within this many seconds")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float64\n")
    tiny = dict(d_in=2, width=2, d_out=2)
    count(build("relu2", **tiny)), naive_count(build("relu2", **tiny))  # warm-up: first torch.func calls
    compare("relu2 12-18-9", "relu2", dict(d_in=12, width=18, d_out=9), 2.0)
    compare("swiglu d=16 m=32 out 16", "swiglu", dict(d_model=16, d_hidden=32, d_out=16), 5.0)
    compare("linear2 6-4-6 (needs brackets)", "linear2", dict(d_in=6, width=4, d_out=6), None)
    compare("mha d=8 H=2 d_k=2 d_v=3 rope", "mha", dict(d_model=8, heads=2, d_k=2, d_v=3, positions="rope"), None)
    if args.scale:
        scale(args.scale, args.device)


if __name__ == "__main__":
    main()
