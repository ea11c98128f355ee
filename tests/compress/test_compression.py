"""Calibrated compression end to end on a tiny Llama: Grams against transformers' hidden states, every method,
factored checkpoints (bytes, loaders, logits), sequential calibration, pruning statistics, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_share_evaluate import _byte_tokenizer, _run, _state, hf_tiny

from flowgeom.compress import plan as C
from flowgeom.compress import factorize as fz
from flowgeom.compress.calibrate import GRAM_KEYS, cached_calibration, calibrate, sequences
from flowgeom.compress.write import save_llama_folder
from flowgeom.compress.folder import factored_hf, factored_llama, projection_bytes, read_factored
from flowgeom.errors import FlowgeomError
from flowgeom.nn.llama import LlamaConfig, llama_from_state, llama_state_dict

transformers = pytest.importorskip("transformers")

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
        "and darkness was upon the face of the deep. ") * 40


def tiny_folder(tmp_path, monkeypatch, **config):
    """A tiny HF Llama folder (``config`` overrides hf_tiny's) with a byte tokenizer, a calibration text and a
    held-out text beside it; the Gram cache under ``tmp_path``."""
    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    hf = hf_tiny(**config)
    folder = tmp_path / "tiny"
    folder.mkdir()
    save_llama_folder(folder, LlamaConfig.from_hf(hf.config.to_dict()).to_hf(), hf.state_dict(),
                      tokenizer=_byte_tokenizer())
    (tmp_path / "calib.txt").write_text(TEXT)
    (tmp_path / "text.txt").write_text(TEXT[::-1])
    return folder


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A tiny HF Llama folder with a byte tokenizer, a calibration text and a held-out text."""
    return tiny_folder(tmp_path, monkeypatch)


def _share(capsys, tiny, out, *argv, verb="run"):
    calib = tiny.parent / "calib.txt"
    return _run(capsys, "compress", verb, str(tiny), "--out", str(out), "--calib", str(calib),
                "--calib-tokens", "512", *argv)


def _model_and_ids(tiny, tokens=512, seq_len=128):
    cfg, state = llama_state_dict(tiny)
    ids = torch.tensor(list(TEXT.encode()[:tokens]), dtype=torch.long).reshape(-1, seq_len)
    return cfg, state, llama_from_state(cfg, state), ids


# ---------------------------------------------------------------- calibration against an independent forward

def test_grams_and_block_influence_match_transformers_hidden_states(tiny):
    cfg, state, model, ids = _model_and_ids(tiny)
    calib = calibrate(model, ids)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tiny), torch_dtype=torch.float64).eval()
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states  # embeddings, then after each block (last normed)
        layer = hf.model.layers[1]
        x = layer.input_layernorm(hidden[1]).reshape(-1, cfg.hidden_size)
        assert torch.allclose(calib.grams[1]["attn"], x.T @ x, rtol=1e-4, atol=1e-4 * float((x.T @ x).abs().max()))
        post = hidden[1] + layer.self_attn(layer.input_layernorm(hidden[1]),
                                           position_embeddings=hf.model.rotary_emb(hidden[1], torch.arange(
                                               ids.shape[1])[None]), attention_mask=None)[0]
        z = layer.post_attention_layernorm(post).reshape(-1, cfg.hidden_size)
        assert torch.allclose(calib.grams[1]["mlp"], z.T @ z, rtol=1e-4, atol=1e-4 * float((z.T @ z).abs().max()))
    assert calib.tokens == ids.numel()
    # BI of block 0: 1 - mean cosine of its input and output (hidden states before the final norm)
    cos = torch.nn.functional.cosine_similarity(hidden[0], hidden[1], dim=-1)
    assert calib.block_influence[0] == pytest.approx(1 - float(cos.mean()), abs=1e-5)
    assert set(calib.angular) == set(range(1, cfg.num_hidden_layers))
    assert all(0 <= a <= 1 for v in calib.angular.values() for a in v)


