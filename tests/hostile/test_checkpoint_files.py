"""Hostile checkpoint files for ``flowgeom continuity analyze`` (issue #13): each class built on disk.

Every case checks the library (a :class:`FlowgeomError` whose one-line
message names the problem) and the CLI end to end (exit 2, one line
``flowgeom: error: ...``, no traceback: the ``cli`` fixture of conftest.py).
Random headers and indexes (hypothesis) must end in a FlowgeomError or in a
load whose bytes are exactly the ones the header points at.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from flowgeom.continuity import AnalyzeConfig, analyze
from flowgeom.continuity.naming import resolve_roles
from flowgeom.continuity.spectra import top_singular_pairs
from flowgeom.errors import FlowgeomError
from flowgeom.io import open_source
from flowgeom.io.checkpoints import ITEMSIZE

HYPO = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SECRET = b"SECRET-BYTES-never-echo"
TORCH_DTYPE = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
               "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
               "U8": torch.uint8, "BOOL": torch.bool}


def raw_safetensors(path: Path, header, data: bytes = b"", *, length: int | None = None) -> Path:
    """Write ``u64 len | header | data``; ``header`` is a JSON value or raw bytes; ``length`` overrides len."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return path


def good_header() -> dict:
    return {"__metadata__": {"format": "pt"},
            "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
            "b": {"dtype": "F16", "shape": [4], "data_offsets": [24, 32]}}


def with_entry(key: str, **fields) -> dict:
    h = good_header()
    h[key] = {**h[key], **fields}
    return h


def stack_state(scale: float = 1.0, dtype=torch.float32, layers: int = 4, prefix: str = "model.layers") -> dict:
    """Planted input-continuous q_proj stack (shared top right vector), ``layers`` x (12, 10)."""
    g = torch.Generator().manual_seed(1)
    v = torch.nn.functional.normalize(torch.randn(10, generator=g, dtype=torch.float64), dim=0)
    out = {}
    for i in range(layers):
        u = torch.nn.functional.normalize(torch.randn(12, generator=g, dtype=torch.float64), dim=0)
        w = torch.randn(12, 10, generator=g, dtype=torch.float64) / 6 + 4 * torch.outer(u, v)
        out[f"{prefix}.{i}.self_attn.q_proj.weight"] = (w * scale).to(dtype)
    return out


def refused(cli, path, *fragments: str) -> str:
    """The library and the CLI both refuse ``path``; the message holds ``fragments``; returns the message."""
    with pytest.raises(FlowgeomError) as info:
        open_source(path)
    msg = str(info.value)
    assert "\n" not in msg and all(f in msg for f in fragments), msg
    rc, _, err = cli(["continuity", "analyze", path])
    assert rc == 2 and err.startswith("flowgeom: error: ") and all(f in err for f in fragments), err
    return msg


# 1. safetensors headers that parse as JSON but break the schema ------------------------------------------------

