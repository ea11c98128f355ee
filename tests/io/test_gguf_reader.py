"""flowgeom's minimal GGUF reader against the gguf package: same tables, bit-identical dequantisation, hostile files."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "continuity"))  # the synthetic checkpoint writers
from synthetic_checkpoints import write_gguf as _write  # noqa: E402

from flowgeom.errors import FlowgeomError  # noqa: E402
from flowgeom.io import open_source  # noqa: E402
from flowgeom.io.gguf import GGML_TYPES  # noqa: E402

Q = gguf.GGMLQuantizationType


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"blk.0.attn_q.weight": rng.standard_normal((64, 96)).astype(np.float32),
            "blk.0.ffn_down.weight": rng.standard_normal((32, 128)).astype(np.float32),
            "blk.0.attn_norm.weight": rng.standard_normal(96).astype(np.float32)}


def test_type_table_matches_the_gguf_package():
    for tid, (name, block, size) in GGML_TYPES.items():
        assert Q(tid).name == name and gguf.constants.GGML_QUANT_SIZES[Q(tid)] == (block, size)


@pytest.mark.parametrize("quant", [None, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16])
def test_tables_and_values_bit_identical_to_gguf(tmp_path, quant):
    path = tmp_path / "m.gguf"
    _write(path, _tensors(), quant=quant, tokens=300)
    src = open_source(path)
    reader = gguf.GGUFReader(str(path), "r")
    assert set(src.shapes) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(src.shapes[t.name])
        got = src.load(t.name)
        assert got.dtype == torch.float32 and tuple(got.shape) == tuple(int(d) for d in reversed(t.shape))
        assert np.array_equal(got.numpy(), ref), t.name  # bit for bit, not approximately
        got.add_(1.0)  # the caller owns the memory: the mapped file is never written
    assert np.array_equal(src.load("blk.0.attn_norm.weight").numpy(), _tensors()["blk.0.attn_norm.weight"])


def test_other_quants_fall_back_to_the_gguf_package(tmp_path):
    path = tmp_path / "m.gguf"
    arr = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    try:
        _write(path, {"blk.0.attn_q.weight": arr}, quant=Q.Q5_0)  # not among the torch kernels
    except NotImplementedError:
        pytest.skip("this gguf version cannot quantise Q5_0")
    t = gguf.GGUFReader(str(path), "r").tensors[0]
    ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(8, 256)
    assert np.array_equal(open_source(path).load("blk.0.attn_q.weight").numpy(), ref)


def _layout(path):
    """Byte offsets of a file written by _write with one tensor: (data start, tensor-table start)."""
    data = path.read_bytes()
    return data, data.index(b"blk.0.attn_q.weight") - 8  # the name's u64 length precedes it


@pytest.mark.parametrize("cut", [3, 10, 30, 200, 1000, -100])
def test_truncated_files_one_error(tmp_path, cut):
    path = tmp_path / "m.gguf"
    _write(path, {"blk.0.attn_q.weight": _tensors()["blk.0.attn_q.weight"]}, tokens=50)
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:cut] if cut > 0 else data[:cut])
    with pytest.raises(FlowgeomError, match="truncated|runs past|GGUF") as err:
        open_source(tmp_path / "cut.gguf")
    assert "\n" not in str(err.value) and "cut.gguf" in str(err.value)


def test_hostile_headers(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, {"blk.0.attn_q.weight": _tensors()["blk.0.attn_q.weight"]})
    data, table = _layout(path)
    name_len = len(b"blk.0.attn_q.weight")
    type_at = table + 8 + name_len + 4 + 2 * 8  # after name, n_dims, two dims
    cases = {
        "magic": (b"GGUX" + data[4:], "magic"),
        "version": (data[:4] + struct.pack("<I", 1) + data[8:], "version 1"),
        "bigendian": (data[:4] + struct.pack(">I", 3) + data[8:], "big-endian"),
        "type": (data[:type_at] + struct.pack("<I", 99) + data[type_at + 4:], "unknown ggml type 99"),
        "offset": (data[:type_at + 4] + struct.pack("<Q", 1 << 40) + data[type_at + 12:], "runs past the end"),
        "misaligned": (data[:type_at + 4] + struct.pack("<Q", 4) + data[type_at + 12:], "alignment"),
        "ndims": (data[:table + 8 + name_len] + struct.pack("<I", 9) + data[table + 12 + name_len:], "dimensions"),
        "kvcount": (data[:16] + struct.pack("<Q", 1 << 60) + data[24:], "truncated"),
        "ntensors": (data[:8] + struct.pack("<Q", 1 << 60) + data[16:], "truncated"),
        "empty": (b"", "GGUF"),
    }
    for name, (raw, msg) in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(raw)
        with pytest.raises(FlowgeomError, match=msg) as err:
            open_source(bad)
        assert "\n" not in str(err.value), name


def test_string_array_past_the_end(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, {"blk.0.attn_q.weight": _tensors()["blk.0.attn_q.weight"]}, tokens=20)
    data = bytearray(path.read_bytes())
    at = data.index(b"tok7") - 8
    data[at:at + 8] = struct.pack("<Q", 1 << 50)  # one token claims a petabyte
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(FlowgeomError, match="past the end|truncated"):
        open_source(tmp_path / "bad.gguf")


# ---------------------------------------------------------------- key/value metadata, decoded on demand


def _add_every_type(w):
    """One key of every value type (and arrays of numbers, bools, strings, arrays) on GGUFWriter ``w``."""
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 1 << 60)
    w.add_int64("t.i64", -(1 << 60))
    w.add_float64("t.f64", 0.1)
    w.add_string("t.str", "héllo ⟨x⟩")
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_token_list([f"tok{i}" for i in range(40)] + ["Ġthe", "ĊĊ"])
    w.add_token_merges(["Ġ t", "h e"])


def _write_kv(path):
    _write(path, {"blk.0.attn_q.weight": _tensors()["blk.0.attn_q.weight"]}, kv=_add_every_type)


def _reference_fields(path):
    """{key: value} through gguf.GGUFReader (arrays of arrays left out: its contents() does not nest)."""
    out = {}
    for key, field in gguf.GGUFReader(str(path), "r").fields.items():
        if key.startswith("GGUF.") or (field.types[:1] == [gguf.GGUFValueType.ARRAY] and len(field.types) > 2):
            continue
        out[key] = field.contents()
    return out


def test_metadata_equals_the_gguf_package(tmp_path):
    from flowgeom.io.gguf import open_gguf

    path = tmp_path / "kv.gguf"
    _write_kv(path)
    ref = _reference_fields(path)
    with open_gguf(path) as f:
        meta = f.metadata
        assert set(ref) <= set(meta) and "t.nested" in meta
        for key, value in ref.items():
            got = meta[key]
            assert type(got) is type(value) and got == value, key
            if isinstance(value, list) and value:
                assert [type(v) for v in got] == [type(v) for v in value], key
        assert meta["t.nested"] == [[1, 2], [3]]
        assert meta["t.f32"] == float(np.float32(1e-5)) and meta["t.bool"] is True
        assert meta["tokenizer.ggml.tokens"][-2:] == ["Ġthe", "ĊĊ"]
        assert "missing.key" not in meta and meta.get("missing.key", 7) == 7
        with pytest.raises(KeyError):
            meta["missing.key"]


def test_metadata_is_decoded_only_when_asked(tmp_path):
    """Opening walks the key/value section once and decodes nothing but general.alignment."""
    from flowgeom.io.gguf import open_gguf

    path = tmp_path / "kv.gguf"
    _write_kv(path)
    with open_gguf(path) as f:
        assert f.metadata._done == {}  # the analyzer's path: no value decoded
        assert f.metadata["t.str"] == "héllo ⟨x⟩"
        assert set(f.metadata._done) == {"t.str"}
    src = open_source(path)  # the tensor source reads the same metadata through the same reader
    assert src.metadata["t.ints"] == [3, 1, 4, 1, 5]


def test_metadata_strings_with_broken_utf8_are_replaced(tmp_path):
    """A value string that is not UTF-8 (a partial byte token) decodes with U+FFFD; a key must be UTF-8."""
    from flowgeom.io.gguf import open_gguf

    path = tmp_path / "kv.gguf"
    _write_kv(path)
    data = bytearray(path.read_bytes())
    at = data.index(b"tok39")
    data[at:at + 5] = b"to\xff39"
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with open_gguf(tmp_path / "bad.gguf") as f:
        assert f.metadata["tokenizer.ggml.tokens"][39] == "to\ufffd39"
    data = bytearray(path.read_bytes())
    at = data.index(b"t.u16")
    data[at:at + 1] = b"\xff"
    (tmp_path / "badkey.gguf").write_bytes(bytes(data))
    with pytest.raises(FlowgeomError, match="not UTF-8"):
        open_gguf(tmp_path / "badkey.gguf")


def test_duplicate_key_and_hostile_values_refused_at_open(tmp_path):
    from flowgeom.io.gguf import open_gguf

    path = tmp_path / "kv.gguf"
    _write_kv(path)
    data = path.read_bytes()
    count_at = data.index(b"t.ints") + len(b"t.ints") + 8  # after the key, the u32 type 9, the u32 element type
    assert struct.unpack_from("<Q", data, count_at) == (5,)
    cases = {
        "dup": (data.replace(b"t.u16", b"t.i16"), "appears twice"),
        "vtype": (data.replace(b"t.u8" + struct.pack("<I", 0), b"t.u8" + struct.pack("<I", 77)),
                  "unknown value type 77"),
        "count": (data[:count_at] + struct.pack("<Q", 1 << 61) + data[count_at + 8:], "truncated"),
    }
    for name, (raw, msg) in cases.items():
        assert raw != data, name  # the corruption hit
        (tmp_path / f"{name}.gguf").write_bytes(raw)
        for opener in (open_gguf, open_source):
            with pytest.raises(FlowgeomError, match=msg) as err:
                opener(tmp_path / f"{name}.gguf")
            assert "\n" not in str(err.value) and f"{name}.gguf" in str(err.value), name


def test_open_gguf_refuses_a_fifo_and_a_missing_file(tmp_path):
    import os

    from flowgeom.io.gguf import open_gguf

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(FlowgeomError, match="not a regular file"):
        open_gguf(fifo)  # would block forever if opened
    with pytest.raises(FlowgeomError, match="GGUF file .*missing.gguf does not exist; pass the .gguf file itself"):
        open_gguf(tmp_path / "missing.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(FlowgeomError, match="not a readable GGUF"):
        open_gguf(tmp_path / "empty.gguf")
