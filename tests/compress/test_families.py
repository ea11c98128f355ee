"""Compression for every causal-LM family of the table: role weights round-trip, blocks run one at a time
as the model's own forward runs them, and a compressed folder loads into the family's transformers class
with the logits of its dense reconstruction; MoE and unknown families are refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_share_evaluate import _byte_tokenizer

from flowgeom.compress.arch import CAUSAL_FAMILIES, Runner, arch_of, family_state, logits, role_state

transformers = pytest.importorskip("transformers")

VOCAB = 256  # the byte tokenizer's


def _tiny(model_type: str, seed: int = 0):
    from flowgeom.hf.tiny import tiny_model

    return tiny_model(model_type, seed=seed, dtype=torch.float32, vocab_size=VOCAB)


def _ids(seed: int = 0, shape=(2, 12)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", CAUSAL_FAMILIES)
def test_role_weights_round_trip_and_split_as_the_module_computes(model_type):
    """family_state(role_state(s)) == s exactly; each role's rows are what the module outputs for that role
    (checked on the module itself: its output at the role's rows equals x W_role^T)."""
    model = _tiny(model_type)
    arch = arch_of(model.config)
    L = model.config.num_hidden_layers
    state = dict(model.state_dict())
    roles = role_state(arch, state, L)
    back = family_state(arch, roles, L)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    from flowgeom.compress.arch import weight_key

    x = torch.randn(5, model.config.hidden_size, dtype=torch.float32)
    with torch.no_grad():
        for role in arch.roles:
            slot = arch.slots[role]
            module = model.get_submodule(f"{arch.layers}.1.{slot.path}")
            w = roles[weight_key(1, role)]
            if w.shape[1] != x.shape[1]:
                continue  # o and down read other widths; their rows are the whole module (no fusion)
            out = module(x)
            bias = getattr(module, "bias", None)
            out = out - (bias if bias is not None else 0)
            mine = out if slot.rows is None else out[:, list(slot.rows)]
            torch.testing.assert_close(mine, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", CAUSAL_FAMILIES)
def test_runner_blocks_give_the_models_own_logits(model_type):
    model = _tiny(model_type, seed=1)
    runner = Runner(model)
    ids = _ids(1)
    with torch.no_grad():
        h = runner.embed(ids)
        for l in range(len(runner)):
            h = runner.block(l, h)
        torch.testing.assert_close(runner.head(h), model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    """Per family: (source folder, factored folder (default method, loss-allocated ranks), dense folder)."""
    from flowgeom.compress.run import CompressionConfig, run_compression

    made = {}
    root = tmp_path_factory.mktemp("families")
    mp = pytest.MonkeyPatch()
    mp.setenv("FLOWGEOM_CACHE", str(root / "cache"))
    for mt in CAUSAL_FAMILIES:
        src = root / mt
        _tiny(mt, seed=2).save_pretrained(src)
        _byte_tokenizer().save(str(src / "tokenizer.json"))
        config = dict(budget=0.3, calib_tokens=1024, seq_len=64)
        run_compression(str(src), root / f"{mt}-f", CompressionConfig(**config))
        run_compression(str(src), root / f"{mt}-d", CompressionConfig(**config, dense=True, allocate="even"))
        made[mt] = (src, root / f"{mt}-f", root / f"{mt}-d")
    yield made
    mp.undo()


@pytest.mark.parametrize("model_type", CAUSAL_FAMILIES)
def test_factored_logits_equal_the_dense_reconstruction_and_generate_runs(compressed, model_type):
    """The factored modules (split fused projections, shared bases, dense biases) compute what the dense
    reconstruction of the same factors computes, in the family's own transformers class."""
    from flowgeom.compress import load
    from flowgeom.compress.folder import dense_state, read_factored
    from flowgeom.compress.source import build_model

    _, folder, _ = compressed[model_type]
    model = load(folder)
    assert type(model).__name__ == transformers.AutoModelForCausalLM._model_mapping[
        type(transformers.AutoConfig.for_model(model_type))].__name__
    cfg, units, tensors = read_factored(folder)
    assert units, "nothing was factored"
    reference = build_model(cfg, dense_state(units, tensors))
    ids = _ids(3)
    with torch.no_grad():
        torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=1e-5, atol=1e-5)
    out = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)


@pytest.mark.parametrize("model_type", CAUSAL_FAMILIES)
def test_auto_class_loads_the_factored_folder_and_the_dense_folder_is_plain(compressed, model_type):
    from flowgeom.compress import load

    src, folder, dense = compressed[model_type]
    auto = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = _ids(4)
    with torch.no_grad():
        torch.testing.assert_close(auto(ids).logits, load(folder)(ids).logits, rtol=0, atol=0)
    assert json.loads((dense / "config.json").read_text())["model_type"] == model_type
    plain = transformers.AutoModelForCausalLM.from_pretrained(dense)  # any tool loads it: no flowgeom class
    original = transformers.AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        change = (plain(ids).logits - original(ids).logits).abs().max()
    assert 0 < float(change) < 10  # compressed (not the source), and a working model


def test_evaluate_reads_every_family(compressed, tmp_path, capsys):
    from flowgeom.cli import main

    text = tmp_path / "t.txt"
    text.write_text("In the beginning was the word, and the word was with the tokenizer. " * 20)
    folders = [str(compressed[mt][1]) for mt in CAUSAL_FAMILIES]
    src = compressed["phi3"][0]
    code = main(["compress", "evaluate", str(src), "--compare", *folders, "--text", str(text), "--context", "64",
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = json.loads(out)["models"]
    assert len(rows) == 1 + len(folders) and all(r["ppl"] > 1 for r in rows)
    # bytes against the reference stored densely in the same dtype: the float32 source is ~1 (its header aside),
    # every factored folder below it
    assert rows[0]["stored"] == "float32" and abs(rows[0]["bytes_ratio"] - 1) < 0.05
    assert all(r["stored"] == "float32" and r["bytes_ratio"] < rows[0]["bytes_ratio"] for r in rows[1:])


def test_sequential_on_a_fused_family_writes_what_it_measured(tmp_path, monkeypatch):
    """--sequential writes each group's dense reconstruction into the fused qkv rows before the next group's
    Grams: its factors differ from the one-pass run's after the first layer, and the folder loads exactly."""
    from flowgeom.compress import load
    from flowgeom.compress.folder import dense_state, read_factored
    from flowgeom.compress.run import CompressionConfig, run_compression
    from flowgeom.compress.source import build_model

    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "falcon"
    _tiny("falcon", seed=5).save_pretrained(src)
    _byte_tokenizer().save(str(src / "tokenizer.json"))
    base = dict(budget=0.3, calib_tokens=1024, seq_len=64, allocate="even")
    run_compression(str(src), tmp_path / "one", CompressionConfig(**base))
    run_compression(str(src), tmp_path / "seq", CompressionConfig(**base, sequential=True))
    _, units1, t1 = read_factored(tmp_path / "one")
    cfg, units2, t2 = read_factored(tmp_path / "seq")
    first = [u.coeffs[0] for u in units1 if u.layers == (0,)]
    later = [u.coeffs[0] for u in units1 if u.layers == (1,)]
    assert all(torch.allclose(t1[c], t2[c], atol=1e-5) for c in first)  # block 0 sees the same inputs
    assert any(not torch.allclose(t1[c], t2[c], atol=1e-5) for c in later)
    ids = _ids(6)
    with torch.no_grad():
        torch.testing.assert_close(logits(load(tmp_path / "seq"), ids),
                                   logits(build_model(cfg, dense_state(units2, t2)), ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type,message", [("mixtral", "mixtral is a mixture-of-experts model"),
                                                ("qwen2_moe", "qwen2_moe is a mixture-of-experts model")])
def test_moe_is_refused_in_one_line(tmp_path, capsys, model_type, message):
    from flowgeom.cli import main
    from flowgeom.hf.tiny import tiny_model

    src = tmp_path / model_type
    tiny_model(model_type, seed=0, dtype=torch.float32).save_pretrained(src)
    capsys.readouterr()  # save_pretrained's own progress bar
    code = main(["compress", "run", str(src), "--out", str(tmp_path / "o"), "--method", "svd", "--budget", "0.2"])
    _, err = capsys.readouterr()
    assert code == 2 and message in err and "supported: llama" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_without_flowgeom_a_factored_family_folder_is_refused(compressed):
    folder = compressed["gpt2"][1]
    code = f"import transformers\ntransformers.AutoModelForCausalLM.from_pretrained({str(folder)!r})"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "flowgeom.compress.load" in run.stderr


def test_heal_trains_a_split_fused_projection_and_writes_a_loadable_folder(compressed, tmp_path):
    """Healing a Phi-3 folder trains the factors inside its split qkv/gate_up modules (by their folder names)
    and writes a folder whose factored model still equals its own dense reconstruction."""
    from flowgeom.compress import load
    from flowgeom.compress.folder import dense_state, read_factored
    from flowgeom.compress.heal import HealConfig, heal_folder
    from flowgeom.compress.source import build_model

    _, folder, _ = compressed["phi3"]
    heal_folder(folder, tmp_path / "h", HealConfig(tokens=4 * 64 * 2, seq_len=64, batch=2, lr=1e-3, eval_every=4,
                                                   eval_tokens=256, eval_context=64, checkpoint_every=4))
    _, units, before = read_factored(folder)
    cfg, units_after, after = read_factored(tmp_path / "h")
    assert units_after == units
    fused = [c for u in units if u.role in ("q", "gate") for c in u.coeffs]
    assert fused and all(not torch.equal(before[c], after[c]) for c in fused)
    ids = _ids(7)
    with torch.no_grad():
        torch.testing.assert_close(logits(load(tmp_path / "h"), ids),
                                   logits(build_model(cfg, dense_state(units_after, after)), ids),
                                   rtol=1e-5, atol=1e-5)


def test_a_fused_layout_the_table_does_not_know_is_one_line_exit_2(compressed, tmp_path, capsys, monkeypatch):
    """A family entry whose fused weight has no FusedLayout cannot be split: refused before any work."""
    from dataclasses import replace

    from flowgeom.cli import main
    from flowgeom.hf import families

    monkeypatch.setitem(families.FAMILIES, "phi3", replace(families.FAMILIES["phi3"], fused={}))
    src = compressed["phi3"][0]
    code = main(["compress", "run", str(src), "--out", str(tmp_path / "o"), "--method", "svd", "--budget", "0.2"])
    _, err = capsys.readouterr()
    assert code == 2 and "self_attn.qkv_proj has no layout in the family table" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_sweep_scores_a_family_at_several_budgets(compressed, tmp_path):
    from flowgeom.compress.run import CompressionConfig
    from flowgeom.compress.sweep import sweep_budgets

    src = compressed["gpt2"][0]
    result = sweep_budgets(str(src), tmp_path / "s", CompressionConfig(calib_tokens=1024, seq_len=64, allocate="even"),
                           [0.2, 0.5], eval_tokens=256, context=64)
    ratios = [p["ppl_ratio"] for p in result["points"]]
    assert [p["budget"] for p in result["points"]] == [0.2, 0.5] and (tmp_path / "s" / "sweep.json").is_file()
    assert all(r > 0.5 for r in ratios) and result["roles"] == ["q", "k", "v", "o", "up", "down"]


@pytest.mark.parametrize("model_type,over", [("gpt2", {}), ("gemma2", {"final_logit_softcapping": 3.0})])
def test_heal_step_gradient_is_the_whole_logits_kl_through_any_head(model_type, over):
    """The closed-form head gradient of a heal step (through the family's final norm, and Gemma 2's logit
    soft cap) equals autograd through the model's own logits, float64."""
    from flowgeom.compress.heal import distillation_loss, distillation_step_loss
    from flowgeom.hf.tiny import tiny_model

    teacher = tiny_model(model_type, seed=0, dtype=torch.float64, vocab_size=VOCAB, **over)
    student = tiny_model(model_type, seed=1, dtype=torch.float64, vocab_size=VOCAB, **over)
    student.requires_grad_(False)
    assert Runner(student).softcap == over.get("final_logit_softcapping")
    ids = _ids(8, (2, 20))
    arch = arch_of(student.config)
    wrt = student.get_submodule(f"{arch.layers}.0.{arch.slots['up'].path}").weight
    wrt.requires_grad_(True)
    whole = distillation_loss(student(ids).logits, teacher(ids).logits.detach())
    chunked = distillation_step_loss(student, teacher, ids, checkpointing=True, chunk=7)
    assert float(chunked) == pytest.approx(float(whole), rel=1e-9)
    torch.testing.assert_close(torch.autograd.grad(chunked, wrt)[0], torch.autograd.grad(whole, wrt)[0],
                               rtol=1e-7, atol=1e-12)
