"""A fast, bounds-checked GGUF reader: metadata, tensor directory, dequantised tensors.

``gguf.GGUFReader`` builds one numpy view per array element while it opens a
file; on SmolLM2 (98k tokenizer strings and merges) that is ~35 s on a loaded
2-core machine. This reader walks the same header with ``struct`` over a
read-only ``mmap`` (~0.2 s) and dequantises a tensor only when asked, through
``gguf.quants.dequantize`` (the same numerics as llama.cpp's reference).

Layout (GGUF v2/v3, little endian)::

    "GGUF" u32 version, u64 n_tensors, u64 n_kv
    n_kv x  (string key, u32 type, value)            # type 9 = array: u32 elem type, u64 count, elems
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset)
    padding to general.alignment (default 32), then the tensor data

Dims are stored fastest-first (``ne[0]`` = columns), so a matrix is returned
as ``(dims[1], dims[0]) = (out, in)``, the ``nn.Linear`` layout. Every length,
count and offset is checked against the file size before it is used: a
truncated or hostile file gives one :class:`FlowgeomError`, never a crash or
a huge allocation.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flowgeom.errors import FlowgeomError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # (out, in) for matrices: dims reversed
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class GGUFFile:
    """``metadata`` ({key: value}; arrays as lists) and ``tensors`` ({name: GGUFTensorInfo}) of one GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self._buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise FlowgeomError(f"cannot open GGUF file {self.path} ({exc}); check the path") from None
        self._pos = 0
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError) as exc:
            raise FlowgeomError(f"{self.path} is not a readable GGUF file ({type(exc).__name__}: {exc}); it may be "
                                "truncated or corrupt: re-download it") from None

    # ---- primitive reads, bounds-checked
    def _take(self, n: int) -> bytes:
        if n < 0 or self._pos + n > len(self._buf):
            raise FlowgeomError(f"{self.path}: header field at byte {self._pos} runs past the end of the file "
                                f"({len(self._buf)} bytes); the file is truncated or corrupt: re-download it")
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def _scalar(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return self._take(self._scalar("<Q")).decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._scalar("<I"), self._scalar("<Q")
            if count > len(self._buf):  # every element takes at least one byte
                raise FlowgeomError(f"{self.path}: an array claims {count} elements in a {len(self._buf)}-byte file; "
                                    "the file is corrupt: re-download it")
            if etype in _SCALARS and etype != 7:  # numeric arrays in one read
                fmt = _SCALARS[etype]
                raw = self._take(count * struct.calcsize(fmt))
                return np.frombuffer(raw, dtype=np.dtype(fmt)).tolist()
            return [self._value(etype) for _ in range(count)]
        raise FlowgeomError(f"{self.path}: unknown GGUF value type {vtype} at byte {self._pos}; the file is corrupt "
                            "or from an unsupported GGUF version")

    def _parse(self) -> tuple[dict, dict[str, GGUFTensorInfo]]:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if self._take(4) != b"GGUF":
            raise FlowgeomError(f"{self.path} does not start with the GGUF magic; it is not a GGUF file")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise FlowgeomError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        if n_tensors > len(self._buf) or n_kv > len(self._buf):
            raise FlowgeomError(f"{self.path}: header claims {n_tensors} tensors and {n_kv} keys; corrupt file")
        metadata = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            if n_dims > 8:
                raise FlowgeomError(f"{self.path}: tensor {name!r} claims {n_dims} dimensions; corrupt file")
            dims = [self._scalar("<Q") for _ in range(n_dims)]
            infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        align = int(metadata.get("general.alignment", 32)) or 32
        start = -(-self._pos // align) * align
        tensors = {}
        for name, dims, gtype, rel in infos:
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
            except (ValueError, KeyError):
                raise FlowgeomError(f"{self.path}: tensor {name!r} has unknown ggml type {gtype}") from None
            count = int(np.prod(dims, dtype=object)) if dims else 1
            if dims and dims[0] % block:
                raise FlowgeomError(f"{self.path}: tensor {name!r} rows of {dims[0]} are not whole blocks of {block}")
            nbytes = count // block * size
            offset = start + rel
            if offset + nbytes > len(self._buf):
                raise FlowgeomError(f"{self.path}: tensor {name!r} runs past the end of the file; it is truncated: "
                                    "re-download it")
            tensors[name] = GGUFTensorInfo(name, tuple(int(d) for d in reversed(dims)), gtype, offset, nbytes)
        return metadata, tensors

    def load(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantised to float32, shape ``info.shape`` (a copy; the file stays read-only)."""
        from gguf import GGMLQuantizationType, quants

        if name not in self.tensors:
            raise FlowgeomError(f"{self.path} holds no tensor {name!r}")
        info = self.tensors[name]
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        arr = quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType(info.ggml_type))  # (rows, cols)
        out = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(info.shape))
        if not bool(torch.isfinite(out).all()):
            raise FlowgeomError(f"tensor {name!r} in {self.path} contains NaN or Inf weights; fix the checkpoint")
        return out
