"""``ConservationCallback``: the conservation monitor in one line of a ``transformers.Trainer``.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ConservationCallback(every=10)])

Events (transformers 5.23), and why each is used:

- ``on_train_begin``: θ_0 is the model's weights now (after a resume has
  loaded the checkpoint), or, when ``state.global_step > 0`` (a resume), θ_0
  and the denominators come from the checkpoint's ``flowgeom_monitor.safetensors``
  — refused if missing or saved for another model, unless ``rebase=True``;
  θ_0's law values are written to ``<output_dir>/flowgeom_theta0.safetensors``
  (atomic, no pickle), from which ``flowgeom conserve drift`` measures the
  run's checkpoints, so both give the same numbers;
- plain SGD: the monitor follows the optimiser's own steps (a torch step hook,
  after the Trainer's clipping) for the exact drift Σ τ²·h(g);
- ``on_pre_optimizer_step`` / ``on_optimizer_step``: the gradients (clipped,
  accumulated) and the momentum buffers for Kunin et al.'s predicted drift
  (momentum, weight decay);
- ``on_step_end``: measure every ``every`` optimiser steps (``state.global_step``
  counts the steps taken, so the record of step k is θ_k);
- ``on_log``: the latest per-family values (``flowgeom/eps/<family>``,
  ``flowgeom/control/…``, ``flowgeom/ratio/…``, ``flowgeom/pred/…``) are added
  to the Trainer's ``logs``, so TensorBoard, W&B, MLflow and the console get
  them through the Trainer's own reporting. The Trainer calls callbacks in
  list order with one shared ``logs`` dict, and its reporting callbacks come
  first; so the callback moves itself to the front of the Trainer's
  callback list when the Trainer first calls it (``on_init_end``). Per-block
  values go to ``out/metrics.csv``;
- ``on_save``: the monitor's state next to the checkpoint (resume keeps θ_0);
- ``on_train_end``: the verdicts, one summary line (printed and logged),
  ``out/summary.json`` and ``out/figures/conservation.png``.

``out`` defaults to ``<output_dir>/flowgeom``.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from flowgeom.errors import FlowgeomError, positive_int
from flowgeom.integrations.session import STATE_FILE, MonitorSession
from flowgeom.laws.locate import FlowgeomWarning
from flowgeom.laws.verdict import HELD_THRESHOLD


class ConservationCallback(TrainerCallback):
    """Measure the conservation laws' drift during ``Trainer.train()``; see the module docstring.

    Options: ``every`` (steps between measurements), ``out`` (folder for metrics.csv, summary.json,
    figures/), ``threshold`` (held below ε_law/ε_control = 0.1), ``predict`` (auto/on/off),
    ``optimizer_kind`` (when the monitor cannot see the optimiser), ``rebase`` (accept a resume
    without saved monitor state by taking a new θ_0), ``resume_from`` (the checkpoint folder a resume
    starts from, when it is not ``output_dir/checkpoint-<step>``), ``csv``/``figure`` (write them), ``writers``
    (extra :mod:`flowgeom.integrations.writers`), and monitor options (``heads``, ``positions``,
    ``weight_decay``, ``lr``, ``per_block``, ``include_refuted``) as keywords.
    """

    def __init__(self, *, every: int = 1, out: str | os.PathLike | None = None, threshold: float = HELD_THRESHOLD,
                 predict: str = "auto", optimizer_kind: str | None = None, rebase: bool = False, csv: bool = True,
                 figure: bool = True, writers: tuple = (), resume_from: str | os.PathLike | None = None,
                 **monitor_kwargs: Any):
        positive_int(every, "every", fix="measure every N >= 1 steps")
        self.every, self.out, self.threshold, self.predict = every, out, threshold, predict
        self.resume_from = resume_from
        self.optimizer_kind, self.rebase, self.csv, self.figure = optimizer_kind, rebase, csv, figure
        self.writers, self.monitor_kwargs = tuple(writers), monitor_kwargs
        self.session: MonitorSession | None = None
        self.summary: dict[str, Any] | None = None
        self._pending: dict[str, float] = {}

    # The Trainer's reporting callbacks read `logs` before ours could add to it: go first.
    def on_init_end(self, args, state, control, **kwargs):
        self._go_first()

    def _go_first(self) -> bool:
        """Move to the front of the calling CallbackHandler's list; False when no handler is found up the stack."""
        frame = inspect.currentframe().f_back
        for _ in range(6):  # call_event -> on_… (perhaps through a subclass's super()) -> here
            if frame is None:
                break
            handler = frame.f_locals.get("self")
            if isinstance(handler, CallbackHandler) and self in handler.callbacks:
                # moving ourselves from index i to 0 while call_event iterates is safe: the entries after i
                # keep their positions, so none is skipped or called twice
                handler.callbacks.remove(self)
                handler.callbacks.insert(0, self)
                return True
            frame = frame.f_back
        return False

    @property
    def monitor(self):
        return None if self.session is None else self.session.monitor

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from flowgeom.integrations.writers import CSVWriter

        # also when added by trainer.add_callback() after __init__ (no on_init_end then)
        if not self._go_first():
            warnings.warn("ConservationCallback could not move ahead of the Trainer's reporting callbacks: its "
                          "values reach out/metrics.csv but not TensorBoard/W&B/MLflow; pass it in "
                          "Trainer(callbacks=[...])", FlowgeomWarning, stacklevel=2)
        if model is None:
            raise FlowgeomError("the Trainer passed no model to the callback; use transformers.Trainer (5.x)")
        # files are written by the main process only (every process measures the same replicated weights)
        main = state.is_world_process_zero
        out = self.out if self.out is not None else os.path.join(args.output_dir, "flowgeom")
        out = out if main else None
        writers = list(self.writers) if main else []
        resumed = state.global_step > 0
        if self.csv and main:
            from flowgeom.integrations.writers import check_writable_dir

            check_writable_dir(out, "flowgeom output folder")
            writers.append(CSVWriter(os.path.join(out, "metrics.csv")))
        self.session = MonitorSession(model, optimizer, every=self.every, out=out, writers=writers,
                                      threshold=self.threshold, predict=self.predict,
                                      optimizer_kind=self.optimizer_kind, figure=self.figure, **self.monitor_kwargs)
        if resumed:
            # the Trainer does not tell callbacks which folder it resumed from: the one named here, in
            # TrainingArguments, or output_dir/checkpoint-<global_step> (resume_from_checkpoint=True)
            candidates = [c for c in (self.resume_from, getattr(args, "resume_from_checkpoint", None)) if
                          isinstance(c, (str, os.PathLike))]
            candidates.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
            found = [c for c in candidates if os.path.isfile(os.path.join(c, STATE_FILE))]
            if found or not self.rebase:
                self.session.load(found[0] if found else candidates[0])
            else:  # rebase: θ_0 is the resumed weights, and the reference file says so
                self.session.theta0_step = state.global_step
        if main:
            from flowgeom.integrations.writers import check_writable_dir

            self.session.save_reference(check_writable_dir(args.output_dir, "Trainer output_dir"))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.session.before_step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.session.after_step()

    def on_step_end(self, args, state, control, **kwargs):
        record = self.session.measure(state.global_step)
        if record is not None:
            self._pending = self.session.log_scalars(record)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self._pending and "loss" in logs:  # training logs only, not eval metrics
            logs.update(self._pending)
            self._pending = {}

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder):
            self.session.save(folder)

    def on_train_end(self, args, state, control, **kwargs):
        if self.session is None or self.session.monitor.last is None:
            return
        self.summary = self.session.finish()
        if state.is_world_process_zero:
            print(self.summary["line"], file=sys.stderr)
