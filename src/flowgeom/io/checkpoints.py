"""safetensors checkpoints (single files, sharded indexes) from other people, read as hostile input.

Nothing here reads a tensor; it decides whether a file may be opened at all
(:mod:`flowgeom.io.sources` opens what passes).

* **Regular files only** (:func:`flowgeom.files.regular_file`): a FIFO blocks ``open`` forever, a character device (``/dev/zero``)
  never ends, a folder named ``x.safetensors`` is no file; dangling and
  looping symlinks get their own message. The check runs on ``stat`` *before*
  any open, and the open itself is non-blocking and re-checked with ``fstat``.
* **safetensors header schema** (:func:`read_safetensors_header`). Layout:
  ``n`` (u64 little-endian), ``n`` bytes of UTF-8 JSON, then the data
  section of ``D = size - 8 - n`` bytes. The header must be an object; its
  optional ``__metadata__`` a ``{str: str}`` object; every other entry an
  object with exactly ``dtype`` (a known name), ``shape`` (a list of ints
  >= 0) and ``data_offsets`` (``[start, end]``, ints, ``0 <= start <= end``)
  with ``end - start = prod(shape) * itemsize(dtype)``. Sorted by
  ``start``, the spans must tile ``[0, D)`` exactly: each starts where the
  previous ended, none overlaps, the last ends at ``D`` (past it: the file is
  truncated; before it: unexplained bytes). Duplicate keys (which
  ``json.loads`` would silently collapse, last one wins) are refused, and so
  are a header longer than the library's own 100 MB limit and JSON nested
  deeper than Python's recursion limit.
* **Index confinement** (:func:`read_index`, :func:`confined_shard`): the
  index is an object whose ``weight_map`` is ``{tensor: shard file name}``;
  a shard name that is absolute or has a ``..`` component is refused, and so
  is one that, symlinks resolved, lands outside the index's folder (or the
  folder the index itself resolves into: the Hugging Face cache keeps both
  index and shards as links into one ``blobs/`` folder). A refused shard is
  never opened, so no byte of it can reach a message.

Messages are one line: names and paths with control characters are shown
escaped (:func:`shown`), reader errors flattened (:func:`one_line`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from flowgeom.errors import FlowgeomError, shown
from flowgeom.files import one_line, open_regular, regular_file

MAX_HEADER = 100_000_000  # bytes; the safetensors library refuses longer headers too
MAX_INDEX = 100_000_000  # bytes of model.safetensors.index.json (real ones are ~100 kB)
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
            "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


class _Duplicate(ValueError):
    pass


def _unique_object(pairs: list[tuple[str, object]]) -> dict:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(f"key {shown(key)} appears twice in one JSON object (a reader would silently keep "
                             "only one of them)")
        seen[key] = value
    return seen


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes, where: str) -> object:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, nesting bounded (else :class:`FlowgeomError`)."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_object, parse_constant=_no_constant)
    except _Duplicate as exc:
        raise FlowgeomError(f"{where}: {exc}; the file is corrupt or forged: re-export it") from None
    except RecursionError:
        raise FlowgeomError(f"{where}: the JSON is nested too deeply to be a checkpoint header; the file is corrupt "
                            "or forged: re-download or re-export it") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int too long
        raise FlowgeomError(f"{where}: not valid JSON ({one_line(exc)[:200]}); the file is corrupt or truncated: "
                            "re-download or re-export it") from None


@dataclass(frozen=True)
class TensorEntry:
    """One validated header entry: dtype name, shape, byte span ``[start, end)`` in the data section."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _entry(name: str, info: object, where: str) -> TensorEntry:
    """Validate one ``{dtype, shape, data_offsets}`` entry (see module docstring)."""
    label = f"{where}: tensor {shown(name)}"
    fix = "the header is corrupt or forged: re-export the checkpoint"
    if not name.isprintable():
        raise FlowgeomError(f"{label}: the name holds control characters; {fix}")
    if not isinstance(info, dict):
        raise FlowgeomError(f"{label}: the entry is {_kind(info)}, not an object {{dtype, shape, data_offsets}}; {fix}")
    missing = [k for k in _ENTRY_KEYS if k not in info]
    unexpected = sorted(k for k in info if k not in _ENTRY_KEYS)
    if missing or unexpected:
        detail = "; ".join(p for p in (missing and f"missing {', '.join(missing)}",
                                       unexpected and f"unexpected {', '.join(map(shown, unexpected[:5]))}") if p)
        raise FlowgeomError(f"{label}: the entry must hold exactly dtype, shape, data_offsets ({detail}); {fix}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise FlowgeomError(f"{label}: unknown dtype {shown(dtype) if isinstance(dtype, str) else _kind(dtype)}; "
                            f"flowgeom reads {', '.join(ITEMSIZE)}; convert the checkpoint to one of those")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FlowgeomError(f"{label}: shape must be a list of integers >= 0, got {_short(shape)}; {fix}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise FlowgeomError(f"{label}: data_offsets must be [start, end] with integers 0 <= start <= end, got "
                            f"{_short(offsets)}; {fix}")
    want = math.prod(shape) * ITEMSIZE[dtype]
    if offsets[1] - offsets[0] != want:
        raise FlowgeomError(f"{label} claims {dtype} {_short(shape)} = {want} bytes but its data_offsets "
                            f"{offsets[0]}..{offsets[1]} span {offsets[1] - offsets[0]}; the header lies about "
                            "sizes: re-export the checkpoint")
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _short(value: object, limit: int = 80) -> str:
    """A parsed JSON value for a message: compact, escaped, cut at ``limit`` characters."""
    try:
        text = shown(json.dumps(value))
    except (RecursionError, ValueError, TypeError):  # nested just under the parser's limit
        text = _kind(value)
    return text if len(text) <= limit else text[:limit] + "…"


