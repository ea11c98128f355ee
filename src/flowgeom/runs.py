"""Run folders: the one on-disk format every experiment writes.

A run folder holds ``config.json``, ``metrics.jsonl`` (one JSON line per
logged step, flushed as written), ``summary.json``, ``figures/`` and
``checkpoint.safetensors`` for resume. Every whole-file write is atomic
(temporary file in the same folder, then ``os.replace``), so a killed
process leaves either the old or the new file, never half of one. Every
file flowgeom writes, in a run folder or anywhere else, goes through
:func:`flowgeom.files.atomic_write` (or ``open_append`` for line logs,
both re-exported here): a run folder may
come from someone else, so a symlink planted in it is refused, never
followed, and an output onto or inside an input is refused.
``summary.json`` is written last: its presence is what marks a run as
finished. :meth:`RunFolder.summary` raises :class:`FlowgeomError` when that
file is not valid JSON or not a JSON object (it never returns garbage and
never pretends the run is unfinished).

Strict JSON
-----------
Every JSON file and every ``--json`` output goes through :func:`to_json`,
which writes standard JSON only: tensors and numpy values become numbers or
lists, and a non-finite float (NaN, +Inf, -Inf) is written as ``null``
(``allow_nan=False`` guards the rest). A reader that must tell a diverged
value from a missing one looks at the record's other fields (``status``,
``diverged``, ``message``); it never sees the non-standard ``NaN`` token.

Checkpoint format (``checkpoint.safetensors``, version 1)
---------------------------------------------------------
A checkpoint is one safetensors file, written atomically like every other
file, so there is no window in which a half-written pair of files exists.
Loading it parses JSON and copies raw tensor bytes: nothing in the file can
run code (no pickle anywhere). Its content, for a state tree of dicts,
lists, tuples, ``None``/bool/int/float/str and tensors:

* every tensor, at any depth, is one safetensors entry named by its dotted
  path in the tree (``model.fc.weight``, ``optimizer.state.0.exp_avg``,
  ``generator`` — a ``torch.Generator.get_state()`` is a uint8 tensor),
  stored on the CPU with its dtype and shape; a repeated path gets ``#n``;
* the header's ``__metadata__`` holds ``format = "flowgeom-checkpoint"``,
  ``version = "1"``, ``state`` = the tree as JSON with each tensor replaced
  by ``{"__tensor__": name}``, and ``sha256`` = the digest of ``state`` and
  of every tensor's name, dtype, shape and bytes (in name order). In
  ``state`` a tuple is ``{"__tuple__": [...]}``, a dict whose keys are not
  all plain strings (an optimiser's integer parameter ids) is
  ``{"__items__": [[key, value], ...]}`` and a non-finite float is
  ``{"__float__": "nan" | "inf" | "-inf"}``; everything else is itself.

Round trip is exact (same values, dtypes, shapes, int/float/tuple types), so
a resumed run computes the same numbers as an uninterrupted one. Saving
anything else (a callable, a module) is a :class:`FlowgeomError`. Loading a
file that is truncated, does not parse, or whose digest does not match is a
:class:`FlowgeomError`. A ``checkpoint.pt`` (the pickle format of earlier
flowgeom versions) is refused with a message, never opened.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from flowgeom.errors import FlowgeomError
from flowgeom.files import (  # noqa: F401 - the write helpers live with the readers; re-exported here
    atomic_write, atomic_write_bytes, atomic_write_figure, check_out_file, confined, open_append, out_folder,
    read_json_object, read_regular,
)

CHECKPOINT_FORMAT = "flowgeom-checkpoint"
CHECKPOINT_VERSION = "1"
MAX_CHECKPOINT = 2**36  # bytes of a run's checkpoint.safetensors read back
MAX_METRICS = 2**30  # bytes of metrics.jsonl read back (a 10^6-step run logs ~200 MB)


def plain(obj: Any) -> Any:
    """``obj`` as plain JSON values: tensors/numpy to numbers and lists, non-finite floats to ``None``.

    The one place where NaN and ±Inf are mapped (to ``null``); see the module
    docstring.
    """
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return plain(obj.detach().cpu().tolist())
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy arrays and scalars
        return plain(obj.tolist())
    if hasattr(obj, "item"):
        return plain(obj.item())
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def to_json(obj: Any, **kwargs: Any) -> str:
    """Strict JSON text for ``obj``: tensors and numpy values become numbers, NaN/±Inf become ``null``."""
    return json.dumps(plain(obj), allow_nan=False, **kwargs)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, root: str | os.PathLike | None = None,
                      inputs: Iterable[str | os.PathLike] = (), what: str = "the output") -> Path:
    """:func:`atomic_write` of ``obj`` as indented strict JSON."""
    return atomic_write_bytes(path, (to_json(obj, indent=2) + "\n").encode(), root=root, inputs=inputs, what=what)


# ---------------------------------------------------------------- checkpoints (no pickle)

_TAGS = ("__tensor__", "__tuple__", "__items__", "__float__")


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor], copy: bool = True) -> Any:
    """The JSON tree of ``obj``; tensors are moved into ``tensors`` under their dotted path (private copies
    unless ``copy`` is False)."""
    def child(key: Any) -> str:
        return f"{path}.{key}" if path else str(key)

    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else {"__float__": repr(float(obj))}
    if isinstance(obj, torch.Tensor):
        name, n = path or "tensor", 1
        while name in tensors:
            name, n = f"{path}#{n}", n + 1
        tensors[name] = obj.detach().to("cpu", copy=copy).contiguous()  # a private copy unless asked otherwise
        return {"__tensor__": name}
    if isinstance(obj, list):
        return [_encode(v, child(i), tensors, copy) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, child(i), tensors, copy) for i, v in enumerate(obj)]}
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {str(k): _encode(v, child(k), tensors, copy) for k, v in obj.items()}
        return {"__items__": [[_encode(k, child(f"key{i}"), tensors, copy), _encode(v, child(k), tensors, copy)]
                              for i, (k, v) in enumerate(obj.items())]}
    raise FlowgeomError(
        f"cannot checkpoint a {type(obj).__name__} at {path or 'the top level'}: a checkpoint holds only "
        "tensors, numbers, strings, None and lists, tuples and dicts of them (never code); "
        "store the value's data instead"
    )


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1 and next(iter(obj)) in _TAGS:
        tag, value = next(iter(obj.items()))
        if tag == "__tensor__":
            if not isinstance(value, str) or value not in tensors:
                raise ValueError(f"its state names a tensor {value!r} that the file does not hold")
            return tensors[value]
        if tag == "__tuple__":
            return tuple(_decode(v, tensors) for v in value)
        if tag == "__items__":
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value}
        if value not in ("nan", "inf", "-inf"):
            raise ValueError(f"bad float {value!r}")
        return float(value)
    return {k: _decode(v, tensors) for k, v in obj.items()}


def _digest(state_text: str, tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256(state_text.encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the raw bytes, (numel * itemsize,)
    return h.hexdigest()


def checkpoint_parts(state: Mapping[str, Any], *, copy: bool = True) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """``(metadata, tensors)`` of a version-1 checkpoint of ``state``: what :func:`encode_checkpoint` writes.

    With ``copy=False`` the tensors share storage with ``state`` (for a caller that streams them to a file at
    once, e.g. a model's parameters and optimiser state, which a copy would double in memory)."""
    tensors: dict[str, torch.Tensor] = {}
    state_text = json.dumps(_encode(dict(state), "", tensors, copy), allow_nan=False, separators=(",", ":"))
    meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "state": state_text,
            "sha256": _digest(state_text, tensors)}
    return meta, tensors


