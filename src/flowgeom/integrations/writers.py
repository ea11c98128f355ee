"""Where the monitor's records go in a plain loop: CSV, TensorBoard, an offline W&B run.

Every writer takes a record of :meth:`ConservationMonitor.step` (or ``None``,
a step that was not due, which is skipped) and keeps only its finite float
entries (``uncovered``, ``zero_baseline`` and other lists are not scalars).
Keys become tags by :func:`tag`: ``eps/attn.qk_rope@model.layers.0.self_attn``
→ ``flowgeom/eps/attn.qk_rope/model.layers.0.self_attn`` (TensorBoard and W&B
group by ``/``; ``@`` would not group)::

    mon = ConservationMonitor(model, optimizer=opt)
    with TensorBoardWriter("runs/tb") as tb:
        for k in range(steps):
            loss.backward(); opt.step(); opt.zero_grad()
            tb.write(mon.step(k + 1))

The logging folder is checked before training starts: a folder that cannot
be written is one :class:`~flowgeom.errors.FlowgeomError` naming it, not a
crash at the first record. ``tensorboard`` and ``wandb`` are imported only by
their writer (the ``integrations`` extra).
"""

from __future__ import annotations

import csv
import io
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flowgeom.errors import FlowgeomError, shown
from flowgeom.files import read_text
from flowgeom.runs import open_append

EXTRA = "pip install 'flowgeom[integrations]'"


def tag(key: str, prefix: str = "flowgeom") -> str:
    """The logger tag of a record key: ``@`` becomes ``/`` and ``prefix/`` goes in front."""
    return f"{prefix}/{key.replace('@', '/')}" if prefix else key.replace("@", "/")


def scalars(record: Mapping[str, Any] | None, *, per_block: bool = True) -> dict[str, float]:
    """The finite float entries of ``record`` except ``step`` (per-family keys only if not ``per_block``)."""
    if record is None:
        return {}
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        if per_block or "@" not in k:
            out[k] = float(v)
    return out


def check_writable_dir(path: str | os.PathLike, what: str = "logging directory") -> Path:
    """Create ``path`` if needed and prove a file can be written in it; else one clear error."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".flowgeom-write-test-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise FlowgeomError(f"the {what} {shown(path)} cannot be written ({reason}); pass a writable folder") from exc
    return path


class _Writer:
    def write(self, record: Mapping[str, Any] | None, step: int | None = None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step_of(record: Mapping[str, Any], step: int | None) -> int:
    step = record.get("step") if step is None else step
    if not isinstance(step, int) or isinstance(step, bool):
        raise FlowgeomError(f"a record without an integer step ({step!r}); pass write(record, step=k)")
    return step


class CSVWriter(_Writer):
    """Long-format CSV ``step,key,value`` (one row per scalar; new keys may appear at any step), flushed per record."""

    def __init__(self, path: str | os.PathLike, *, per_block: bool = True):
        path = Path(path)
        if path.is_dir():
            raise FlowgeomError(f"CSV path {shown(path)} is a folder; give a file name, e.g. {shown(path / 'flowgeom.csv')}")
        check_writable_dir(path.parent, "CSV folder")
        new = not path.exists() or path.stat().st_size == 0
        self.path, self.per_block = path, per_block
        self._fh = open_append(path, newline="")  # never through a planted link, never a FIFO
        self._csv = csv.writer(self._fh)
        if new:
            self._csv.writerow(["step", "key", "value"])
            self._fh.flush()

    def write(self, record: Mapping[str, Any] | None, step: int | None = None) -> None:
        if record is None:
            return
        k = _step_of(record, step)
        self._csv.writerows([k, key, repr(v)] for key, v in scalars(record, per_block=self.per_block).items())
        self._fh.flush()  # a killed run keeps every record written so far

    def close(self) -> None:
        self._fh.close()


def read_csv(path: str | os.PathLike) -> dict[int, dict[str, float]]:
    """``{step: {key: value}}`` of a :class:`CSVWriter` file."""
    out: dict[int, dict[str, float]] = {}
    text = read_text(path, "CSV file", fix="pass a file written by CSVWriter", limit=2**30)  # never a FIFO
    for row in csv.DictReader(io.StringIO(text, newline="")):
        out.setdefault(int(row["step"]), {})[row["key"]] = float(row["value"])
    return out


class TensorBoardWriter(_Writer):
    """A ``torch.utils.tensorboard.SummaryWriter`` in ``log_dir``; one scalar per key, tag :func:`tag`."""

    def __init__(self, log_dir: str | os.PathLike, *, per_block: bool = True, prefix: str = "flowgeom"):
        check_writable_dir(log_dir, "TensorBoard log_dir")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise FlowgeomError(f"TensorBoardWriter needs tensorboard; install the extra: {EXTRA}") from exc
        self.log_dir, self.per_block, self.prefix = Path(log_dir), per_block, prefix
        self._w = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: Mapping[str, Any] | None, step: int | None = None) -> None:
        if record is None:
            return
        k = _step_of(record, step)
        for key, v in scalars(record, per_block=self.per_block).items():
            self._w.add_scalar(tag(key, self.prefix), v, k)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class WandbWriter(_Writer):
    """An offline W&B run under ``dir`` (``mode="offline"``: nothing leaves the machine; ``wandb sync`` later).

    Pass ``run=`` to log into a run you already started instead (its mode is yours).
    """

    def __init__(self, dir: str | os.PathLike | None = None, *, project: str = "flowgeom", name: str | None = None,
                 per_block: bool = True, prefix: str = "flowgeom", run: Any = None, config: Mapping | None = None):
        try:
            import wandb
        except ImportError as exc:
            raise FlowgeomError(f"WandbWriter needs wandb; install the extra: {EXTRA}") from exc
        self.per_block, self.prefix, self._own = per_block, prefix, run is None
        if run is None:
            if dir is None:
                raise FlowgeomError("WandbWriter needs dir= (where the offline run is written) or run= (a started run)")
            check_writable_dir(dir, "W&B dir")
            run = wandb.init(mode="offline", dir=str(dir), project=project, name=name, config=dict(config or {}),
                             reinit="create_new", settings=wandb.Settings(silent=True, console="off"))
        self.run = run

    @property
    def run_dir(self) -> Path:
        """The offline run folder (``…/wandb/offline-run-*``)."""
        return Path(self.run.dir).parent

    def write(self, record: Mapping[str, Any] | None, step: int | None = None) -> None:
        if record is None:
            return
        k = _step_of(record, step)
        values = {tag(key, self.prefix): v for key, v in scalars(record, per_block=self.per_block).items()}
        self.run.log(values, step=k)

    def close(self) -> None:
        if self._own:
            self.run.finish()
