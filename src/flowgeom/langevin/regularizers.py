"""Super-quadratic regularisers that make attention and LoRA losses Villani (seed ``004_…``).

For one weight matrix ``W`` with ``n = ‖W‖²_F``:

=============  =============================  ==========================================
kind           R(W)                           ∇_W R
=============  =============================  ==========================================
``log``        λ n log(1 + n)                 2λ (log(1 + n) + n / (1 + n)) W
``power``      λ n^{(2+ε)/2} = λ‖W‖_F^{2+ε}   λ (2 + ε) ‖W‖_F^{ε} W
``frobenius``  λ n  (weight decay, control)   2λ W
``none``       0                              0
=============  =============================  ==========================================

``log`` and ``power`` grow faster than quadratically, which is what the
paper's Villani proofs need (``|∇R|²/s − ΔR → ∞``); plain Frobenius is the
quadratic control. A penalty is a *sum over matrices*: each selected tensor
is regularised on its own (``R(W_Q) + R(W_K)``, ``R(U) + R(V)``).

Parameters are picked by name: an explicit list, a regular expression
(``re.search`` on the ``named_parameters`` name), or a preset: ``"qk"``
(``q_proj``/``k_proj`` weights, our attention layout) and ``"lora"`` (HF
PEFT names ``…lora_A….weight`` / ``…lora_B….weight``; PEFT itself is never
imported).

Gradient transforms: :meth:`Regularizer.transform` is the pure map
``g ↦ g + ∇R(θ)`` over dicts ``name -> tensor`` (``(grads, params) -> grads``),
and :func:`chain` composes such maps left to right, so ``Ṽ = L + R₁ + R₂``
is ``chain(R₁.transform(names), R₂.transform(names))`` applied to ``∇L``.
They plug into the Langevin core (``build(..., grad_transform=…)``) and the
:class:`~flowgeom.langevin.Langevin` optimiser (``grad_transform=``), and give
the same numbers as :meth:`Regularizer.add_grad_` (same additions).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, choice_error, finite_number

KINDS = ("none", "log", "power", "frobenius")
GradTransform = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
PRESETS = {
    "qk": r"(^|\.)(q_proj|k_proj)\.weight$",
    "lora": r"(^|\.)lora_[AB](\.[^.]+)?\.weight$",
}


@dataclass(frozen=True)
class Regularizer:
    """``R(W)`` of the table above, with ``λ = lam > 0`` and ``ε = eps > 0``."""

    kind: str = "log"
    lam: float = 1e-3
    eps: float = 0.5

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise choice_error("regulariser", self.kind, KINDS)
        if self.kind != "none":  # the one check of real hyper-parameters: NaN, inf, strings refused by name
            finite_number(self.lam, "regulariser lambda", positive=True, fix="use kind='none' for no regularisation")
        if self.kind == "power":
            finite_number(self.eps, "power regulariser epsilon", positive=True,
                          fix="super-quadratic needs epsilon > 0; use kind='frobenius' for the quadratic case")

    # -- one matrix ------------------------------------------------------------------------
    def value(self, w: torch.Tensor) -> torch.Tensor:
        """``R(W)`` (differentiable)."""
        n = w.pow(2).sum()
        if self.kind == "log":
            return self.lam * n * torch.log1p(n)
        if self.kind == "power":  # n^{1+ε/2} is C² at W = 0, but autograd's second derivative of pow there is 0·∞
            positive = n > 0
            safe = torch.where(positive, n, torch.ones_like(n))
            return self.lam * torch.where(positive, safe.pow(1 + self.eps / 2), torch.zeros_like(n))
        if self.kind == "frobenius":
            return self.lam * n
        return torch.zeros((), dtype=w.dtype, device=w.device)

    def grad(self, w: torch.Tensor) -> torch.Tensor:
        """Closed-form ``∇_W R`` (see the table; tested against autograd)."""
        n = w.detach().pow(2).sum()
        if self.kind == "log":
            return 2 * self.lam * (torch.log1p(n) + n / (1 + n)) * w.detach()
        if self.kind == "power":
            return self.lam * (2 + self.eps) * n.pow(self.eps / 2) * w.detach()
        if self.kind == "frobenius":
            return 2 * self.lam * w.detach()
        return torch.zeros_like(w)

    def laplacian(self, w: torch.Tensor) -> torch.Tensor:
        """Closed-form ``Δ_W R`` for a matrix with ``D`` entries (``r = ‖W‖_F``, ``n = r²``).

        For a radial ``R = f(n)``: ``ΔR = 4 n f''(n) + 2 D f'(n)``.
        """
        n = w.detach().pow(2).sum()
        d = w.numel()
        if self.kind == "log":
            f1 = torch.log1p(n) + n / (1 + n)
            f2 = 1 / (1 + n) + 1 / (1 + n) ** 2
        elif self.kind == "power":
            a = 1 + self.eps / 2
            f1 = a * n.pow(a - 1)
            f2 = a * (a - 1) * n.pow(a - 2) if float(n) > 0 else torch.zeros_like(n)
        elif self.kind == "frobenius":
            f1, f2 = torch.ones_like(n), torch.zeros_like(n)
        else:
            return torch.zeros_like(n)
        return self.lam * (4 * n * f2 + 2 * d * f1)

    # -- many matrices ---------------------------------------------------------------------
    def penalty(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """``Σ_W R(W)`` over ``tensors`` (differentiable)."""
        terms = [self.value(w) for w in tensors]
        if not terms:
            raise FlowgeomError("regulariser selected no parameters; check the names/pattern")
        return torch.stack(terms).sum()

    @torch.no_grad()
    def add_grad_(self, tensors: Iterable[torch.Tensor]) -> None:
        """Add ``∇R`` to each tensor's ``.grad`` in place (no autograd graph)."""
        if self.kind == "none":
            return
        for w in tensors:
            g = self.grad(w)
            if w.grad is None:
                w.grad = g
            else:
                w.grad.add_(g)

    def transform(self, names: Iterable[str] | None = None) -> GradTransform:
        """The gradient transform ``g_n ↦ g_n + ∇R(θ_n)`` for ``n`` in ``names`` (all of ``params`` if ``None``).

        ``names``: parameter names as ``named_parameters()`` spells them (a
        list, the dict :func:`select` returns, or ``(name, parameter)``
        pairs). Pure: returns a new dict; a selected name without a gradient
        gets ``∇R`` alone (as :meth:`add_grad_` does); a name that is not
        being trained is an error that says why. The transform's ``.names``
        holds the names (``None`` for all), so :class:`~flowgeom.langevin.Langevin`
        checks them when it is built.
        """
        chosen = None if names is None else _names(names)

        def apply(grads: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = dict(grads)
            if self.kind == "none":
                return out
            targets = params if chosen is None else chosen
            for n in targets:
                if n not in params:
                    raise FlowgeomError(_not_trained(n, list(params)))
                g = self.grad(params[n])
                out[n] = g if out.get(n) is None else out[n] + g
            return out

        apply.names = chosen  # type: ignore[attr-defined]
        return apply


HOW_TO_NAME = ("pass the parameters with their names: Langevin(model.named_parameters(), …), or groups "
               "{'params': [(name, p) for name, p in model.named_parameters() if p.requires_grad]}")


def _names(names: Iterable[object]) -> tuple[str, ...]:
    """Parameter names from strings or ``(name, parameter)`` pairs; a tensor or other value is refused."""
    if isinstance(names, str):
        raise FlowgeomError(f"Regularizer.transform takes a list of parameter names, got the string {names!r}; "
                            f"write transform([{names!r}])")
    out = []
    for item in names:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            item = item[0]  # a named_parameters() pair
        if not isinstance(item, str):
            raise FlowgeomError(f"Regularizer.transform takes parameter names (str), got a {type(item).__name__}; "
                                "pass names such as select(model, preset='lora') or "
                                "[n for n, p in model.named_parameters() if 'lora_' in n]")
        out.append(item)
    return tuple(out)


def _listing(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit]) or "(none)"
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


