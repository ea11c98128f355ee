"""The one GGUF reader: header walked once, tensors as zero-copy views, key/value metadata decoded on demand.

Used by :mod:`flowgeom.io.sources` (the tensor table; the analyzer never
needs the metadata), :mod:`flowgeom.nn.llama` (model settings) and
:mod:`flowgeom.data.tokens` (tokenizer strings, merges, token types). It lives
in :mod:`flowgeom.io`, at the bottom of the house, so ``nn`` and ``data`` read
GGUF without importing anything above them.

Why not ``gguf.GGUFReader``: it builds a numpy object for every field it
meets, including each of the ~49k tokenizer strings of SmolLM2, so opening the
98 MB SmolLM2 file took 2-5 s (plus ~1 s to import ``gguf``) before any
weight was read. Here opening *walks* the key/value section once with
``struct``, recording where each value starts (only ``general.alignment`` is
decoded), and parses the tensor table: a few ms. A value is decoded when
:attr:`GGUFFile.metadata` is first asked for it (the tokenizer's string
arrays in a tight loop, ~0.5 s for SmolLM2's vocabulary and merges).

Layout (GGUF v2/v3, little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)::

    "GGUF"  u32 version  u64 n_tensors  u64 n_kv
    n_kv    x  { string key, u32 type, value }      value: scalar | string | array
    n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset }
    padding to ``alignment`` (general.alignment, default 32), then the data section

with ``string = u64 length + UTF-8 bytes`` and ``array = u32 type, u64 count,
count values``. ``ne[0]`` is the fastest-moving (input) dimension, so the
matrix a tensor holds is ``(ne[1], ne[0])`` = ``(out, in)``.

Hostile files: every read is bounds-checked against the file size (a
truncated header, a string or array longer than the file, an absurd count),
the tensor types must be known, ``ne[0]`` a multiple of the type's block,
every tensor must lie inside the file and start on the alignment, no tensor
or key may appear twice. Every failure is one :class:`FlowgeomError` naming
the file and what is wrong; the walk checks every length before a value is
decoded, so decoding never meets a length the file cannot hold.
Big-endian files and version 1 are refused with a message (no maintained
tool writes them any more).

Dequantisation (:func:`dequantize`) is done in torch for the types small
models ship (F32, F16, BF16, Q8_0, Q4_0, Q4_1), bit-identical to
``gguf.quants.dequantize`` (float32 ``d * q`` then ``+ m``); any other type
goes through ``gguf.quants`` (imported only then).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from flowgeom.errors import FlowgeomError, shown
from flowgeom.files import open_regular

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# ggml type id -> (name, block size in elements, bytes per block); same numbers as gguf.constants.GGML_QUANT_SIZES
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}
# key/value scalar types: id -> struct code (u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64); 8 = string, 9 = array
_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALAR = {vtype: struct.calcsize(code) for vtype, code in _CODES.items()}  # id -> byte size
_STRING, _ARRAY, _UINT32 = 8, 9, 4
MAX_DIMS = 4  # ggml tensors have at most 4 dimensions
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table: ``shape`` in torch order (``ne`` reversed), absolute byte ``offset``."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type][0]


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; every overrun names the file and says "truncated"."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, what: str) -> FlowgeomError:
        return FlowgeomError(f"{shown(self.path)} is not a readable GGUF file ({what} at byte {self.pos}); it may be "
                             "truncated or corrupt: re-download it")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes past the end of the {self.size}-byte file: truncated")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return out

    def skip_string(self, what: str) -> None:
        (n,) = self.unpack("<Q", what)
        self.need(n, what)
        self.pos += n

    def string(self, what: str, errors: str = "strict") -> str:
        """A GGUF string; ``errors="replace"`` for values (a token may hold a partial UTF-8 sequence)."""
        (n,) = self.unpack("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8", errors)
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """Decode the value of type ``vtype`` at the cursor: a number, bool, str, or a list (arrays)."""
        if vtype in _CODES:
            return self.unpack("<" + _CODES[vtype], what)[0]
        if vtype == _STRING:
            return self.string(what, "replace")
        if vtype != _ARRAY:
            raise self.fail(f"{what}: unknown value type {vtype}")
        if depth > 8:
            raise self.fail(f"{what}: arrays nested deeper than 8")
        etype, count = self.unpack("<IQ", what)
        if etype in _CODES:  # numbers in one read
            self.need(count * _SCALAR[etype], what)
            return list(self.unpack(f"<{count}{_CODES[etype]}", what))
        if etype == _STRING:  # tokenizer vocabularies and merges: ~50k strings each, so a tight loop
            self.need(count * 8, what)
            out, pos, buf, size, u64 = [], self.pos, self.buf, self.size, _U64.unpack_from
            for _ in range(count):
                n = u64(buf, pos)[0] if pos + 8 <= size else size
                if pos + 8 + n > size:
                    self.pos = pos
                    raise self.fail(f"{what}: a string runs past the end of the file: truncated")
                out.append(str(buf[pos + 8:pos + 8 + n], "utf-8", "replace"))
                pos += 8 + n
            self.pos = pos
            return out
        self.need(count * 8, what)
        return [self.value(etype, what, depth + 1) for _ in range(count)]

    def skip_value(self, vtype: int, what: str, depth: int = 0) -> None:
        if vtype in _SCALAR:
            self.need(_SCALAR[vtype], what)
            self.pos += _SCALAR[vtype]
        elif vtype == _STRING:
            self.skip_string(what)
        elif vtype == _ARRAY:
            if depth > 8:
                raise self.fail(f"{what}: arrays nested deeper than 8")
            etype, count = self.unpack("<IQ", what)
            if etype in _SCALAR:
                self.need(count * _SCALAR[etype], what)
                self.pos += count * _SCALAR[etype]
            elif etype == _STRING:  # tokenizer vocabularies: ~50k strings, so a tight loop
                self.need(count * 8, what)  # every element holds at least a u64: bounds absurd counts first
                pos, buf, size, u64 = self.pos, self.buf, self.size, _U64.unpack_from
                for _ in range(count):
                    if pos + 8 > size:
                        pos = size + 1
                        break
                    pos += 8 + u64(buf, pos)[0]
                if pos > size:
                    self.pos = size
                    raise self.fail(f"{what}: a string runs past the end of the file: truncated")
                self.pos = pos
            elif etype == _ARRAY:
                self.need(count * 8, what)
                for _ in range(count):
                    self.skip_value(etype, what, depth + 1)
            else:
                raise self.fail(f"{what}: unknown array element type {etype}")
        else:
            raise self.fail(f"{what}: unknown value type {vtype}")


@dataclass(frozen=True)
class GGUFHeader:
    """What one walk of a GGUF header finds: ``kv`` maps each key to ``(value type, byte offset of its value)``."""

    version: int
    tensors: dict[str, GGUFTensor]
    kv: dict[str, tuple[int, int]]


def read_gguf_header(path: Path, buf) -> GGUFHeader:
    """The header of the GGUF file ``path`` whose bytes are ``buf`` (bytes-like), every length checked."""
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != MAGIC:
        raise cur.fail(f"magic bytes {bytes(buf[:4])!r}, expected {MAGIC!r}")
    cur.pos = 4
    (version,) = cur.unpack("<I", "version")
    if version not in (2, 3):
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        kind = "a big-endian file" if swapped in (2, 3) else f"version {version}"
        raise FlowgeomError(f"{shown(path)}: GGUF {kind} is not supported (only little-endian version 2 or 3); "
                            "re-convert it with a current llama.cpp convert script")
    n_tensors, n_kv = cur.unpack("<QQ", "header counts")
    cur.need(n_kv * 12, f"{n_kv} key/value pairs")  # each is at least a u64 length, a u32 type
    alignment = DEFAULT_ALIGNMENT
    kv: dict[str, tuple[int, int]] = {}
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        (vtype,) = cur.unpack("<I", f"type of {shown(key)}")
        if key in kv:
            raise cur.fail(f"key {shown(key)} appears twice (a reader would silently keep only one)")
        kv[key] = (vtype, cur.pos)
        if key == "general.alignment":
            if vtype != _UINT32:
                raise cur.fail(f"general.alignment has type {vtype}, not uint32")
            (alignment,) = cur.unpack("<I", "general.alignment")
            if alignment < 1 or alignment & (alignment - 1):
                raise cur.fail(f"general.alignment {alignment} is not a power of two")
        else:
            cur.skip_value(vtype, f"value of {shown(key)}")
    cur.need(n_tensors * 24, f"{n_tensors} tensor entries")  # name length, n_dims, type, offset at least
    entries = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name {i}")
        (n_dims,) = cur.unpack("<I", f"dims of {shown(name)}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {shown(name)} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        ne = cur.unpack(f"<{n_dims}Q", f"shape of {shown(name)}")
        ggml_type, offset = cur.unpack("<IQ", f"type of {shown(name)}")
        entries.append((name, ne, ggml_type, offset))
    data_start = -(-cur.pos // alignment) * alignment
    size = cur.size
    tensors: dict[str, GGUFTensor] = {}
    for name, ne, ggml_type, offset in entries:
        if ggml_type not in GGML_TYPES:
            raise FlowgeomError(f"{shown(path)}: tensor {shown(name)} has unknown ggml type {ggml_type}; the file is "
                                "corrupt or newer than this reader: re-convert it, or export safetensors")
        _, block, type_size = GGML_TYPES[ggml_type]
        if ne[0] % block:
            raise FlowgeomError(f"{shown(path)}: tensor {shown(name)} ({GGML_TYPES[ggml_type][0]}) has a row of "
                                f"{ne[0]} elements, not a multiple of its block of {block}; the file is corrupt")
        numel = 1
        for n in ne:
            numel *= n
        n_bytes = numel // block * type_size
        start = data_start + offset
        if offset % alignment:
            raise FlowgeomError(f"{shown(path)}: tensor {shown(name)} starts at data offset {offset}, not a multiple "
                                f"of the alignment {alignment}; the file is corrupt: re-download it")
        if start + n_bytes > size:
            raise FlowgeomError(f"{shown(path)}: tensor {shown(name)} runs past the end of the file (bytes {start} to "
                                f"{start + n_bytes} of {size}); it is truncated: re-download it")
        if name in tensors:
            raise FlowgeomError(f"{shown(path)}: tensor {shown(name)} is listed twice; the file is corrupt")
        tensors[name] = GGUFTensor(name, tuple(int(n) for n in reversed(ne)), ggml_type, start, n_bytes)
    return GGUFHeader(version, tensors, kv)


class GGUFMetadata(Mapping):
    """``{key: value}`` of a GGUF file's key/value section, each value decoded on first access (arrays as lists)."""

    def __init__(self, path: Path, buf, kv: dict[str, tuple[int, int]]):
        self._path, self._buf, self._kv, self._done = path, buf, kv, {}

    def __getitem__(self, key: str):
        if key not in self._done:
            vtype, pos = self._kv[key]  # KeyError for a missing key, as a dict
            cur = _Cursor(self._buf, self._path)
            cur.pos = pos
            self._done[key] = cur.value(vtype, f"value of {shown(key)}")
        return self._done[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._kv)

    def __len__(self) -> int:
        return len(self._kv)


