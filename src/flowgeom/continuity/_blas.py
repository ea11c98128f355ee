"""CPU BLAS/LAPACK kernels for the analyzer's heavy steps, called with the GIL released.

* ``syrk_gram``: ``X^T X`` or ``X X^T`` by ``?syrk``, which computes one
  triangle: half the flops of ``X.mT @ X`` (torch has no syrk).
* ``cross_product``: ``A B^T`` or ``A^T B`` by ``?gemm``; ``matmul``: ``A @ B``.
* ``tridiagonal_top``: the top-k eigenpairs of a symmetric matrix (and,
  when asked, every eigenvalue) from one ``?sytrd`` reduction (``?stemr``,
  ``?ormtr``; ``?sterf`` for all values).

**Why raw function pointers.** scipy publishes the BLAS/LAPACK it links as
C function pointers (``scipy.linalg.cython_blas`` / ``cython_lapack``,
Fortran convention: every argument by address). Called through ``ctypes``
they run with the GIL released, so the analyzer can work on several roles
in parallel threads (one BLAS thread each); scipy's own f2py wrappers keep
the GIL for the whole call. The routines and arguments are those the f2py
wrappers pass (same ``lwork`` queries, upper triangles), so the results are
bit-identical to ``scipy.linalg.blas``/``lapack`` (scipy wraps no ``?ormtr``:
the tests check that product against the reflectors applied one by one;
tests/continuity/test_blas_kernels.py).

**Why not torch for these.** While the kernels run, torch is kept
single-threaded (:func:`cpu_threads`) because libgomp's spin-waiting workers
slow every LAPACK call that follows a torch op (the SmolLM2 analysis went
from 2.6 s to 10.6 s with torch at 2 threads on a 2-vCPU VM), and OpenBLAS's
own spinning workers slow the torch ops that follow in a training loop (the
quick continuity experiments ran 3x slower). torch has no ``syrk`` or
partial eigensolver, and its MKL ``?syevd`` is slower than OpenBLAS's
reduction on the AMD CPUs measured.

A C-ordered (m, n) array is the Fortran-ordered (n, m) matrix ``X^T``, so the
products pass ``.T`` views and BLAS transposition flags: no copies.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import numpy as np
import torch
from scipy.linalg import cython_blas, cython_lapack
from threadpoolctl import ThreadpoolController

from flowgeom.errors import FlowgeomError

_PREFIX = {np.dtype(np.float32): "s", np.dtype(np.float64): "d"}
_SCALAR = {np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}
_DTYPES = (torch.float32, torch.float64)


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


def blas_threads() -> int:
    """scipy's BLAS thread count now (the largest among the BLAS libraries loaded)."""
    return max((info["num_threads"] for info in _controller().select(user_api="blas").info()), default=1)


def supported(*tensors: torch.Tensor) -> bool:
    """Whether these kernels apply: CPU float32/float64 tensors of one dtype."""
    return all(t.device.type == "cpu" and t.dtype in _DTYPES and t.dtype == tensors[0].dtype for t in tensors)


# --- raw routines -------------------------------------------------------------------------------------------

def _capsule_api():
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return name, pointer


@cache
def _routine(name: str):
    """scipy's ``name`` (e.g. ``ssyrk``) as a ctypes function: every argument an address, the GIL released."""
    get_name, get_pointer = _capsule_api()
    module = cython_blas if name in cython_blas.__pyx_capi__ else cython_lapack
    capsule = module.__pyx_capi__[name]
    signature = get_name(capsule)  # b"void (char *, int *, float *, ...)": one address per argument
    return ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * (signature.count(b",") + 1))(get_pointer(capsule, signature))


def _call(name: str, dtype: np.dtype, *args) -> None:
    _routine(_PREFIX[np.dtype(dtype)] + name)(*args)


def _int(value: int):
    return ctypes.byref(ctypes.c_int(value))


def _real(value: float, dtype):
    return ctypes.byref(_SCALAR[np.dtype(dtype)](value))


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _workspace(name: str, dtype, query) -> int:
    """The optimal ``lwork`` of ``name``: ``query(work, lwork=-1)`` writes it into ``work[0]``."""
    work = np.zeros(1, dtype=dtype)
    info = ctypes.c_int(0)
    query(work, info)
    if info.value:
        raise FlowgeomError(f"LAPACK ?{name} workspace query failed (info={info.value})")
    return max(int(work[0]), 1)


