"""The one training loop of the experiments: tick order, kill hook, checkpoints, divergence.

Every experiment (continuity tracker, conservation drift, Darcy phases,
Langevin rate) is the same sequence of *ticks* ``k = start, start+1, …``;
tick ``k`` sees the parameters ``θ_k`` after ``k`` updates and does, in
this order:

1. **kill hook**: with ``stop_after`` set and ``k >= stop_after``, return
   ``status="stopped"`` — as if the process were killed right after ``k``
   updates, before anything else of tick ``k`` (its checkpoint included);
2. **checkpoint**: ``checkpoint(k)`` when ``k % checkpoint_every == 0`` and
   ``start < k < steps`` (the state after ``k`` updates; the state the run
   resumed from, and the finished state, are never rewritten);
3. **forward**: ``loss = step.forward(k)``, the batch loss at ``θ_k``
   (``None`` when the experiment logs no batch loss; its ``update`` computes
   the loss it needs);
4. **measure**: when ``k % log_every == 0`` or ``k`` is the last tick,
   one metrics line ``{**context(k), **hook₁(tick), **hook₂(tick), …}`` is
   handed to ``log`` (hooks run after the forward, so a hook can read the
   loss and the gradients of ``θ_k``, and before the update);
5. **update**: ``step.update(k)`` takes ``θ_k`` to ``θ_{k+1}``, then
   ``progress(k + 1)``.

With ``final_tick=True`` the run has ``steps + 1`` ticks and the last,
``k = steps``, only measures the trained parameters (conservation, Darcy,
Langevin rate); with ``final_tick=False`` it has ``steps`` ticks and the last
measured is ``steps − 1``, before the last update (the continuity tracker
needs a batch gradient, so it measures before each update only).

Why one loop: resume equality and the divergence policy are properties of
this order, so they are proved once (``tests/experiments/test_training_loop.py``)
instead of once per experiment. A run resumed from ``checkpoint(k)`` with
``start=k`` replays ticks ``k, k+1, …`` exactly as the uninterrupted run did,
provided the checkpoint holds everything ``forward``/``update``/hooks read
(model, optimiser, data generator, monitor references).

**Divergence policy**: a non-finite loss from ``forward``, or a
:class:`Diverged` raised by ``forward``, a hook, ``log`` or ``update``
(a blown-up chain, non-finite metrics), ends the loop at that tick: one
metrics line ``{**context(k), **diverged_extra, "loss": loss, "diverged":
True, "message": …}`` is logged (``loss`` only when known) and the loop
returns ``status="diverged"`` with the message. What a diverged run means to
its user stays the experiment's choice (a ``status: "nan"`` summary, a raised
:class:`~flowgeom.errors.FlowgeomError`, an arm marked diverged).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from flowgeom.errors import FlowgeomError, positive_int


class Diverged(FlowgeomError):
    """Raised inside a tick to end the run as diverged; ``loss`` is the offending loss when known."""

    def __init__(self, message: str, *, loss: float | None = None):
        super().__init__(message)
        self.loss = loss


@dataclass(frozen=True)
class Tick:
    """What a measurement hook sees: the tick ``step`` (= updates done) and its batch ``loss`` (or ``None``)."""

    step: int
    loss: float | None


Hook = Callable[[Tick], Mapping[str, Any]]


@dataclass(frozen=True)
class Step:
    """The experiment's half of a tick.

    ``forward(k)`` computes the batch loss at ``θ_k`` (and, if the hooks need
    them, its gradients) and returns it as a float; ``None`` (no ``forward``)
    when nothing is logged per batch. ``update(k)`` takes ``θ_k`` to
    ``θ_{k+1}``; it may compute its own loss and raise :class:`Diverged`.
    """

    update: Callable[[int], None]
    forward: Callable[[int], float | None] | None = None


@dataclass(frozen=True)
class LoopEnd:
    """How the loop ended.

    ``step``: ``steps`` when finished, the updates done when stopped, the
    tick that diverged. ``loss``: the last batch loss computed (NaN if none).
    ``last``: the last metrics line logged (``{}`` if none; never the
    divergence line). ``message``: why it diverged.
    """

    status: Literal["finished", "stopped", "diverged"]
    step: int
    loss: float = math.nan
    last: dict[str, Any] = field(default_factory=dict)
    message: str = ""


def loss_hook(tick: Tick) -> dict[str, Any]:
    """The batch loss as a metrics entry ``{"loss": …}``."""
    return {"loss": tick.loss}


def _step_only(k: int) -> dict[str, Any]:
    return {"step": k}


def train_loop(step: Step, *, steps: int, start: int = 0, log: Callable[[dict[str, Any]], None],
               log_every: int, hooks: Sequence[Hook] = (), context: Callable[[int], Mapping[str, Any]] = _step_only,
               checkpoint: Callable[[int], None] | None = None, checkpoint_every: int = 1,
               stop_after: int | None = None, final_tick: bool = True,
               progress: Callable[[int], None] | None = None,
               diverged_extra: Mapping[str, Any] | None = None) -> LoopEnd:
    """Run ticks ``start …`` to the end (see the module docstring for the order of a tick).

    ``context(k)`` gives the leading keys of every line of tick ``k`` (default
    ``{"step": k}``); ``diverged_extra`` adds keys to the divergence line only.
    """
    for name, value in (("log_every", log_every), ("checkpoint_every", checkpoint_every)):
        positive_int(value, name)
    last_tick = steps if final_tick else steps - 1
    if not 0 <= start <= last_tick + 1:
        raise FlowgeomError(f"start must be in 0..{last_tick + 1} for steps={steps}, got {start}; "
                            "the checkpoint does not belong to this run")
    loss_value, last = math.nan, {}
    for k in range(start, last_tick + 1):
        if stop_after is not None and k >= stop_after:
            return LoopEnd("stopped", k, loss_value, last)
        if checkpoint is not None and start < k < steps and k % checkpoint_every == 0:
            checkpoint(k)
        loss: float | None = None
        try:
            if step.forward is not None:
                loss = step.forward(k)
                if loss is not None:
                    loss_value = loss = float(loss)
                    if not math.isfinite(loss):
                        raise Diverged(f"loss became {loss} at step {k}", loss=loss)
            if k % log_every == 0 or k == last_tick:
                tick = Tick(k, loss)
                line: dict[str, Any] = dict(context(k))
                for hook in hooks:
                    line.update(hook(tick))
                log(line)
                last = line
            if k == steps:
                break
            step.update(k)
        except Diverged as exc:
            bad = exc.loss if exc.loss is not None else loss
            record = {**context(k), **(diverged_extra or {})}
            if bad is not None:
                record["loss"] = loss_value = bad
            record.update({"diverged": True, "message": str(exc)})
            log(record)
            return LoopEnd("diverged", k, loss_value, last, str(exc))
        if progress is not None:
            progress(k + 1)
    return LoopEnd("finished", steps, loss_value, last)


# ---------------------------------------------------------------- the one checkpoint schema

def checkpoint_state(step: int, *, model: Any, optimizer: Any, generator: Any, **extra: Any) -> dict[str, Any]:
    """The checkpoint of every experiment: ``step``, ``model``, ``optimizer``, ``generator`` and its own ``extra``.

    ``model``/``optimizer`` are modules/optimisers (their ``state_dict()`` is
    stored) or already state dicts; ``generator`` is the data generator (its
    ``get_state()``, a uint8 tensor, is stored). Written with
    :meth:`flowgeom.runs.RunFolder.save_checkpoint` (safetensors, no pickle).
    """
    def state(obj: Any) -> Any:
        return obj.state_dict() if hasattr(obj, "state_dict") else obj

    gen = generator.get_state() if hasattr(generator, "get_state") else generator
    return {"step": step, "model": state(model), "optimizer": state(optimizer), "generator": gen, **extra}


def restore_checkpoint(ckpt: Mapping[str, Any], *, model: Any, optimizer: Any, generator: Any) -> int:
    """Load a :func:`checkpoint_state` into ``model``, ``optimizer`` and ``generator``; returns its ``step``."""
    for key in ("step", "model", "optimizer", "generator"):
        if key not in ckpt:
            raise FlowgeomError(f"the checkpoint has no {key!r} entry (keys: {', '.join(sorted(ckpt))}); "
                                "it was not written by this experiment: delete it and rerun without --resume")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    generator.set_state(ckpt["generator"])
    return int(ckpt["step"])
