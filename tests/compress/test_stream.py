"""compress run --stream: a Llama read shard by shard and compressed block by block gives the folder the
in-memory path gives (factors, report, perplexity), with --sequential too; what cannot stream is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flowgeom.cli import main
from flowgeom.compress.folder import load_model, read_factored
from flowgeom.compress.perplexity import EvalConfig, perplexity
from flowgeom.compress.run import CompressionConfig, run_compression
from flowgeom.compress.stream import float32_bytes, stream_compression
from flowgeom.errors import FlowgeomError
from flowgeom.nn.llama import LlamaConfig, LlamaForCausalLM

# hidden 64 and intermediate 128: every Gram is full rank from 1,024 calibration tokens (8 sequences, 2 batches)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256)
CALIB = dict(calib_tokens=1024, seq_len=128, cache=False)
SHARD_BYTES = 100_000  # shards cut through blocks: a block's tensors come from two files


@pytest.fixture(scope="module")
def tokenizer():
    from flowgeom.data.tokens import load_tokenizer
    from flowgeom.io import builtin_path

    try:
        return load_tokenizer(builtin_path("builtin:smollm2"))
    except FlowgeomError:
        pytest.skip("the smollm2 data package is not installed")


def random_llama(cfg: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Weights of ``cfg`` with activations of order one: N(0, 1/fan_in) matrices, norms in [0.5, 1.5]."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    state = {}
    for name, shape in sorted(shapes.items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            state[name] = 0.5 + torch.rand(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            state[name] = torch.randn(shape, generator=gen)
        else:
            state[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
    return state


def write_sharded(folder: Path, cfg: LlamaConfig, state: dict, tokenizer) -> list[Path]:
    """An HF folder as ``save_pretrained(max_shard_size=...)`` writes it: shards, their index, config.json."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    shards: list[dict] = [{}]
    for name in sorted(state):  # HF order: by name, a new shard when the current one is full
        if shards[-1] and sum(t.numel() * 4 for t in shards[-1].values()) >= SHARD_BYTES:
            shards.append({})
        shards[-1][name] = state[name].contiguous()
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, part in zip(names, shards):
        save_file(part, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * 4 for t in state.values())},
             "weight_map": {k: file for file, part in zip(names, shards) for k in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(cfg.to_hf()))
    if tokenizer is not None:
        tokenizer.save(str(folder / "tokenizer.json"))
    return [folder / n for n in names]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """A tied and an untied tiny Llama with SmolLM2's vocabulary, sharded; a calibration and an evaluation text."""
    from flowgeom.data.text import load_text

    root = tmp_path_factory.mktemp("stream")
    vocab = tokenizer.get_vocab_size()
    out = {}
    for tie in (True, False):
        cfg = LlamaConfig(vocab_size=vocab, tie_word_embeddings=tie, **TINY)
        out[tie] = root / ("tied" if tie else "untied")
        shards = write_sharded(out[tie], cfg, random_llama(cfg, seed=int(tie)), tokenizer)
        assert len(shards) >= 4  # the test is about shards
    (root / "calib.txt").write_text(load_text("kjv", split="train")[:12_000])
    out["calib"], out["eval_ids"] = str(root / "calib.txt"), _eval_ids(tokenizer)
    return out


def _eval_ids(tokenizer) -> torch.Tensor:
    from flowgeom.data.text import load_text

    return torch.tensor(tokenizer.encode(load_text("kjv", split="test")[:3000]).ids[:384])


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))


def _same_tensors(a: Path, b: Path) -> dict[str, float]:
    """Relative Frobenius difference of every tensor of two factored folders (same units, same names)."""
    _, units_a, ta = read_factored(a)
    _, units_b, tb = read_factored(b)
    assert units_a == units_b and set(ta) == set(tb)
    return {k: float((ta[k].double() - tb[k].double()).norm() / ta[k].double().norm()) for k in ta}


def _ppl(folder: Path, ids: torch.Tensor) -> float:
    return perplexity(load_model(folder), ids, EvalConfig(context=128, max_tokens=None))["ppl"]


