"""Numbers read from files (config.json, GGUF metadata, adapter_config.json, hf: --config) are checked first.

A forged number must be refused by name, in one line and exit 2, *before*
it sizes an allocation (vocab_size 4e9), bounds a loop (block_count 2e9,
num_hidden_layers 200000) or is divided by (LoRA r = 0); a wrong type
(embedding_length as a string, alpha_pattern as a list) likewise. The hangs
and allocations are guarded by a timeout / by asserting the refusal is fast.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgeom.compress.write import save_llama_folder
from flowgeom.errors import FlowgeomError
from flowgeom.limits import LIMITS, file_float, file_int
from flowgeom.nn.llama import LlamaConfig, llama_state_dict
from tree_digest import snapshot  # noqa: E402  (tests/hostile is on sys.path)

TINY = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=4, max_position_embeddings=64)


def _state(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    from flowgeom.nn.llama import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).state_dict()


@pytest.fixture
def folder(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(31)} | {"[UNK]": 31}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "m"
    path.mkdir()
    save_llama_folder(path, TINY.to_hf(), _state(TINY), tokenizer=tok)
    (tmp_path / "text.txt").write_text(" ".join(f"w{i % 31}" for i in range(200)))
    return path


# -- the helper itself ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, fragment", [
    (True, "must be a whole number between 1 and 4096, got bool True"),
    ("12", "must be a whole number between 1 and 4096, got str '12'"),
    (2.5, "got float 2.5"),
    (float("nan"), "got float nan"),
    (None, "got NoneType None"),
    ([3], "got list [3]"),
    (0, "num_hidden_layers = 0 is outside 1..4096"),
    (2e9, "num_hidden_layers = 2000000000 is outside 1..4096"),
    (10**400, "is outside 1..4096"),
])
def test_file_int_refuses_by_name(value, fragment):
    with pytest.raises(FlowgeomError) as info:
        file_int(value, "num_hidden_layers", where="config.json", fix="fix it")
    text = str(info.value)
    assert text.startswith("config.json num_hidden_layers") and fragment in text and text.endswith("; fix it")
    assert "\n" not in text and len(text) < 200


def test_file_int_and_float_accept_real_values():
    assert file_int(4.0, "num_hidden_layers", where="w", fix="f") == 4 and isinstance(file_int(4.0, "r", where="w",
                                                                                                 fix="f"), int)
    assert file_int(LIMITS["vocab_size"][1], "vocab_size", where="w", fix="f") == 2**22
    assert file_float(1e-5, "eps", where="w", fix="f") == 1e-5
    for bad in (0.0, -1.0, float("inf"), "1e-5", 10**400):
        with pytest.raises(FlowgeomError, match="eps must be a"):
            file_float(bad, "eps", where="w", fix="f")


# -- config.json ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, line", [
    ("vocab_size", 4e9, "Llama config vocab_size = 4000000000 is outside 1..4194304"),
    ("num_hidden_layers", 200000, "Llama config num_hidden_layers = 200000 is outside 1..4096"),
    ("hidden_size", 2**40, "Llama config hidden_size = 1099511627776 is outside 1..65536"),
    ("max_position_embeddings", 10**30, f"Llama config max_position_embeddings = {10**30} is outside 1..134217728"),
])
def test_huge_numbers_in_config_json_are_refused_before_any_allocation(folder, tmp_path, cli, key, value, line):
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    before = snapshot(tmp_path, skip=("cache",))
    start = time.perf_counter()
    rc, out, err = cli(["compress", "evaluate", folder, "--text", tmp_path / "text.txt", "--context", "8",
                        "--out", tmp_path / "o.json"])
    assert time.perf_counter() - start < 60  # refused, not allocated or looped over
    assert rc == 2 and not out
    assert err.strip() == (f"flowgeom: error: {folder}: {line} (no real model is that size); fix config.json "
                           "(or the GGUF metadata)")
    assert not (tmp_path / "o.json").exists() and snapshot(tmp_path, skip=("cache",)) == before


def test_the_untouched_folder_evaluates(folder, tmp_path, cli, strict_json):
    rc, out, _ = cli(["compress", "evaluate", folder, "--text", tmp_path / "text.txt", "--context", "8", "--json"])
    assert rc == 0 and strict_json(out)  # the fixture is valid: the refusals above are about the one number


# -- GGUF metadata ----------------------------------------------------------------------------------------------

def _gguf(path: Path, *, int8: str | None = None, **override) -> Path:
    """A llama GGUF of TINY whose metadata values can be replaced: ``key=(writer method, value)``."""
    import gguf

    from flowgeom.nn.llama import GGUF_NAMES

    names = {v: k for k, v in GGUF_NAMES.items()}
    meta = {"llama.block_count": ("add_uint32", TINY.num_hidden_layers),
            "llama.embedding_length": ("add_uint32", TINY.hidden_size),
            "llama.feed_forward_length": ("add_uint32", TINY.intermediate_size),
            "llama.attention.head_count": ("add_uint32", TINY.num_attention_heads),
            "llama.attention.head_count_kv": ("add_uint32", TINY.num_key_value_heads),
            "llama.rope.dimension_count": ("add_uint32", TINY.head_dim),
            "llama.attention.layer_norm_rms_epsilon": ("add_float32", 1e-5),
            "llama.context_length": ("add_uint32", 64), "llama.vocab_size": ("add_uint32", TINY.vocab_size)}
    meta.update(override)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (method, value) in meta.items():
        getattr(w, method)(key, value)
    for key, t in _state(TINY).items():
        if key == "lm_head.weight":  # tied to the embedding (no output.weight in the GGUF)
            continue
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, layer, *rest = key.split(".")
            name = f"blk.{layer}.{names['.'.join(rest[:-1])]}.weight"
        w.add_tensor(name, (t * 50).round().numpy().astype(np.int8) if name == int8 else t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_real_gguf_loads(tmp_path):
    cfg, state = llama_state_dict(_gguf(tmp_path / "ok.gguf"))
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 8 and cfg.tie_word_embeddings
    assert set(state) == set(_state(TINY)) - {"lm_head.weight"}


@pytest.mark.parametrize("override, line", [
    ({"llama.block_count": ("add_uint64", 2_000_000_000)},
     "GGUF metadata llama.block_count = 2000000000 is outside 1..4096 (no real model is that size)"),
    ({"llama.vocab_size": ("add_uint64", 4_000_000_000)},
     "GGUF metadata llama.vocab_size = 4000000000 is outside 1..4194304 (no real model is that size)"),
    ({"llama.embedding_length": ("add_string", "576")},
     "GGUF metadata llama.embedding_length must be a whole number between 1 and 65536, got str '576'"),
    ({"llama.attention.layer_norm_rms_epsilon": ("add_string", "tiny")},
     "GGUF metadata llama.attention.layer_norm_rms_epsilon must be a number, got str 'tiny'"),
    ({"llama.attention.head_count": ("add_uint32", 0)},
     "GGUF metadata llama.attention.head_count = 0 is outside 1..4096 (no real model is that size)"),
])
def test_forged_gguf_metadata_is_refused_by_share(tmp_path, cli, override, line):
    path = _gguf(tmp_path / "forged.gguf", **override)
    before = snapshot(tmp_path, skip=("cache",))
    start = time.perf_counter()
    rc, out, err = cli(["compress", "run", path, "--out", tmp_path / "o", "--method", "svd", "--rank", "2"])
    assert time.perf_counter() - start < 60
    assert rc == 2 and err.strip() == (f"flowgeom: error: {line}; the file is corrupt or forged: re-download or "
                                       "re-convert it")
    assert not (tmp_path / "o").exists() and snapshot(tmp_path, skip=("cache",)) == before


def test_int8_codes_in_a_gguf_are_refused_like_in_an_hf_folder(tmp_path, cli):
    """One rule for both paths: integer weight codes are refused, never cast to float and scored."""
    path = _gguf(tmp_path / "codes.gguf", int8="blk.1.ffn_up.weight")
    before = snapshot(tmp_path, skip=("cache",))
    rc, _, err = cli(["compress", "run", path, "--out", tmp_path / "o", "--method", "svd", "--rank", "2"])
    assert rc == 2 and err.strip() == (f"flowgeom: error: {path}: blk.1.ffn_up.weight has dtype int8 (and 0 more "
                                       "integer tensors): a quantised checkpoint; dequantise it to float (e.g. "
                                       "save_pretrained of the dequantised model) first")
    assert not (tmp_path / "o").exists() and snapshot(tmp_path, skip=("cache",)) == before
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    state = _state(TINY)
    state["model.layers.1.mlp.up_proj.weight"] = (state["model.layers.1.mlp.up_proj.weight"] * 50).round().to(
        torch.int8)
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, hf / "model.safetensors")
    (hf / "config.json").write_text(json.dumps(TINY.to_hf()))
    rc, _, err_hf = cli(["compress", "run", hf, "--out", tmp_path / "o", "--method", "svd", "--rank", "2"])
    assert rc == 2 and err_hf.strip() == err.strip().replace(str(path), str(hf)).replace(
        "blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight")


# -- adapter_config.json ----------------------------------------------------------------------------------------

def _lora_folder(path: Path, rank: int, adapter: dict) -> Path:
    """Base weights and PEFT LoRA factors of rank ``rank`` on q_proj, with ``adapter`` as adapter_config.json."""
    from safetensors.torch import save_file

    path.mkdir()
    gen = torch.Generator().manual_seed(0)
    state = {}
    for layer in range(3):
        p = f"base_model.model.model.layers.{layer}.self_attn"
        for role in ("q", "k", "v", "o"):
            state[f"{p}.{role}_proj.base_layer.weight" if role == "q" else f"{p}.{role}_proj.weight"] = \
                torch.randn(8, 8, generator=gen)
        state[f"{p}.q_proj.lora_A.weight"] = torch.randn(rank, 8, generator=gen)
        state[f"{p}.q_proj.lora_B.weight"] = torch.randn(8, rank, generator=gen)
    save_file(state, path / "model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(adapter))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 2,
                                                  "num_key_value_heads": 2}))
    return path


@pytest.mark.parametrize("rank, adapter, line", [
    (2, {"lora_alpha": 4, "r": 2, "alpha_pattern": ["q_proj", 8]},
     "adapter_config.json alpha_pattern must be an object {module: value}, got list; fix it"),
    (2, {"lora_alpha": 4, "r": 2, "rank_pattern": "q_proj=2"},
     "adapter_config.json rank_pattern must be an object {module: value}, got str; fix it"),
    (0, {"lora_alpha": 4, "r": 0},
     "adapter_config.json (module model.layers.0.self_attn.q_proj) r = 0 is outside 1..65536 (no real model is that "
     "size); fix it"),
    (0, {"lora_alpha": 4},
     "the lora_A/lora_B of model.layers.0.self_attn.q_proj have rank 0: an empty adapter, nothing to merge; drop "
     "--merge-lora or use the adapter's real weights"),
])
def test_forged_adapter_config_is_refused_by_name(tmp_path, cli, rank, adapter, line):
    path = _lora_folder(tmp_path / "m", rank, adapter)
    before = snapshot(tmp_path, skip=("cache",))
    rc, out, err = cli(["continuity", "analyze", path, "--merge-lora", "--out", tmp_path / "o.json"])
    assert rc == 2 and err.strip() == f"flowgeom: error: {line}"
    assert not (tmp_path / "o.json").exists() and snapshot(tmp_path, skip=("cache",)) == before


def test_a_well_formed_adapter_merges(tmp_path, cli, strict_json):
    path = _lora_folder(tmp_path / "m", 2, {"lora_alpha": 4, "r": 2, "alpha_pattern": {"q_proj": 6}})
    rc, out, _ = cli(["continuity", "analyze", path, "--merge-lora", "--json", "--k", "2"])
    assert rc == 0
    report = strict_json(out)
    assert {e["scale"] for e in report["lora"] if e["merged"]} == {3.0}  # alpha_pattern 6 / r 2


# -- hf: --config -----------------------------------------------------------------------------------------------

def test_hf_target_with_200000_layers_is_refused_before_it_is_built(cli):
    pytest.importorskip("transformers")
    start = time.perf_counter()
    rc, _, err = cli(["laws", "count", "hf:llama:mlp", "--config", "num_hidden_layers=200000"])
    assert time.perf_counter() - start < 60  # a meta build of 200000 layers took minutes
    assert rc == 2 and err.strip() == ("flowgeom: error: --config num_hidden_layers = 200000 is outside 1..4096 (no "
                                       "real model is that size); lower num_hidden_layers")


def _spy_builds(monkeypatch) -> list:
    import transformers

    built = []
    real = transformers.AutoModelForCausalLM.from_config

    def spy(config, **kwargs):
        built.append(config.num_hidden_layers)
        return real(config, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", spy)
    return built


def test_hf_target_size_is_refused_by_arithmetic_before_any_build(cli, monkeypatch):
    """4000 layers pass the layer bound but not the size: refused from the config alone, nothing built."""
    pytest.importorskip("transformers")
    built = _spy_builds(monkeypatch)
    rc, _, err = cli(["laws", "count", "hf:llama:mlp", "--config", "num_hidden_layers=4000",
                      "--config", "hidden_size=64", "--config", "intermediate_size=64", "--config", "head_dim=32"])
    per_layer = 4 * 64 * 64 + 3 * 64 * 64 + 2 * 64  # q k v o (2 heads x 32), gate/up/down, two RMSNorms
    total = 4000 * per_layer + 2 * 16 * 64 + 64  # untied embedding and lm_head (vocab 16), final norm
    assert rc == 2 and f"has at least {total:,} parameters, more than the 20,000,000" in err, err
    assert built == []  # not even on meta


def test_what_the_bound_leaves_out_is_extrapolated_before_the_full_build(cli, monkeypatch):
    """GPT-2's position table is not in the arithmetic bound: the 1- and 2-layer meta builds catch it."""
    pytest.importorskip("transformers")
    built = _spy_builds(monkeypatch)
    rc, _, err = cli(["laws", "count", "hf:gpt2:mlp", "--config", "n_layer=3", "--config", "n_positions=3000000"])
    assert rc == 2 and "has about " in err and "more than the 20,000,000" in err, err
    assert built == [1, 2]  # the 3-layer model was never built


