"""A user's own loss as a Villani-probe :class:`~flowgeom.langevin.objective.Objective`.

Two ways in:

* ``loss_objective(loss_fn, theta0)``: ``theta0`` is a dict ``name -> tensor``
  (e.g. the trainable parameters of a PEFT model) or one tensor, and
  ``loss_fn`` takes the same structure and returns a scalar ``V``. The probe
  starts its rays at ``theta0``.
* ``load_objective("path/to/file.py:NAME")`` (and ``flowgeom langevin villani
  FILE.py:NAME``): NAME is a zero-argument factory returning ``(loss_fn,
  theta0)`` or an ``Objective``; the file is loaded by
  :mod:`flowgeom.usercode`, the loader ``laws count FILE.py:NAME`` uses.

**LoRA orbit.** When the names of ``theta0`` hold PEFT LoRA pairs
(``….lora_A[.<adapter>].weight`` ``A`` (r, in) and the matching
``….lora_B[.<adapter>].weight`` ``B`` (out, r)), the objective carries their
symmetry orbit: every pair moves as ``B → B M``, ``A → M⁻¹ A`` with ``M`` the
top-left ``r × r`` block of ``M_t = diag(e^t, e^{-t}, 1, …)``. ``B A`` is
unchanged, so an unregularised loss that depends on the adapters only through
``W + s·B A`` is constant along it, which is why such a loss is not Villani
(seed ``004_…``, the LoRA case); a super-quadratic regulariser on ``A`` and
``B`` restores confinement.

The probe works in float64: ``loss_fn`` is evaluated at ``theta0`` in float64
before anything else, and a loss that cannot run there (a float32 model) is
refused with the fix (build the model in float64 in the factory).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

import torch

from flowgeom.errors import FlowgeomError
from flowgeom.langevin.objective import Objective, Params
from flowgeom.usercode import attribute, call_factory, describe

SINGLE = "theta"  # the one name of a tensor theta0
_LORA_A = re.compile(r"(^|\.)lora_A(\.[^.]+)?\.weight$")
RETURNS = "NAME must be a zero-argument factory returning (loss_fn, theta0) or a flowgeom.langevin.Objective"


def lora_pairs(shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, str]]:
    """``(A name, B name)`` of every PEFT LoRA pair in ``shapes`` whose A is (r, in) and B (out, r)."""
    pairs = []
    for name, shape in shapes.items():
        hit = _LORA_A.search(name)
        if not hit:
            continue
        partner = name[:hit.start()] + hit[0].replace("lora_A", "lora_B")
        other = shapes.get(partner)
        if other is not None and len(shape) == 2 and len(other) == 2 and shape[0] == other[1]:
            pairs.append((name, partner))
    return pairs


def _lora_orbit(pairs: list[tuple[str, str]]) -> Callable[[Params, torch.Tensor], Params]:
    def orbit(p: Params, m: torch.Tensor) -> Params:
        out = dict(p)
        for a, b in pairs:
            r = p[a].shape[0]
            block = m[:r, :r]  # (r, r)
            out[b] = p[b] @ block  # (out, r)
            out[a] = torch.linalg.solve(block, p[a])  # (r, in)
        return out

    return orbit


def _check_value(value: object, where: str) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or value.is_complex():
        got = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise FlowgeomError(f"{where} must return a real scalar tensor, got {got}; return the mean loss")
    if not math.isfinite(float(value.detach())):
        raise FlowgeomError(f"{where} is {float(value.detach())} at theta0; the probe needs a finite loss there")


def loss_objective(loss_fn: Callable, theta0: Mapping[str, torch.Tensor] | torch.Tensor, *,
                   name: str = "user loss") -> Objective:
    """An :class:`Objective` for ``V = loss_fn(θ)`` starting at ``theta0`` (dict ``name -> tensor`` or a tensor).

    A dict holding PEFT LoRA pairs gets their orbit (module docstring).
    Raises :class:`FlowgeomError` when ``theta0`` is empty or not real
    tensors, or ``loss_fn`` fails or is not a finite scalar at ``theta0`` in float64.
    """
    if not callable(loss_fn):
        raise FlowgeomError(f"{name}: loss_fn is a {type(loss_fn).__name__}, not a function; {RETURNS}")
    single = isinstance(theta0, torch.Tensor)
    start = {SINGLE: theta0} if single else theta0
    if not isinstance(start, Mapping) or not start:
        raise FlowgeomError(f"{name}: theta0 must be a tensor or a non-empty dict name -> tensor, got "
                            f"{type(theta0).__name__}; e.g. {{n: p for n, p in model.named_parameters() "
                            "if p.requires_grad}")
    for key, t in start.items():
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.numel() == 0:
            got = f"{t.dtype} tensor of {t.numel()} elements" if isinstance(t, torch.Tensor) else type(t).__name__
            raise FlowgeomError(f"{name}: theta0[{key!r}] must be a non-empty floating-point tensor, got {got}")
    theta0 = {k: t.detach().to(torch.float64).clone() for k, t in start.items()}
    shapes = {k: tuple(t.shape) for k, t in theta0.items()}

    def loss(p: Params) -> torch.Tensor:
        """``loss_fn`` with its failures, anywhere on a path, as one FlowgeomError naming where."""
        try:
            return loss_fn(p[SINGLE]) if single else loss_fn(p)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code: any failure is reported with the fix
            radius = math.sqrt(sum(float(t.detach().pow(2).sum()) for t in p.values()))
            raise FlowgeomError(f"{name}: loss_fn raised {describe(exc)} at ‖θ‖ = {radius:.3g} in float64; the "
                                "Villani probe evaluates V in float64 far from theta0: build the model in float64 "
                                "(model.double()) in the factory, and make loss_fn take what theta0 holds") from None

    probe_point = {k: t.clone().requires_grad_(True) for k, t in theta0.items()}
    value = loss(probe_point)
    _check_value(value, f"{name}: loss_fn")
    if not value.requires_grad:
        raise FlowgeomError(f"{name}: loss_fn's value does not depend on theta through torch autograd; compute it "
                            "with torch operations on the tensors it is given (no .detach(), .item() or numpy)")
    pairs = lora_pairs(shapes)
    orbit = _lora_orbit(pairs) if pairs else None
    rank = max((shapes[a][0] for a, _ in pairs), default=0)
    return Objective(name, shapes, loss, orbit, max(rank, 2) if pairs else 0, theta0=theta0)


def as_objective(made: object, *, name: str) -> Objective:
    """What a user's factory returned, as an Objective: an Objective itself, or ``(loss_fn, theta0)``."""
    if isinstance(made, Objective):
        return made
    if isinstance(made, tuple) and len(made) == 2:
        return loss_objective(made[0], made[1], name=name)
    raise FlowgeomError(f"{name} returned a {type(made).__name__}; {RETURNS}")


def load_objective(target: str, *, seed: int = 0) -> Objective:
    """The Objective made by ``FILE.py:NAME`` (``package.module:NAME``), its factory run under ``torch.manual_seed(seed)``.

    The global RNG is restored afterwards (the factory's random weights are
    seeded, the caller's stream untouched).
    """
    factory = attribute(target)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        made = call_factory(factory, target, fix=RETURNS)
    return as_objective(made, name=target)