def _not_trained(name: str, keys: Sequence[str]) -> str:
    """Why the regulariser cannot find ``name`` among the keys it was given, and the fix."""
    if keys and all(k.isdigit() for k in keys):
        return (f"regulariser names parameter {name!r}, but the optimiser was given its parameters without names "
                f"(it knows them by position: {_listing(list(keys))}); {HOW_TO_NAME}")
    return (f"regulariser names parameter {name!r}, which is not being trained (not given to the optimiser, frozen, "
            f"or without a gradient this step); trained: {_listing(list(keys))}")


def check_transform_names(transform: GradTransform | None, names: Sequence[str] | None) -> None:
    """Before a first step: the parameter names ``transform`` needs (its ``.names``) are among ``names``.

    ``names`` is None when the optimiser was given its parameters without names.
    """
    wanted = getattr(transform, "names", None)
    if not wanted:
        return
    if names is None:
        raise FlowgeomError(f"the gradient transform regularises parameters by name ({_listing(list(wanted), 3)}) but "
                            f"the optimiser was given its parameters without names; {HOW_TO_NAME}")
    known = set(names)
    missing = [n for n in wanted if n not in known]
    if missing:
        raise FlowgeomError(f"the gradient transform names {_listing(missing, 3)}, which the optimiser was not given; "
                            f"its parameters: {_listing(list(names))}; pass every parameter to regularise to the "
                            "optimiser, or fix the names")


def chain(*transforms: GradTransform) -> GradTransform:
    """Compose gradient transforms left to right: ``chain(f, g)(grads, params) = g(f(grads, params), params)``.

    ``.names`` of the chain: every name its parts need (None when none names any).
    """

    def apply(grads: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(grads)
        for t in transforms:
            out = t(out, params)
        return out

    wanted = [n for t in transforms for n in (getattr(t, "names", None) or ())]
    apply.names = tuple(dict.fromkeys(wanted)) or None  # type: ignore[attr-defined]
    return apply


def select(module: nn.Module, *, names: Sequence[str] | None = None, pattern: str | None = None,
           preset: str | None = None) -> dict[str, nn.Parameter]:
    """The parameters of ``module`` to regularise, by exact ``names``, regex ``pattern`` or ``preset``.

    Exactly one selector must be given; an empty selection is an error (a typo
    in a pattern would otherwise silently regularise nothing).
    """
    given = [x is not None for x in (names, pattern, preset)]
    if sum(given) != 1:
        raise FlowgeomError("select parameters with exactly one of names=, pattern= or preset=")
    named = dict(module.named_parameters())
    if names is not None:
        missing = [n for n in names if n not in named]
        if missing:
            raise FlowgeomError(f"no parameter named {', '.join(missing)}; available: {', '.join(named)}")
        chosen = {n: named[n] for n in names}
    else:
        if preset is not None:
            if preset not in PRESETS:
                raise choice_error("parameter preset", preset, PRESETS)
            pattern = PRESETS[preset]
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise FlowgeomError(f"bad parameter pattern {pattern!r}: {exc}") from exc
        chosen = {n: p for n, p in named.items() if rx.search(n)}
    if not chosen:
        raise FlowgeomError(f"no parameter matches {pattern!r}; available: {', '.join(named) or '(none)'}")
    return chosen
