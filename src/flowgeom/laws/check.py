"""Independent verification of conservation laws by orthogonality.

h is a conservation law of gradient flow for every data set iff
⟨∇h(θ), ∇_θ⟨c, f(x; θ)⟩⟩ = 0 for all inputs x and output directions c
(the gradient of any loss is a combination of these fields). :func:`check`
measures, in float64 with autograd, the normalised inner products

    viol(h_k, x, c) = |⟨∇h_k, X_{x,c}⟩| / (‖∇h_k‖ · ‖X_{x,c}‖)

over many random (x, c) and a few parameter points, and reports the largest.
A real law sits at round-off (≤ 1e-10); a non-conserved control quantity
shows O(1e-2..1), so the check demonstrably fails when it should.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call  # forward only; reverse mode below is plain torch.autograd

from flowgeom.errors import FlowgeomError, positive_int
from flowgeom.laws.law import Law

DEFAULT_TOLERANCE = 1e-10


@dataclass(frozen=True)
class LawVerdict:
    name: str
    family: str
    status: str
    count: int
    max_violation: float
    passed: bool


@dataclass(frozen=True)
class CheckReport:
    verdicts: tuple[LawVerdict, ...]
    tolerance: float
    n_fields: int
    n_points: int
    dtype: str

    @property
    def max_violation(self) -> float:
        """Largest violation over the items claimed to be laws (status "law")."""
        vals = [v.max_violation for v in self.verdicts if v.status == "law"]
        return max(vals, default=0.0)

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts if v.status == "law")

    def as_dict(self) -> dict:
        return {
            "max_violation": self.max_violation, "passed": self.passed, "tolerance": self.tolerance,
            "fields": self.n_fields, "points": self.n_points, "dtype": self.dtype,
            "items": [v.__dict__ for v in self.verdicts],
        }


def _state(model: nn.Module, dtype: torch.dtype) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    params = {n: p.detach().to(dtype) for n, p in model.named_parameters()}
    buffers = {n: (b.to(dtype) if b.is_floating_point() else b) for n, b in model.named_buffers()}
    if not params:
        raise FlowgeomError(f"{type(model).__name__} has no parameters; nothing can be conserved")
    return params, buffers


def _sample(model: nn.Module, batch: int, gen: torch.Generator, dtype: torch.dtype) -> Tensor:
    if not hasattr(model, "sample_input"):
        raise FlowgeomError(f"{type(model).__name__} has no sample_input(batch, generator); pass inputs explicitly")
    return model.sample_input(batch, gen).to(dtype)


def field_matrix(model: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor,
                 gen: torch.Generator) -> Tensor:
    """Rows X_{x_b, c_b} = ∇_θ⟨c_b, f(x_b; θ)⟩ for each sample b: (B, D), parameter order of ``params``.

    One reverse-mode Jacobian of the per-sample scalars gives all B fields;
    samples are independent because the zoo's blocks act per batch element.
    """
    with torch.no_grad():
        y = functional_call(model, (params, buffers), (x,))
    c = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    p = {n: t.detach().requires_grad_(True) for n, t in params.items()}
    with torch.enable_grad():
        scalars = (functional_call(model, (p, buffers), (x,)) * c).flatten(1).sum(1)  # (B,)
        return torch.cat([j.flatten(1) for j in _jacobian(scalars, list(p.values()))], dim=1)


def _jacobian(out: Tensor, inputs: list[Tensor]) -> list[Tensor]:
    """d out / d inputs for a 1-D ``out`` (n,): one (n, *input.shape) block per input.

    Plain ``torch.autograd``, not ``torch.func.jacrev``: the first torch.func reverse-mode
    call imports all of ``torch._dynamo`` (1–4 s per process). The n rows are one
    batched backward pass (what ``torch.autograd.grad(..., is_grads_batched=True)``
    runs), called below its argument checks, which import sympy through torch.fx
    (~0.5 s) for a shape comparison; if torch moves those internals, one backward
    pass per row gives the same rows (``_jacobian_rows``, ~4× slower).
    """
    n = out.numel()
    eye = torch.eye(n, dtype=out.dtype, device=out.device)  # (n, n) one cotangent per output
    try:
        from torch._vmap_internals import _vmap
        from torch.autograd.graph import _engine_run_backward

        def vjp(cotangent: Tensor):
            return _engine_run_backward((out,), (cotangent,), False, False, tuple(inputs), True, accumulate_grad=False)

        grads = _vmap(vjp, 0, 0, allow_none_pass_through=True)(eye)
    except (ImportError, AttributeError, TypeError):
        return _jacobian_rows(out, inputs)
    return [torch.zeros(n, *t.shape, dtype=t.dtype, device=t.device) if g is None else g
            for g, t in zip(grads, inputs)]


def _jacobian_rows(out: Tensor, inputs: list[Tensor]) -> list[Tensor]:
    """:func:`_jacobian` through the public API only: one backward pass per row of ``out``."""
    n = out.numel()
    rows = [torch.autograd.grad(out[i], inputs, retain_graph=i < n - 1, allow_unused=True) for i in range(n)]
    return [torch.stack([torch.zeros_like(t) if r[k] is None else r[k] for r in rows]) if n else
            torch.zeros(0, *t.shape, dtype=t.dtype, device=t.device) for k, t in enumerate(inputs)]


def law_gradients(laws: Sequence[Law], params: dict[str, Tensor]) -> list[Tensor]:
    """∇h_k for each component k of each law: one (count, D) block per law, parameter order of ``params``.

    All laws go through one reverse-mode Jacobian (one call, not one per law).
    """
    for law in laws:
        missing = [n for n in law.params if n not in params]
        if missing:
            raise FlowgeomError(f"law {law.name!r} uses parameters not in the model: {', '.join(missing)}")
    total = sum(law.count for law in laws)
    p = {n: t.detach().requires_grad_(True) for n, t in params.items()}
    with torch.enable_grad():
        values = torch.cat([law.evaluate(p).reshape(-1) for law in laws])  # (total,)
        jac = _jacobian(values, list(p.values()))  # one (total, *shape) block per parameter
    G = torch.cat([j.reshape(total, -1) for j in jac], dim=1)  # (total, D)
    return list(G.split([law.count for law in laws]))


def _violation(G: Tensor, J: Tensor) -> float:
    num = (G @ J.T).abs()  # (count, B)
    den = G.norm(dim=1, keepdim=True) * J.norm(dim=1)[None, :]
    return float((num / den.clamp_min(torch.finfo(G.dtype).tiny)).max())


def check(model: nn.Module, laws: Sequence[Law], *, n_fields: int = 64, n_points: int = 3, seed: int = 0,
          tolerance: float = DEFAULT_TOLERANCE, dtype: torch.dtype = torch.float64) -> CheckReport:
    """Verify each of ``laws`` (and report controls / refuted claims) on ``model``.

    Points: the model's own θ, then ``n_points − 1`` random perturbations
    θ + N(0, mean|θ_p|²) per parameter tensor. ``n_fields`` random (x, c)
    pairs per point. A law passes when its largest violation ≤ ``tolerance``.
    """
    positive_int(n_fields, "n_fields")
    positive_int(n_points, "n_points")
    gen = torch.Generator().manual_seed(seed)
    base, buffers = _state(model, dtype)
    worst = {id(law): 0.0 for law in laws}
    for point in range(n_points):
        params = base if point == 0 else {
            n: p + p.abs().mean().clamp_min(1e-3) * torch.randn(p.shape, generator=gen, dtype=dtype)
            for n, p in base.items()
        }
        x = _sample(model, n_fields, gen, dtype)
        J = field_matrix(model, params, buffers, x, gen)
        if not laws:
            continue
        for law, G in zip(laws, law_gradients(laws, params)):
            worst[id(law)] = max(worst[id(law)], _violation(G, J))
    verdicts = tuple(
        LawVerdict(law.name, law.family, law.status, law.count, worst[id(law)], worst[id(law)] <= tolerance)
        for law in laws
    )
    return CheckReport(verdicts, tolerance, n_fields, n_points, str(dtype).removeprefix("torch."))


def flow_rate(model: nn.Module, law: Law, *, batch: int = 32, seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    """Relative rate of change of ``law`` under gradient flow on a random regression loss.

    Returns |dh_k/dt| / (‖∇h_k‖ ‖∇L‖) per component, where
    dh/dt = −⟨∇h, ∇L⟩ and L = ½ mean‖f(x) − y‖² with random x, y.
    Zero (round-off) for a conservation law; order one otherwise.
    """
    gen = torch.Generator().manual_seed(seed)
    params, buffers = _state(model, dtype)
    x = _sample(model, batch, gen, dtype)
    with torch.no_grad():
        y = torch.randn(functional_call(model, (params, buffers), (x,)).shape, generator=gen, dtype=dtype)

    p = {n: t.detach().requires_grad_(True) for n, t in params.items()}
    with torch.enable_grad():
        loss = 0.5 * ((functional_call(model, (p, buffers), (x,)) - y) ** 2).sum() / batch
        g = torch.autograd.grad(loss, list(p.values()), allow_unused=True)
    gL = torch.cat([torch.zeros_like(t).flatten() if gi is None else gi.flatten() for gi, t in zip(g, p.values())])
    (G,) = law_gradients([law], params)  # (count, D)
    return (G @ gL).abs() / (G.norm(dim=1) * gL.norm()).clamp_min(torch.finfo(dtype).tiny)