def validate_header(header: object, data_len: int, where: str) -> dict[str, TensorEntry]:
    """Check a parsed safetensors header against a data section of ``data_len`` bytes (module docstring)."""
    if not isinstance(header, dict):
        raise FlowgeomError(f"{where}: the safetensors header is {_kind(header)}, not an object of tensors; the file "
                            "is corrupt or not a safetensors file: re-export it")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FlowgeomError(f"{where}: __metadata__ must be an object of strings {{str: str}}, got {_short(meta)}; "
                            "the header is corrupt or forged: re-export the checkpoint")
    entries = {name: _entry(name, info, where) for name, info in header.items() if name != "__metadata__"}
    pos, prev = 0, None
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if e.start != pos:
            how = (f"overlaps {shown(prev)} (which ends at byte {pos})" if e.start < pos
                   else f"leaves bytes {pos}..{e.start} unexplained")
            raise FlowgeomError(f"{where}: tensor {shown(name)} starts at byte {e.start} and {how}; data_offsets must "
                                "tile the data section from 0 without gaps or overlaps: the header is corrupt or "
                                "forged, re-export the checkpoint")
        pos, prev = e.end, name
    if pos > data_len:
        raise FlowgeomError(f"{where}: tensor {shown(prev)} ends at byte {pos} but the data section has only "
                            f"{data_len} bytes; the file is truncated: re-download or re-export it")
    if pos < data_len:
        raise FlowgeomError(f"{where}: the tensors end at byte {pos} but the data section has {data_len} bytes; "
                            "the header and the data disagree: re-export the checkpoint")
    return entries


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Validated ``{tensor name: TensorEntry}`` of safetensors file ``path``; no tensor data is read."""
    where = shown(path)
    with open_regular(path, "safetensors file") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        n = int.from_bytes(head, "little")
        if len(head) < 8 or n < 1 or n > MAX_HEADER or 8 + n > size:
            why = (f"{size} bytes, shorter than the 8-byte header length" if len(head) < 8 else
                   f"header length {n} does not fit in "
                   + (f"the {MAX_HEADER}-byte limit" if n > MAX_HEADER else f"a {size}-byte file"))
            raise FlowgeomError(f"{where} is not a readable safetensors file ({why}); it may be truncated or corrupt: "
                                "re-download or re-export it")
        raw = fh.read(n)
    if len(raw) != n:
        raise FlowgeomError(f"{where} shrank while being read; retry once the file is complete")
    header = parse_json(raw, f"{where} is not a readable safetensors file: header")
    return validate_header(header, size - 8 - n, where)


def read_index(path: Path) -> dict[str, str]:
    """``weight_map`` of a ``*.safetensors.index.json`` after checking its schema: ``{tensor name: shard name}``."""
    where = shown(path)
    with open_regular(path, "safetensors index") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_INDEX:
            raise FlowgeomError(f"{where}: {size} bytes is far too large for a safetensors index (limit {MAX_INDEX}); "
                                "pass the right file")
        raw = fh.read(MAX_INDEX + 1)
    index = parse_json(raw, f"{where} is not a safetensors index")
    fix = "it must look like {\"weight_map\": {\"tensor name\": \"shard.safetensors\", …}}: regenerate it"
    if not isinstance(index, dict):
        raise FlowgeomError(f"{where}: the index is {_kind(index)}, not an object; {fix}")
    if "weight_map" not in index:
        raise FlowgeomError(f"{where} is not a safetensors index (no 'weight_map'; keys: "
                            f"{', '.join(map(shown, list(index)[:10])) or 'none'}); {fix}")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not weight_map:
        raise FlowgeomError(f"{where}: weight_map is {_kind(weight_map) if weight_map != {} else 'empty'}, not an "
                            f"object mapping tensor names to shard files; {fix}")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise FlowgeomError(f"{where}: weight_map maps {shown(name)} to {_short(shard)}, not a shard file name; "
                                f"{fix}")
    return weight_map


def confined_shard(index: Path, shard: str) -> Path:
    """``index.parent / shard`` if it stays inside the index's folder (symlinks resolved) and is a regular file.

    Refused without opening: absolute names, names with a ``..`` component,
    names that resolve outside both ``realpath(index.parent)`` and
    ``realpath(index).parent`` (module docstring).
    """
    where = f"{shown(index)}: shard {shown(shard)}"
    fix = "an index may only name files in its own folder; it was not opened: fix the index or use a trusted copy"
    parts = shard.replace("\\", "/").split("/")
    if "\x00" in shard or PurePosixPath(shard).is_absolute() or PureWindowsPath(shard).is_absolute() \
            or PureWindowsPath(shard).drive or shard.startswith(("/", "\\")):
        raise FlowgeomError(f"{where} is an absolute path; {fix}")
    if ".." in parts:
        raise FlowgeomError(f"{where} climbs out of the index's folder with '..'; {fix}")
    candidate = index.parent / shard
    target = Path(os.path.realpath(candidate))
    roots = {Path(os.path.realpath(index.parent)), Path(os.path.realpath(index)).parent}
    if not any(target == root or target.is_relative_to(root) for root in roots):
        raise FlowgeomError(f"{where} resolves to {shown(target)}, outside the index's folder; {fix}")
    regular_file(candidate, "shard")
    return candidate
