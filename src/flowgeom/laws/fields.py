"""Gradient fields of a module and their Lie brackets, batched with ``torch.func``.

A module ``f(x; θ)`` with parameters flattened to ``θ ∈ R^D`` defines, for an
input ``x`` and an output weight ``c`` (same shape as ``f(x)``), the vector
field

    X_{x,c}(θ) = ∇_θ ⟨c, f(x; θ)⟩ ∈ R^D.

These fields span the trace ``W(θ)`` of the functional space of Marcotte et
al. (2023, "Abide by the law and follow the flow"); a function ``h`` is a
conservation law of gradient flow for every data set iff ``∇h(θ) ⊥ W(θ)``.
The Lie bracket of two fields is

    [X, Y](θ) = J_Y(θ) X(θ) − J_X(θ) Y(θ),

computed forward-over-reverse: ``J_Y(θ) X(θ)`` is ``torch.func.jvp`` of the
gradient function ``Y`` along the tangent ``X(θ)`` (a Hessian-vector product
for a gradient field). Left-nested brackets
``[X_1, [X_2, [ …, [X_k, X_{k+1}] … ]]]`` span the depth-k part of the Lie
algebra ``Lie(W)``; each one is a pure function of ``(θ, xs, cs)`` so a block
of random draws is one ``vmap`` call, never a Python call per vector.

Convention: ``θ`` is the concatenation of ``module.named_parameters()`` in
order, each flattened row-major (weights ``(out, in)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vmap

from flowgeom.errors import FlowgeomError

# sampler(n, generator) -> (n, *sample): n valid module inputs stacked on a new dim 0.
Sampler = Callable[[int, torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class ParamLayout:
    """Names, shapes and offsets of the flat parameter vector θ (D,)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, module: nn.Module) -> ParamLayout:
        named = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
        return cls(tuple(n for n, _ in named), tuple(s for _, s in named))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def size(self) -> int:
        return sum(self.numels)

    def offsets(self) -> list[int]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return out

    def unflatten(self, theta: torch.Tensor) -> dict[str, torch.Tensor]:
        """θ (D,) -> {name: view of shape}; differentiable, vmap-friendly."""
        parts = torch.split(theta, list(self.numels))
        return {n: p.reshape(s) for n, p, s in zip(self.names, parts, self.shapes)}

    def flatten(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([params[n].reshape(-1) for n in self.names])

    def coordinate(self, index: int) -> tuple[str, tuple[int, ...]]:
        """Flat index -> (parameter name, multi-index)."""
        for name, shape, start, n in zip(self.names, self.shapes, self.offsets(), self.numels):
            if start <= index < start + n:
                local, idx = index - start, []
                for dim in reversed(shape):
                    idx.append(local % dim)
                    local //= dim
                return name, tuple(reversed(idx))
        raise IndexError(index)


class FieldModel:
    """A module seen as ``f(θ, x)`` over a flat θ, with its fields and brackets.

    ``module`` is used through ``functional_call`` only (its own parameters are
    not touched); buffers are passed as they are.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.layout = ParamLayout.of(module)
        self.buffers = dict(module.named_buffers())

    def output(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, (self.layout.unflatten(theta), self.buffers), (x,))

    def field(self, theta: torch.Tensor, xs: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
        """Σ_i X_{x_i,c_i}(θ) = ∇_θ Σ_i ⟨c_i, f(x_i; θ)⟩, (D,), for ``xs`` (p, *sample), ``cs`` (p, *out).

        A sum of a few generators (p inputs) rather than one: a draw then has
        a component along directions only some inputs excite (a ReLU unit
        active on 5% of inputs), which keeps random draws generic.
        """
        per_input = vmap(lambda t, x, c: (c * self.output(t, x)).sum(), in_dims=(None, 0, 0))
        return grad(lambda t: per_input(t, xs, cs).sum())(theta)

    def nested(self, depth: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``g(θ, xs, cs)`` = (left-nested bracket of ``depth + 1`` fields, its scale).

        ``xs`` (depth+1, p, *sample) and ``cs`` (depth+1, p, *out) hold the inputs
        and output weights of the fields X_1 … X_{depth+1};
        g = [X_1, [X_2, … [X_depth, X_{depth+1}] … ]]; depth 0 is X_1 itself.
        The scale ‖J_B A‖ + ‖J_A B‖ is what rounding errors are relative to: a
        bracket that cancels to round-off (e.g. [aV, bV] = 0) must count as
        zero, not be blown up to a unit vector.
        """
        if depth == 0:
            def single(theta, xs, cs):
                v = self.field(theta, xs[0], cs[0])
                return v, torch.linalg.vector_norm(v)

            return single
        inner = self.nested(depth - 1)

        def bracket(theta, xs, cs):
            outer = lambda t: self.field(t, xs[0], cs[0])  # noqa: E731
            a = outer(theta)
            b, db_a, _ = jvp(lambda t: inner(t, xs[1:], cs[1:]), (theta,), (a,), has_aux=True)  # J_B(θ) A(θ)
            _, da_b = jvp(outer, (theta,), (b,))  # J_A(θ) B(θ)
            return db_a - da_b, torch.linalg.vector_norm(db_a) + torch.linalg.vector_norm(da_b)

        return bracket

    def draw(self, theta: torch.Tensor, depth: int, xs: torch.Tensor, cs: torch.Tensor, *, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Brackets for draws ``xs`` (n, depth+1, p, *sample), ``cs`` (n, depth+1, p, *out) -> (n, D), scales (n,)."""
        fn = vmap(self.nested(depth), in_dims=(None, 0, 0))
        parts = [fn(theta, xs[i : i + chunk], cs[i : i + chunk]) for i in range(0, xs.shape[0], chunk)]
        return torch.cat([v for v, _ in parts]), torch.cat([s for _, s in parts])


SEED_LIMIT = 2**63  # seeds are whole numbers in [0, 2**63): what every torch.Generator accepts, on every entry point


def generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``; FlowgeomError (not torch's RuntimeError) for a bad seed."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise FlowgeomError(f"seed must be a whole number in [0, 2**63), got {seed!r}; pass e.g. --seed 0")
    return torch.Generator().manual_seed(seed)


def _user_call(what: str, fn: Callable[[], object]) -> object:
    """Call user code; anything it raises (SystemExit included, Ctrl-C excepted) becomes one FlowgeomError."""
    try:
        return fn()
    except (FlowgeomError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - user code may raise anything, even SystemExit
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise FlowgeomError(f"{what} raised {type(exc).__name__}{': ' + msg if msg else ''}") from None


def module_sampler(module: nn.Module) -> Sampler:
    """Sampler from ``module.sample_input(batch, generator)``: each module input is a batch of one.

    The result is checked on every call: a tensor with ``batch`` rows; a
    wrong type, shape, signature or an exception is a FlowgeomError naming
    ``sample_input`` and what it must return.
    """
    name = f"{type(module).__name__}.sample_input(batch, generator)"

    def sample(n: int, gen: torch.Generator) -> torch.Tensor:
        x = _user_call(name, lambda: module.sample_input(n, gen))
        if not isinstance(x, torch.Tensor):
            raise FlowgeomError(f"{name} returned a {type(x).__name__}; it must return one tensor of shape (batch, ...)")
        if x.dim() == 0 or x.shape[0] != n:
            raise FlowgeomError(f"{name} returned shape {tuple(x.shape)} for batch = {n}; "
                                f"it must return a tensor whose first dim is batch ({n}, ...)")
        return x.unsqueeze(1)  # (n, 1, ...)

    return sample


def shape_sampler(shape: tuple[int, ...]) -> Sampler:
    """Sampler of standard-normal inputs of exactly ``shape`` (one sample per draw)."""
    return lambda n, generator: torch.randn(n, *shape, generator=generator, dtype=torch.float64)


def draw_inputs(sampler: Sampler, n: int, slots: int, per_field: int, generator: torch.Generator, *, dtype, device) -> torch.Tensor:
    """(n, slots, per_field, *sample): independent module inputs from ``sampler``.

    FlowgeomError when the sampler fails, returns something other than a
    tensor of ``n * slots * per_field`` rows, or floating inputs with NaN/Inf.
    """
    total = n * slots * per_field
    x = _user_call("the input sampler", lambda: sampler(total, generator))  # (total, *sample)
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != total:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise FlowgeomError(f"the input sampler returned {got} for {total} inputs; it must return a tensor ({total}, ...)")
    if x.is_floating_point() or x.is_complex():
        if not bool(torch.isfinite(x).all()):
            raise FlowgeomError("the sampled inputs contain NaN or Inf; sample_input must return finite values")
        if x.is_floating_point():
            x = x.to(dtype=dtype)
    return x.to(device=device).reshape(n, slots, per_field, *x.shape[1:])


def forward_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes of every intermediate tensor of one forward ``module(x)``, counted on the meta device.

    ``module`` and ``x`` live on the meta device (shapes only, nothing is
    allocated); each dispatched op adds the size of its outputs. An upper
    bound on the activations autograd keeps; 0 when the forward cannot run on
    meta tensors (the estimate then rests on the parameter terms alone).
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class _Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            _Count.total += sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    try:
        with _Count(), torch.no_grad():
            module(x)
    except Exception:  # noqa: BLE001 - an estimate only; some ops have no meta kernel
        return 0
    return _Count.total
