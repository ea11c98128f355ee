"""Where weights come from: modules, safetensors (single, sharded, HF folders), GGUF.

A :class:`TensorSource` lists ``{name: shape}`` without reading data and
loads **one tensor at a time** (safetensors ``safe_open`` reads only that
tensor's bytes; GGUF tensors are views into a private memory map, dequantised
one at a time by :mod:`flowgeom.io.gguf` — F32/F16/BF16/Q8_0/
Q4_0/Q4_1 in torch, K-quants and others through ``gguf.quants``).

Checkpoints come from other people, so every file is treated as hostile
(see :mod:`flowgeom.io.checkpoints`): it must be a regular file
(a FIFO would block the open forever, a device never ends), a safetensors
header must follow the schema (an object of ``{dtype, shape, data_offsets}``
entries whose byte spans tile the data section exactly, from 0, with sizes
that match ``prod(shape) * itemsize``), and every shard an index names must
stay inside the index's folder. Every failure — and any error the readers
still raise — becomes one single-line :class:`FlowgeomError` naming the file
and the fix.

``open_source(spec)`` accepts an ``nn.Module``, a ``{name: tensor}`` mapping,
a path (``.safetensors``, ``model.safetensors.index.json``, ``.gguf``, or a
folder holding one of those), or ``builtin:smollm2`` / ``builtin:minilm``
(:mod:`flowgeom.io.builtin`).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, choice_error, shown
from flowgeom.files import one_line, open_regular, regular_file
from flowgeom.io.builtin import builtin_path
from flowgeom.io.checkpoints import ITEMSIZE, confined_shard, read_index, read_safetensors_header
from flowgeom.io.gguf import GGUFFile

_FILE_SUFFIXES = (".safetensors", ".gguf", ".index.json")


class TensorSource:
    """Lazy ``{name: tensor}``: ``shapes`` without data, ``load(name)`` reads one tensor (CPU)."""

    label = "tensors"

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]):
        self.shapes = dict(shapes)

    def _read(self, name: str) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def load(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored (layout and dtype), checked finite."""
        if name not in self.shapes:
            raise choice_error("tensor", name, sorted(self.shapes)[:20])
        try:
            t = self._read(name)
        except FlowgeomError:
            raise
        except Exception as exc:  # reader errors: corrupt or truncated data
            raise FlowgeomError(f"cannot read tensor {shown(name)} from {self.label}: {one_line(exc)}; the file looks "
                                "corrupt or truncated, re-download or re-export it") from exc
        if t.is_meta:
            raise FlowgeomError(f"tensor {shown(name)} in {self.label} is on the meta device (no values); materialise "
                                "the model first (load its weights, e.g. from_pretrained without device_map='meta')")
        if tuple(t.shape) != tuple(self.shapes[name]):
            raise FlowgeomError(f"tensor {shown(name)} in {self.label} holds shape {list(t.shape)} but the header says "
                                f"{list(self.shapes[name])}; the file is corrupt, re-export it")
        if t.is_floating_point():
            probe = t.float() if t.element_size() == 1 else t  # float8 has no sum/isfinite kernels
            if not bool(torch.isfinite(probe.sum())) and not bool(torch.isfinite(probe).all()):
                raise FlowgeomError(f"tensor {shown(name)} in {self.label} contains NaN or Inf weights; "
                                    "fix the checkpoint (or exclude this role with --roles)")
        return t

    def _read_part(self, name: str, index: int) -> torch.Tensor:
        return self._read(name)[index]

    def load_part(self, name: str, index: int) -> torch.Tensor:
        """``load(name)[index]`` (one expert of a 3-D stack), reading only that slice where the format allows."""
        shape = self.shapes.get(name)
        if shape is None or len(shape) < 2 or not 0 <= index < shape[0]:
            raise FlowgeomError(f"tensor {shown(name)} in {self.label} has shape {list(shape or ())}: no slice {index} "
                                "along its first axis")
        try:
            t = self._read_part(name, index)
        except Exception as exc:  # reader errors: corrupt or truncated data
            raise FlowgeomError(f"cannot read slice {index} of tensor {shown(name)} from {self.label}: "
                                f"{one_line(exc)}; the file looks corrupt or truncated, re-export it") from exc
        if tuple(t.shape) != tuple(shape[1:]):
            raise FlowgeomError(f"slice {index} of tensor {shown(name)} in {self.label} holds shape {list(t.shape)}, "
                                f"not {list(shape[1:])}; the file is corrupt, re-export it")
        if t.is_floating_point() and not bool(torch.isfinite(t.float() if t.element_size() == 1 else t).all()):
            raise FlowgeomError(f"tensor {shown(name)} in {self.label} contains NaN or Inf weights (slice {index}); "
                                "fix the checkpoint (or exclude this role with --roles)")
        return t

    def nbytes(self) -> int:
        return 0


