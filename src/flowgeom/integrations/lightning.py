"""``ConservationLightningCallback``: the conservation monitor in one line of a Lightning ``Trainer``.

    trainer = L.Trainer(max_steps=100, callbacks=[ConservationLightningCallback(every=10)])

Same contract as the transformers callback (:mod:`flowgeom.integrations.trainer`),
on Lightning's hooks:

- ``on_fit_start``: θ_0 (the LightningModule's weights; laws located in it,
  whatever it wraps); restored instead from the checkpoint's callback state
  by ``load_state_dict`` when Lightning resumes (``ckpt_path=``), which it
  calls after ``on_fit_start`` — the state waits until the session exists;
- ``on_before_optimizer_step``: the gradients for the predicted drift;
- ``on_train_batch_end``: the step was applied; measure at
  ``trainer.global_step`` (steps taken) every ``every`` steps and send the
  per-family values to every logger of the trainer (TensorBoard, W&B, CSV,
  MLflow) under ``flowgeom/…``;
- ``state_dict`` / ``load_state_dict``: θ_0, denominators, fingerprint and
  history travel inside Lightning's checkpoint; a state of another model is
  refused;
- ``on_fit_end``: verdicts, summary line, ``out/summary.json``, figure.

``out`` defaults to ``<trainer.default_root_dir>/flowgeom``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch.callbacks import Callback

from flowgeom.errors import FlowgeomError, positive_int
from flowgeom.integrations.session import MonitorSession
from flowgeom.laws.verdict import HELD_THRESHOLD


class ConservationLightningCallback(Callback):
    """Measure the conservation laws' drift during ``Trainer.fit``; options as :class:`ConservationCallback`."""

    def __init__(self, *, every: int = 1, out: str | os.PathLike | None = None, threshold: float = HELD_THRESHOLD,
                 predict: str = "auto", optimizer_kind: str | None = None, rebase: bool = False, csv: bool = True,
                 figure: bool = True, writers: tuple = (), **monitor_kwargs: Any):
        positive_int(every, "every", fix="measure every N >= 1 steps")
        self.every, self.out, self.threshold, self.predict = every, out, threshold, predict
        self.optimizer_kind, self.rebase, self.csv, self.figure = optimizer_kind, rebase, csv, figure
        self.writers, self.monitor_kwargs = tuple(writers), monitor_kwargs
        self.session: MonitorSession | None = None
        self.summary: dict[str, Any] | None = None
        self._saved: dict[str, Any] | None = None
        self._last_step = 0

    @property
    def monitor(self):
        return None if self.session is None else self.session.monitor

    def on_fit_start(self, trainer, pl_module) -> None:
        from flowgeom.integrations.writers import CSVWriter, check_writable_dir

        # files are written by the global-zero process only (every process measures the same replicated weights)
        main = getattr(trainer, "is_global_zero", True)
        out = self.out if self.out is not None else os.path.join(trainer.default_root_dir, "flowgeom")
        out = out if main else None
        writers = list(self.writers) if main else []
        if self.csv and main:
            check_writable_dir(out, "flowgeom output folder")
            writers.append(CSVWriter(os.path.join(out, "metrics.csv")))
        optimizers = trainer.optimizers
        if len(optimizers) > 1:
            raise FlowgeomError(f"{len(optimizers)} optimisers: the monitor follows one; train the laws' "
                                "parameters with a single optimiser")
        self.session = MonitorSession(pl_module, optimizers[0] if optimizers else None, every=self.every, out=out,
                                      writers=writers, threshold=self.threshold, predict=self.predict,
                                      optimizer_kind=self.optimizer_kind, figure=self.figure, **self.monitor_kwargs)
        if self._saved is not None:
            self._restore(self._saved)

    def on_train_start(self, trainer, pl_module) -> None:
        # a resume restores the weights and global_step before this hook; its monitor state must have come too
        if trainer.global_step > 0 and self._saved is None and not self.rebase:
            raise FlowgeomError(f"resumed at step {trainer.global_step} without flowgeom monitor state in the "
                                "checkpoint: resume from a checkpoint saved with this callback, or pass rebase=True "
                                "to take the resumed weights as a new θ_0")
        if trainer.global_step > 0 and self._saved is None:
            self.session.monitor.reset()
        self._last_step = trainer.global_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.session.before_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # gradient accumulation: no optimiser step since the last batch
        self._last_step = step
        self.session.after_step()
        record = self.session.measure(step)
        if record is not None:
            scalars = self.session.log_scalars(record)
            for logger in trainer.loggers:
                logger.log_metrics(scalars, step=step)

    def state_dict(self) -> dict[str, Any]:
        if self.session is None:
            return {} if self._saved is None else self._saved
        return self.session.state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._saved = state_dict
        if self.session is not None:
            self._restore(state_dict)

    def _restore(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.session.monitor.fingerprint():
            raise FlowgeomError("the flowgeom monitor state in this checkpoint was saved for another model (its laws "
                                "or parameter shapes differ): refused; resume with the model it was saved for, or "
                                "drop the callback state to start a new θ_0")
        self.session.restore(state)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.session is None or self.session.monitor.last is None:
            return
        self.summary = self.session.finish()
        self._saved = None  # a later fit of the same callback starts from its own θ_0 unless a checkpoint says otherwise
        if getattr(trainer, "is_global_zero", True):
            print(self.summary["line"], file=sys.stderr)
