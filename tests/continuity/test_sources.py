"""Sources and naming: every format and naming scheme, and every kind of bad input."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from synthetic_checkpoints import llama_state, write_gguf
from safetensors.torch import save_file

from flowgeom.continuity.naming import resolve_roles
from flowgeom.errors import FlowgeomError
from flowgeom.io import open_source

GGUF_NAMES = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
              "down": "ffn_down"}


def _gguf_state(sd):
    from synthetic_checkpoints import LLAMA

    return {f"blk.{i}.{GGUF_NAMES[r]}.weight": sd[f"model.layers.{i}.{n}.weight"] for i in range(3) for r, n in LLAMA.items()}


def _same_layout(src, sd):
    layout = resolve_roles(src.shapes)
    assert list(layout.roles) == ["q", "k", "v", "o", "gate", "up", "down"]
    assert layout.roles["k"][0].shape == (8, 16)  # GQA: fewer k rows
    ref = layout.roles["down"][2]
    assert torch.equal(ref.extract(src.load(ref.tensor)), sd["model.layers.2.mlp.down_proj.weight"])
    return layout


def test_module_file_shards_and_folder_agree(tmp_path):
    sd = llama_state()
    assert _same_layout(open_source(sd), sd).scheme == "llama"
    save_file(sd, tmp_path / "model.safetensors")
    _same_layout(open_source(tmp_path / "model.safetensors"), sd)
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    names = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: sd[k] for k in keys}, shard_dir / fname)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    _same_layout(open_source(shard_dir), sd)  # HF folder with an index
    _same_layout(open_source(shard_dir / "model.safetensors.index.json"), sd)


def test_flowgeom_module_and_custom_roles():
    from flowgeom.nn.feedforward import LinearChain

    chain = LinearChain((6, 6, 6, 6))
    with pytest.raises(FlowgeomError, match="no projection matrices recognised.*layers.0.weight.*--role"):
        resolve_roles(open_source(chain).shapes)
    layout = resolve_roles(open_source(chain).shapes, custom={"chain": r"layers\.(\d+)\.weight"})
    assert [r.layer for r in layout.roles["chain"]] == [0, 1, 2]


@pytest.mark.parametrize("quant", [None, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1])
def test_gguf_f32_and_quantised(tmp_path, quant):
    sd = llama_state(d=32, kv=32, hidden=64)
    tensors = _gguf_state(sd) | {"blk.0.attn_norm.weight": torch.ones(32)}
    write_gguf(tmp_path / "m.gguf", tensors, quant=quant)
    src = open_source(tmp_path / "m.gguf")
    layout = resolve_roles(src.shapes)
    assert layout.scheme == "gguf" and layout.roles["down"][0].shape == (32, 64)
    got = src.load("blk.1.ffn_up.weight")
    err = (got - sd["model.layers.1.mlp.up_proj.weight"]).abs().max()
    assert err == 0 if quant is None else err < (0.05 if quant == gguf.GGMLQuantizationType.Q8_0 else 0.5)


def test_bert_and_gpt2_naming():
    g = torch.Generator().manual_seed(0)
    bert = {}
    for i in range(2):
        p = f"encoder.layer.{i}."
        bert |= {p + "attention.self.query.weight": torch.randn(8, 8, generator=g),
                 p + "attention.self.key.weight": torch.randn(8, 8, generator=g),
                 p + "attention.self.value.weight": torch.randn(8, 8, generator=g),
                 p + "attention.output.dense.weight": torch.randn(8, 8, generator=g),
                 p + "intermediate.dense.weight": torch.randn(32, 8, generator=g),
                 p + "output.dense.weight": torch.randn(8, 32, generator=g)}
    layout = resolve_roles({k: tuple(v.shape) for k, v in bert.items()})
    assert layout.scheme == "bert" and list(layout.roles) == ["q", "k", "v", "o", "up", "down"]
    assert layout.roles["down"][1].tensor == "encoder.layer.1.output.dense.weight"
    gpt2 = {}
    for i in range(2):
        p = f"transformer.h.{i}."
        gpt2 |= {p + "attn.c_attn.weight": torch.randn(8, 24, generator=g),  # Conv1D (in, 3 out)
                 p + "attn.c_proj.weight": torch.randn(8, 8, generator=g),
                 p + "mlp.c_fc.weight": torch.randn(8, 32, generator=g),
                 p + "mlp.c_proj.weight": torch.randn(32, 8, generator=g)}
    layout = resolve_roles({k: tuple(v.shape) for k, v in gpt2.items()})
    assert layout.scheme == "gpt2"
    assert layout.roles["up"][0].shape == (32, 8) and layout.roles["down"][0].shape == (8, 32)
    k_ref = layout.roles["k"][1]
    fused = gpt2["transformer.h.1.attn.c_attn.weight"]
    assert torch.equal(k_ref.extract(fused), fused[:, 8:16].T)  # k = middle third of the outputs, (out, in)


def test_bad_files(tmp_path):
    sd = llama_state()
    good = tmp_path / "good.safetensors"
    save_file(sd, good)
    data = good.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) - 100])
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = "model.layers.0.self_attn.q_proj.weight"
    header[key]["shape"] = [32, 16]  # lies: twice the bytes it has
    raw = json.dumps(header).encode()
    (tmp_path / "lies.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])
    for name, msg in (("trunc", "truncated"), ("junk", "not a readable safetensors"), ("lies", "lies about sizes")):
        with pytest.raises(FlowgeomError, match=msg):
            open_source(tmp_path / f"{name}.safetensors")
    write_gguf(tmp_path / "m.gguf", _gguf_state(llama_state(d=32, kv=32, hidden=64)))
    gdata = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(gdata[: len(gdata) // 2])
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    for name in ("cut", "bad"):
        with pytest.raises(FlowgeomError, match="GGUF|truncated"):
            open_source(tmp_path / f"{name}.gguf")
    with pytest.raises(FlowgeomError, match="unsupported file"):
        open_source(tmp_path / "x.bin") if (tmp_path / "x.bin").write_bytes(b"0") else None


def test_bad_contents():
    sd = llama_state()
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    with pytest.raises(FlowgeomError, match="changes shape between layers"):
        resolve_roles(shapes | {"model.layers.1.mlp.up_proj.weight": (25, 16)})
    with pytest.raises(FlowgeomError, match="not a matrix"):
        resolve_roles(shapes | {"model.layers.1.mlp.up_proj.weight": (24, 16, 1)})
    with pytest.raises(FlowgeomError, match="only 1 layer"):
        resolve_roles({k: s for k, s in shapes.items() if ".layers.0." in k})
    with pytest.raises(FlowgeomError, match=r"missing layer\(s\) \[1\]"):
        resolve_roles({k: s for k, s in shapes.items() if ".layers.1." not in k})
    bad = dict(sd)
    bad["model.layers.2.self_attn.v_proj.weight"] = sd["model.layers.2.self_attn.v_proj.weight"].clone()
    bad["model.layers.2.self_attn.v_proj.weight"][0, 0] = float("nan")
    with pytest.raises(FlowgeomError, match="v_proj.*NaN or Inf"):
        open_source(bad).load("model.layers.2.self_attn.v_proj.weight")