BAD_HEADERS = {
    "list": ([], "is a list"),
    "string": ("x", "is a string"),
    "number": (3, "is a number"),
    "entry not an object": ({"a": 5}, "not an object"),
    "entry a list": ({"a": [0, 24]}, "not an object"),
    "missing dtype": ({"a": {"shape": [2, 3], "data_offsets": [0, 24]}}, "missing dtype"),
    "missing shape": ({"a": {"dtype": "F32", "data_offsets": [0, 24]}}, "missing shape"),
    "missing offsets": ({"a": {"dtype": "F32", "shape": [2, 3]}}, "missing data_offsets"),
    "unexpected key": (with_entry("a", offset=3), "unexpected offset"),
    "offsets strings": (with_entry("a", data_offsets=["0", "24"]), "data_offsets must be"),
    "offsets null": (with_entry("a", data_offsets=None), "data_offsets must be"),
    "offsets too long": (with_entry("a", data_offsets=[0, 12, 24]), "data_offsets must be"),
    "offsets negative": (with_entry("a", data_offsets=[-24, 0]), "data_offsets must be"),
    "offsets reversed": (with_entry("a", data_offsets=[24, 0]), "data_offsets must be"),
    "offsets floats": (with_entry("a", data_offsets=[0.0, 24.0]), "data_offsets must be"),
    "gap": (with_entry("b", data_offsets=[28, 36]), "unexplained"),
    "overlap": (with_entry("b", data_offsets=[20, 28]), "overlaps a"),
    "not from zero": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [24, 32]}}, "unexplained"),
    "past the end": (with_entry("b", shape=[8], data_offsets=[24, 40]), "truncated"),
    "shape negative": (with_entry("a", shape=[-2, -3]), "shape must be"),
    "shape floats": (with_entry("a", shape=[2.0, 3]), "shape must be"),
    "shape bools": (with_entry("a", shape=[True, 6]), "shape must be"),
    "shape a string": (with_entry("a", shape="2x3"), "shape must be"),
    "size mismatch": (with_entry("a", shape=[3, 3]), "lies about sizes"),
    "unknown dtype": (with_entry("a", dtype="F128"), "unknown dtype F128"),
    "dtype null": (with_entry("a", dtype=None), "unknown dtype null"),
    "metadata a list": (good_header() | {"__metadata__": ["x"]}, "__metadata__"),
    "metadata numbers": (good_header() | {"__metadata__": {"step": 3}}, "__metadata__"),
    "control chars in a name": ({"a\nb": good_header()["a"]}, "control characters"),
    "trailing bytes": ({"a": good_header()["a"]}, "disagree"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_header_schema_is_refused(tmp_path, cli, case):
    header, fragment = BAD_HEADERS[case]
    path = raw_safetensors(tmp_path / "m.safetensors", header, bytes(32))
    refused(cli, path, fragment, str(path))


@pytest.mark.parametrize("raw,length,fragment", [
    (b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', None, "appears twice"),
    (b'{"__metadata__": {"k": "x", "k": "y"}}', None, "appears twice"),
    (b'{"a": NaN}', None, "not valid JSON"),
    (b"\xff\xfe{}", None, "not valid JSON"),
    (b"{}", 2 ** 63, "header length 9223372036854775808"),
    (b"{}", 10 ** 9, "100000000-byte limit"),
    (b"{}", 0, "header length 0"),
])
def test_raw_headers_are_refused(tmp_path, cli, raw, length, fragment):
    refused(cli, raw_safetensors(tmp_path / "m.safetensors", raw, length=length), fragment)


def test_valid_edge_cases_load(tmp_path):
    """Zero-size tensors (start == end, shared offsets), metadata, every dtype: accepted, bytes exact."""
    tensors = {"empty": torch.zeros(0, 3), "also_empty": torch.zeros(2, 0, dtype=torch.float16),
               "w": torch.arange(6.0).reshape(2, 3), "i": torch.tensor([1, -2], dtype=torch.int8),
               "f8": torch.tensor([0.5, -1.0]).to(torch.float8_e4m3fn)}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt"})
    src = open_source(tmp_path / "m.safetensors")
    for name, t in tensors.items():
        assert torch.equal(src.load(name).view(torch.uint8), t.view(torch.uint8))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                    max_leaves=12)


def _check_outcome(path: Path, data: bytes, header: object) -> None:
    """FlowgeomError (one line), or every tensor loads with exactly the bytes its data_offsets name."""
    try:
        src = open_source(path)
    except FlowgeomError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    for name, (start, end) in ((k, v["data_offsets"]) for k, v in header.items() if k != "__metadata__"):
        try:
            t = src.load(name)
        except FlowgeomError as exc:  # random bytes may spell NaN
            assert "NaN or Inf" in str(exc)
            continue
        assert t.dtype == TORCH_DTYPE[header[name]["dtype"]] and list(t.shape) == header[name]["shape"]
        assert bytes(t.reshape(-1).contiguous().view(torch.uint8).tolist()) == data[start:end]


@HYPO
@given(header=JSON, data=st.binary(max_size=40))
def test_random_json_headers(header, data):
    with tempfile.TemporaryDirectory() as tmp:
        path = raw_safetensors(Path(tmp) / "m.safetensors", header, data)
        _check_outcome(path, data, header if isinstance(header, dict) else {})


@st.composite
def near_valid_headers(draw):
    """A consistent header (random dtypes/shapes, tiled offsets), then maybe one field or the data length broken."""
    header, pos = {}, 0
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = ITEMSIZE[dtype] * (1 if not shape else __import__("math").prod(shape))
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    extra = 0
    breakage = draw(st.sampled_from(["none", "none", "offset", "shape", "dtype", "data"]))
    key = draw(st.sampled_from(sorted(header)))
    if breakage == "offset":
        header[key]["data_offsets"][draw(st.integers(0, 1))] += draw(st.sampled_from([-3, -1, 1, 2, 10 ** 6]))
    elif breakage == "shape":
        header[key]["shape"] = header[key]["shape"] + [draw(st.sampled_from([2, -1, 0]))]
    elif breakage == "dtype":
        header[key]["dtype"] = draw(st.sampled_from(["F64", "U8", "F4", "f32", "C64"]))
    elif breakage == "data":
        extra = draw(st.sampled_from([-1, 1, 7]))
    data = draw(st.binary(min_size=max(pos + extra, 0), max_size=max(pos + extra, 0)))
    return header, data


@HYPO
@given(case=near_valid_headers())
def test_random_near_valid_headers(case):
    header, data = case
    with tempfile.TemporaryDirectory() as tmp:
        _check_outcome(raw_safetensors(Path(tmp) / "m.safetensors", header, data), data, header)


# 2. shard indexes: schema and path confinement ------------------------------------------------------------------

def _sharded(folder: Path) -> dict:
    """Two shards of ``stack_state()`` and their index; returns the state."""
    sd = stack_state()
    names = sorted(sd)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: sd[k] for k in names[:2]}, folder / "model-1.safetensors")
    save_file({k: sd[k] for k in names[2:]}, folder / "model-2.safetensors")
    index = {"weight_map": {k: ("model-1.safetensors" if k in names[:2] else "model-2.safetensors") for k in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return sd


def _secret(tmp_path: Path) -> Path:
    """A file outside the model folder whose bytes must never reach a message (a valid safetensors file)."""
    (tmp_path / "outside").mkdir(exist_ok=True)
    path = tmp_path / "outside" / "secret.safetensors"
    save_file({SECRET.decode(): torch.zeros(2)}, path)
    return path


BAD_INDEXES = {
    "a list": ([1, 2], "not an object"),
    "a string": ("weights", "not an object"),
    "null": (None, "not an object"),
    "no weight_map": ({"metadata": {}}, "no 'weight_map'"),
    "weight_map a list": ({"weight_map": ["model-1.safetensors"]}, "weight_map is a list"),
    "weight_map null": ({"weight_map": None}, "weight_map is null"),
    "weight_map a string": ({"weight_map": "model-1.safetensors"}, "weight_map is a string"),
    "weight_map empty": ({"weight_map": {}}, "weight_map is empty"),
    "maps to a number": ({"weight_map": {"x": 1}}, "maps x to 1"),
    "maps to null": ({"weight_map": {"x": None}}, "maps x to null"),
    "maps to a list": ({"weight_map": {"x": ["model-1.safetensors"]}}, "not a shard file name"),
}


@pytest.mark.parametrize("case", sorted(BAD_INDEXES))
def test_index_schema_is_refused(tmp_path, cli, case):
    _sharded(tmp_path / "m")
    index, fragment = BAD_INDEXES[case]
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(cli, tmp_path / "m", fragment)
    refused(cli, tmp_path / "m" / "model.safetensors.index.json", fragment)


def _point_first_tensor(folder: Path, shard: str) -> None:
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    first = sorted(index["weight_map"])[0]
    index["weight_map"][first] = shard
    path.write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["absolute", "dotdot", "dotdot-deep", "symlink-out", "backslash-dotdot"])
def test_index_shards_stay_in_the_folder(tmp_path, cli, how):
    _sharded(tmp_path / "m")
    secret = _secret(tmp_path)
    shard, fragment = {"absolute": (str(secret), "absolute"),
                       "dotdot": ("../outside/secret.safetensors", "'..'"),
                       "dotdot-deep": ("model-1.safetensors/../../outside/secret.safetensors", "'..'"),
                       "symlink-out": ("link.safetensors", "outside the index's folder"),
                       "backslash-dotdot": ("..\\outside\\secret.safetensors", "'..'")}[how]
    if how == "symlink-out":
        (tmp_path / "m" / "link.safetensors").symlink_to(secret)
    _point_first_tensor(tmp_path / "m", shard)
    msg = refused(cli, tmp_path / "m", fragment)
    assert SECRET.decode() not in msg and "SECRET" not in msg


def test_index_symlinks_resolving_inside_are_fine(tmp_path):
    sd = _sharded(tmp_path / "m")
    (tmp_path / "m" / "sub").mkdir()
    os.replace(tmp_path / "m" / "model-2.safetensors", tmp_path / "m" / "sub" / "real.safetensors")
    (tmp_path / "m" / "alias.safetensors").symlink_to("sub/real.safetensors")  # relative link, inside
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: "alias.safetensors" if v == "model-2.safetensors" else v
                           for k, v in index["weight_map"].items()}
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    src = open_source(tmp_path / "m")
    assert sorted(src.shapes) == sorted(sd) and all(torch.equal(src.load(k), sd[k]) for k in sd)
    index["weight_map"] = {k: "sub/real.safetensors" if v == "alias.safetensors" else v
                           for k, v in index["weight_map"].items()}
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(open_source(tmp_path / "m").load(sorted(sd)[-1]), sd[sorted(sd)[-1]])