def test_calibration_cache_is_reused_and_a_tampered_file_recomputed(tiny, tmp_path):
    cfg, state, model, ids = _model_and_ids(tiny)
    first, hit = cached_calibration(model, state, ids, cache=tmp_path / "g")
    assert not hit
    again, hit = cached_calibration(model, state, ids, cache=tmp_path / "g")
    assert hit and torch.equal(again.grams[2]["down"], first.grams[2]["down"])
    [folder] = list((tmp_path / "g").iterdir())  # one block per file, then calibration.json
    assert sorted(p.name for p in folder.iterdir()) == ["0.safetensors", "1.safetensors", "2.safetensors",
                                                        "3.safetensors", "calibration.json"]
    want = first.grams[2]["down"].clone()
    path = folder / "1.safetensors"
    path.write_bytes(path.read_bytes()[:-64])  # truncated
    third, hit = cached_calibration(model, state, ids, cache=tmp_path / "g")
    assert not hit and torch.equal(third.grams[2]["down"], want) and torch.equal(third.grams[1]["o"],
                                                                                   calibrate(model, ids).grams[1]["o"])
    (folder / "calibration.json").unlink()  # killed before the end: measured again
    assert not cached_calibration(model, state, ids, cache=tmp_path / "g")[1]
    other = dict(state)
    other["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"] * 2
    _, hit = cached_calibration(llama_from_state(cfg, other), other, ids, cache=tmp_path / "g")
    assert not hit  # keyed by the weights, not the file name


def test_sequential_calibration_sees_the_compressed_earlier_blocks(tiny):
    cfg, state, model, ids = _model_and_ids(tiny)
    plain = calibrate(model, ids)
    p = C.plan("whiten", state, n_layers=cfg.num_hidden_layers, ratio=0.5)
    comp, seq = C.compress_sequential(p, llama_from_state(cfg, state), ids)
    assert torch.allclose(seq.grams[0]["attn"], plain.grams[0]["attn"])  # block 0 sees the embeddings either way
    assert not torch.allclose(seq.grams[2]["attn"], plain.grams[2]["attn"], rtol=1e-3)
    # block l's factors are the whitened truncation of W_l under the Grams measured on the compressed prefix
    u = next(i for i, u in enumerate(p.units) if u.role == "gate" and u.layers == (2,))
    W = state[C.weight_key(2, "gate")][None]
    want = fz.share_input(W, seq.grams[2]["mlp"][None], p.units[u].rank).dense()[0]
    assert torch.allclose(comp.factors[u].dense()[0], want.float(), atol=1e-5)


# ---------------------------------------------------------------- methods and plans

