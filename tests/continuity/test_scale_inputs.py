"""Bad sharded checkpoints at the CLI (issue 34): each one line on stderr, exit 2, naming the fix.

Cases: a shard the index names is missing; a tensor whose shape disagrees with config.json; a bf16
shard truncated in the middle of a tensor; a role whose estimated peak memory exceeds what may be
used (the message names the figure and the --roles that would fit). Checkpoints are tiny Llama
layouts (GQA) written here, sharded one layer per file with an HF index, like the 8B benchmark's.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from synthetic_checkpoints import LLAMA

from flowgeom.cli import main

D, HEADS, KV, HD, MLP = 32, 4, 2, 8, 48
SHAPES = {"q": (HEADS * HD, D), "k": (KV * HD, D), "v": (KV * HD, D), "o": (D, HEADS * HD), "gate": (MLP, D),
          "up": (MLP, D), "down": (D, MLP)}


def _checkpoint(folder, layers: int = 4, *, shapes=SHAPES, config=None):
    """A bf16 Llama checkpoint, one shard per layer, with model.safetensors.index.json and config.json."""
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    for layer in range(layers):
        name = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        tensors = {f"model.layers.{layer}.{LLAMA[r]}.weight": torch.randn(*shapes[r], generator=g).bfloat16()
                   for r in LLAMA}
        save_file(tensors, str(folder / name))
        weight_map |= {t: name for t in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = {"model_type": "llama", "hidden_size": D, "intermediate_size": MLP, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": layers}
    (folder / "config.json").write_text(json.dumps(cfg | (config or {})))
    return folder


def _error(capsys, argv) -> str:
    """Run the CLI; it must exit 2 with exactly one stderr line ``flowgeom...: error: ...``; return that line."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("flowgeom") and "error:" in lines[0], err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]


def test_the_tiny_sharded_checkpoint_is_fine(tmp_path, capsys):
    """The control: the same layout, intact, analyses (so each failure below is its defect's)."""
    folder = _checkpoint(tmp_path)
    assert main(["continuity", "analyze", str(folder), "--json", "--k", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["roles"]) == set(LLAMA) and report["layers"] == 4


def test_a_shard_missing_from_the_index(tmp_path, capsys):
    folder = _checkpoint(tmp_path)
    (folder / "model-00003-of-00004.safetensors").unlink()
    line = _error(capsys, ["continuity", "analyze", folder])
    assert "model-00003-of-00004.safetensors" in line


@pytest.mark.parametrize("key, value, role", [("intermediate_size", 64, "gate"), ("num_key_value_heads", 4, "k")])
def test_a_tensor_whose_shape_disagrees_with_config_json(tmp_path, capsys, key, value, role):
    folder = _checkpoint(tmp_path, config={key: value})
    line = _error(capsys, ["continuity", "analyze", folder])
    assert f"role {role}" in line and "config.json" in line and str(list(SHAPES[role])) in line


def test_a_bf16_shard_truncated_mid_tensor(tmp_path, capsys):
    folder = _checkpoint(tmp_path)
    shard = folder / "model-00002-of-00004.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:  # cut inside the last tensor's bytes, not at a tensor boundary
        fh.truncate(size - MLP * D)
    line = _error(capsys, ["continuity", "analyze", folder])
    assert "model-00002-of-00004.safetensors" in line and "truncated" in line


def test_a_checkpoint_larger_than_the_memory_names_the_figure_and_the_roles_that_fit(tmp_path, capsys,
                                                                                   monkeypatch):
    from flowgeom.continuity.analyze import role_memory

    folder = _checkpoint(tmp_path)
    gate = role_memory(SHAPES["gate"], stored=2, compute=4, bf16_window=True)
    q = role_memory(SHAPES["q"], stored=2, compute=4, bf16_window=True)
    assert q < gate  # the limit below lets the attention roles through, not the MLP ones
    limit = (q + gate) // 2
    monkeypatch.setattr("flowgeom.memory.available_memory", lambda device: int(limit / 0.8))
    line = _error(capsys, ["continuity", "analyze", folder, "--threads", "1"])
    assert f"{gate / 2**30:.2f} GiB" in line and "--roles q,k,v,o" in line and "--max-layers does not lower it" in line
    # the roles it names do fit: the same command with them runs
    assert main(["continuity", "analyze", str(folder), "--threads", "1", "--roles", "q,k,v,o", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["roles"]) == {"q", "k", "v", "o"}


def test_batch_over_memory_suggests_batch_1(tmp_path, capsys, monkeypatch):
    from flowgeom.continuity.analyze import role_memory

    folder = _checkpoint(tmp_path)
    one = role_memory(SHAPES["gate"], stored=2, compute=4, bf16_window=True)
    monkeypatch.setattr("flowgeom.memory.available_memory", lambda device: int(1.05 * one / 0.8))
    line = _error(capsys, ["continuity", "analyze", folder, "--threads", "1", "--batch", "3"])
    assert "--batch 1" in line
    assert main(["continuity", "analyze", str(folder), "--threads", "1", "--json"]) == 0


def test_progress_lines_name_layers_roles_and_eta(tmp_path, capsys):
    folder = _checkpoint(tmp_path)
    assert main(["continuity", "analyze", str(folder), "--json", "--progress", "lines", "--threads", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    last = [line for line in err if line.startswith("continuity analyze:")][-1]
    assert "28/28 layer matrices, 7/7 roles done" in last and "ETA 0s" in last
