"""GGUF metadata (the key/value section), decoded fast and bounds-checked: model config and tokenizer.

Tensors are read through :func:`flowgeom.continuity.open_source` (its
``gguf_file`` reader walks past this section without decoding it). The
model's hyper-parameters and its tokenizer (``tokenizer.ggml.tokens``,
``merges``, ``token_type``) live here, which is why this module decodes it.
``gguf.GGUFReader`` builds one numpy view per array element (~35 s on
SmolLM2's 98k tokenizer strings on a loaded 2-core machine); this walks the
section with ``struct`` over a read-only ``mmap`` (~0.5 s).

Layout (GGUF v2/v3, little endian)::

    "GGUF" u32 version, u64 n_tensors, u64 n_kv
    n_kv x  (string key, u32 type, value)   # type 9 = array: u32 elem type, u64 count, elems
    string = u64 length + UTF-8 bytes

Every length and count is checked against the file size before it is used:
a truncated or hostile file gives one :class:`FlowgeomError`, never a crash
or a huge allocation.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

from flowgeom.errors import FlowgeomError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFMetadata:
    """``metadata``: {key: value} of one GGUF file (arrays as lists)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self._buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise FlowgeomError(f"cannot open GGUF file {self.path} ({exc}); check the path") from None
        self._pos = 0
        try:
            self.metadata = self._parse()
        except (struct.error, UnicodeDecodeError, OverflowError, RecursionError) as exc:
            raise FlowgeomError(f"{self.path} is not a readable GGUF file ({type(exc).__name__}); it may be "
                                "truncated or corrupt: re-download it") from None
        finally:
            self._buf.close()  # every value is a copy: nothing keeps the mapping

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

    def _parse(self) -> dict:
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
        return metadata