@pytest.mark.parametrize("method", ["svd", "whiten", "basis-sharing", "share", "continuity"])
def test_every_method_meets_the_budget_and_writes_a_loadable_factored_folder(tiny, tmp_path, capsys, method):
    out = tmp_path / method
    code, stdout, err = _share(capsys, tiny, out, "--method", method, "--budget", "0.25", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["format"] == "factored" and report["method"] == method
    # rank floors store at most (1 - budget) of each role (continuity: of all roles, up to break-even rounding)
    assert 0.25 - 0.01 <= report["scope_saved_fraction"] <= 0.36
    factored, dense = projection_bytes(out)
    kept = sum(m * n * 4 for _, r in report["roles"].items() for s, (m, n) in
               zip(r["spaces"], [r["shape"]] * len(r["spaces"])) if s == "dense")
    assert factored <= (0.75 + 0.01) * (dense + kept)
    # the factored model's logits equal the dense reconstruction's, in flowgeom's Llama and in transformers
    cfg, units, tensors = read_factored(out)
    from flowgeom.compress.folder import dense_state

    ref = llama_from_state(cfg, dense_state(units, tensors))
    ids = torch.tensor([[5, 9, 200, 17, 3, 44, 101]])
    with torch.no_grad():
        want = ref(ids)
        assert (factored_llama(out)(ids) - want).abs().max() < 1e-5
        assert (factored_hf(out)(ids).logits - want).abs().max() < 1e-5
        exact = llama_from_state(cfg, dense_state(units, tensors, dtype=torch.float64), dtype=torch.float64)(ids)
        # llama_from_state holds float32 weights before casting: the reference is the reconstruction to float32
        assert (factored_llama(out, dtype=torch.float64)(ids) - exact).abs().max() < 1e-6
    for u in units:  # stored balanced (factorize.balance): per rank, basis and stacked coefficients of equal norm
        basis, coeffs = tensors[u.basis].double(), torch.stack([tensors[c].double() for c in u.coeffs])
        b_norm = basis.norm(dim=1) if u.space == "input" else basis.norm(dim=0)
        c_norm = coeffs.pow(2).sum(dim=(0, 1) if u.space == "input" else (0, 2)).sqrt()
        assert torch.allclose(b_norm, c_norm, rtol=1e-4), (u.role, u.layers)
    shared = [u for u in units if len(u.layers) > 1]
    if method == "basis-sharing":
        assert {u.role for u in shared} == {"q", "k", "v", "gate", "up"}
        assert all(u.space == "input" for u in units)
    if method in ("svd", "whiten"):
        assert not shared


def test_basis_sharing_uses_the_papers_rank_rule_and_split(tiny):
    cfg, state, _, _ = _model_and_ids(tiny)
    p = C.plan("basis-sharing", state, n_layers=4, ratio=0.3, group=2)
    for u in p.units:
        m, n = u.shape
        g = len(u.layers)
        assert u.rank == math.floor(0.7 * n * m * g / (n + m * g) + 1e-9)
        assert g == (2 if u.role in C.BS_SHARED else 1)


def test_data_free_share_plan_groups_counts_and_leaves_the_input_alone():
    state = _state()  # 5 layers, float64
    before = {k: v.clone() for k, v in state.items()}
    p = C.with_rank(C.plan("share", state, n_layers=5, ratio=0.2, roles=("q", "down"), group=2,
                           spaces={"q": "input", "down": "output"}), 3)
    comp = C.compress(p, state, None)
    new = comp.dense_state(state)
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in state)
    roles = p.by_role()
    assert roles["q"]["groups"] == [[0, 1], [2, 3], [4]] and roles["q"]["spaces"] == ["input"] * 3
    # q: (48, 48); groups of 2, 2, 1: each stores a 3x48 basis plus 48x3 per layer
    assert roles["q"]["stored"] == 3 * (3 * 48) + 5 * (48 * 3) and roles["q"]["dense"] == 5 * 48 * 48
    # down: (48, 80) output space: basis 48x3 + per layer 3x80
    assert roles["down"]["stored"] == 3 * 48 * 3 + 5 * 3 * 80 and roles["down"]["spaces"] == ["output"] * 3
    assert [f.stored() for f in comp.factors] == [u.stored_params for u in p.units]  # counted = held
    # group [2, 3] against projectors from torch's SVD of its stacks
    q = torch.stack([state[C.weight_key(l, "q")] for l in (2, 3)])  # (2, 48, 48)
    Vh = torch.linalg.svd(q.reshape(96, 48))[2][:3]  # top right singular vectors of [W_2; W_3], (3, 48)
    down = torch.stack([state[C.weight_key(l, "down")] for l in (2, 3)])  # (2, 48, 80)
    U = torch.linalg.svd(torch.cat(list(down), dim=1))[0][:, :3]  # top left singular vectors of [W_2, W_3], (48, 3)
    for i, l in enumerate((2, 3)):
        assert torch.allclose(new[C.weight_key(l, "q")].double(), q[i] @ Vh.T @ Vh)
        assert torch.allclose(new[C.weight_key(l, "down")].double(), U @ U.T @ down[i])
    assert torch.equal(new[C.weight_key(0, "v")], state[C.weight_key(0, "v")])


