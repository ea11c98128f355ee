"""Run folders: the one on-disk format every experiment writes.

A run folder holds ``config.json``, ``metrics.jsonl`` (one JSON line per
logged step, flushed as written), ``summary.json``, ``figures/`` and
``checkpoint.safetensors`` for resume. Every whole-file write is atomic
(temporary file in the same folder, then ``os.replace``), so a killed
process leaves either the old or the new file, never half of one. Every
file flowgeom writes, in a run folder or anywhere else, goes through
:func:`atomic_write` (or :func:`open_append` for line logs): a run folder may
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

import contextlib
import errno
import hashlib
import json
import math
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import torch

from flowgeom.errors import FlowgeomError
from flowgeom.files import file_kind, read_json_object, read_regular  # read_json_object: re-exported

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


def _is_checkpoint(path: Path) -> bool:
    """Whether ``path`` starts like a GGUF or safetensors file (magic ``GGUF``; u64 header length, then ``{``)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return False
    return head[:4] == b"GGUF" or (len(head) == 9 and head[8:9] == b"{"
                                   and 2 <= int.from_bytes(head[:8], "little") <= path.stat().st_size - 8)


# ---------------------------------------------------------------- output paths
#
# Every file flowgeom writes goes through :func:`atomic_write` (whole files) or :func:`open_append` (metrics
# lines, CSV rows). Both take the folder being written (``root``: a run folder, ``--out``, ``--export``; by
# default the file's own folder) and
#
# * refuse an output that is, or lies inside, one of ``inputs`` (symlinks resolved);
# * walk from ``root`` down with one descriptor per folder, opening each with ``O_NOFOLLOW`` (and creating
#   missing ones), so a symlink planted below ``root`` is refused, never followed, even if it appears after a
#   check; ``root`` itself is the user's choice and may be a link;
# * refuse a symlink at the file itself, and create the temporary file ``O_EXCL | O_NOFOLLOW`` next to it,
#   then ``rename`` it over the file (rename replaces a name, it never writes through one).

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC


def _folder_error(flag: str, path: Path) -> FlowgeomError:
    return FlowgeomError(f"{flag} {path} is a folder; {flag} takes a file name, e.g. {path / 'report.json'}")


def _link_error(what: str, path: Path, link: Path, root: Path) -> FlowgeomError:
    try:
        target = os.readlink(link)
    except OSError:  # removed meanwhile
        target = "?"
    return FlowgeomError(f"{what} {path} goes through the symlink {link} (-> {target}); flowgeom never writes "
                         f"through a link out of {root}: remove the link")


def _write_error(what: str, path: Path, exc: OSError) -> FlowgeomError:
    fix = "free disk space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "choose a writable location"
    return FlowgeomError(f"cannot write {what} {path}: {exc.strerror or exc}; {fix}")


def _refuse_inputs(path: Path, flag: str, inputs: Iterable[str | os.PathLike]) -> None:
    """Refuse an output ``path`` that is one of ``inputs`` or lies inside an input folder (symlinks resolved).

    The folder of a sharded index (``*.index.json``) counts as an input folder: its shards are read too.
    """
    target = Path(os.path.realpath(path))
    for given in inputs:
        if str(given).startswith("builtin:") or not os.path.lexists(given):
            continue
        source = Path(os.path.realpath(given))
        folders = [source] if source.is_dir() else [source.parent] if source.name.endswith(".index.json") else []
        if target == source:
            raise FlowgeomError(f"{flag} {path} is the input {given}: writing it would replace what is being read; "
                                f"choose another {flag}")
        for folder in folders:
            if target.is_relative_to(folder):
                raise FlowgeomError(f"{flag} {path} lies inside the input folder {folder}: writing there could "
                                    f"replace what is being read; choose another {flag} outside it")


def check_out_file(path: str | os.PathLike, flag: str = "--out", *,
                   inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Refuse, before any work, an output file path that cannot be written: a folder, or under a file.

    ``inputs`` (the files and folders the command reads) are compared with symlinks resolved: an output that
    is an input, or lies inside an input folder (or the folder of a sharded index), is refused, so a report
    can never replace the weights it describes. A user flag (``--out``, ``--figure``) onto an existing file
    that starts like a safetensors or GGUF checkpoint is refused whatever the inputs. :func:`atomic_write`
    checks the inputs again when it writes.
    """
    path = Path(path)
    if path.is_dir():
        raise _folder_error(flag, path)
    _refuse_inputs(path, flag, inputs)
    if path.is_symlink():  # refused here, before the work, as atomic_write would refuse it after
        raise _link_error(flag, path, path, path.parent)
    if flag.startswith("--") and path.is_file() and not path.is_symlink() and _is_checkpoint(path):
        raise FlowgeomError(f"{flag} {path} is an existing model checkpoint; {flag} writes a report and would "
                            f"replace the weights: choose another {flag}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise FlowgeomError(f"{flag} {path}: {parent} is a file, not a folder; choose another {flag}")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise FlowgeomError(f"{flag} {path}: the folder {parent} is not writable; choose another {flag}")
            return


def _below(root: Path, path: Path, what: str) -> tuple[str, ...]:
    """The parts of ``path`` below ``root``; refused when ``path`` is not strictly inside ``root``."""
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        parts = ()
    if not parts or ".." in parts:
        raise FlowgeomError(f"{what} {path} is not inside {root}; flowgeom writes only inside it")
    return parts


def confined(root: str | os.PathLike, path: str | os.PathLike, what: str = "the output") -> Path:
    """``path`` under ``root``, refused when any component below ``root`` (``path`` included) is a symlink.

    A check only, for moves and deletions (a sweep's ``rejected/``); writes walk the folders themselves
    (:func:`atomic_write`). ``root`` itself may be a link the user chose.
    """
    root, path = Path(root), Path(path)
    current = root
    for part in _below(root, path, what):
        current = current / part
        if current.is_symlink():
            raise _link_error(what, path, current, root)
    return path


def _open_folder(root: Path, parts: tuple[str, ...], *, path: Path, what: str) -> int:
    """A descriptor of ``root/parts...``, creating missing folders; a symlink below ``root`` is refused.

    Each step opens the next folder relative to the previous descriptor with ``O_NOFOLLOW``, so no link
    swapped in between a check and the write can lead out of ``root``.
    """
    try:
        root.mkdir(parents=True, exist_ok=True)  # the user's own path: links there are theirs
        fd = os.open(root, _DIRECTORY)
    except FileExistsError:
        raise FlowgeomError(f"{what} {path}: {root} is a file, not a folder; choose another location") from None
    except OSError as exc:
        raise _write_error(what, path, exc) from None
    here = root
    try:
        for part in parts:
            here = here / part
            try:
                os.mkdir(part, 0o777, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                child = os.open(part, _DIRECTORY | _NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if os.path.islink(here):
                    raise _link_error(what, path, here, root) from None
                if exc.errno == errno.ENOTDIR:
                    raise FlowgeomError(f"{what} {path}: {here} is a file, not a folder; remove it or choose "
                                        "another location") from None
                raise _write_error(what, path, exc) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _output(path: str | os.PathLike, *, root: str | os.PathLike | None, inputs: Iterable[str | os.PathLike],
            what: str) -> tuple[Path, int, str, os.stat_result | None]:
    """``(path, folder descriptor, file name, lstat of the file or None)`` for a write; see "output paths"."""
    path = Path(path)
    root = path.parent if root is None else Path(root)
    parts = _below(root, path, what)
    _refuse_inputs(path, what, inputs)
    fd = _open_folder(root, parts[:-1], path=path, what=what)
    try:
        info = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return path, fd, parts[-1], None
    except OSError as exc:
        os.close(fd)
        raise _write_error(what, path, exc) from None
    if stat.S_ISLNK(info.st_mode) or stat.S_ISDIR(info.st_mode):
        os.close(fd)
        raise _link_error(what, path, path, root) if stat.S_ISLNK(info.st_mode) else _folder_error(what, path)
    return path, fd, parts[-1], info


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object], *,
                 root: str | os.PathLike | None = None, inputs: Iterable[str | os.PathLike] = (),
                 what: str = "the output") -> Path:
    """Fill ``path`` through ``write(fh)`` (a binary file) so readers see the old or the new file only.

    The one way flowgeom writes a whole file: never through a symlink below ``root`` (default: the file's
    folder), never onto or inside ``inputs`` (see "output paths" above). Returns ``path``.
    """
    path, fd, name, _ = _output(path, root=root, inputs=inputs, what=what)
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    try:
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644, dir_fd=fd)
        except OSError as exc:
            raise _write_error(what, path, exc) from None
        try:
            with os.fdopen(out, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            if isinstance(exc, OSError):
                raise _write_error(what, path, exc) from exc
            raise
    finally:
        os.close(fd)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, root: str | os.PathLike | None = None,
                       inputs: Iterable[str | os.PathLike] = (), what: str = "the output") -> Path:
    """:func:`atomic_write` of ``data``."""
    return atomic_write(path, lambda fh: fh.write(data), root=root, inputs=inputs, what=what)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, root: str | os.PathLike | None = None,
                      inputs: Iterable[str | os.PathLike] = (), what: str = "the output") -> Path:
    """:func:`atomic_write` of ``obj`` as indented strict JSON."""
    return atomic_write_bytes(path, (to_json(obj, indent=2) + "\n").encode(), root=root, inputs=inputs, what=what)


def atomic_write_figure(path: str | os.PathLike, fig: Any, *, root: str | os.PathLike | None = None,
                        inputs: Iterable[str | os.PathLike] = (), **savefig: Any) -> Path:
    """:func:`atomic_write` of a matplotlib figure, in the format its suffix names unless ``format=`` is given."""
    savefig.setdefault("format", Path(path).suffix.lstrip(".").lower() or "png")
    return atomic_write(path, lambda fh: fig.savefig(fh, **savefig), root=root, inputs=inputs, what="the figure")


def out_folder(root: str | os.PathLike, path: str | os.PathLike, what: str = "the output folder") -> Path:
    """Create folder ``path`` below ``root`` (parents too) without following a symlink below ``root``.

    For a folder handed to code that writes several files into it (a run's ``figures/``, a claim's figures).
    """
    root, path = Path(root), Path(path)
    os.close(_open_folder(root, _below(root, path, what), path=path, what=what))
    return path


def open_append(path: str | os.PathLike, *, root: str | os.PathLike | None = None,
                newline: str | None = None) -> TextIO:
    """``path`` opened for appending UTF-8 text (created if missing), never through a symlink below ``root``.

    A FIFO, device or socket in its place is refused (appending to one blocks or never lands in a file).
    """
    what = "the output"
    path, fd, name, info = _output(path, root=root, inputs=(), what=what)
    try:
        if info is not None and not stat.S_ISREG(info.st_mode):
            raise FlowgeomError(f"{path} is {file_kind(info.st_mode)}, not a regular file; remove it and run again")
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
        try:
            out = os.open(name, flags, 0o644, dir_fd=fd)
        except OSError as exc:
            raise _write_error(what, path, exc) from None
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):  # swapped in after the check
        os.close(out)
        raise FlowgeomError(f"{path} changed into a non-regular file while being opened; remove it and run again")
    return os.fdopen(out, "a", encoding="utf-8", newline=newline)


# ---------------------------------------------------------------- checkpoints (no pickle)

_TAGS = ("__tensor__", "__tuple__", "__items__", "__float__")


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON tree of ``obj``; tensors are moved into ``tensors`` under their dotted path."""
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
        tensors[name] = obj.detach().to("cpu", copy=True).contiguous()  # a private copy: no shared storage
        return {"__tensor__": name}
    if isinstance(obj, list):
        return [_encode(v, child(i), tensors) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, child(i), tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {str(k): _encode(v, child(k), tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, child(f"key{i}"), tensors), _encode(v, child(k), tensors)]
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


def encode_checkpoint(state: Mapping[str, Any]) -> bytes:
    """The bytes of a version-1 checkpoint of ``state``; see the module docstring."""
    import safetensors.torch

    tensors: dict[str, torch.Tensor] = {}
    state_text = json.dumps(_encode(dict(state), "", tensors), allow_nan=False, separators=(",", ":"))
    meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "state": state_text,
            "sha256": _digest(state_text, tensors)}
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
