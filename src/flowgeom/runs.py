"""Run folders: the one on-disk format every experiment writes.

A run folder holds ``config.json``, ``metrics.jsonl`` (one JSON line per
logged step, flushed as written), ``summary.json``, ``figures/`` and
``checkpoint.pt`` for resume. Every whole-file write is atomic (temporary
file in the same folder, then ``os.replace``), so a killed process leaves
either the old or the new file, never half of one. ``summary.json`` is
written last: its presence is what marks a run as finished.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from flowgeom.errors import FlowgeomError


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def to_json(obj: Any, **kwargs: Any) -> str:
    """JSON text for ``obj``; tensors and numpy scalars become numbers, NaN stays NaN."""
    return json.dumps(obj, default=_json_default, **kwargs)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file only."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise FlowgeomError(f"cannot write {path}: {exc.strerror}; choose a writable --out folder") from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise FlowgeomError(f"cannot write {path}: {exc.strerror}; free disk space or choose another --out") from exc


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON."""
    atomic_write_bytes(path, (to_json(obj, indent=2) + "\n").encode())


def atomic_torch_save(path: str | os.PathLike, obj: Any) -> None:
    """Atomically ``torch.save`` ``obj`` (checkpoints for resume)."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


class RunFolder:
    """One run on disk; see the module docstring for the layout.

    >>> run = RunFolder("runs/x")                     # doctest: +SKIP
    >>> run.start({"lr": 0.1}, resume=False)          # doctest: +SKIP
    >>> run.log({"step": 0, "loss": 1.0})             # doctest: +SKIP
    >>> run.finish({"final_loss": 0.5})               # doctest: +SKIP
    """

    CONFIG = "config.json"
    METRICS = "metrics.jsonl"
    SUMMARY = "summary.json"
    CHECKPOINT = "checkpoint.pt"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @property
    def figures(self) -> Path:
        return self.path / "figures"

    @property
    def finished(self) -> bool:
        return (self.path / self.SUMMARY).exists()

    def start(self, config: Mapping[str, Any], *, resume: bool) -> None:
        """Create the folder and write ``config.json``.

        With ``resume`` an existing folder must hold the same config; without
        it, an existing non-empty run is refused rather than overwritten.
        """
        cfg_path = self.path / self.CONFIG
        config = json.loads(to_json(dict(config)))
        if cfg_path.exists():
            if not resume:
                raise FlowgeomError(
                    f"run folder {self.path} already holds a run; pass --resume to continue it "
                    "or choose another --out"
                )
            old = json.loads(cfg_path.read_text())
            if old != config:
                changed = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k))
                raise FlowgeomError(
                    f"cannot resume {self.path}: its config differs in {', '.join(changed)}; "
                    "rerun with the same options or choose another --out"
                )
            return
        atomic_write_json(cfg_path, config)

    def log(self, record: Mapping[str, Any]) -> None:
        """Append one metrics line and flush it to disk."""
        path = self.path / self.METRICS
        try:
            with open(path, "a") as fh:
                fh.write(to_json(dict(record)) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise FlowgeomError(f"cannot append to {path}: {exc.strerror}") from exc

    def metrics(self) -> list[dict[str, Any]]:
        """Every complete metrics line (a torn last line from a kill is skipped)."""
        return list(self.iter_metrics())

    def iter_metrics(self) -> Iterator[dict[str, Any]]:
        path = self.path / self.METRICS
        if not path.exists():
            return
        for line in path.read_text().splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue

    def truncate_metrics(self, *, after_step: int, key: str = "step") -> None:
        """Drop metric lines logged after ``after_step`` (used when resuming from a checkpoint)."""
        kept = [m for m in self.iter_metrics() if m.get(key, -math.inf) <= after_step]
        atomic_write_bytes(self.path / self.METRICS, "".join(to_json(m) + "\n" for m in kept).encode())

    def save_checkpoint(self, state: Mapping[str, Any]) -> None:
        atomic_torch_save(self.path / self.CHECKPOINT, dict(state))

    def load_checkpoint(self) -> dict[str, Any] | None:
        path = self.path / self.CHECKPOINT
        if not path.exists():
            return None
        return torch.load(path, map_location="cpu", weights_only=False)

    def finish(self, summary: Mapping[str, Any]) -> None:
        """Write ``summary.json`` last: only then is the run complete."""
        atomic_write_json(self.path / self.SUMMARY, dict(summary))

    def summary(self) -> dict[str, Any] | None:
        path = self.path / self.SUMMARY
        return json.loads(path.read_text()) if path.exists() else None