def _fortran_t(X: torch.Tensor) -> np.ndarray:
    """``X^T`` as a Fortran-ordered array sharing X's memory (after making X C-contiguous)."""
    return np.ascontiguousarray(X.detach().numpy()).T


# --- products -----------------------------------------------------------------------------------------------

def syrk_gram(X: torch.Tensor, side: str) -> torch.Tensor:
    """``X^T X`` (side "in") or ``X X^T`` ("out") of one (m, n) matrix, symmetric, in X's dtype."""
    a = _fortran_t(X)  # (n, m) Fortran: a a^T = X^T X, a^T a = X X^T
    rows, cols = a.shape
    size, inner, trans = (rows, cols, b"N") if side == "in" else (cols, rows, b"T")
    upper = np.zeros((size, size), dtype=a.dtype, order="F")
    _call("syrk", a.dtype, b"U", trans, _int(size), _int(inner), _real(1.0, a.dtype), _ptr(a), _int(rows),
          _real(0.0, a.dtype), _ptr(upper), _int(size))
    upper = torch.from_numpy(upper)  # zeros below the diagonal
    gram = upper + upper.mT  # one new buffer; the diagonal is counted twice, halved exactly below
    gram.diagonal().mul_(0.5)
    return gram


def _gemm(a: np.ndarray, b: np.ndarray, trans_a: bytes, trans_b: bytes, out: np.ndarray) -> None:
    """``out = op(a) op(b)`` by ``?gemm``; ``a``, ``b``, ``out`` Fortran-ordered 2-D arrays (``.T`` views of C ones)."""
    m, n = out.shape
    inner = a.shape[1] if trans_a == b"N" else a.shape[0]
    _call("gemm", a.dtype, trans_a, trans_b, _int(m), _int(n), _int(inner), _real(1.0, a.dtype), _ptr(a),
          _int(max(a.shape[0], 1)), _ptr(b), _int(max(b.shape[0], 1)), _real(0.0, a.dtype), _ptr(out), _int(max(m, 1)))


def cross_product(A: torch.Tensor, B: torch.Tensor, space: str) -> torch.Tensor:
    """``A B^T`` (space "in": contracts the input dim) or ``A^T B`` ("out") of two (m, n) matrices."""
    at, bt = _fortran_t(A), _fortran_t(B)  # A^T (n, m), B^T (n', m'), Fortran
    if space == "in":  # A B^T = (A^T)^T (B^T): (m, m'), contracting n
        out = np.zeros((at.shape[1], bt.shape[1]), dtype=at.dtype, order="F")
        _gemm(at, bt, b"T", b"N", out)
    else:  # A^T B = (A^T) (B^T)^T: (n, n'), contracting m
        out = np.zeros((at.shape[0], bt.shape[0]), dtype=at.dtype, order="F")
        _gemm(at, bt, b"N", b"T", out)
    return torch.from_numpy(out)


def matmul(A: torch.Tensor, B: torch.Tensor, *, transpose_a: bool = False) -> torch.Tensor:
    """``A @ B`` (or ``A^T @ B``) of stacks (L m n) @ (L n p), one ``?gemm`` per matrix, no copy of ``A``.

    MKL's gemm (torch) is ~4x slower than OpenBLAS's for the tall-skinny
    ``(m x n) @ (n x k)`` products of the top-k pairs on the AMD CPUs measured.
    """
    a = np.ascontiguousarray(A.detach().numpy()).reshape(-1, *A.shape[-2:])
    b = np.ascontiguousarray(B.detach().numpy()).reshape(-1, *B.shape[-2:])
    m = a.shape[2] if transpose_a else a.shape[1]
    out = np.empty((a.shape[0], m, b.shape[-1]), dtype=a.dtype)
    for x, y, z in zip(a, b, out):  # C-ordered z = op(x) y is Fortran z^T = y^T op(x)^T
        _gemm(y.T, x.T, b"N", b"T" if transpose_a else b"N", z.T)
    return torch.from_numpy(out).reshape(*A.shape[:-2], m, b.shape[-1])


# --- symmetric eigenproblems --------------------------------------------------------------------------------

