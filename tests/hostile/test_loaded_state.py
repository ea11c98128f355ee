"""Loaded weights are checked against config.json in every layer, by one check (``nn.llama.check_state``).

``share`` used to read only layer-0 shapes, so a config.json that disagreed
with a later layer produced a checkpoint its own ``evaluate`` refused. Here
layer 1 (only) is wider than the config says: ``share`` and ``evaluate``
refuse it with the same line, exit 2, and nothing is written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from flowgeom.compress.write import save_llama_folder
from flowgeom.errors import FlowgeomError
from flowgeom.nn.llama import LlamaConfig, LlamaForCausalLM, check_state
from tree_digest import snapshot  # noqa: E402  (tests/hostile is on sys.path)

TINY = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=4, max_position_embeddings=64)
LINE = ("tensor model.layers.1.mlp.down_proj.weight has shape [8, 16], the config implies [8, 12]; fix config.json "
        "or the checkpoint")


def _state(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).state_dict()


@pytest.fixture
def wide_layer_1(tmp_path, monkeypatch) -> Path:
    """An HF Llama folder whose config.json says MLP width 12, while layer 1's MLP weights are 16 wide."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    state, wide = _state(TINY), _state(dataclasses.replace(TINY, intermediate_size=16))
    for role in ("gate", "up", "down"):
        key = f"model.layers.1.mlp.{role}_proj.weight"
        state[key] = wide[key]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(31)} | {"[UNK]": 31}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "m").mkdir()
    save_llama_folder(tmp_path / "m", TINY.to_hf(), state, tokenizer=tok)
    (tmp_path / "text.txt").write_text(" ".join(f"w{i % 31}" for i in range(400)))
    return tmp_path / "m"


@pytest.mark.parametrize("argv", [
    ["compress", "run", "m", "--out", "o", "--method", "svd", "--rank", "2", "--calib", "text.txt"],
    ["compress", "evaluate", "m", "--text", "text.txt", "--context", "16", "--out", "o.json"],
])
def test_a_config_that_disagrees_with_a_later_layer_is_refused_alike(wide_layer_1, tmp_path, cli, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path, skip=("cache",))
    rc, out, err = cli(argv)
    assert rc == 2 and not out and err.strip() == f"flowgeom: error: {LINE}"
    assert snapshot(tmp_path, skip=("cache",)) == before
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.json").exists()


def test_check_state_names_missing_and_unexpected_tensors():
    state = _state(TINY)
    check_state(TINY, state)  # the matching state passes
    del state["model.layers.1.self_attn.q_proj.weight"]
    state["model.layers.2.mlp.up_proj.weight"] = torch.zeros(12, 8)
    with pytest.raises(FlowgeomError) as info:
        check_state(TINY, state)
    assert str(info.value) == ("Llama weights do not match the config: missing ['model.layers.1.self_attn.q_proj.weight']"
                               ", unexpected ['model.layers.2.mlp.up_proj.weight']; the checkpoint is not a 2-layer "
                               "Llama of this shape")
