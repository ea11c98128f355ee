"""The Langevin optimiser: Euler–Maruyama steps of an overdamped Langevin SDE.

Convention (seed ``004_…``, the paper's SDE for the trainable parameters
``T_t``, e.g. ``(W_Q, W_K)`` or the LoRA factors ``(U, V)``)::

    dθ_t = −∇V(θ_t) dt + √s dB_t                                   (SDE)
    θ_{k+1} = θ_k − η ∇V(θ_k) + √(η s) ξ_k,   ξ_k ~ N(0, I)          (this optimiser)

with step size ``η = lr`` and temperature ``s = temperature``. ``V`` is the
regularised loss ``Ṽ = L + R`` of the paper; ``R`` may be added to the loss
or applied to the gradient as a transform (:mod:`flowgeom.langevin.regularizers`).
The SDE's stationary (Gibbs) density is ``p(θ) ∝ exp(−2 V(θ) / s)``: the
generator ``L f = −∇V·∇f + (s/2) Δf`` has ``L* p = 0`` for that ``p``. The
Euler scheme adds an ``O(η)`` bias (for ``V = a θ²/2`` the chain's variance
is ``s / (a (2 − a η))`` instead of ``s / (2a)``).

Mapping to other SGLD conventions:

* Welling & Teh (2011): ``Δθ = (ε/2) ∇log p(θ) + N(0, ε)`` targets ``p``.
  It is this optimiser with ``V = −log p``, ``lr = ε/2`` and ``s = 2``
  (then ``lr·s = ε`` and ``exp(−2V/s) = p``).
* posteriors' ``sgld`` (``θ ← θ + lr ∇log p + √(2 lr T) ξ``) targets
  ``p^{1/T}``: set ``V = −log p`` and ``s = 2 T``.
* "temperature τ" samplers of ``exp(−V/τ)``: ``s = 2 τ``.

Pure core (in the manner of posteriors' ``sgmcmc/sgld.py`` and optax)::

    transform = build(lr=1e-2, temperature=1e-4, grad_transform=reg)   # hyper-parameters, once
    state = transform.init(params, seed=0)         # LangevinState(step=0, rng=<generator state>)
    params, state = transform.update(state, params, grads)   # one step, new dict, new state

``params`` and ``grads`` are dicts ``name -> tensor``; ``update`` never
touches its inputs (``inplace=True`` writes into ``params`` instead). The
state is the step count ``k`` and the noise generator's state (a uint8
tensor, :meth:`torch.Generator.get_state`), so the same state gives the same
step. :class:`Langevin` is a thin :class:`torch.optim.Optimizer` over the
same step kernel (:func:`langevin_step`) with a live generator; the two give
identical parameters bit for bit (tested).

Schedules: ``lr`` and ``temperature`` may be numbers or callables of the
step index ``k`` (0 for the first step). In :class:`Langevin` a number
``lr`` lives in ``param_group["lr"]``, so any ``torch.optim.lr_scheduler``
drives it.

Randomness: the noise comes from ``generator`` (a ``torch.Generator``) or a
fresh one seeded with ``seed``; never from the global RNG. The generator's
state is part of ``state_dict()`` so a resumed run draws the same noise.

Implementation: per (device, dtype) bucket of a parameter group, one flat
``N(0, I)`` draw is split over the parameters (in order), then
``torch._foreach_add_`` applies the drift and the noise (``foreach=True``,
default); ``foreach=False`` does the same per parameter with identical
arithmetic (tested equal bit for bit).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch

from flowgeom.errors import FlowgeomError, finite_number, positive_int
from flowgeom.langevin.regularizers import GradTransform, check_transform_names

Schedule = float | Callable[[int], float]
_SCHEDULED = ("lr", "temperature")
_SCHEDULE_MARK = "schedule"  # a callable schedule in state_dict (code is never saved)


def _value(schedule: Schedule, step: int, name: str) -> float:
    value = schedule(step) if callable(schedule) else schedule
    return finite_number(value, f"Langevin {name} at step {step}", minimum=0.0, positive=name == "lr",
                         fix="fix the value or the schedule")


def check_hyper(lr: Schedule, temperature: Schedule) -> None:
    """Validate numeric ``lr > 0`` and ``temperature >= 0`` (callables are checked per step)."""
    if not callable(lr):
        _value(lr, 0, "lr")
    if not callable(temperature):
        _value(temperature, 0, "temperature")
    if not (callable(lr) or callable(temperature)) and not math.isfinite(float(lr) * float(temperature)):
        raise FlowgeomError(f"Langevin lr={float(lr):g} times temperature={float(temperature):g} overflows "
                            "(the noise scale sqrt(lr·temperature) is infinite); lower lr or temperature")


# -- the step kernel (shared by the functional core and the torch.optim wrapper) ---------------
def _noise(params: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """One flat N(0, I) draw split into tensors shaped like ``params``."""
    flat = torch.randn(sum(p.numel() for p in params), generator=generator, device=generator.device,
                       dtype=params[0].dtype)  # (sum numel,)
    pieces = flat.to(params[0].device).split([p.numel() for p in params])
    return [piece.view_as(p) for piece, p in zip(pieces, params)]


def _check_representable(params: list[torch.Tensor], lr: float, sigma: float) -> None:
    """Refuse, before any parameter changes, a step whose ``η`` or ``√(η s)`` its parameters' dtype cannot hold.

    torch would raise a bare ``RuntimeError`` (or write ±inf) for ``lr = 1e200`` on float32 parameters; integer
    parameters have no Gaussian noise at all.
    """
    for dtype in {p.dtype for p in params}:
        if not (dtype.is_floating_point or dtype.is_complex):
            raise FlowgeomError(f"Langevin got {str(dtype).replace('torch.', '')} parameters; it samples real "
                                "(floating-point) parameters only: convert them with .float() or leave them out")
        top = torch.finfo(dtype).max
        if lr > top or sigma > top:
            raise FlowgeomError(f"Langevin lr={lr:g} with noise scale sqrt(lr·temperature)={sigma:g} overflows "
                                f"{str(dtype).replace('torch.', '')} parameters (max {top:g}); lower lr or temperature")


@torch.no_grad()
def langevin_step(params: list[torch.Tensor], grads: list[torch.Tensor], *, lr: float, temperature: float,
                  generator: torch.Generator, inplace: bool, foreach: bool = True) -> list[torch.Tensor]:
    """``θ − η g + √(η s) ξ`` for each ``(θ, g)``; ``ξ`` drawn from ``generator`` (advanced).

    One flat draw per (device, dtype) bucket, buckets in order of first
    appearance. ``inplace=True`` writes into ``params`` and returns them;
    otherwise new tensors are returned and ``params`` is left as it was. Both
    run the same kernels in the same order, so they agree bit for bit.
    """
    sigma = math.sqrt(lr * temperature)
    _check_representable(params, lr, sigma)
    out: list[torch.Tensor | None] = [None] * len(params)
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        buckets.setdefault((p.device, p.dtype), []).append(i)
    for idx in buckets.values():
        ps = [params[i] for i in idx]
        gs = [grads[i] for i in idx]
        noise = _noise(ps, generator) if sigma > 0 else None
        if foreach:
            if inplace:
                torch._foreach_add_(ps, gs, alpha=-lr)
                new = ps
            else:
                new = list(torch._foreach_add(ps, gs, alpha=-lr))
            if noise is not None:
                torch._foreach_add_(new, noise, alpha=sigma)
        else:
            new = []
            for j, p in enumerate(ps):
                q = p.add_(gs[j], alpha=-lr) if inplace else p.add(gs[j], alpha=-lr)
                if noise is not None:
                    q.add_(noise[j], alpha=sigma)
                new.append(q)
        for i, q in zip(idx, new):
            out[i] = q
    return out  # type: ignore[return-value]


def check_finite(params: list[torch.Tensor], step: int, lr: float, temperature: float, *,
                 foreach: bool = True) -> None:
    """Raise :class:`FlowgeomError` naming ``step`` when a parameter is NaN or infinite."""
    if not params:
        return
    norms = torch._foreach_norm(params) if foreach else [p.norm() for p in params]
    if not bool(torch.isfinite(torch.stack(norms)).all()):
        raise FlowgeomError(
            f"Langevin chain blew up at step {step}: a parameter became non-finite "
            f"(lr={lr:g}, temperature={temperature:g}); lower lr or temperature, "
            "or add a confining regulariser"
        )


# -- the pure core: build / init / update --------------------------------------------------------
class LangevinState(NamedTuple):
    """What a Langevin chain carries between steps besides its parameters.

    ``step``: the index ``k`` of the next step (schedules are called with it);
    ``rng``: the noise generator's state (``torch.Generator.get_state()``, uint8);
    ``device``: the generator's device (``"cpu"``, ``"cuda:0"``).
    """

    step: int
    rng: torch.Tensor
    device: str


def init(params: Mapping[str, torch.Tensor], *, seed: int = 0,
         generator: torch.Generator | None = None) -> LangevinState:
    """State at step 0: a generator seeded with ``seed`` on the first parameter's device (or ``generator``'s state)."""
    if generator is None:
        first = next(iter(params.values()), None)
        if first is None:
            raise FlowgeomError("Langevin init got no parameters; pass a non-empty dict name -> tensor")
        generator = torch.Generator(device=first.device)
        generator.manual_seed(int(seed))
    return LangevinState(0, generator.get_state(), str(generator.device))


def _generator(state: LangevinState) -> torch.Generator:
    gen = torch.Generator(device=state.device)
    gen.set_state(state.rng)
    return gen


def update(state: LangevinState, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], *,
           lr: Schedule, temperature: Schedule, grad_transform: GradTransform | None = None,
           inplace: bool = False, foreach: bool = True,
           check: bool = True) -> tuple[dict[str, torch.Tensor], LangevinState]:
    """One step ``θ_{k+1} = θ_k − η_k g_k + √(η_k s_k) ξ_k`` over the names of ``params`` with a gradient.

    ``g = grad_transform(grads, params)`` when given (e.g. ``+ ∇R``), else
    ``grads``. A name missing from ``grads`` (or mapped to ``None``) is
    carried over unchanged. Returns the new parameters (a new dict; the
    input tensors are untouched unless ``inplace``) and the new state.
    ``check`` raises :class:`FlowgeomError` on a non-finite result.
    """
    k = state.step
    eta, s = _value(lr, k, "lr"), _value(temperature, k, "temperature")
    if grad_transform is not None:
        grads = grad_transform(grads, params)
    names = [n for n in params if grads.get(n) is not None]
    gen = _generator(state)
    stepped = langevin_step([params[n] for n in names], [grads[n] for n in names], lr=eta, temperature=s,
                            generator=gen, inplace=inplace, foreach=foreach)
    if check:
        check_finite(stepped, k, eta, s, foreach=foreach)
    new = dict(params)
    new.update(zip(names, stepped))
    return new, LangevinState(k + 1, gen.get_state(), state.device)


class LangevinTransform(NamedTuple):
    """``init`` and ``update`` with the hyper-parameters bound (what :func:`build` returns)."""

    init: Callable[..., LangevinState]
    update: Callable[..., tuple[dict[str, torch.Tensor], LangevinState]]


def build(*, lr: Schedule, temperature: Schedule, grad_transform: GradTransform | None = None,
          foreach: bool = True, check: bool = True) -> LangevinTransform:
    """Bind the hyper-parameters: ``init(params, *, seed=0, generator=None)`` and ``update(state, params, grads, *, inplace=False)``."""
    check_hyper(lr, temperature)

    def bound_update(state: LangevinState, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
                     *, inplace: bool = False) -> tuple[dict[str, torch.Tensor], LangevinState]:
        return update(state, params, grads, lr=lr, temperature=temperature, grad_transform=grad_transform,
                      inplace=inplace, foreach=foreach, check=check)

    return LangevinTransform(init, bound_update)


# -- the torch.optim wrapper ------------------------------------------------------------------
class Langevin(torch.optim.Optimizer):
    """Overdamped Langevin (SGLD) optimiser; see the module docstring for the maths.

    A thin :class:`torch.optim.Optimizer` over :func:`langevin_step`: it
    reads ``p.grad``, applies ``grad_transform``, and steps in place with its
    own generator. Same seed, same gradients: same parameters as the
    functional :func:`update` (bit for bit).

    Args:
        params: parameters, ``named_parameters()`` pairs, or parameter groups
            (groups may override ``lr`` and ``temperature``).
        lr: step size ``η > 0`` (number or callable of the step).
        temperature: ``s >= 0`` (number or callable); ``s = 0`` is plain GD.
        generator: the noise source; if absent, ``torch.Generator`` seeded
            with ``seed`` on the first parameter's device.
        seed: seed of the default generator.
        foreach: use the ``torch._foreach_*`` kernels (default) or a loop.
        check_finite: raise :class:`FlowgeomError` when a step produces a
            non-finite parameter (a blown-up chain), naming the step.
        check_every: run that check every ``check_every`` steps (it reads a
            value back from the device: on a GPU it costs a synchronisation).
        grad_transform: ``(grads, params) -> grads``, called once per step over
            the dicts of every parameter with a gradient, all groups together,
            keyed by the names given with them (``named_parameters()`` pairs,
            or groups ``{"params": [(name, p), …]}``) or, without names, by
            the position among all the optimiser's parameters (``"0"``, ``"1"``, …);
            e.g. ``Regularizer("log").transform(names)`` adds ``∇R``. A
            transform that names parameters (``.names``) is checked here,
            before any step: the optimiser must have been given names, and
            these names among them.

    Example (PEFT LoRA, regularising only the adapter factors)::

        reg = Regularizer("log", lam=1e-3)
        opt = Langevin(model.named_parameters(), lr=1e-3, temperature=1e-4,
                       grad_transform=reg.transform(select(model, preset="lora")))
    """

    def __init__(self, params: Iterable[Any], lr: Schedule, temperature: Schedule, *,
                 generator: torch.Generator | None = None, seed: int = 0, foreach: bool = True,
                 check_finite: bool = True, check_every: int = 1, grad_transform: GradTransform | None = None):
        check_hyper(lr, temperature)
        defaults = {"lr": lr, "temperature": temperature}
        try:
            super().__init__(params, defaults)
        except ValueError as exc:  # torch: named and unnamed groups mixed
            if "names" not in str(exc):
                raise
            raise FlowgeomError(f"Langevin got some parameter groups with names and some without ({exc}); "
                                "give every group (name, parameter) pairs, e.g. "
                                "{'params': list(model.named_parameters())}, or none of them") from None
        self.foreach = bool(foreach)
        self.check_finite = bool(check_finite)
        self.check_every = positive_int(check_every, "Langevin check_every", fix="check the weights every N >= 1 steps")
        self.grad_transform = grad_transform
        self.step_count = 0
        if generator is None:
            device = self.param_groups[0]["params"][0].device
            generator = torch.Generator(device=device)
            generator.manual_seed(int(seed))
        self.generator = generator
        check_transform_names(grad_transform, self._names())

    def _names(self) -> list[str] | None:
        """Every parameter's name in group order, or None when the parameters came without names."""
        if not all(group.get("param_names") for group in self.param_groups):
            return None
        return [n for group in self.param_groups for n in group["param_names"]]

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (checkpoints hold no code).

        A callable ``lr``/``temperature`` schedule is code: it is saved as the
        marker ``"schedule"`` and :meth:`load_state_dict` keeps this
        optimiser's own callable in its place.
        """
        state = super().state_dict()
        for group in state["param_groups"]:  # fresh dicts made by torch: safe to edit
            for key in _SCHEDULED:
                if callable(group.get(key)):
                    group[key] = _SCHEDULE_MARK
        state["langevin"] = {"step_count": self.step_count, "generator": self.generator.get_state()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("langevin", None)
        groups = []
        for saved, live in zip(state_dict.get("param_groups", []), self.param_groups):
            saved = dict(saved)
            for key in _SCHEDULED:
                if saved.get(key) == _SCHEDULE_MARK:
                    if not callable(live.get(key)):
                        raise FlowgeomError(f"this state was saved with a callable {key} schedule but the "
                                            f"optimiser has {key}={live.get(key)!r}; build it with the same "
                                            "schedule before loading")
                    saved[key] = live[key]
            groups.append(saved)
        if "param_groups" in state_dict:
            state_dict["param_groups"] = groups + list(state_dict["param_groups"][len(groups):])
        if extra is not None:  # validated before anything is loaded
            self._check_extra(extra)
        super().load_state_dict(state_dict)
        if extra is not None:
            self.step_count = int(extra["step_count"])
            self.generator.set_state(extra["generator"])

    def _check_extra(self, extra: object) -> None:
        """The ``"langevin"`` entry of a state dict: ``{"step_count": int >= 0, "generator": uint8 state}``."""
        fix = "load a state_dict saved by Langevin.state_dict() for this device"
        if not isinstance(extra, Mapping) or "step_count" not in extra or "generator" not in extra:
            raise FlowgeomError(f"Langevin state_dict['langevin'] must be a dict with step_count and generator, got "
                                f"{type(extra).__name__}; {fix}")
        count = extra["step_count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise FlowgeomError(f"Langevin state_dict step_count must be a whole number >= 0, got {count!r}; {fix}")
        gen, want = extra["generator"], self.generator.get_state()
        if not isinstance(gen, torch.Tensor) or gen.dtype != torch.uint8 or gen.shape != want.shape:
            got = f"{gen.dtype} {list(gen.shape)}" if isinstance(gen, torch.Tensor) else type(gen).__name__
            raise FlowgeomError(f"Langevin state_dict generator state must be a uint8 tensor of shape "
                                f"{list(want.shape)} (a {self.generator.device} generator), got {got}; {fix}")
        try:  # torch checks the state's content (e.g. an all-zero Mersenne Twister state) on a scratch generator
            torch.Generator(device=self.generator.device).set_state(gen)
        except RuntimeError as exc:
            raise FlowgeomError(f"Langevin state_dict generator state is invalid ({' '.join(str(exc).split())}); "
                                f"{fix}") from None

    def functional_state(self) -> LangevinState:
        """This optimiser's :class:`LangevinState` (step count and a copy of the generator state)."""
        return LangevinState(self.step_count, self.generator.get_state(), str(self.generator.device))

    # -- the update ---------------------------------------------------------------------------
    def _transformed(self, live: list[list[int]]) -> list[torch.Tensor]:
        """``grad_transform`` applied once to the gradients of every group; flat, in ``live`` order.

        ``live[g]``: the indices (within group ``g``) of the parameters with a gradient.
        """
        flat = [(group["params"][i], key) for group, idx, keys in zip(self.param_groups, live, self._keys())
                for i, key in ((i, keys[i]) for i in idx)]
        grads = {key: p.grad for p, key in flat}
        out = self.grad_transform(grads, {key: p for p, key in flat})
        return [out[key] for _, key in flat]

    def _keys(self) -> list[list[str]]:
        """Per group, the keys its parameters have in ``grad_transform``'s dicts: names, or global positions."""
        names, start, keys = self._names(), 0, []
        for group in self.param_groups:
            n = len(group["params"])
            keys.append(names[start:start + n] if names is not None else [str(i) for i in range(start, start + n)])
            start += n
        return keys

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One Euler–Maruyama step ``θ ← θ − η ∇V + √(η s) ξ`` on every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        k = self.step_count
        live = [[i for i, p in enumerate(group["params"]) if p.grad is not None] for group in self.param_groups]
        grads = iter(self._transformed(live) if self.grad_transform is not None else
                     [group["params"][i].grad for group, idx in zip(self.param_groups, live) for i in idx])
        for group, idx in zip(self.param_groups, live):
            params = [group["params"][i] for i in idx]
            group_grads = [next(grads) for _ in idx]
            if not params:
                continue
            lr = _value(group["lr"], k, "lr")
            temperature = _value(group["temperature"], k, "temperature")
            langevin_step(params, group_grads, lr=lr, temperature=temperature,
                          generator=self.generator, inplace=True, foreach=self.foreach)
            if self.check_finite and k % self.check_every == 0:
                check_finite(params, k, lr, temperature, foreach=self.foreach)
        self.step_count += 1
        return loss


def check_loss(loss: torch.Tensor | float, step: int) -> None:
    """Raise :class:`FlowgeomError` when a training loss is NaN or infinite."""
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    if not math.isfinite(value):
        raise FlowgeomError(
            f"loss became {value} at step {step}: the chain blew up; lower lr or temperature, "
            "or add a confining regulariser"
        )