def test_hugging_face_cache_layout_is_accepted(tmp_path):
    """snapshots/REV/* are links into blobs/ (index included): shards resolve where the index resolves."""
    sd = _sharded(tmp_path / "built")
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted((tmp_path / "built").iterdir())):
        os.replace(f, blobs / f"hash{i}")
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"hash{i}"))
    src = open_source(snap)
    assert all(torch.equal(src.load(k), sd[k]) for k in sd)


@pytest.mark.parametrize("edit,fragment", [
    (lambda m: m.update({"model.layers.9.self_attn.q_proj.weight": "model-1.safetensors"}), "no shard holds it"),
    (lambda m: m.update({sorted(m)[0]: "model-2.safetensors"}), "does not match the shards"),
    (lambda m: m.pop(sorted(m)[0]), "not in the index"),
    (lambda m: m.update({sorted(m)[0]: "model-3.safetensors"}), "no such file"),
    (lambda m: m.update({sorted(m)[0]: "sub"}), "is a folder"),
])
def test_index_and_shards_must_agree(tmp_path, cli, edit, fragment):
    _sharded(tmp_path / "m")
    (tmp_path / "m" / "sub").mkdir()
    path = tmp_path / "m" / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index["weight_map"])
    path.write_text(json.dumps(index))
    refused(cli, tmp_path / "m", fragment)