class GGUFFile:
    """A GGUF file's tensor table and metadata over its bytes as a private (copy-on-write) memory map.

    ``tensors``: ``{name: GGUFTensor}``; ``metadata``: a :class:`GGUFMetadata`
    mapping (valid while the file is open). Usable as a context manager.
    """

    def __init__(self, path: Path, fileobj):
        self.path = path
        self._map = mmap.mmap(fileobj.fileno(), 0, access=mmap.ACCESS_COPY)  # writable view, the file stays as is
        header = read_gguf_header(path, self._map)
        self.tensors, self.version = header.tensors, header.version
        self.metadata = GGUFMetadata(path, self._map, header.kv)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # a raw() view is still alive: the map goes when it does
            pass

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def raw(self, name: str) -> torch.Tensor:
        """The stored bytes of tensor ``name``, uint8, zero-copy."""
        t = self.tensors[name]
        return torch.frombuffer(self._map, dtype=torch.uint8, count=t.n_bytes, offset=t.offset)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` dequantised to float32 (float64 for F64, integers as stored), torch order."""
        t = self.tensors[name]
        return dequantize(self.raw(name), t.ggml_type).reshape(t.shape)


def open_gguf(path: str | Path) -> GGUFFile:
    """:class:`GGUFFile` of the regular file ``path``; a FIFO or device is refused before it is opened."""
    path = Path(path)
    with open_regular(path, "GGUF file", fix="pass the .gguf file itself") as fh:
        try:
            return GGUFFile(path, fh)
        except ValueError as exc:  # mmap of an empty file (FlowgeomError is a ValueError too)
            if isinstance(exc, FlowgeomError):
                raise
            raise FlowgeomError(f"{shown(path)} is not a readable GGUF file ({exc}); it may be truncated or "
                                "corrupt: re-download it") from None


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """float16 scale stored at bytes ``start:start+2`` of each block (n_blocks, type_size) -> float32 (n_blocks, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 16) packed bytes -> (n_blocks, 32) values 0..15: low nibbles first, then high ones (ggml order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dequantize(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Flat values of ``raw`` (uint8 bytes of one tensor) of ggml type ``ggml_type``, in new memory.

    Block formats (32 values per block): Q8_0 ``x = d q`` (d f16, q int8);
    Q4_0 ``x = d (q - 8)``; Q4_1 ``x = d q + m`` (d, m f16, q 4-bit,
    low nibbles are values 0-15, high nibbles 16-31).
    """
    name, block, type_size = GGML_TYPES[ggml_type]
    plain = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
             "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
    if name in plain:
        out = raw.view(plain[name])
        return out.to(torch.float32) if name in ("F16", "BF16") else out.clone()  # own memory, never the map's
    if name in ("Q8_0", "Q4_0", "Q4_1"):
        blocks = raw.reshape(-1, type_size)  # (n_blocks, type_size)
        d = _f16(blocks, 0)
        if name == "Q8_0":
            q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)  # (n_blocks, 32)
            return (d * q).reshape(-1)
        if name == "Q4_0":
            q = (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).to(torch.float32)
            return (d * q).reshape(-1)
        qs = blocks[:, 4:]  # (n_blocks, 16) packed nibbles
        out = torch.empty(qs.shape[0], 32, dtype=torch.float32)  # filled in place: no uint8/float temporaries
        out[:, :16] = qs & 0x0F  # low nibbles: values 0-15 (copy_ converts to float32, exactly)
        out[:, 16:] = qs >> 4  # high nibbles: values 16-31
        return out.mul_(d).add_(_f16(blocks, 2)).reshape(-1)  # float32 d * q, then + m: gguf's rounding, bit for bit
    from gguf import quants  # other (K-, I-) quants: the reference implementation, imported only when needed

    return torch.from_numpy(quants.dequantize(raw.numpy(), ggml_type).reshape(-1).copy())