_BOUND_FAMILIES = ("llama", "qwen2", "qwen3", "gemma2", "phi3", "gpt2", "bert", "gpt_neox", "mixtral", "qwen2_moe", "olmoe")
_BOUND_CASES = [(mt, o) for mt in _BOUND_FAMILIES
                for o in ({}, {"num_hidden_layers": 3}, {"tie_word_embeddings": True}, {"num_key_value_heads": 1},
                          {"mlp_only_layers": [1]})
                if not ("num_key_value_heads" in o and mt in ("gpt2", "bert", "gpt_neox"))  # no GQA there
                and not ("mlp_only_layers" in o and mt != "qwen2_moe")]  # only Qwen2-MoE mixes dense layers


@pytest.mark.parametrize("model_type,overrides", _BOUND_CASES)
def test_the_arithmetic_bound_never_exceeds_the_real_count(model_type, overrides):
    pytest.importorskip("transformers")
    import torch
    import transformers

    from flowgeom.hf.families import FAMILIES
    from flowgeom.hf.tiny import tiny_config
    from flowgeom.laws.hf_target import parameters_at_least

    config = tiny_config(model_type, **{**FAMILIES[model_type].tiny, **overrides})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                                 experts_implementation="eager")
    real = sum(p.numel() for p in model.parameters())
    assert 0.5 * real <= parameters_at_least(config, FAMILIES[model_type]) <= real