INDEX_VALUES = st.sampled_from(["model-1.safetensors", "model-2.safetensors", "./model-1.safetensors",
                                "../outside/secret.safetensors", "link.safetensors", "sub", "", "nope.safetensors",
                                "model-1.safetensors/..", "/abs/secret.safetensors", "a\x00b"]) | JSON
RANDOM_INDEX = JSON | st.fixed_dictionaries(
    {"weight_map": st.dictionaries(st.sampled_from(sorted(stack_state())) | st.text(max_size=5), INDEX_VALUES,
                                   max_size=5) | JSON})


@HYPO
@given(index=RANDOM_INDEX)
def test_random_indexes(index):
    """FlowgeomError without the secret's bytes, or a load that matches the index exactly."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sd = _sharded(tmp / "m")
        secret = _secret(tmp)
        (tmp / "m" / "link.safetensors").symlink_to(secret)
        (tmp / "m" / "sub").mkdir()
        (tmp / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
        try:
            src = open_source(tmp / "m")
        except FlowgeomError as exc:
            assert "\n" not in str(exc) and "SECRET" not in str(exc)
            return
        assert set(src.shapes) == set(index["weight_map"]) == set(sd)
        assert all(torch.equal(src.load(k), sd[k]) for k in sd)


# 3. folders, symlinks, non-regular files -----------------------------------------------------------------------

def test_folder_symlinks_and_candidates(tmp_path, cli):
    save_file(stack_state(), tmp_path / "ok.safetensors")
    for name, target, fragment in (("dangling", "gone.safetensors", "dangling symlink"),
                                   ("loop", "loop/x.safetensors", "symlink loop")):
        folder = tmp_path / name
        folder.mkdir()
        os.symlink(tmp_path / "ok.safetensors", folder / "a.safetensors")
        os.symlink(folder / target if name == "dangling" else folder / "x.safetensors", folder / "x.safetensors")
        refused(cli, folder, fragment, "x.safetensors")
        refused(cli, folder / "x.safetensors", fragment)  # the link itself given as checkpoint
    two = tmp_path / "two_indexes"
    _sharded(two)
    (two / "other.safetensors.index.json").write_text((two / "model.safetensors.index.json").read_text())
    refused(cli, two, "2 safetensors indexes")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    save_file(stack_state(), mixed / "a.safetensors")
    (mixed / "b.gguf").write_bytes(b"GGUF")
    refused(cli, mixed, "both .safetensors")


def test_non_regular_files_are_refused(tmp_path, cli):
    (tmp_path / "x.safetensors").mkdir()
    refused(cli, tmp_path / "x.safetensors", "is a folder")
    holder = tmp_path / "holder"
    holder.mkdir()
    save_file(stack_state(), holder / "a.safetensors")
    (holder / "b.safetensors").mkdir()
    refused(cli, holder, "b.safetensors is a folder")
    if not stat.S_ISCHR(os.stat("/dev/zero").st_mode):
        pytest.skip("no /dev/zero character device here")
    for name in ("z.safetensors", "z.gguf", "model.safetensors.index.json"):
        (tmp_path / name).symlink_to("/dev/zero")  # a read would never end
        refused(cli, tmp_path / name, "character device")
    devfolder = tmp_path / "dev"
    devfolder.mkdir()
    (devfolder / "a.safetensors").symlink_to("/dev/zero")
    refused(cli, devfolder, "character device")


FIFO_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from flowgeom.cli import main
    from flowgeom.io import open_source
    from flowgeom.errors import FlowgeomError
    root = Path(sys.argv[1])
    (root / "m").mkdir(); (root / "folder").mkdir(); (root / "out").mkdir()
    os.mkfifo(root / "pipe.safetensors"); os.mkfifo(root / "pipe.index.json"); os.mkfifo(root / "pipe.gguf")
    os.mkfifo(root / "folder" / "a.safetensors"); os.mkfifo(root / "m" / "shard.safetensors")
    os.mkfifo(root / "out" / "far.safetensors")
    os.symlink(root / "out" / "far.safetensors", root / "m" / "link.safetensors")
    index = {"weight_map": {"x": "shard.safetensors", "y": "link.safetensors", "z": "../out/far.safetensors"}}
    for key, target in [("x", "shard"), ("y", "link"), ("z", "up")]:
        one = {"weight_map": {key: index["weight_map"][key]}}
        (root / "m" / f"{target}.safetensors.index.json").write_text(json.dumps(one))
    cases = [root / "pipe.safetensors", root / "pipe.index.json", root / "pipe.gguf", root / "folder"]
    cases += [root / "m" / f"{t}.safetensors.index.json" for t in ("shard", "link", "up")]
    for path in cases:
        try:
            open_source(path)
            print("LOADED", path)
        except FlowgeomError as exc:
            print("REFUSED", path.name, "|", exc)
    print("CLI", main(["continuity", "analyze", str(root / "pipe.safetensors")]))
""")