def test_streamed_grams_equal_calibrate_bit_for_bit(models, monkeypatch):
    """The stream's block-by-block Grams, summed in row chunks, are calibrate()'s whole-model pass summed in one
    chunk (every width here is below GRAM_ROWS), exactly."""
    import torch.nn.functional as F

    from flowgeom.compress import calibrate as calibrate_module
    from flowgeom.compress import stream
    from flowgeom.compress.calibrate import calibrate
    from flowgeom.nn.llama import llama_from_state, llama_state_dict, rope_tables

    cfg, state = llama_state_dict(models[True])
    ids = torch.randint(0, cfg.vocab_size, (6, 32), generator=torch.Generator().manual_seed(3))  # 2 batches
    want = calibrate(llama_from_state(cfg, state), ids).grams
    assert max(g.shape[0] for grams in want for g in grams.values()) <= calibrate_module.GRAM_ROWS
    monkeypatch.setattr(calibrate_module, "GRAM_ROWS", 24)  # several chunks, the last one short
    h = F.embedding(ids, state["model.embed_tokens.weight"])  # (S, T, d)
    cos, sin = rope_tables(cfg, ids.shape[1], dtype=h.dtype)
    for l in range(cfg.num_hidden_layers):
        grams: dict[str, torch.Tensor] = {}
        block = {k: v for k, v in state.items() if k.startswith(f"model.layers.{l}.")}
        h = stream._run(stream._decoder_layer(cfg, block, l), h, cos, sin, grams)
        assert set(grams) == set(want[l]) == {"attn", "o", "mlp", "down"}
        for key, g in want[l].items():
            assert grams[key].dtype == torch.float64 and torch.equal(grams[key], g), (l, key)


@pytest.mark.parametrize("method", ["whiten", "svd"])
def test_stream_equals_the_in_memory_compression(models, tmp_path, method):
    config = CompressionConfig(method=method, allocate="even", budget=0.3, calib=models["calib"], **CALIB)
    src = models[method == "whiten"]  # svd on the untied model: lm_head comes from the source at assembly
    mem = run_compression(str(src), tmp_path / "mem", config).report
    stages: list[tuple[str, int, int]] = []
    streamed = stream_compression(str(src), tmp_path / "stream", config, progress=lambda *a: stages.append(a))

    diffs = _same_tensors(tmp_path / "mem", tmp_path / "stream")
    assert any(".basis" in k for k in diffs) and any(".coeff" in k for k in diffs)
    assert max(diffs.values()) < 1e-6, max(diffs.items(), key=lambda kv: kv[1])
    assert ("lm_head.weight" in diffs) is (method == "svd")
    for role, r in mem["roles"].items():
        assert streamed["roles"][role]["ranks"] == r["ranks"]
        assert streamed["roles"][role]["rel_error"] == pytest.approx(r["rel_error"], rel=1e-6)
        assert min(r["rel_error"]) > 0.01  # budget 0.3 really truncated something
    for key in ("saved_params", "model_params", "scope_saved_fraction", "calib_tokens"):
        assert streamed.get(key) == mem.get(key), key
    assert stages[-1] == ("assemble", 1, 1) and ("stream", 4, 4) in stages
    files = {p.name for p in (tmp_path / "stream").iterdir()}
    assert files == {p.name for p in (tmp_path / "mem").iterdir()}  # no block temporaries left
    ids = models["eval_ids"]
    got, want = _ppl(tmp_path / "stream", ids), _ppl(tmp_path / "mem", ids)
    assert got == pytest.approx(want, rel=1e-6)
    assert abs(got - _ppl(src, ids)) > 1e-3 * got  # the compression changed the model


