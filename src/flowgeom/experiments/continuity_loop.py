"""The training loop shared by the continuity experiments (MLP and LM).

One loop, any model: it draws batches from an explicit ``torch.Generator``,
measures :class:`~flowgeom.continuity.dynamics.ContinuityTracker` every
``log_every`` steps (after ``backward``, before the update, so step 0 is the
initialisation: gradient coherence before any weight moved), checkpoints every
``ckpt_every`` updates and writes everything into a :class:`RunFolder`.

Robustness contract (tested):

- **resume**: a killed run restarted with ``resume=True`` reloads model,
  optimiser, data-generator and ``W(0)`` from its last checkpoint, drops the
  metric lines logged after it, and reproduces the uninterrupted run's numbers
  exactly on CPU;
- **NaN stop**: a non-finite loss logs that step (the shared divergence line
  of :mod:`flowgeom.experiments.training`), writes ``summary.json`` with
  ``status: "nan"`` (all earlier metrics kept) and stops;
- **seeds**: model init, batches and SVD start blocks all derive from ``seed``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from flowgeom.continuity.dynamics import ContinuityTracker
from flowgeom.errors import FlowgeomError, choice_error, positive_int
from flowgeom.experiments.training import Step, checkpoint_state, loss_hook, restore_checkpoint, train_loop
from flowgeom.runs import RunFolder

OPTIMIZERS = ("sgd", "adam", "adam_b2_0")


def validate_run(cfg: Any, *, positive: Sequence[str], depth_field: str) -> None:
    """Checks shared by the run configs: optimiser name, fields >= 1, >= 2 layers, a finite positive lr."""
    if cfg.optimizer not in OPTIMIZERS:
        raise choice_error("optimizer", cfg.optimizer, OPTIMIZERS)
    for name in (*positive, "steps", "batch", "log_every", "ckpt_every", "k"):
        positive_int(getattr(cfg, name), name)
    if getattr(cfg, depth_field) < 2:
        raise FlowgeomError(
            f"{depth_field} must be >= 2 (continuity compares adjacent layers), got {getattr(cfg, depth_field)}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise FlowgeomError(f"lr must be a positive number, got {cfg.lr}")


def make_optimizer(name: str, params, *, lr: float) -> torch.optim.Optimizer:
    """``sgd`` (momentum 0.9), ``adam`` (β = 0.9, 0.999) or ``adam_b2_0`` (β2 = 0: sign-like steps)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adam_b2_0":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.0))
    raise choice_error("optimizer", name, OPTIMIZERS)


def _progress(total: int, label: str):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    err = Console(stderr=True)
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err, disable=not err.is_terminal, transient=True)


def train_tracked(run: RunFolder, *, config: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                  next_batch: Callable[[torch.Generator], Sequence[torch.Tensor]],
                  loss_fn: Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor],
                  roles: Mapping[str, Sequence[torch.Tensor]], steps: int, log_every: int, ckpt_every: int,
                  seed: int, k: int = 4, resume: bool = False, evaluate: Callable[[nn.Module], dict] | None = None,
                  stop_after: int | None = None, label: str = "train") -> dict[str, Any] | None:
    """Train ``steps`` updates with continuity tracking; returns the summary.

    The ticks are :func:`~flowgeom.experiments.training.train_loop`'s with
    ``final_tick=False``: tick ``t`` draws a batch, backpropagates and
    measures the tracker before the update (so step 0 is the initialisation).
    ``stop_after`` stops after that many updates without finishing the run
    (it simulates a kill in tests and lets long runs be done in slices); the
    return value is then ``None``. A finished run is not retrained on resume.
    """
    run.start(config, resume=resume)
    if resume and run.finished:
        return run.summary()
    gen = torch.Generator().manual_seed(seed + 1)
    tracker = ContinuityTracker(roles, k=k, seed=seed)
    step0 = 0
    ckpt = run.load_checkpoint() if resume else None
    if ckpt is not None:
        step0 = restore_checkpoint(ckpt, model=model, optimizer=optimizer, generator=gen)
        tracker.load_state_dict(ckpt["tracker"])
    if resume:
        run.truncate_metrics(after_step=step0 - 1)

    def forward(t: int) -> float:
        batch = next_batch(gen)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        value = float(loss.detach())
        if math.isfinite(value):  # a non-finite loss ends the run at this tick: no backward
            loss.backward()
        return value

    def save(t: int) -> None:
        run.save_checkpoint(checkpoint_state(t, model=model, optimizer=optimizer, generator=gen,
                                             tracker=tracker.state_dict()))

    with _progress(steps, label) as bar:
        task = bar.add_task(label, total=steps, completed=step0)
        end = train_loop(Step(forward=forward, update=lambda t: optimizer.step()), steps=steps, start=step0,
                         log=run.log, log_every=log_every,
                         hooks=(loss_hook, lambda tick: {"continuity": tracker.measure()}),
                         checkpoint=save, checkpoint_every=ckpt_every, stop_after=stop_after, final_tick=False,
                         progress=lambda done: bar.update(task, completed=done))
    if end.status == "stopped":
        return None
    if end.status == "diverged":
        summary = {"status": "nan", "step": end.step, "loss": end.loss,
                   "message": f"{end.message}; lower the learning rate", "last": end.last}
        run.finish(summary)
        return summary
    summary = {"status": "finished", "steps": steps, "final_loss": end.loss, "last": end.last}
    if evaluate is not None:
        model.eval()
        with torch.no_grad():
            summary["eval"] = evaluate(model)
    run.finish(summary)
    return summary


def log_progress(message: str) -> None:
    """One line of progress on stderr (for sweeps of many runs)."""
    print(message, file=sys.stderr, flush=True)
