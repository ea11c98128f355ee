"""The probe's derivatives (plain torch.autograd) equal torch.func's Hessian, and a villani run imports no torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import torch

from flowgeom.langevin.villani import derivatives


def _v(th):
    return (th**4).sum() + (th[:3] ** 2).sum() * th[3:6].pow(2).sum()


def test_exact_laplacian_and_gradient_match_torch_func():
    th = torch.randn(10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    d = derivatives(_v, th, exact=True)
    hess = torch.func.hessian(_v)(th)  # (10, 10), an independent route
    grad = torch.func.grad(_v)(th)
    assert abs(d.laplacian - float(torch.trace(hess))) <= 1e-10 * abs(d.laplacian)
    assert abs(d.grad_sq - float(grad.pow(2).sum())) <= 1e-10 * d.grad_sq and d.value == float(_v(th))


def test_hutchinson_is_unbiased_against_the_trace():
    th = torch.randn(10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    exact = derivatives(_v, th, exact=True).laplacian
    est = derivatives(_v, th, exact=False, probes=4000, generator=torch.Generator().manual_seed(1))
    assert est.laplacian_err > 0 and abs(est.laplacian - exact) < 4 * est.laplacian_err


def test_villani_command_imports_no_dynamo():
    code = ("import sys; from flowgeom.cli import main; rc = main(['langevin', 'villani', '--loss', 'norm2', '--rays', '1', "
            "'--points', '4', '--probes', '2']); print(rc, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "0 False"
