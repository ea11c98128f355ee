"""One monitored training run, whatever the framework: the contract both callbacks share.

The Trainer and Lightning callbacks are thin adapters over :class:`MonitorSession`,
which holds the order of events once:

1. ``MonitorSession(model, optimizer, …)`` at the start of training takes θ_0
   (or :meth:`load` restores θ_0 and the denominators from a checkpoint);
2. per optimiser step: under plain SGD the monitor follows the optimiser's
   own steps (a step hook: the gradient the step used, clipping included) and
   accumulates the exact discretisation drift Σ τ²·h(g)
   (:class:`flowgeom.laws.predict.SGDPrediction`); with momentum or weight
   decay :meth:`before_step` (gradients are final: clipped, accumulated) and
   :meth:`after_step` (the step is applied) feed Kunin et al.'s predicted
   drift (:class:`flowgeom.laws.predict.DriftPredictor`);
3. :meth:`measure` with the number of steps taken: every ``every`` steps a
   record (ε per family and block, controls, ``ratio/<family>`` = ε_law /
   ε_control, predicted drift) goes to the writers and to ``history``;
4. :meth:`save` next to each checkpoint, :meth:`finish` at the end: verdicts,
   the summary line, ``summary.json`` and the figure in ``out``.

State saved with a checkpoint (``flowgeom_monitor.safetensors``, flowgeom's
pickle-free format, :func:`flowgeom.runs.encode_checkpoint`): θ_0's law values,
ε's denominators, the monitor's fingerprint (laws and parameter shapes), the
predictions' state and the per-family history. A state whose fingerprint does
not match the model is refused, never silently re-based.

θ_0 itself (:meth:`save_reference`, ``flowgeom_theta0.safetensors``, same
format): θ_0's law values, denominators, fingerprint and the step θ_0 was taken
at, written once into the training's output folder, so that
``flowgeom conserve drift`` measures a run's checkpoints from the same θ_0 as
the callback did (:func:`read_reference`).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, finite_number, shown
from flowgeom.files import read_regular
from flowgeom.laws.locate import FlowgeomWarning
from flowgeom.laws.monitor import ConservationMonitor
from flowgeom.laws.predict import DriftPredictor, hyper_of
from flowgeom.laws.verdict import HELD_THRESHOLD, KINDS, describe_optimizer, info_of_kind, unwrap_optimizer

STATE_FILE = "flowgeom_monitor.safetensors"
REFERENCE_FILE = "flowgeom_theta0.safetensors"
REFERENCE_KIND = "flowgeom θ_0 law values"
MAX_STATE = 2**36  # bytes of a saved monitor state (θ_0 of the measured parameters)


def read_state(path: Path) -> bytes:
    """The bytes of a saved monitor state: a regular file of at most :data:`MAX_STATE` bytes (never a FIFO)."""
    return read_regular(path, STATE_FILE, limit=MAX_STATE, fix="delete it, or pass rebase=True to start a new θ_0")


def read_reference(path: str | os.PathLike) -> dict[str, Any]:
    """The θ_0 a callback saved (:meth:`MonitorSession.save_reference`): ``{step, fingerprint, monitor}``.

    Read as data only (no pickle); anything else than such a file is one :class:`FlowgeomError`.
    """
    from flowgeom.runs import decode_checkpoint

    fix = f"delete {REFERENCE_FILE} to measure from the first checkpoint instead"
    state = decode_checkpoint(read_regular(path, REFERENCE_FILE, limit=MAX_STATE, fix=fix), source=str(path))
    monitor = state.get("monitor")
    if (state.get("kind") != REFERENCE_KIND or not isinstance(state.get("step"), int)
            or not isinstance(state.get("fingerprint"), str) or not isinstance(monitor, dict)
            or not all(isinstance(monitor.get(k), torch.Tensor) for k in ("h0", "denominator", "fingerprint"))):
        raise FlowgeomError(f"{shown(path)} is not a flowgeom θ_0 file (no step, fingerprint and law values); {fix}")
    return state


PREDICT_CHOICES = ("auto", "on", "off")


class MonitorSession:
    """A :class:`ConservationMonitor` wired to an optimiser, writers, a predictor, checkpoints and a verdict.

    ``optimizer_kind`` (one of ``sgd, sgd+wd, momentum, adam, other``) replaces the optimiser's
    description when the monitor cannot see it (no torch-style ``param_groups``).
    ``predict``: ``auto``/``on`` (plain torch SGD: the exact drift Σ τ²·h(g), followed by the monitor;
    torch SGD with momentum or weight decay, without Nesterov/dampening: Kunin et al.'s modified equation;
    ``on`` is refused where there is no prediction, e.g. Adam), ``off``. Monitor options (``heads``, ``positions``, ``weight_decay``, ``lr``, …) pass
    through ``monitor_kwargs``.
    """

    def __init__(self, model: nn.Module, optimizer: Any = None, *, every: int = 1, out: str | os.PathLike | None = None,
                 writers: Iterable[Any] = (), threshold: float = HELD_THRESHOLD, predict: str = "auto",
                 optimizer_kind: str | None = None, figure: bool = True, **monitor_kwargs: Any):
        if predict not in PREDICT_CHOICES:
            raise FlowgeomError(f"unknown predict {predict!r}; choose one of: {', '.join(PREDICT_CHOICES)}")
        if not 0 < finite_number(threshold, "threshold", fix="a ratio ε_law/ε_control in (0, 1), e.g. 0.1") < 1:
            raise FlowgeomError(f"threshold must lie in (0, 1), got {threshold}")
        if optimizer_kind is not None and optimizer_kind not in KINDS:
            raise FlowgeomError(f"unknown optimizer_kind {optimizer_kind!r}; choose one of: {', '.join(KINDS)}")
        if out is not None:
            from flowgeom.integrations.writers import check_writable_dir

            out = check_writable_dir(out, "flowgeom output folder")
        self.optimizer = unwrap_optimizer(optimizer) if optimizer is not None else None
        if optimizer_kind is not None:
            self.info = info_of_kind(optimizer_kind)
        elif optimizer is None:
            raise FlowgeomError("the monitor cannot see the optimiser (none was given); pass the optimiser, or "
                                f"optimizer_kind= one of {', '.join(KINDS)}")
        else:
            self.info = describe_optimizer(optimizer)
        # warn=False: the plain-GD warning is replaced by the verdict's expected behaviour; uncovered blocks are
        # still said out loud, once here and in the summary line
        self.monitor = ConservationMonitor(model, every=every, warn=False, optimizer=self.optimizer,
                                           predict=predict != "off", **monitor_kwargs)
        self.monitor.optimizer_info = self.info
        if self.monitor.uncovered:
            warnings.warn(f"not covered by any law, not measured: {self._uncovered_text()}", FlowgeomWarning,
                          stacklevel=3)
        self.every, self.out, self.threshold, self.figure = every, out, threshold, figure
        self.writers = list(writers)
        self.history: list[dict[str, float]] = []
        self._named = dict(model.named_parameters())
        self._check_optimizer_sees_laws()
        self.predictor = self._make_predictor(predict)
        self._drive = None
        self._hyper = None
        self.theta0_step = 0  # the optimiser step θ_0 was taken at (a rebased resume: not 0)

    # ------------------------------------------------------------------ set-up

    def _check_optimizer_sees_laws(self) -> None:
        """The laws' parameters must be trained by this optimiser (else ε measures nothing it does)."""
        if self.optimizer is None or not hasattr(self.optimizer, "param_groups"):
            return
        trained = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        names = self.monitor.param_names
        missing = [n for n in names if id(self._named[n]) not in trained]
        if len(missing) == len(names):
            raise FlowgeomError(f"the optimiser {self.info.name} trains none of the {len(names)} parameters the laws "
                                f"read (e.g. {missing[0]}); pass the optimiser of this model")

    def _make_predictor(self, predict: str) -> DriftPredictor | None:
        info = self.info
        supported = (self.optimizer is not None and info.name == "SGD" and not info.nesterov and info.dampening == 0)
        # plain SGD: the monitor's exact prediction (its step hook), not the modified equation's approximation of it
        beyond_flow = info.momentum > 0 or info.weight_decay > 0
        if predict == "on" and self.monitor.prediction is not None:
            return None
        if predict == "off" or (predict == "auto" and not (supported and beyond_flow)):
            return None
        if not supported:
            raise FlowgeomError(f"predict='on' needs torch.optim.SGD without nesterov/dampening (Kunin et al.'s "
                                f"modified equation); the optimiser is {info.name}: use predict='auto' or 'off'")
        predictor = DriftPredictor(self.monitor)
        try:  # every law's parameters must sit in a group of this optimiser: refuse now, not at the first step
            predictor.per_item(self._hyper_now(), "lr")
        except FlowgeomError as exc:
            if predict == "on":
                raise
            warnings.warn(f"no predicted drift: {exc}", FlowgeomWarning, stacklevel=3)
            return None
        return predictor

    # ------------------------------------------------------------------ per step

    def _hyper_now(self) -> dict[str, Mapping[str, float]]:
        p = self.monitor.param_names
        return hyper_of(self.optimizer, p, [self._named[n] for n in p])

    @torch.no_grad()
    def before_step(self) -> None:
        """Gradients are final (after clipping / accumulation), the step not yet applied."""
        if self.predictor is None:
            return
        self._hyper = self._hyper_now()  # lr of *this* step (schedulers step after the optimiser)
        if self.info.momentum == 0:
            self._drive = self.monitor.values_at({n: self._named[n].grad for n in self.monitor.param_names})

    @torch.no_grad()
    def after_step(self) -> None:
        """The optimiser step was applied (feeds the predictor)."""
        if self.predictor is None:
            return
        hyper = self._hyper or self._hyper_now()
        pr = self.predictor
        lr, wd = pr.per_item(hyper, "lr"), pr.per_item(hyper, "weight_decay")
        if self.info.momentum > 0:
            state = self.optimizer.state
            buffers = {n: state.get(self._named[n], {}).get("momentum_buffer") for n in self.monitor.param_names}
            drive, is_grad = self.monitor.values_at(buffers), False
        else:
            if self._drive is None:
                raise FlowgeomError("after_step() without before_step(): the predicted drift needs the gradients "
                                    "before the optimiser step")
            drive, is_grad = self._drive, True
        pr.advance(lr=lr, momentum=self.info.momentum, weight_decay=wd, drive=drive, drive_is_gradient=is_grad)
        self._drive, self._hyper = None, None

    def measure(self, step: int, extra: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
        """The record after ``step`` optimiser steps (None when not due); written and kept in ``history``."""
        if not self.monitor.due(step):
            return None
        values = self.monitor.values()
        record = self.monitor.step(step, values=values, extra=extra)
        if not all(math.isfinite(v) for k, v in record.items() if k.startswith("eps/")):
            raise FlowgeomError(f"the laws are NaN or Inf at step {step}: training diverged (lower the learning rate)")
        for v in self.monitor.verdicts(record, threshold=self.threshold):
            record[f"ratio/{v.family}"] = v.ratio
        if self.predictor is not None and self.predictor.steps:
            record.update(self.predictor.compare(values))
        self.history.append({k: v for k, v in record.items()
                             if k == "step" or ("@" not in k and isinstance(v, (int, float)))})
        for w in self.writers:
            w.write(record, step)
        return record

    def log_scalars(self, record: Mapping[str, Any] | None) -> dict[str, float]:
        """Per-family scalars of ``record`` under ``flowgeom/…`` tags, for a framework's own loggers."""
        from flowgeom.integrations.writers import scalars, tag

        return {tag(k): v for k, v in scalars(record, per_block=False).items()}

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict[str, Any]:
        pr = self.predictor
        return {"fingerprint": self.monitor.fingerprint(), "monitor": self.monitor.state_dict(),
                "predictor": None if pr is None else {"h": pr.h, "u": pr.u, "t": pr.t, "steps": pr.steps},
                "history": self.history, "optimizer": self.info.as_dict(), "theta0_step": self.theta0_step}

    def save(self, folder: str | os.PathLike) -> Path:
        """Write the state into ``folder`` (a checkpoint folder) as :data:`STATE_FILE`."""
        from flowgeom.runs import atomic_write_bytes, encode_checkpoint

        path = Path(folder) / STATE_FILE
        atomic_write_bytes(path, encode_checkpoint(self.state()))
        return path

    def save_reference(self, folder: str | os.PathLike) -> Path:
        """Write θ_0's law values into ``folder`` (the training's output folder) as :data:`REFERENCE_FILE`."""
        from flowgeom.files import atomic_write_bytes
        from flowgeom.runs import encode_checkpoint

        m = self.monitor.state_dict()
        state = {"kind": REFERENCE_KIND, "step": self.theta0_step, "fingerprint": self.monitor.fingerprint(),
                 "monitor": {k: m[k] for k in ("h0", "denominator", "fingerprint")}}
        path = Path(folder) / REFERENCE_FILE
        atomic_write_bytes(path, encode_checkpoint(state))
        return path

    def load(self, folder: str | os.PathLike) -> None:
        """Restore θ_0, the denominators, the predictor and the history saved in ``folder``; refuse a mismatch."""
        from flowgeom.runs import decode_checkpoint

        path = Path(folder) / STATE_FILE
        if not path.is_file():
            raise FlowgeomError(f"no flowgeom monitor state in {shown(folder)} ({STATE_FILE} is missing): the run "
                                "was checkpointed without the callback (or resumed from elsewhere: pass "
                                "resume_from=CHECKPOINT_DIR); resume from a checkpoint it saved, or pass "
                                "rebase=True to take the resumed weights as a new θ_0")
        state = decode_checkpoint(read_state(path), source=str(path))
        if state.get("fingerprint") != self.monitor.fingerprint():
            raise FlowgeomError(f"the monitor state in {shown(folder)} was saved for another model (its laws or "
                                "parameter shapes differ): refused; resume with the model it was saved for, or "
                                "pass rebase=True to start a new θ_0")
        self.restore(state)

    def restore(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state` (fingerprint checked by the monitor too)."""
        self.monitor.load_state_dict(state["monitor"])
        pr, saved = self.predictor, state.get("predictor")
        if pr is not None and saved is not None:
            pr.h, pr.u = saved["h"].to(torch.float64), saved["u"].to(torch.float64)
            pr.t, pr.steps = float(saved["t"]), int(saved["steps"])
        elif pr is not None:  # saved without a prediction: it cannot restart mid-run
            self.predictor = None
        self.history = [dict(h) for h in state.get("history") or []]
        step = state.get("theta0_step", 0)
        self.theta0_step = step if isinstance(step, int) else 0

    # ------------------------------------------------------------------ the end

    def _uncovered_text(self) -> str:
        u = self.monitor.uncovered_list()
        return "; ".join(f"{x['block'] or '<model>'} ({x['reason']})" for x in u[:3]) + (" …" if len(u) > 3 else "")

    def summary(self) -> dict[str, Any]:
        """Verdicts at the last record, the optimiser's expected behaviour, the prediction's agreement."""
        if self.monitor.last is None:
            raise FlowgeomError("no step was measured: train at least `every` steps before the summary")
        out = self.monitor.summary(record=self.monitor.last, threshold=self.threshold)
        out["uncovered"] = self.monitor.uncovered_list()
        if out["uncovered"]:
            out["line"] += f"; not covered by any law, not measured: {self._uncovered_text()}"
        last = self.monitor.last
        if self.monitor.prediction is not None:  # the exact plain-SGD drift: its numbers (the line has the verdict)
            out["prediction"] = {"model": "plain SGD, exact: h(θ_0) + Σ τ²·h(g) from the optimiser's steps",
                                 "steps": self.monitor.prediction.steps,
                                 **{k: {f[len(k) + 1:]: v for f, v in last.items() if f.startswith(k + "/")}
                                    for k in ("pred", "pred_err", "pred_excess")}}
        if self.predictor is None:
            return out
        # a drift at the weights' round-off (ε below 100 ulps: float32 weights, ~1e-5) is rounding, which
        # no equation of motion predicts: its pred_err is not a verdict on the prediction
        floor = 100 * max(torch.finfo(self._named[n].dtype).eps for n in self.monitor.param_names)
        errs = {k[9:]: v for k, v in last.items() if k.startswith("pred_err/") and math.isfinite(v)
                and last.get(f"eps/{k[9:]}", 0.0) > floor}
        if errs:
            worst = max(errs.values())
            out["prediction"] = {"pred_err": errs, "model": "Kunin et al., ICLR 2021 (modified equation)",
                                 "round_off_floor": floor}
            out["line"] += (f"; predicted drift (Kunin et al. 2021) agrees with the measured one to within "
                            f"{100 * worst:.1f}% of the drift (worst family)")
        return out

    def finish(self, *, title: str = "") -> dict[str, Any]:
        """Summary, ``summary.json`` and the figure in ``out`` (when given); closes the writers."""
        from flowgeom.runs import atomic_write_json, out_folder

        try:
            out = self.summary()
            if self.out is not None:
                if self.figure and self.history:
                    from flowgeom.integrations.figure import plot_drift

                    fig = out_folder(self.out, self.out / "figures", "figures folder") / "conservation.png"
                    # the summary's short form, whole (the full line is in summary.json and printed)
                    plot_drift(self.history, fig, title=title or out["title"])
                    out["figure"] = str(fig)
                atomic_write_json(self.out / "summary.json", out, root=self.out)
            return out
        finally:
            self.monitor.close()
            for w in self.writers:
                w.close()