def encode_checkpoint(state: Mapping[str, Any]) -> bytes:
    """The bytes of a version-1 checkpoint of ``state``; see the module docstring."""
    import safetensors.torch

    meta, tensors = checkpoint_parts(state)
    try:
        return safetensors.torch.save(tensors, metadata=meta)
    except Exception as exc:  # noqa: BLE001 - e.g. a dtype safetensors cannot store
        raise FlowgeomError(f"cannot write the checkpoint: {exc}") from exc


def decode_checkpoint(data: bytes, *, source: str = "checkpoint") -> dict[str, Any]:
    """The state written by :func:`encode_checkpoint`; :class:`FlowgeomError` for anything else.

    Parses JSON and copies tensor bytes only: no byte of ``data`` is run as code.
    """
    import safetensors.torch

    try:
        if len(data) < 8:
            raise ValueError(f"{len(data)} bytes, shorter than the 8-byte header length")
        size = int.from_bytes(data[:8], "little")
        if size > len(data) - 8:
            raise ValueError(f"its header claims {size} bytes but only {len(data) - 8} follow")
        header = json.loads(data[8:8 + size])
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("it is not a flowgeom checkpoint")
        if meta.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"format version {meta.get('version')!r} is not {CHECKPOINT_VERSION!r}")
        tensors = safetensors.torch.load(data)
        if _digest(meta["state"], tensors) != meta.get("sha256"):
            raise ValueError("its content does not match its sha256 (the file was modified or damaged)")
        state = _decode(json.loads(meta["state"]), tensors)
        if not isinstance(state, dict):
            raise ValueError(f"its state is a {type(state).__name__}, not a dict")
    except Exception as exc:  # noqa: BLE001 - every way a file can be broken gets the same clear message
        raise FlowgeomError(f"{source} is corrupt or truncated ({type(exc).__name__}: {exc}); delete it and "
                            "resume again (the run restarts from its first step)") from exc
    return state


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
    CHECKPOINT = "checkpoint.safetensors"
    LEGACY_CHECKPOINT = "checkpoint.pt"  # pickle, written by flowgeom before checkpoint format 1; refused

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    @property
    def figures(self) -> Path:
        """``figures/``, created, refused if it (or the run folder's content on the way) is a planted link."""
        return out_folder(self.path, self.path / "figures", "figures folder")

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
            old = read_json_object(cfg_path, fix="delete the run folder and run it again")
            if old != config:
                changed = sorted(k for k in set(old) | set(config) if old.get(k) != config.get(k))
                raise FlowgeomError(
                    f"cannot resume {self.path}: its config differs in {', '.join(changed)}; "
                    "rerun with the same options or choose another --out"
                )
            return
        atomic_write_json(cfg_path, config, root=self.path)

    def log(self, record: Mapping[str, Any]) -> None:
        """Append one metrics line and flush it to disk."""
        path = self.path / self.METRICS
        try:
            with open_append(path, root=self.path) as fh:
                fh.write(to_json(dict(record)) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise FlowgeomError(f"cannot append to {path}: {exc.strerror}") from exc

    def metrics(self) -> list[dict[str, Any]]:
        """Every complete metrics line (a torn last line from a kill is skipped)."""
        return list(self.iter_metrics())

    def iter_metrics(self) -> Iterator[dict[str, Any]]:
        """The metrics records; lines that are not a JSON object (a torn last line) are skipped."""
        path = self.path / self.METRICS
        if not path.exists() and not path.is_symlink():
            return
        raw = read_regular(path, self.METRICS, limit=MAX_METRICS,
                           fix=f"the run in {self.path} must be redone: delete that folder and rerun")
        for line in raw.decode("utf-8", errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record

    def truncate_metrics(self, *, after_step: int, key: str = "step") -> None:
        """Drop metric lines logged after ``after_step`` (used when resuming from a checkpoint)."""
        kept = [m for m in self.iter_metrics() if m.get(key, -math.inf) <= after_step]
        text = "".join(to_json(m) + "\n" for m in kept)
        atomic_write_bytes(self.path / self.METRICS, text.encode(), root=self.path)

    def save_checkpoint(self, state: Mapping[str, Any]) -> None:
        """Atomically write ``state`` as ``checkpoint.safetensors`` (format in the module docstring)."""
        atomic_write_bytes(self.path / self.CHECKPOINT, encode_checkpoint(state), root=self.path)

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The last checkpoint's state, or ``None`` when the run has none; never unpickles.

        Raises :class:`FlowgeomError` for a damaged checkpoint and for an
        old-format ``checkpoint.pt`` (which is never opened).
        """
        path = self.path / self.CHECKPOINT
        if path.exists():
            data = read_regular(path, "checkpoint", limit=MAX_CHECKPOINT, fix="delete it and resume again (the run "
                                "restarts from its first step)")
            return decode_checkpoint(data, source=f"the checkpoint {path}")
        legacy = self.path / self.LEGACY_CHECKPOINT
        if legacy.exists():
            raise FlowgeomError(
                f"{legacy} is in the old pickle format, which flowgeom no longer loads because unpickling can "
                "execute code; delete it and resume again (the run restarts from its first step), or rerun "
                "without --resume into a fresh --out"
            )
        return None

    def finish(self, summary: Mapping[str, Any]) -> None:
        """Write ``summary.json`` last: only then is the run complete."""
        atomic_write_json(self.path / self.SUMMARY, dict(summary), root=self.path)

    def summary(self) -> dict[str, Any] | None:
        """``summary.json`` of a finished run, ``None`` before it finished.

        A summary that is not valid JSON or not a JSON object raises
        :class:`FlowgeomError` (it was damaged or edited: the run must be redone).
        """
        path = self.path / self.SUMMARY
        if not path.exists():
            return None
        return read_json_object(path, fix=f"the run in {self.path} must be redone: delete that folder and rerun")
