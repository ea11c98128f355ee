"""Crossover of the two top-k eigensolvers (dense ?syevr vs block Krylov) on CPU, by Gram size d.

    .venv/bin/python benchmarks/continuity_solvers.py [--threads 1] [--k 8] [--dims 576,1024,2048,4096]

For each d, a (1.5 d) x d Gaussian matrix with 8 planted spikes (trained
weights are spiked; pure noise is the Krylov worst case) gives the Gram
``G = A^T A`` in float32; both solvers find its top-k eigenpairs and the
script prints their times, the Krylov depth and the largest relative
eigenvalue difference between them. ``spectra.DENSE_MAX_DIM`` (the ``auto``
switch) was set from this table.
"""

from __future__ import annotations

import argparse
import time

import torch
from threadpoolctl import threadpool_limits

from flowgeom.continuity.spectra import DENSE_MAX_DIM, dense_top_eigenpairs, krylov_top_eigenpairs, small_gram


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--dims", default="576,1024,2048,4096")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    threadpool_limits(limits=args.threads, user_api="blas")
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