def test_data_free_svd_reaches_the_eckart_young_error():
    state = _state()
    p = C.with_rank(C.plan("svd", state, n_layers=5, ratio=0.2, roles=("up",)), 4)
    new = C.compress(p, state, None).dense_state(state)
    assert p.stored_params == 5 * 4 * (80 + 48)
    for l in range(5):
        W, W4 = state[C.weight_key(l, "up")], new[C.weight_key(l, "up")]  # (80, 48) float64, its float32 rank 4
        U, s, Vh = torch.linalg.svd(W, full_matrices=False)
        rel_error = float(torch.linalg.matrix_norm(W - W4.double()) / s.norm())
        assert math.isclose(rel_error, float(s[4:].norm() / s.norm()), rel_tol=1e-9)
        assert torch.allclose(W4.double(), (U[:, :4] * s[:4]) @ Vh[:4])  # the truncation itself, to float32
        assert torch.linalg.matrix_rank(W4) == 4


def test_bad_compression_input_is_one_error():
    state = _state()
    p = C.plan("share", state, n_layers=5, ratio=0.2, roles=("q",), group=2)
    with pytest.raises(FlowgeomError, match="rank bound 48"):
        C.with_rank(p, 49)
    with pytest.raises(FlowgeomError, match="--group 6 is outside 1..5"):
        C.plan("share", state, n_layers=5, ratio=0.2, roles=("q",), group=6)
    with pytest.raises(FlowgeomError, match="unknown space 'diagonal'"):
        C.plan("share", state, n_layers=5, ratio=0.2, roles=("q",), spaces={"q": "diagonal"})
    with pytest.raises(FlowgeomError, match="unknown role 'qq'"):
        C.plan("svd", state, n_layers=5, ratio=0.2, roles=("qq",))
    del state[C.weight_key(3, "k")]
    with pytest.raises(FlowgeomError, match=r"role k .*missing in layer\(s\) \[3\]"):
        C.plan("share", state, n_layers=5, ratio=0.2, roles=("k",), group=2)


def test_whiten_beats_data_free_svd_on_held_out_perplexity(tiny, tmp_path, capsys):
    for method in ("svd", "whiten"):
        assert _share(capsys, tiny, tmp_path / method, "--method", method, "--budget", "0.4")[0] == 0
    code, stdout, err = _run(capsys, "compress", "evaluate", str(tiny), "--compare", str(tmp_path / "svd"),
                             str(tmp_path / "whiten"), "--text", str(tiny.parent / "calib.txt"), "--context", "64",
                             "--json")
    assert code == 0, err
    ref, svd, whiten = (r["ppl"] for r in json.loads(stdout)["models"])
    assert abs(whiten - ref) < abs(svd - ref)  # on the calibration text, whitening keeps the outputs closer


def test_continuity_plan_groups_pairs_where_a_shared_basis_loses_less(tiny):
    cfg, state, model, ids = _model_and_ids(tiny)
    planted = dict(state)
    gen = torch.Generator().manual_seed(0)
    m, n = state[C.weight_key(0, "up")].shape
    k = fz.rank_for_ratio(m, n, 2, 0.3, "input")
    for pair in ([0, 1], [2, 3]):  # up: each pair exactly shares a rank-k input basis
        basis = torch.linalg.qr(torch.randn(n, k, generator=gen))[0]
        for l in pair:
            planted[C.weight_key(l, "up")] = torch.randn(m, k, generator=gen) @ basis.T
    calib = calibrate(llama_from_state(cfg, planted), ids)
    everywhere = {(l, l + 1): True for l in range(3)}
    evidence = {r: {"space": C.SEED_SPACE.get(r, "input"), "pairs": everywhere} for r in C.ROLES}
    p = C.plan("continuity", planted, n_layers=4, ratio=0.3, calib=calib, continuity=evidence)
    up = [u for u in p.units if u.role == "up"]
    assert [u.layers for u in up] == [(0, 1), (2, 3)] and all(u.rank == k for u in up)
    assert {u.space for u in p.units if u.role == "down"} == {"output"}
    comp = C.compress(p, planted, calib)
    for u, f in zip(p.units, comp.factors):
        if u.role == "up":
            want = torch.stack([planted[C.weight_key(l, "up")] for l in u.layers])
            assert torch.allclose(f.dense(), want, atol=1e-4)
    nowhere = {r: {"space": "input", "pairs": {}} for r in C.ROLES}  # no pair above chance: per layer
    p = C.plan("continuity", planted, n_layers=4, ratio=0.3, calib=calib, continuity=nowhere)
    assert all(len(u.layers) == 1 for u in p.units)


