"""Crossover of the two top-k eigensolvers (dense ?syevr vs block Krylov) on CPU, by Gram size d.

    .venv/bin/python benchmarks/continuity_solvers.py [--threads 1] [--k 8] [--dims 576,1024,2048,4096]
    .venv/bin/python benchmarks/continuity_solvers.py --source builtin:smollm2 [--every 6]

For each d, a (1.5 d) x d Gaussian matrix with 8 planted spikes (trained
weights are spiked; pure noise is the Krylov worst case) gives the Gram
``G = A^T A`` in float32; both solvers find its top-k eigenpairs and the
script prints their times, the Krylov depth and the largest relative
eigenvalue difference between them. ``spectra.DENSE_MAX_DIM`` (the ``auto``
switch) was set from this table.

``--source builtin:smollm2`` runs the same comparison on a real checkpoint
instead: every ``--every``-th layer of each role (its float32 small-side
Gram), with the Krylov depth reached at the default tolerances (top pair
1e-10, the others 1e-5) and the spectral ratio ``lambda_k / lambda_{k+9}``
(the block is ``k + 8`` wide) that sets the Krylov convergence rate.
Trained LLM weights have flat spectra below the first few directions, so
Krylov needs a deep space there.
"""

from __future__ import annotations

import argparse
import time

import torch
from threadpoolctl import threadpool_limits

from flowgeom.continuity.spectra import DENSE_MAX_DIM, dense_top_eigenpairs, krylov_top_eigenpairs, small_gram


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def on_checkpoint(source: str, k: int, every: int) -> None:
    """Dense vs Krylov per sampled layer of each role of ``source`` (module docstring)."""
    from flowgeom.continuity import open_source
    from flowgeom.continuity.layouts import hints_for
    from flowgeom.continuity.naming import resolve_roles

    src = open_source(source)
    layout = resolve_roles(src.shapes, hints=hints_for(source))
    print(f"{source}, k={k}, every {every}th layer; float32 Grams")
    print(f"{'role':>6s} {'layer':>5s} {'d':>5s} {'dense':>9s} {'krylov':>9s} {'depth':>5s} {'l_k/l_k+9':>9s}")
    for role, refs in layout.roles.items():
        for ref in refs[::every]:
            G = small_gram(ref.load(src).to(torch.float32))[0].unsqueeze(0)
            _, t_dense = timed(lambda: dense_top_eigenpairs(G, k))
            (_, _, _, depth), t_kry = timed(lambda: krylov_top_eigenpairs(G, k))
            lam = torch.linalg.eigvalsh(G[0].double()).flip(0)
            print(f"{role:>6s} {ref.layer:5d} {G.shape[-1]:5d} {t_dense * 1e3:7.1f}ms {t_kry * 1e3:7.1f}ms "
                  f"{depth:5d} {float(lam[k - 1] / lam[k + 8]):9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--dims", default="576,1024,2048,4096")
    ap.add_argument("--source", help="a checkpoint (e.g. builtin:smollm2) instead of planted Gaussian Grams")
    ap.add_argument("--every", type=int, default=6, help="with --source: every N-th layer of each role")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    threadpool_limits(limits=args.threads, user_api="blas")
    if args.source:
        return on_checkpoint(args.source, args.k, args.every)
    g = torch.Generator().manual_seed(0)
    print(f"k={args.k}, threads {args.threads}; auto uses dense for d <= {DENSE_MAX_DIM}")
    print(f"{'d':>6s} {'dense':>9s} {'krylov':>9s} {'depth':>5s} {'faster':>7s} {'max rel dtheta':>15s}")
    for d in map(int, args.dims.split(",")):
        A = torch.randn(int(1.5 * d), d, generator=g) / d ** 0.5
        A[:, :8] *= 3
        G = small_gram(A)[0].unsqueeze(0)
        t0 = time.perf_counter()
        th_d = dense_top_eigenpairs(G, args.k)[0]
        t_dense = time.perf_counter() - t0
        t0 = time.perf_counter()
        th_k, _, _, depth = krylov_top_eigenpairs(G, args.k)
        t_kry = time.perf_counter() - t0
        diff = float(((th_d - th_k).abs() / th_d[..., :1]).max())
        faster = "dense" if t_dense < t_kry else "krylov"
        print(f"{d:6d} {t_dense * 1e3:7.1f}ms {t_kry * 1e3:7.1f}ms {depth:5d} {faster:>7s} {diff:15.1e}")


if __name__ == "__main__":
    main()