# -- GGUF tokenizer metadata ------------------------------------------------------------------------------------

FIX = "the GGUF's tokenizer metadata is corrupt or forged: re-download or re-convert it"


@pytest.mark.parametrize("meta, message", [
    ({"tokenizer.ggml.tokens": [1, 2, 3]}, f"GGUF metadata tokenizer.ggml.tokens must be a list of str, got list; {FIX}"),
    ({"tokenizer.ggml.merges": "a b"}, f"GGUF metadata tokenizer.ggml.merges must be a list of str, got str; {FIX}"),
    ({"tokenizer.ggml.token_type": ["control"]},
     f"GGUF metadata tokenizer.ggml.token_type must be a list of int, got list; {FIX}"),
    ({"tokenizer.ggml.merges": ["a b c"]}, f"GGUF merge 'a b c' is not two tokens separated by one space; {FIX}"),
    ({"tokenizer.ggml.merges": ["a zz"]}, "the GGUF tokenizer cannot be built ("),
])
def test_forged_gguf_tokenizer_metadata_is_one_error(meta, message):
    from flowgeom.data.tokens import gguf_tokenizer

    good = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
            "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.token_type": [1, 1, 1]}
    assert gguf_tokenizer(good).encode("ab").ids == [2]  # the unforged metadata builds a working tokenizer
    with pytest.raises(FlowgeomError) as info:
        gguf_tokenizer({**good, **meta})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