def test_sweep_writes_the_curve_and_its_figure(tiny, tmp_path, capsys):
    out = tmp_path / "sweep"
    code, stdout, err = _share(capsys, tiny, out, "--method", "whiten", "--budgets", "0.2,0.4", "--eval-tokens",
                               "300", "--json", verb="sweep")
    assert code == 0, err
    result = json.loads(stdout)
    assert [p["budget"] for p in result["points"]] == [0.2, 0.4]
    assert all(math.isfinite(p["ppl"]) and p["saved_fraction"] >= p["budget"] - 1e-9 for p in result["points"])
    assert (out / "sweep.png").stat().st_size > 1000 and json.loads((out / "sweep.json").read_text())["points"]
    code, stdout, err = _share(capsys, tiny, tmp_path / "drops", "--method", "drop-angular", "--budgets", "0.2,0.4",
                               "--eval-tokens", "300", "--json", verb="sweep")
    assert code == 0, err
    assert [p["saved_params"] > 0 for p in json.loads(stdout)["points"]] == [True, True]


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing written

@pytest.mark.parametrize("argv,message", [
    (["--method", "basis-sharing", "--space", "output"], "--space goes with --method share only"),
    (["--method", "continuity", "--rank", "4"], "takes no --rank"),
    (["--method", "svd", "--sequential"], "data-free"),
    (["--budget", "1.5"], "--budget"),
    (["--rank", "49", "--method", "whiten"], "rank bound 48"),
    (["--calib-tokens", "40"], "below one sequence of 512"),
])
def test_share_options_that_do_not_go_together(tiny, tmp_path, capsys, argv, message):
    code, _, err = _share(capsys, tiny, tmp_path / "o", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_share_calibration_text_problems(tiny, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("too short")
    code, _, err = _run(capsys, "compress", "run", str(tiny), "--out", str(tmp_path / "o"), "--calib", str(short),
                        "--calib-tokens", "512")
    assert code == 2 and "fewer than --calib-tokens 512" in err
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe" * 400)
    code, _, err = _run(capsys, "compress", "run", str(tiny), "--out", str(tmp_path / "o"), "--calib",
                        str(binary), "--calib-tokens", "512")
    assert code == 2 and "not UTF-8" in err
    long = tmp_path / "long.txt"
    long.write_text(TEXT)
    code, _, err = _run(capsys, "compress", "run", str(tiny), "--out", str(tmp_path / "o"), "--calib", str(long),
                        "--calib-tokens", "64", "--method", "whiten")
    assert code == 2 and "below one sequence" in err
    assert not (tmp_path / "o").exists()


def test_too_few_calibration_tokens_for_the_widest_input_names_the_count(tiny):
    from flowgeom.compress.calibrate import check_rank
    with pytest.raises(FlowgeomError, match=r"at least 1,536 are needed"):
        check_rank({"attn": 576, "o": 576, "mlp": 576, "down": 1536}, 1024)


def test_nan_weights_are_refused_before_any_work(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny / "model.safetensors"))
    state["model.layers.1.self_attn.v_proj.weight"][0, 0] = float("nan")
    save_file(state, str(tiny / "model.safetensors"))
    code, _, err = _share(capsys, tiny, tmp_path / "o")
    assert code == 2 and "v_proj" in err and "NaN" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv", [[], ["--method", "svd", "--rank", "8"], ["--method", "drop-bi"]])
def test_a_tokenizer_larger_than_the_vocabulary_is_one_line_naming_both_sizes(tmp_path, monkeypatch, capsys, argv):
    small = tiny_folder(tmp_path, monkeypatch, vocab_size=128)  # the byte tokenizer has 256 tokens
    code, _, err = _share(capsys, small, tmp_path / "o", *argv)
    assert code == 2 and "256 tokens" in err and "128 token embeddings" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_a_missing_source_lists_the_families_of_the_table(tmp_path, capsys):
    from flowgeom.compress.arch import CAUSAL_FAMILIES

    code, _, err = _run(capsys, "compress", "run", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()
    assert all(family in err for family in CAUSAL_FAMILIES), err


WEIGHTS = "flowgeom_factored.safetensors"  # a factored folder's tensors (flowgeom.compress.folder.WEIGHTS_NAME)


@pytest.mark.parametrize("damage,message", [
    (lambda o: _edit_json(o, lambda m: m["units"][0].update(rank=m["units"][0]["rank"] + 1)), "has shape"),
    (lambda o: _edit_json(o, lambda m: m["units"].append(dict(m["units"][0]))), "factored twice"),
    (lambda o: _edit_json(o, lambda m: m.update(format="other")), "not a flowgeom-factored"),
    (lambda o: (o / WEIGHTS).write_bytes((o / WEIGHTS).read_bytes()[:-100]), "flowgeom_factored.safet"),
    (lambda o: (o / "flowgeom_factored.json").unlink(), None),
    (lambda o: _int_codes(o / WEIGHTS), "a quantised checkpoint; dequantise it"),  # the rule of HF/GGUF
])
def test_a_damaged_factored_folder_is_one_line_exit_2(tiny, tmp_path, capsys, damage, message):
    out = tmp_path / "f"
    assert _share(capsys, tiny, out, "--method", "basis-sharing", "--budget", "0.3")[0] == 0
    damage(out)
    code, _, err = _run(capsys, "compress", "evaluate", str(tiny), "--compare", str(out), "--text",
                        str(tiny.parent / "text.txt"), "--context", "64")
    if message is None:  # without its JSON the folder is read as a plain Llama folder: the factors do not fit it
        assert code == 2 and "missing" in err
    else:
        assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _int_codes(path):
    """The folder's embedding replaced by int8 codes: refused by the same rule as an int8 HF folder or GGUF."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].to(torch.int8)
    save_file(state, str(path))


def _edit_json(folder, edit):
    path = folder / "flowgeom_factored.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def test_share_refuses_an_out_inside_or_equal_to_the_source(tiny, tmp_path, capsys):
    before = {p.name: p.read_bytes() for p in tiny.iterdir()}
    for out in (tiny, tiny / "inside"):
        code, _, err = _share(capsys, tiny, out, "--force")
        assert code == 2 and "source" in err
    assert {p.name: p.read_bytes() for p in tiny.iterdir()} == before


def test_sequences_cut_whole_rows():
    ids = torch.arange(1000)
    assert sequences(ids, 600, 128).shape == (4, 128)
    assert set(GRAM_KEYS) == {"attn", "o", "mlp", "down"}


def test_float16_storage_halves_the_projection_bytes_and_loads_as_its_own_reconstruction(tiny, tmp_path, capsys):
    from flowgeom.compress.folder import dense_state

    for dtype in ("float32", "float16"):
        code, _, err = _share(capsys, tiny, tmp_path / dtype, "--method", "basis-sharing", "--budget", "0.3",
                              "--dtype", dtype)
        assert code == 0, err
    f32, dense32 = projection_bytes(tmp_path / "float32")
    f16, dense16 = projection_bytes(tmp_path / "float16")
    assert dense32 == dense16 and f16 * 2 == f32
    cfg, units, tensors = read_factored(tmp_path / "float16")
    assert tensors[units[0].basis].dtype == torch.float16
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == torch.float32
    ids = torch.tensor([[5, 9, 200, 17, 3]])
    with torch.no_grad():
        want = llama_from_state(cfg, dense_state(units, tensors))(ids)
        assert (factored_llama(tmp_path / "float16")(ids) - want).abs().max() < 1e-5
    code, _, err = _share(capsys, tiny, tmp_path / "x", "--dense", "--dtype", "float16")
    assert code == 2 and "--dtype applies to factored folders only" in err


@pytest.mark.parametrize("method", ["drop-angular", "drop-bi"])
def test_dropping_blocks_writes_a_shorter_llama_that_evaluates(tiny, tmp_path, capsys, method):
    from flowgeom.compress.calibrate import calibrate as calib_of
    from flowgeom.compress.blocks import angular_drop, bi_drop

    out = tmp_path / method
    code, stdout, err = _share(capsys, tiny, out, "--method", method, "--budget", "0.3", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    cfg, state, model, _ = _model_and_ids(tiny)
    ids = torch.tensor(list(TEXT.encode()[:512]), dtype=torch.long).reshape(-1, 512)  # the CLI's one sequence
    calib = calib_of(model, ids)
    n = len(report["dropped"])
    assert report["dropped"] == (angular_drop(calib.angular, n) if method == "drop-angular"
                                 else bi_drop(calib.block_influence, n))
    back, _ = llama_state_dict(out)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4 - n == report["layers"]
    assert report["scope_saved_fraction"] == pytest.approx(report["saved_params"] / report["scope_params"])
    code, stdout, err = _run(capsys, "compress", "evaluate", str(tiny), "--compare", str(out), "--text",
                             str(tiny.parent / "text.txt"), "--context", "64", "--json")
    assert code == 0, err
    assert math.isfinite(json.loads(stdout)["models"][1]["ppl"])
    code, _, err = _share(capsys, tiny, tmp_path / "x", "--method", method, "--rank", "4")
    assert code == 2 and "drops whole blocks" in err


def test_a_config_that_disagrees_with_a_later_layer_is_refused_before_any_work(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny / "model.safetensors"))
    key = "model.layers.3.mlp.up_proj.weight"
    state[key] = state[key][:40]  # layer 3 only: layer 0 still matches the config
    save_file(state, str(tiny / "model.safetensors"))
    code, _, err = _share(capsys, tiny, tmp_path / "o", "--method", "svd")
    assert code == 2 and key in err and "config implies [80, 48]" in err and not (tmp_path / "o").exists()


def test_sweep_judges_each_point_heals_it_and_recommends_the_largest_budget_meeting_the_targets(tiny, tmp_path,
                                                                                                 capsys):
    out = tmp_path / "sweep"
    code, stdout, err = _share(capsys, tiny, out, "--method", "whiten", "--budgets", "0.1,0.5", "--eval-tokens",
                               "300", "--prompts", "3", "--heal", "256", "--seq-len", "64", "--heal-batch", "2",
                               "--heal-text", str(tiny.parent / "calib.txt"), "--eval-texts",
                               str(tiny.parent / "text.txt"), "--eval-tokens-heal", "128", "--json", verb="sweep")
    assert code == 0, err
    result = json.loads(stdout)
    assert result["healed"] == 256 and result["judge"]["prompts"] == 3
    for p in result["points"]:
        assert 0 <= p["agreement"]["top1"] <= 1 and p["agreement"]["kl"] >= 0
        assert p["saved_fraction"] >= p["budget"] - 1e-9  # of the projections, as the budget is
        assert set(p["generation"]) == {"loop_fraction", "distinct2", "prefix_agreement"}
        assert p["targets"]["all"] == all(v for k, v in p["targets"].items() if k != "all")
        healed = json.loads((Path(p["folder"]) / "flowgeom_share.json").read_text())
        assert healed["heal"]["tokens"] == 256 and healed["budget"] == p["budget"]
    met = [p["budget"] for p in result["points"] if p["targets"]["all"]]
    assert result["recommended"] == (max(met) if met else None)
    # the human table names the targets and the recommendation (or that none was met)
    code, stdout, err = _share(capsys, tiny, tmp_path / "s2", "--method", "whiten", "--budgets", "0.1",
                               "--eval-tokens", "300", "--prompts", "2", verb="sweep")
    assert code == 0, err
    assert "top-1 agree" in stdout and ("recommended budget: 10%" in stdout or "no budget meets" in stdout)
