"""The check's reverse-mode Jacobians (one batched backward pass, or one pass per row) agree with
torch.func.jacrev, and a fresh ``flowgeom laws show`` imports neither torch._dynamo nor sympy."""

from __future__ import annotations

import subprocess
import sys

import torch

from flowgeom.laws.check import _jacobian, _jacobian_rows


def test_batched_and_per_row_equal_jacrev():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, generator=g, dtype=torch.float64)
    b = torch.randn(3, generator=g, dtype=torch.float64)
    unused = torch.randn(2, dtype=torch.float64)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)

    def out_fn(p):  # (5,) per-sample scalars; the third input is unused (its rows must be zeros)
        return (torch.tanh(x @ p[0].T + p[1]) ** 2).sum(1)

    ref = torch.func.jacrev(lambda w, b: out_fn([w, b]), argnums=(0, 1))(w, b)
    for jac in (_jacobian, _jacobian_rows):
        ins = [t.clone().requires_grad_(True) for t in (w, b, unused)]
        got = jac(out_fn(ins), ins)
        assert [tuple(t.shape) for t in got] == [(5, 3, 4), (5, 3), (5, 2)]
        torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-14)
        assert got[2].abs().max() == 0


def test_laws_show_imports_no_dynamo_nor_sympy():
    code = ("import sys; from flowgeom.cli import main; rc = main(['laws', 'show', 'mha', '--positions', 'rope']); "
            "print(rc, 'torch._dynamo' in sys.modules, 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "0 False False"