def test_stream_sequential_equals_in_memory_and_differs_from_one_pass(models, tmp_path):
    """--sequential measures block l's Grams on the compressed blocks before it: block 0 as in one pass,
    later blocks not."""
    seq = CompressionConfig(method="whiten", allocate="even", budget=0.3, calib=models["calib"], sequential=True,
                            **CALIB)
    one = CompressionConfig(method="whiten", allocate="even", budget=0.3, calib=models["calib"], **CALIB)
    src = models[True]
    run_compression(str(src), tmp_path / "mem", seq)
    stream_compression(str(src), tmp_path / "seq", seq)
    stream_compression(str(src), tmp_path / "one", one)
    diffs = _same_tensors(tmp_path / "mem", tmp_path / "seq")
    assert max(diffs.values()) < 1e-6, max(diffs.items(), key=lambda kv: kv[1])
    across = _same_tensors(tmp_path / "one", tmp_path / "seq")
    assert across["model.layers.0.mlp.down_proj.coeff"] < 1e-6
    assert across["model.layers.3.mlp.down_proj.coeff"] > 1e-4
    ids = models["eval_ids"]
    assert _ppl(tmp_path / "seq", ids) == pytest.approx(_ppl(tmp_path / "mem", ids), rel=1e-6)


def _run(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _refused(capsys, out: Path, *argv) -> str:
    """The error line of a refused ``compress run``: exit 2, one line, nothing written beside ``out``."""
    code, _, err = _run(capsys, "compress", "run", *argv, "--out", out)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowgeom: error: "), err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))
    return lines[0]


def test_cli_streams_and_refuses_what_cannot_stream(models, tmp_path, capsys):
    src, out = models[True], tmp_path / "out"
    calib = ("--calib", models["calib"], "--calib-tokens", "1024")
    code, stdout, err = _run(capsys, "compress", "run", src, "--out", out, "--stream", "--method", "whiten",
                             "--budget", "0.3", *calib, "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["stream"] is True and report["allocate"] == "even" and report["saved_params"] > 0
    assert load_model(out).config.num_hidden_layers == TINY["num_hidden_layers"]

    bad = tmp_path / "bad"
    assert "GGUF" in _refused(capsys, bad, "builtin:smollm2", "--stream", "--allocate", "even")
    single = tmp_path / "single"
    single.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (single / name).write_bytes((src / name).read_bytes())
    from safetensors.torch import save_file

    cfg = LlamaConfig.from_hf(json.loads((src / "config.json").read_text()))
    save_file(random_llama(cfg, seed=5), str(single / "model.safetensors"))
    line = _refused(capsys, bad, single, "--stream", "--allocate", "even")
    assert "no model.safetensors.index.json" in line and "max_shard_size" in line
    assert "shares bases across blocks" in _refused(capsys, bad, src, "--stream", "--method", "basis-sharing")
    assert "--allocate loss" in _refused(capsys, bad, src, "--stream", "--allocate", "loss", *calib)
    assert "--heal" in _refused(capsys, bad, src, "--stream", "--allocate", "even", "--heal", "1024")
    holed = tmp_path / "holed"
    holed.mkdir()
    for f in src.iterdir():
        (holed / f.name).write_bytes(f.read_bytes())
    victim = sorted(holed.glob("model-*.safetensors"))[1]
    victim.unlink()
    line = _refused(capsys, bad, holed, "--stream", "--allocate", "even", *calib)
    assert victim.name in line and "missing" in line


def test_streaming_is_the_default_when_the_model_does_not_fit(models, tmp_path, capsys, monkeypatch):
    from flowgeom.compress import stream

    src = models[False]
    params = sum(t.numel() for t in random_llama(LlamaConfig.from_hf(json.loads((src / "config.json").read_text())),
                                                 seed=0).values())
    assert float32_bytes(str(src)) == 4 * params
    monkeypatch.setattr(stream, "available_bytes", lambda: 4 * params - 1)
    out = tmp_path / "auto"
    code, stdout, err = _run(capsys, "compress", "run", src, "--out", out, "--method", "svd", "--budget", "0.3",
                             "--json")
    assert code == 0, err
    assert "compressing it block by block (--stream)" in err and json.loads(stdout)["stream"] is True
    monkeypatch.setattr(stream, "available_bytes", lambda: 4 * params + 1)
    code, stdout, err = _run(capsys, "compress", "run", src, "--out", tmp_path / "fits", "--method", "svd",
                             "--budget", "0.3", "--json")
    assert code == 0 and "--stream" not in err and "stream" not in json.loads(stdout)
