"""CPU BLAS kernels for the analyzer's two heavy products, through scipy's BLAS.

* ``syrk_gram``: ``X^T X`` or ``X X^T`` by ``?syrk``, which computes one
  triangle: half the flops of ``X.mT @ X`` (torch has no syrk).
* ``cross_product``: ``A B^T`` or ``A^T B`` by ``?gemm``.

Why not torch for the second: while these kernels run, torch is kept
single-threaded (:func:`cpu_threads`) because libgomp's spin-waiting workers
slow every LAPACK call that follows a torch op (the SmolLM2 analysis went
from 2.6 s to 10.6 s with torch at 2 threads on a 2-vCPU VM), and OpenBLAS's
own spinning workers slow the torch ops that follow in a training loop (the
quick continuity experiments ran 3x slower). The heavy products therefore go
to scipy's OpenBLAS, whose thread count :func:`cpu_threads` sets.

A C-ordered (m, n) array is the Fortran-ordered (n, m) matrix ``X^T``, so every
call below passes ``.T`` views and BLAS transposition flags: no copies.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import numpy as np
import torch
from scipy.linalg import blas
from threadpoolctl import ThreadpoolController

_SYRK = {torch.float32: blas.ssyrk, torch.float64: blas.dsyrk}
_GEMM = {torch.float32: blas.sgemm, torch.float64: blas.dgemm}


@cache
def _controller() -> ThreadpoolController:
    return ThreadpoolController()  # scans the loaded libraries once (~1 ms); limit() is then ~10 us


@contextmanager
def cpu_threads(blas_threads: int | None = None) -> Iterator[None]:
    """Torch at one thread and scipy's BLAS at ``blas_threads`` (None: unchanged) for the duration.

    Both are restored afterwards, so a training loop around a measurement keeps its own settings.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if blas_threads is None:
            yield
        else:
            with _controller().limit(limits=blas_threads, user_api="blas"):
                yield
    finally:
        torch.set_num_threads(before)


def supported(*tensors: torch.Tensor) -> bool:
    """Whether the scipy kernels apply: CPU float32/float64 tensors of one dtype."""
    return all(t.device.type == "cpu" and t.dtype in _SYRK and t.dtype == tensors[0].dtype for t in tensors)


def _fortran_t(X: torch.Tensor) -> np.ndarray:
    """``X^T`` as a Fortran-ordered array sharing X's memory (after making X C-contiguous)."""
    return np.ascontiguousarray(X.detach().numpy()).T


def syrk_gram(X: torch.Tensor, side: str) -> torch.Tensor:
    """``X^T X`` (side "in") or ``X X^T`` ("out") of one (m, n) matrix, symmetric, in X's dtype."""
    upper = torch.from_numpy(_SYRK[X.dtype](1.0, _fortran_t(X), trans=0 if side == "in" else 1))  # zeros below
    gram = upper + upper.mT  # one new buffer; the diagonal is counted twice, halved exactly below
    gram.diagonal().mul_(0.5)
    return gram


def cross_product(A: torch.Tensor, B: torch.Tensor, space: str) -> torch.Tensor:
    """``A B^T`` (space "in": contracts the input dim) or ``A^T B`` ("out") of two (m, n) matrices."""
    at, bt = _fortran_t(A), _fortran_t(B)  # A^T (n, m), B^T (n', m')
    if space == "in":  # A B^T = (A^T)^T (B^T)
        return torch.from_numpy(_GEMM[A.dtype](1.0, at, bt, trans_a=1))
    return torch.from_numpy(_GEMM[A.dtype](1.0, at, bt, trans_b=1))  # A^T B = (A^T) (B^T)^T
