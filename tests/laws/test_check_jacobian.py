"""The check's two reverse-mode Jacobians (one backward per row, batched cotangents) agree with each other
and with torch.func.jacrev, and a fresh ``flowgeom laws list`` imports neither torch._dynamo nor sympy."""

from __future__ import annotations

import subprocess
import sys

import torch

from flowgeom.laws.check import _jacobian


def _rows(mode: str, out_fn, inputs):
    ins = [t.detach().requires_grad_(True) for t in inputs]
    saved = sys.modules.pop("sympy", None) if mode == "loop" else None
    if mode == "batched":
        import sympy  # noqa: F401 - selects the batched path
    try:
        return _jacobian(out_fn(ins), ins)
    finally:
        if saved is not None:
            sys.modules["sympy"] = saved


def test_loop_and_batched_equal_jacrev():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    b = torch.randn(3, generator=g, dtype=torch.float64)
    unused = torch.randn(2, dtype=torch.float64)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)

    def out_fn(p):  # (5,) per-sample scalars; the third input is unused (its rows must be zeros)
        return (torch.tanh(x @ p[0].T + p[1]) ** 2).sum(1)

    loop = _rows("loop", out_fn, [w, b, unused])
    batched = _rows("batched", out_fn, [w, b, unused])
    ref = torch.func.jacrev(lambda w, b: out_fn([w, b]), argnums=(0, 1))(w, b)
    for got in (loop, batched):
        assert [tuple(t.shape) for t in got] == [(5, 3, 4), (5, 3), (5, 2)]
        torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-14)
        assert got[2].abs().max() == 0


def test_laws_show_imports_no_dynamo_nor_sympy():
    code = ("import sys; from flowgeom.cli import main; rc = main(['laws', 'show', 'mha', '--positions', 'rope']); "
            "print(rc, 'torch._dynamo' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "0 False False"