def tridiagonal_top(g: np.ndarray, k: int, *, all_values: bool = True
                    ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """Every eigenvalue (ascending; None unless ``all_values``) and the top-k eigenpairs (descending) of one
    symmetric ``g`` (d d), from one reduction.

    ``?sytrd`` reduces ``g = Q T Q^T`` (T tridiagonal, Q as d-1 Householder
    reflectors; blocked, BLAS-3 for half its flops); ``?sterf`` gives every
    eigenvalue of T in O(d^2); ``?stemr`` (MRRR) the top k eigenvectors z of
    T; ``?ormtr`` applies Q to them (y = Q z, 2 d^2 k flops). ``?syevr``
    does the same reduction but finds a subset by bisection and inverse
    iteration (``?stebz``/``?stein``): 0.4-2 ms more per 576-wide SmolLM2 Gram here.
    The reduction works on the upper triangle: OpenBLAS's ``?sytrd`` took
    15-20% less time that way than on the lower one (576-wide SmolLM2 Grams,
    1 thread, best of 30; docs/continuity.md).
    """
    dt, d = g.dtype, g.shape[0]
    c = np.array(g.T, order="F")  # overwritten by the reflectors; upper triangle = g's lower one
    diag, off, tau = np.empty(d, dt), np.zeros(d, dt), np.empty(max(d - 1, 1), dt)  # off: d long for ?stemr
    info = ctypes.c_int(0)

    def sytrd(work, info, lwork=-1):
        _call("sytrd", dt, b"U", _int(d), _ptr(c), _int(d), _ptr(diag), _ptr(off), _ptr(tau), _ptr(work), _int(lwork),
              ctypes.byref(info))

    lwork = _workspace("sytrd", dt, sytrd)
    sytrd(np.empty(lwork, dt), info, lwork)
    if info.value:
        raise FlowgeomError(f"LAPACK ?sytrd failed (info={info.value}) on a {d}x{d} Gram; the matrix holds NaN/Inf")
    values, sterf_info = None, 0
    if all_values:
        values, scratch = diag.copy(), off[:-1].copy()  # ?sterf overwrites both
        _call("sterf", dt, _int(d), _ptr(values), _ptr(scratch), ctypes.byref(info))
        sterf_info = info.value
    w, y, found, stemr_info = _stemr_top(diag, off, k)
    if sterf_info or stemr_info or found != k:
        raise FlowgeomError(f"LAPACK tridiagonal eigensolver failed (sterf info={sterf_info}, stemr info={stemr_info}, "
                            f"{found} of {k} pairs) on a {d}x{d} Gram; rerun with --solver krylov")

    def ormtr(work, info, lwork=-1):  # y <- Q y, in place
        _call("ormtr", dt, b"L", b"U", b"N", _int(d), _int(k), _ptr(c), _int(d), _ptr(tau), _ptr(y), _int(d),
              _ptr(work), _int(lwork), ctypes.byref(info))

    lwork = _workspace("ormtr", dt, ormtr)
    ormtr(np.empty(lwork, dt), info, lwork)
    if info.value:
        raise FlowgeomError(f"LAPACK ?ormtr failed (info={info.value}) on a {d}x{d} Gram")
    return values, w[:k][::-1].copy(), y[:, ::-1].copy()


def _stemr_top(diag: np.ndarray, off: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``?stemr`` (MRRR) for the top ``k`` eigenpairs of the tridiagonal (diag, off): ``(w, z (d k) F, found, info)``."""
    dt, d = diag.dtype, diag.shape[0]
    w, z = np.empty(d, dt), np.empty((d, k), dt, order="F")
    isuppz, found, info = np.empty(2 * k, np.int32), ctypes.c_int(0), ctypes.c_int(0)

    def stemr(work, iwork, lwork, liwork):
        dd, ee = diag.copy(), off.copy()  # overwritten
        _call("stemr", dt, b"V", b"I", _int(d), _ptr(dd), _ptr(ee), _real(0.0, dt), _real(1.0, dt), _int(d - k + 1),
              _int(d), ctypes.byref(found), _ptr(w), _ptr(z), _int(d), _int(k), _ptr(isuppz),
              ctypes.byref(ctypes.c_int(1)), _ptr(work), _int(lwork), _ptr(iwork), _int(liwork), ctypes.byref(info))

    work, iwork = np.zeros(1, dt), np.zeros(1, np.int32)
    stemr(work, iwork, -1, -1)
    if info.value:
        return w, z, 0, info.value
    lwork, liwork = max(int(work[0]), 1), max(int(iwork[0]), 1)
    stemr(np.empty(lwork, dt), np.empty(liwork, np.int32), lwork, liwork)
    return w, z, found.value, info.value
