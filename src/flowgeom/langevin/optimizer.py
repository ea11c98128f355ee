"""The Langevin optimiser: Euler–Maruyama steps of an overdamped Langevin SDE.

Convention (seed ``004_…``, the paper's Eq. for ``T_t``)::

    dθ_t = −∇V(θ_t) dt + √s dB_t                                   (SDE)
    θ_{k+1} = θ_k − η ∇V(θ_k) + √(η s) ξ_k,   ξ_k ~ N(0, I)          (this optimiser)

with step size ``η = lr`` and temperature ``s = temperature``. The SDE's
stationary (Gibbs) density is ``p(θ) ∝ exp(−2 V(θ) / s)``: the generator
``L f = −∇V·∇f + (s/2) Δf`` has ``L* p = 0`` for that ``p``. The Euler scheme
adds an ``O(η)`` bias (for ``V = a θ²/2`` the chain's variance is
``s / (a (2 − a η))`` instead of ``s / (2a)``).

Mapping to other SGLD conventions:

* Welling & Teh (2011): ``Δθ = (ε/2) ∇log p(θ) + N(0, ε)`` targets ``p``.
  It is this optimiser with ``V = −log p``, ``lr = ε/2`` and ``s = 2``
  (then ``lr·s = ε`` and ``exp(−2V/s) = p``).
* posteriors' ``sgld`` (``θ ← θ + lr ∇log p + √(2 lr T) ξ``) targets
  ``p^{1/T}``: set ``V = −log p`` and ``s = 2 T``.
* "temperature τ" samplers of ``exp(−V/τ)``: ``s = 2 τ``.

Schedules: ``lr`` and ``temperature`` may be numbers or callables of the
step index ``k`` (0 for the first step). A number ``lr`` lives in
``param_group["lr"]``, so any ``torch.optim.lr_scheduler`` drives it.

Randomness: the noise comes from ``generator`` (a ``torch.Generator``) or a
fresh one seeded with ``seed``; never from the global RNG. The generator's
state is part of ``state_dict()`` so a resumed run draws the same noise.

Implementation: per parameter group, one flat ``N(0, I)`` draw is split over
the parameters, then ``torch._foreach_add_`` applies the drift and the noise
(``foreach=True``, default); ``foreach=False`` does the same per parameter
with identical arithmetic (tested equal bit for bit).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from flowgeom.errors import FlowgeomError

Schedule = float | Callable[[int], float]
_SCHEDULED = ("lr", "temperature")
_SCHEDULE_MARK = "schedule"  # a callable schedule in state_dict (code is never saved)


def _value(schedule: Schedule, step: int, name: str) -> float:
    value = schedule(step) if callable(schedule) else schedule
    value = float(value)
    if not math.isfinite(value) or value < 0 or (name == "lr" and value == 0):
        raise FlowgeomError(
            f"Langevin {name} at step {step} is {value!r}; it must be a finite number "
            f"{'> 0' if name == 'lr' else '>= 0'} (fix the value or the schedule)"
        )
    return value


def check_hyper(lr: Schedule, temperature: Schedule) -> None:
    """Validate numeric ``lr > 0`` and ``temperature >= 0`` (callables are checked per step)."""
    if not callable(lr):
        _value(lr, 0, "lr")
    if not callable(temperature):
        _value(temperature, 0, "temperature")


class Langevin(torch.optim.Optimizer):
    """Overdamped Langevin (SGLD) optimiser; see the module docstring for the maths.

    Args:
        params: parameters or parameter groups (groups may override ``lr`` and
            ``temperature``).
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
    """

    def __init__(self, params: Iterable[Any], lr: Schedule, temperature: Schedule, *,
                 generator: torch.Generator | None = None, seed: int = 0, foreach: bool = True,
                 check_finite: bool = True, check_every: int = 1):
        check_hyper(lr, temperature)
        defaults = {"lr": lr, "temperature": temperature}
        super().__init__(params, defaults)
        self.foreach = bool(foreach)
        self.check_finite = bool(check_finite)
        if int(check_every) < 1:
            raise FlowgeomError(f"check_every must be >= 1, got {check_every}")
        self.check_every = int(check_every)
        self.step_count = 0
        if generator is None:
            device = self.param_groups[0]["params"][0].device
            generator = torch.Generator(device=device)
            generator.manual_seed(int(seed))
        self.generator = generator

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
        super().load_state_dict(state_dict)
        if extra is not None:
            self.step_count = int(extra["step_count"])
            self.generator.set_state(extra["generator"])

    # -- the update ---------------------------------------------------------------------------
    def _noise(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """One flat N(0, I) draw split into tensors shaped like ``params``."""
        total = sum(p.numel() for p in params)
        flat = torch.randn(total, generator=self.generator, device=self.generator.device,
                           dtype=params[0].dtype)  # (sum numel,)
        pieces = flat.to(params[0].device).split([p.numel() for p in params])
        return [piece.view_as(p) for piece, p in zip(pieces, params)]

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One Euler–Maruyama step ``θ ← θ − η ∇V + √(η s) ξ`` on every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        k = self.step_count
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr = _value(group["lr"], k, "lr")
            temperature = _value(group["temperature"], k, "temperature")
            sigma = math.sqrt(lr * temperature)
            grads = [p.grad for p in params]
            buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
            for i, p in enumerate(params):  # one flat noise draw per (device, dtype)
                buckets.setdefault((p.device, p.dtype), []).append(i)
            for idx in buckets.values():
                ps = [params[i] for i in idx]
                gs = [grads[i] for i in idx]
                noise = self._noise(ps) if sigma > 0 else None
                if self.foreach:
                    torch._foreach_add_(ps, gs, alpha=-lr)
                    if noise is not None:
                        torch._foreach_add_(ps, noise, alpha=sigma)
                else:
                    for j, p in enumerate(ps):
                        p.add_(gs[j], alpha=-lr)
                        if noise is not None:
                            p.add_(noise[j], alpha=sigma)
            if self.check_finite and k % self.check_every == 0:
                self._check(params, k, lr, temperature)
        self.step_count += 1
        return loss

    def _check(self, params: list[torch.Tensor], k: int, lr: float, temperature: float) -> None:
        norms = torch._foreach_norm(params) if self.foreach else [p.norm() for p in params]
        if not bool(torch.isfinite(torch.stack(norms)).all()):
            raise FlowgeomError(
                f"Langevin chain blew up at step {k}: a parameter became non-finite "
                f"(lr={lr:g}, temperature={temperature:g}); lower lr or temperature, "
                "or add a confining regulariser"
            )


def check_loss(loss: torch.Tensor | float, step: int) -> None:
    """Raise :class:`FlowgeomError` when a training loss is NaN or infinite."""
    value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
    if not math.isfinite(value):
        raise FlowgeomError(
            f"loss became {value} at step {step}: the chain blew up; lower lr or temperature, "
            "or add a confining regulariser"
        )