def test_fifos_are_refused_without_blocking(tmp_path):
    """A FIFO as checkpoint, index, folder entry or shard (inside or outside): refused, never opened.

    Run in a subprocess with a timeout, so a regression (an open that blocks
    forever) fails this test instead of hanging the suite.
    """
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    try:
        proc = subprocess.run([sys.executable, "-c", FIFO_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                              timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail("opening a FIFO checkpoint blocked (timeout): it must be refused before any open")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    refusals = [line for line in lines if line.startswith("REFUSED")]
    assert len(refusals) == 7 and not any(line.startswith("LOADED") for line in lines), proc.stdout
    assert sum("FIFO" in line for line in refusals) == 5  # the two outside ones are refused by confinement
    assert sum("outside the index's folder" in line or "'..'" in line for line in refusals) == 2
    assert "CLI 2" in lines and proc.stderr.count("\n") == 1 and proc.stderr.startswith("flowgeom: error:")


# 4. one tensor in two files --------------------------------------------------------------------------------------

def test_duplicate_tensors_across_shards(tmp_path, cli):
    sd = stack_state()
    name = sorted(sd)[1]
    save_file(sd, tmp_path / "a.safetensors")
    save_file({name: sd[name] * 2}, tmp_path / "b.safetensors")
    refused(cli, tmp_path, name, "a.safetensors", "b.safetensors", "stored twice")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "a.safetensors" for k in sd}}))
    (tmp_path / "b.safetensors").unlink()
    save_file({name: sd[name] * 2}, tmp_path / "b.safetensors")
    index = {"weight_map": {k: "a.safetensors" for k in sd} | {name: "b.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(cli, tmp_path, name, "stored twice")  # the index cannot make two copies one


# 5. absurd layer indices -----------------------------------------------------------------------------------------

LAYER_SCRIPT = textwrap.dedent("""
    import resource, sys
    import torch
    from safetensors.torch import save_file
    from flowgeom.cli import main
    from flowgeom.continuity.naming import resolve_roles
    from flowgeom.errors import FlowgeomError
    used = int(next(l for l in open("/proc/self/status") if l.startswith("VmData")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (used + 400 * 2**20, resource.RLIM_INFINITY))  # + 400 MB, no more
    shapes = {f"model.layers.{i}.self_attn.q_proj.weight": (4, 4) for i in (0, 10**11)}
    try:
        resolve_roles(shapes)
    except FlowgeomError as exc:
        print("REFUSED", exc)
    save_file({k: torch.randn(4, 4) for k in shapes}, sys.argv[1])
    print("CLI", main(["continuity", "analyze", sys.argv[1], "--k", "2"]))
""")


def test_layer_index_far_beyond_the_layers_found(tmp_path):
    """Layers 0 and 10**11 (12 digits, under the digit bound): a clear error in bounded memory (subprocess with a 400 MB data limit and a timeout)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux /proc for the memory limit")
    try:
        proc = subprocess.run([sys.executable, "-c", LAYER_SCRIPT, str(tmp_path / "m.safetensors")],
                              capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        pytest.fail("layer index 10**11 made the analysis run away")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "REFUSED role q: 2 layers found but their indices run from 0 to 100000000000" in proc.stdout
    assert "CLI 2" in proc.stdout and proc.stderr.count("\n") == 1 and "indices run from 0" in proc.stderr


def test_small_gaps_are_still_listed():
    shapes = {f"model.layers.{i}.self_attn.q_proj.weight": (4, 4) for i in (0, 1, 3, 4)}
    with pytest.raises(FlowgeomError, match=r"missing layer\(s\) \[2\] between 0 and 4"):
        resolve_roles(shapes)


def test_layer_index_with_thousands_of_digits():
    shapes = {f"model.layers.{i}.self_attn.q_proj.weight": (4, 4) for i in ("0", "1" * 5000)}
    with pytest.raises(FlowgeomError):
        resolve_roles(shapes)


def test_absurd_expert_number_is_reported_without_a_huge_range():
    shapes = {f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight": (4, 4)
              for layer in (0, 1) for e in (0, 10 ** 11) for p in ("gate", "up", "down")}
    layout = resolve_roles(shapes)
    assert any("run to 100000000000" in w for w in layout.warnings)


# 6. extreme but finite weights -----------------------------------------------------------------------------------

def _cosines(report: dict) -> dict:
    r = report["roles"]["q"]
    return {k: r["metrics"][k]["mean"] for k in r["metrics"]}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("scale", [1e25, 1e-30, 2.0 ** 100])
def test_scaled_weights_give_the_same_cosines(dtype, scale):
    cfg = AnalyzeConfig(k=3, dtype=dtype)
    ref = analyze(stack_state(dtype=torch.float64), cfg)
    got = analyze(stack_state(scale, dtype=torch.float64), cfg)
    for key, value in _cosines(ref).items():
        assert abs(_cosines(got)[key] - value) < 1e-5, key
    s_ref, s_got = ref["roles"]["q"]["spectra"][0]["sigma"][0], got["roles"]["q"]["spectra"][0]["sigma"][0]
    assert abs(s_got / (s_ref * scale) - 1) < 1e-5  # singular values are reported at the true scale
    assert got["roles"]["q"]["verdict"] == ref["roles"]["q"]["verdict"] == "input-continuous"


@pytest.mark.parametrize("store,peak", [(torch.float32, 1e38), (torch.float32, 1e-40), (torch.float16, 65504.0),
                                        (torch.float32, 1e25), (torch.bfloat16, 1e38)])
def test_extreme_stored_weights_match_their_unit_scale_copy(store, peak):
    """W stored at its extreme scale vs the same stored values times an exact power of two: same report."""
    raw = stack_state(dtype=torch.float64)
    stored = {k: (v / v.abs().max() * peak).to(store) for k, v in raw.items()}
    unit = {}
    for k, v in stored.items():
        exponent = torch.frexp(v.double().abs().max()).exponent.item()
        unit[k] = torch.ldexp(v.double(), torch.tensor(-exponent))  # exact: a power of two
    assert all(torch.count_nonzero(v) == v.numel() for v in stored.values())  # subnormals, not zeros
    for dtype in ("float32", "float64"):
        a, b = analyze(stored, AnalyzeConfig(k=3, dtype=dtype)), analyze(unit, AnalyzeConfig(k=3, dtype=dtype))
        assert all(abs(_cosines(a)[key] - val) < 1e-5 for key, val in _cosines(b).items())


def test_extreme_weights_through_the_cli(tmp_path, cli, strict_json):
    save_file(stack_state(1e25), tmp_path / "big.safetensors")
    save_file(stack_state(1e-40), tmp_path / "tiny.safetensors")
    for name in ("big", "tiny"):
        rc, out, _ = cli(["continuity", "analyze", tmp_path / f"{name}.safetensors", "--json", "--k", "2"])
        assert rc == 0 and strict_json(out)["roles"]["q"]["verdict"] == "input-continuous"
    save_file({k: torch.zeros_like(v) for k, v in stack_state().items()}, tmp_path / "zero.safetensors")
    assert cli(["continuity", "analyze", tmp_path / "zero.safetensors"])[0] == 2  # real zeros are still refused


def test_top_singular_pairs_in_float32_at_1e25():
    W = stack_state(dtype=torch.float64)["model.layers.0.self_attn.q_proj.weight"]
    ref = top_singular_pairs(W, 2)
    got = top_singular_pairs((W * 1e25).float(), 2, dtype=torch.float32)
    assert torch.isfinite(got.S).all() and torch.allclose(got.S / 1e25, ref.S, rtol=1e-5)
    assert ((got.V.mT @ ref.V).diagonal().abs() - 1).abs().max() < 1e-5


# 7. rich markup in paths and role names --------------------------------------------------------------------------

def test_markup_in_paths_and_roles_prints_literally(tmp_path, cli, monkeypatch):
    folder = tmp_path / "a[/]b[link=file:x]c[bold]"  # folders 'a[' and ']b[link=…': the path spells 'a[/]b'
    folder.mkdir(parents=True)
    save_file(stack_state(prefix="blocks"), folder / "m.safetensors")
    regex = r"blocks\.(\d+)\.self_attn\.q_proj\.weight"
    argv = ["continuity", "analyze", folder / "m.safetensors", "--k", "2", "--role", f"x[/]={regex}",
            "--role", f"[bold]y[/bold]={regex}", "--role", f"[red]z={regex}"]
    rc, out, _ = cli(argv)
    assert rc == 0, out
    assert "a[/]b[link=file:x]c[bold]" in out
    assert all(name in out for name in ("x[/]", "[bold]y[/bold]", "[red]z")), out
    missing = tmp_path / "nope[/].safetensors"
    rc, _, err = cli(["continuity", "analyze", missing])
    assert rc == 2 and str(missing) in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the progress bar path too (task names 'role x[/]')
    rc, out, err = cli(argv)
    assert rc == 0 and "x[/]" in out


def test_a_moe_model_with_dense_layers_names_both():
    """Qwen2-MoE's mlp_only_layers: experts in layers 0, 1 and a plain gated MLP in layers 2, 3, all claimed."""
    shapes = {f"model.layers.{layer}.self_attn.{r}_proj.weight": (4, 4) for layer in range(4) for r in "qkvo"}
    shapes |= {f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight": (4, 4)
               for layer in (0, 1) for e in (0, 1) for p in ("gate", "up", "down")}
    shapes |= {f"model.layers.{layer}.mlp.gate.weight": (2, 4) for layer in (0, 1)}
    shapes |= {f"model.layers.{layer}.mlp.{p}_proj.weight": (4, 4) for layer in (2, 3) for p in ("gate", "up", "down")}
    layout = resolve_roles(shapes)
    assert layout.unmatched == []
    assert [ref.layer for ref in layout.roles["expert1.down"]] == [0, 1]
    assert [ref.layer for ref in layout.roles["gate"]] == [2, 3]
