"""Vectorised evaluation of many conservation laws at once (the monitor's fast path).

A :class:`~flowgeom.laws.catalogue.Law` may carry a :class:`Batch`: its
operands (views of the parameters where possible) and a pure *kernel* that
evaluates n laws of the same shape from their operands stacked along a new
leading law axis. :class:`BatchedLaws` groups the laws with the same kernel,
static arguments and operand shapes (e.g. the V/O law of every K/V group of
every layer), stacks each operand once in the parameters' own dtype (only
the slices the laws read), and runs each kernel once per group. The kernels
compute in float64: matrix products on float64 copies of the stacked
operands, sums of squares with ``vector_norm(..., dtype=float64)``, which
casts element by element inside the reduction instead of copying the
(large) MLP and expert weights to float64 first. Laws without a ``Batch``
fall back to ``law.evaluate`` on float64 copies of their own parameters.

Contract of a Batch (checked by the tests against ``law.evaluate`` in float64)::

    kernel(*(x[None] for x in operands(p)), *static)[0] == law.evaluate(p64)   (up to float64 round-off)

where p64 is p in float64; the kernel's result is float64 whatever the operands' dtype.

The kernels, with a leading law axis n on every operand:

- :func:`gram_diff` — upper(Σ_a A_a A_aᵀ − Σ_b B_b B_bᵀ): matrix laws
  (Q/K, V/O per K/V group, LoRA A Aᵀ − BᵀB, deep linear chains);
- :func:`rownorm_diff` — Σ_a ‖A_a[i,:]‖² − Σ_b ‖B_b[i,:]‖² per row i, with
  the first 2·half rows summed in pairs (i, i + half): rescaling laws of gated
  MLPs and experts, RoPE pair laws, QK-norm γ laws;
- :func:`sq_norm` — sums of squares (controls, QK-norm scale laws);
- :func:`col_sum` and :func:`flat` — the router sum and plain values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flowgeom.errors import FlowgeomError

Params = Mapping[str, Tensor]

# Laws are stacked into one kernel call up to this many operand elements: small laws (one per
# head or K/V group) are batched, large ones (an MLP's weights) are reduced in place, without a copy.
STACK_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class Batch:
    """A law's vectorised form: ``kernel(*stacked, *static)`` maps operands (n, ...) to values (n, count).

    ``operands(params)`` returns this law's input tensors, without the law axis.
    """

    kernel: Callable[..., Tensor]
    operands: Callable[[Params], tuple[Tensor, ...]]
    static: tuple[Any, ...] = ()


def upper(m: Tensor) -> Tensor:
    """Upper triangles (diagonal included) of (..., r, r) matrices: (..., r(r+1)/2)."""
    i, j = torch.triu_indices(m.shape[-2], m.shape[-1], device=m.device)
    return m[..., i, j]


def _sq(x: Tensor, dim: int) -> Tensor:
    """Σ x² over ``dim`` in float64.

    Along a contiguous dim the cast happens inside the reduction (no float64 copy of x); across rows
    (a column norm, e.g. of an MLP's down projection) a float64 copy squared in place is faster.
    """
    if x.stride(dim) != 1 and x.shape[dim] > 1:
        return x.to(torch.float64, copy=True).square_().sum(dim)
    return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float64) ** 2


def gram_diff(A: Tensor, B: Tensor) -> Tensor:
    """upper(Σ_a A_a A_aᵀ − Σ_b B_b B_bᵀ): A (n, ka, r, p), B (n, kb, r, q) -> (n, r(r+1)/2)."""
    A, B = A.to(torch.float64), B.to(torch.float64)
    g = (A @ A.transpose(-1, -2)).sum(1) - (B @ B.transpose(-1, -2)).sum(1)  # (n, r, r)
    return upper(g)


def rownorm_diff(A: Tensor, B: Tensor, half: int = 0) -> Tensor:
    """Σ_a ‖A_a[i,:]‖² − Σ_b ‖B_b[i,:]‖² per row i: A (n, ka, rows, p), B (n, kb, rows, q) -> (n, rows − half).

    Rows i and i + half (i < half) are summed (a RoPE rotation pair); rows ≥ 2·half are kept as they are.
    """
    h = _sq(A, -1).sum(1) - _sq(B, -1).sum(1)  # (n, rows)
    if half:
        h = torch.cat([h[:, :half] + h[:, half:2 * half], h[:, 2 * half:]], dim=1)  # (n, rows − half)
    return h


def sq_norm(X: Tensor) -> Tensor:
    """Σ of squares per law and slot c: X (n, c, ...) -> (n, c)."""
    return _sq(X.flatten(2), -1)


def col_sum(X: Tensor) -> Tensor:
    """Σ over rows: X (n, rows, d) -> (n, d)."""
    return X.to(torch.float64).sum(1)


def flat(X: Tensor) -> Tensor:
    """The values themselves: X (n, ...) -> (n, numel)."""
    return X.to(torch.float64).reshape(X.shape[0], -1)


@dataclass(frozen=True)
class _Group:
    kernel: Callable[..., Tensor]
    static: tuple[Any, ...]
    shapes: tuple[torch.Size, ...]
    laws: tuple[int, ...]   # indices into the law list
    pos: Tensor             # (n·count,) where the group's values go in the output


class BatchedLaws:
    """Evaluate ``laws`` (in order, concatenated) on a parameter dict, grouped by kernel and shape.

    ``params`` (any dtype/device) fixes the operand shapes; later calls must pass parameters of the
    same shapes. The result is float64 on the CPU, (Σ counts,).
    """

    def __init__(self, laws: Sequence[Any], params: Params):
        self.laws = tuple(laws)
        counts = [law.count for law in self.laws]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        self.total = starts[-1]
        groups: dict[tuple, list[int]] = {}
        meta: dict[tuple, tuple] = {}
        self._fallback: list[int] = []
        for j, law in enumerate(self.laws):
            b = getattr(law, "batch", None)
            if b is None:
                self._fallback.append(j)
                continue
            ops = b.operands(params)
            shapes = tuple(o.shape for o in ops)
            key = (b.kernel, b.static, shapes, tuple((o.device, o.dtype) for o in ops))
            groups.setdefault(key, []).append(j)
            meta[key] = (b.kernel, b.static, shapes)
        self._groups = []
        for key, idx in groups.items():
            kernel, static, shapes = meta[key]
            pos = torch.cat([torch.arange(starts[j], starts[j + 1]) for j in idx])
            self._groups.append(_Group(kernel, static, shapes, tuple(idx), pos))
        self._starts = starts
        self._fallback_names = sorted({n for j in self._fallback for n in self.laws[j].params})
        self.groups = len(self._groups)

    @torch.no_grad()
    def __call__(self, params: Params) -> Tensor:
        out = torch.empty(self.total, dtype=torch.float64)
        for g in self._groups:
            ops = [self.laws[j].batch.operands(params) for j in g.laws]
            per_call = max(1, STACK_ELEMENTS // max(1, sum(s.numel() for s in g.shapes)))
            res = []
            for c in range(0, len(ops), per_call):
                chunk = ops[c:c + per_call]
                if len(chunk) == 1:
                    stacked = [x[None] for x in chunk[0]]  # (1, *shape) views, no copy (large operands)
                else:
                    stacked = [torch.stack([o[a] for o in chunk]) for a in range(len(g.shapes))]  # (n, *shape)
                res.append(g.kernel(*stacked, *g.static).reshape(-1))
            values = torch.cat(res) if len(res) > 1 else res[0]
            if values.numel() != g.pos.numel():
                law = self.laws[g.laws[0]]
                raise FlowgeomError(f"batched kernel {g.kernel.__name__} gave {values.numel()} values for "
                                    f"{len(g.laws)} laws of {law.count} ({law.name!r}); its Batch is wrong")
            out[g.pos] = values.to("cpu", torch.float64)
        if self._fallback:
            p = {n: params[n].to(torch.float64) for n in self._fallback_names}
            for j in self._fallback:
                out[self._starts[j]:self._starts[j + 1]] = self.laws[j].evaluate(p).reshape(-1).to("cpu")
        return out