class MemorySource(TensorSource):
    """An ``nn.Module`` (its state dict) or a mapping of tensors, already in memory."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], label: str = "module"):
        self._tensors = {k: v.detach() for k, v in tensors.items() if isinstance(v, torch.Tensor)}
        super().__init__({k: tuple(v.shape) for k, v in self._tensors.items()})
        self.label = label

    def _read(self, name: str) -> torch.Tensor:
        return self._tensors[name]


class SafetensorsSource(TensorSource):
    """One or several safetensors files (shards); ``weight_map`` says which file holds which tensor.

    Every header is validated (:func:`read_safetensors_header`) before the
    library opens the file. A tensor name held by two files is refused (no
    silent "last one wins"); with a ``weight_map`` (an index), every tensor it
    lists must be in the shard it names and every tensor of the shards must be
    listed.
    """

    def __init__(self, files: list[Path], label: str, weight_map: Mapping[str, Path] | None = None):
        from safetensors import safe_open

        self.label, self._handles, shapes, self._file = label, {}, {}, {}
        self.itemsizes: dict[str, int] = {}  # bytes per element as stored, for memory estimates
        self._entries, self._data_start, self._fds = {}, {}, {}  # validated spans, data offsets, open files
        for path in files:
            entries = read_safetensors_header(path)
            with open_regular(path, "safetensors file") as fh:  # regular-file checks, then a raw descriptor
                self._fds[path] = os.dup(fh.fileno())
            self._data_start[path] = 8 + int.from_bytes(os.pread(self._fds[path], 8, 0), "little")
            for key, entry in entries.items():
                self.itemsizes[key] = ITEMSIZE[entry.dtype]
                self._entries[key] = entry
                if key in self._file:
                    raise FlowgeomError(f"tensor {shown(key)} is stored twice, in {shown(self._file[key])} and in "
                                        f"{shown(path)}; which copy is meant is ambiguous: remove the stale file "
                                        "(or add a model.safetensors.index.json that maps each tensor to one shard)")
                shapes[key], self._file[key] = entry.shape, path
            try:
                handle = safe_open(str(path), framework="pt")
                keys = set(handle.keys())
            except Exception as exc:
                raise FlowgeomError(f"{shown(path)} is not a readable safetensors file ({one_line(exc)}); it may be "
                                    "truncated or corrupt: re-download or re-export it") from exc
            if keys != set(entries):  # the library and our reading of the header must agree
                raise FlowgeomError(f"{shown(path)}: the safetensors library lists {len(keys)} tensors where the "
                                    f"header holds {len(entries)}; the file is corrupt: re-export it")
            self._handles[path] = handle
        if weight_map is not None:
            _check_weight_map(weight_map, self._file, label)
        super().__init__(shapes)

    def _read(self, name: str) -> torch.Tensor:
        """One tensor by a plain ``read`` of its validated byte span into new memory.

        Not through the library's memory map: every mapped page a read touches stays in the process's
        resident set (as file pages) while the file is open, so streaming a 16 GB checkpoint showed a
        peak RSS of ~9 GB although the analysis allocated 0.8 GB. A ``read`` leaves those pages in the
        page cache only. dtypes torch cannot view (none of the float ones) go through the library.
        """
        entry, path = self._entries[name], self._file[name]
        dtype = _TORCH_DTYPES.get(entry.dtype)
        if dtype is None or sys.byteorder != "little" or not hasattr(os, "preadv"):
            return self._handles[path].get_tensor(name)
        size = entry.end - entry.start
        buf = torch.empty(size, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        fd = self._fds[path]  # opened once (open_regular), read by offset: thread-safe, GIL released
        while done < size:  # one read returns at most ~2 GiB on Linux
            got = os.preadv(fd, [view[done:]], self._data_start[path] + entry.start + done)
            if got <= 0:
                raise FlowgeomError(f"{shown(path)}: tensor {shown(name)} needs bytes {entry.start}..{entry.end} of "
                                    f"the data section but only {done} of its {size} could be read; the file is "
                                    "truncated or shrank while being read: re-download or re-export it")
            done += got
        return buf.view(dtype).reshape(entry.shape)  # safetensors data is little-endian, as torch on x86/ARM

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def _read_part(self, name: str, index: int) -> torch.Tensor:
        return self._handles[self._file[name]].get_slice(name)[index]  # reads only this slice's bytes

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self._handles)


_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}


def _check_weight_map(weight_map: Mapping[str, Path], found: Mapping[str, Path], label: str) -> None:
    """Index and shards agree: each listed tensor is in its shard, each shard tensor is listed."""
    for name, shard in weight_map.items():
        if name not in found:
            raise FlowgeomError(f"{label}: the index lists tensor {shown(name)} in {shown(shard.name)} but no shard "
                                "holds it; the shards are incomplete: download all of them")
        if found[name] != shard:
            raise FlowgeomError(f"{label}: the index puts tensor {shown(name)} in {shown(shard.name)} but it is in "
                                f"{shown(found[name].name)}; the index does not match the shards: regenerate it")
    extra = sorted(set(found) - set(weight_map))
    if extra:
        raise FlowgeomError(f"{label}: {len(extra)} tensor(s) of the shards are not in the index (first: "
                            f"{shown(extra[0])} in {shown(found[extra[0]].name)}); the index does not match the "
                            "shards: regenerate it")


class GGUFSource(TensorSource):
    """A GGUF file through flowgeom's GGUF reader (:mod:`flowgeom.io.gguf`); shapes (out, in).

    Opening parses only the tensor table (the key/value section is walked,
    not decoded): ~10 ms for SmolLM2 where ``gguf.GGUFReader`` took seconds.
    Tensors are zero-copy views into a private memory map, dequantised one at
    a time; :attr:`metadata` decodes a key/value entry when it is asked for.
    """

    def __init__(self, path: Path):
        self.label, self._path = shown(path), path
        with open_regular(path, "GGUF file") as fh:
            try:
                self._file = GGUFFile(path, fh)
            except FlowgeomError:
                raise
            except Exception as exc:  # mmap of an empty file, I/O errors
                raise FlowgeomError(f"{shown(path)} is not a readable GGUF file ({type(exc).__name__}: "
                                    f"{one_line(exc)}); it may be truncated or corrupt: re-download it") from exc
        super().__init__({name: t.shape for name, t in self._file.tensors.items()})

    @property
    def metadata(self) -> Mapping:
        """The file's key/value metadata, decoded lazily (:class:`flowgeom.io.gguf.GGUFMetadata`)."""
        return self._file.metadata

    def _read(self, name: str) -> torch.Tensor:
        return self._file.tensor(name)  # new memory: callers may modify it

    def nbytes(self) -> int:
        return self._path.stat().st_size


def open_source(spec) -> TensorSource:
    """A :class:`TensorSource` for a module, a mapping, a path or a ``builtin:`` name."""
    if isinstance(spec, TensorSource):
        return spec
    if isinstance(spec, nn.Module):
        return MemorySource(spec.state_dict(), label=type(spec).__name__)
    if isinstance(spec, Mapping):
        return MemorySource(spec, label="state dict")
    try:
        text = os.fspath(spec)
    except TypeError:
        raise FlowgeomError(f"cannot read weights from a {type(spec).__name__}; pass a checkpoint path, "
                            "'builtin:NAME', an nn.Module or a mapping of tensor names to tensors") from None
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text.startswith("builtin:"):
        return open_source(builtin_path(text))
    path = Path(text)
    info = regular_file(path, "checkpoint", folder_ok=True)
    if stat.S_ISDIR(info.st_mode):
        if path.name.endswith(_FILE_SUFFIXES):
            raise FlowgeomError(f"{shown(path)} is a folder, not a {path.suffix or 'index'} file; pass the file "
                                "itself, or a model folder that holds it")
        return _open_folder(path)
    if path.name.endswith(".index.json"):
        return _open_index(path)
    if path.suffix == ".safetensors":
        return SafetensorsSource([path], shown(path))
    if path.suffix == ".gguf":
        return GGUFSource(path)
    raise FlowgeomError(f"unsupported file {shown(path.name)}; use .safetensors, model.safetensors.index.json or "
                        ".gguf (convert .bin/.pt checkpoints to safetensors first)")


def _open_index(path: Path) -> TensorSource:
    """An index ``{"weight_map": {tensor: shard}}``: shards confined to the index's folder, checked, opened."""
    weight_map = read_index(path)
    shards = {name: confined_shard(path, name) for name in sorted(set(weight_map.values()))}
    files = list(dict.fromkeys(shards.values()))  # two spellings of one file ("a" and "./a") open it once
    return SafetensorsSource(files, shown(path.parent), {t: shards[s] for t, s in weight_map.items()})


def _open_folder(path: Path) -> TensorSource:
    """The one checkpoint a folder holds: an index, its .safetensors files (shards), or a single .gguf."""
    try:
        names = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
    except OSError as exc:
        raise FlowgeomError(f"cannot list folder {shown(path)} ({one_line(exc)}); check its permissions") from exc
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    shards = [n for n in names if n.endswith(".safetensors")]
    ggufs = [n for n in names if n.endswith(".gguf")]
    if len(indexes) > 1:
        raise FlowgeomError(f"folder {shown(path)} holds {len(indexes)} safetensors indexes "
                            f"({', '.join(map(shown, indexes))}); pass the one you mean explicitly")
    if indexes:
        return _open_index(path / indexes[0])
    if shards and ggufs:
        raise FlowgeomError(f"folder {shown(path)} holds both .safetensors ({shown(shards[0])}, …) and .gguf "
                            f"({shown(ggufs[0])}, …) checkpoints; pass the file you mean explicitly")
    if shards:  # several files without an index: shards, each tensor in exactly one of them
        return SafetensorsSource([path / n for n in shards], shown(path))
    if len(ggufs) == 1:
        return GGUFSource(path / ggufs[0])
    listed = ", ".join(map(shown, names[:20])) or "nothing"
    raise FlowgeomError(f"folder {shown(path)} holds no safetensors index, no .safetensors file and not exactly one "
                        f".gguf (found: {listed}); pass one file explicitly")
