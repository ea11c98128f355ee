"""Healing by distillation on a tiny Llama: the loss against float64, the schedule, a run that heals, resume
to the same numbers, divergence that keeps the last good tensors, and bad input (one line, exit 2)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_compression import _share, tiny  # noqa: F401 - the tiny HF Llama folder fixture
from test_share_evaluate import _run

from flowgeom.compress.folder import dense_state, factored_llama, read_factored
from flowgeom.compress.heal import (
    HealConfig, distillation_loss, heal_folder, learning_rate, load_student, sampled_rows, with_samples,
)
from flowgeom.errors import FlowgeomError
from flowgeom.nn.llama import llama_from_state

transformers = pytest.importorskip("transformers")


def test_distillation_loss_is_the_float64_kl_and_zero_on_the_teacher():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=gen), torch.randn(2, 5, 11, generator=gen)
    p = torch.softmax(t.double(), -1)
    want = (p * (torch.log(p) - torch.log_softmax(s.double(), -1))).sum(-1).mean()
    assert float(distillation_loss(s, t)) == pytest.approx(float(want), rel=1e-5)
    assert abs(float(distillation_loss(t, t))) < 1e-6
    assert float(distillation_loss(s, t)) > 0


def test_schedule_warms_up_linearly_peaks_and_decays_to_the_floor():
    cfg = HealConfig(tokens=100 * 256 * 4, lr=1e-3, warmup=0.1, min_lr=0.1)
    lrs = [learning_rate(k, cfg) for k in range(cfg.steps)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(1e-4)


def _compressed(capsys, tiny, tmp_path, *argv):  # noqa: F811
    out = tmp_path / "w"
    code, _, err = _share(capsys, tiny, out, "--method", "whiten", "--budget", "0.4", "--allocate", "even", *argv)
    assert code == 0, err
    return out


def _cfg(tiny, **over):  # noqa: F811
    text = str(tiny.parent / "calib.txt")
    base = dict(tokens=12 * 64 * 2, seq_len=64, batch=2, lr=3e-3, text=text, eval_texts=(str(tiny.parent / "text.txt"),),
                eval_every=4, eval_tokens=256, eval_context=128, checkpoint_every=4, teacher=str(tiny))
    return HealConfig(**{**base, **over})


def test_healing_lowers_the_kl_and_the_held_out_perplexity_and_stays_factored(capsys, tiny, tmp_path):  # noqa: F811
    folder = _compressed(capsys, tiny, tmp_path)
    out = tmp_path / "healed"
    result = heal_folder(folder, out, _cfg(tiny))
    history = [json.loads(line) for line in (out / "heal.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [0, 4, 8, 12]
    assert history[-1]["kl"] < 0.5 * history[1]["kl"]
    (name,) = result["reference_ppl"]
    assert history[-1]["ppl"][name] < history[0]["ppl"][name]  # closer to the teacher on text it never saw
    assert result["ppl_ratio"][name] == pytest.approx(history[-1]["ppl"][name] / result["reference_ppl"][name])
    assert (out / "heal.png").stat().st_size > 0
    # still a factored folder: its loader's logits equal the dense reconstruction's, and the factors moved
    cfg, units, tensors = read_factored(out)
    _, _, before = read_factored(folder)
    assert any(not torch.equal(tensors[u.basis], before[u.basis]) for u in units)
    ids = torch.tensor([[5, 9, 200, 17, 3, 44, 101]])
    with torch.no_grad():
        want = llama_from_state(cfg, dense_state(units, tensors))(ids)
        assert (factored_llama(out)(ids) - want).abs().max() < 1e-5
    share = json.loads((out / "flowgeom_share.json").read_text())
    assert share["heal"]["tokens"] == 12 * 64 * 2 and share["method"] == "whiten"


def test_a_killed_heal_resumes_to_the_same_tensors(capsys, tiny, tmp_path):  # noqa: F811
    folder = _compressed(capsys, tiny, tmp_path)
    heal_folder(folder, tmp_path / "straight", _cfg(tiny))

    def kill(stage, done, total):
        if done == 6:  # after the checkpoint of step 4
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        heal_folder(folder, tmp_path / "resumed", _cfg(tiny), progress=kill)
    assert not (tmp_path / "resumed").exists()
    heal_folder(folder, tmp_path / "resumed", _cfg(tiny), resume=True)
    _, _, a = read_factored(tmp_path / "straight")
    _, _, b = read_factored(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "straight/heal.jsonl").read_text() != ""
    straight = [json.loads(x) for x in (tmp_path / "straight/heal.jsonl").read_text().splitlines()]
    resumed = [json.loads(x) for x in (tmp_path / "resumed/heal.jsonl").read_text().splitlines()]
    assert [h["ppl"] for h in straight] == [h["ppl"] for h in resumed]


def test_divergence_keeps_the_last_good_tensors_and_says_so(capsys, tiny, tmp_path):  # noqa: F811
    folder = _compressed(capsys, tiny, tmp_path)
    out = tmp_path / "blown"
    with pytest.raises(FlowgeomError, match=r"diverged at step \d+ .* the tensors of step 0 were kept"):
        heal_folder(folder, out, _cfg(tiny, lr=0.9, warmup=0.0, checkpoint_every=100))
    _, _, kept = read_factored(out)
    _, _, original = read_factored(folder)
    assert all(torch.equal(kept[k], original[k]) for k in original)


def test_a_dropped_model_heals_its_remaining_blocks(capsys, tiny, tmp_path):  # noqa: F811
    folder = tmp_path / "dropped"
    code, _, err = _share(capsys, tiny, folder, "--method", "drop-angular", "--budget", "0.25")
    assert code == 0, err
    student = load_student(folder)
    assert student.kind == "dense" and all(k.endswith("_proj.weight") for k in student.trainable)
    result = heal_folder(folder, tmp_path / "dh", _cfg(tiny))
    (name,) = result["reference_ppl"]
    assert result["history"][-1]["ppl"][name] < result["history"][0]["ppl"][name]


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "10", "--seq-len", "64"], "less than one sequence of 64 tokens"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--lr", "-1e-3"], "--lr"),
])
def test_bad_heal_flags_are_one_line_exit_2(capsys, tiny, tmp_path, argv, message):  # noqa: F811
    folder = _compressed(capsys, tiny, tmp_path)
    code, _, err = _run(capsys, "compress", "heal", str(folder), "--out", str(tmp_path / "o"), *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_heal_refuses_what_it_cannot_heal(capsys, tiny, tmp_path):  # noqa: F811
    code, _, err = _run(capsys, "compress", "heal", str(tiny), "--out", str(tmp_path / "o"))
    assert code == 2 and "is not a compressed folder" in err and len(err.strip().splitlines()) == 1
    folder = _compressed(capsys, tiny, tmp_path)
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 400)
    code, _, err = _run(capsys, "compress", "heal", str(folder), "--out", str(tmp_path / "o"), "--heal-text", str(bad),
                        "--teacher", str(tiny))
    assert code == 2 and "UTF-8" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_a_resume_from_another_plan_is_refused(capsys, tiny, tmp_path):  # noqa: F811
    a = _compressed(capsys, tiny, tmp_path)
    out = tmp_path / "healed"
    with pytest.raises(KeyboardInterrupt):
        heal_folder(a, out, _cfg(tiny), progress=lambda s, d, t: (_ for _ in ()).throw(KeyboardInterrupt) if d == 5
                    else None)
    b = tmp_path / "w30"
    code, _, err = _share(capsys, tiny, b, "--method", "whiten", "--budget", "0.3")
    assert code == 0, err
    with pytest.raises(FlowgeomError, match="belongs to another student"):
        heal_folder(b, out, _cfg(tiny), resume=True)
    with pytest.raises(FlowgeomError, match="other heal settings"):
        heal_folder(a, out, _cfg(tiny, lr=1e-3), resume=True)
    assert math.isfinite(heal_folder(a, out, _cfg(tiny), resume=True)["seconds"])


def test_share_heal_compresses_then_heals_in_place(capsys, tiny, tmp_path):  # noqa: F811
    out = tmp_path / "wh"
    code, stdout, err = _share(capsys, tiny, out, "--method", "whiten", "--budget", "0.4", "--heal", "768",
                               "--seq-len", "64", "--heal-batch", "2", "--lr", "3e-3", "--eval-every", "3",
                               "--eval-tokens-heal", "256", "--heal-text", str(tiny.parent / "calib.txt"),
                               "--eval-texts", str(tiny.parent / "text.txt"), "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["heal"]["tokens"] == 768 and report["heal"]["steps"] == 6
    assert json.loads((out / "flowgeom_share.json").read_text())["heal"]["steps"] == 6
    read_factored(out)  # still a valid factored folder
    code, _, err = _share(capsys, tiny, tmp_path / "d", "--budget", "0.4", "--dense", "--heal", "768")
    assert code == 2 and "--heal trains the factors" in err


def test_a_finished_heal_removes_its_work_folder_and_keeps_its_log(capsys, tiny, tmp_path):  # noqa: F811
    folder = _compressed(capsys, tiny, tmp_path)
    heal_folder(folder, tmp_path / "done", _cfg(tiny))
    assert not (tmp_path / "done.heal").exists()
    assert {"heal.jsonl", "heal.json", "heal.png"} <= {p.name for p in (tmp_path / "done").iterdir()}


def test_chunked_step_loss_equals_the_whole_logits_kl_in_value_and_gradient(tiny):  # noqa: F811
    from flowgeom.compress.heal import distillation_step_loss
    from flowgeom.nn.llama import llama_state_dict

    cfg, state = llama_state_dict(tiny)
    teacher = llama_from_state(cfg, state, dtype=torch.float64)
    noisy = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(1)) for k, v in state.items()}
    student = llama_from_state(cfg, noisy, dtype=torch.float64)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    student.model.norm.weight.requires_grad_(True)  # --norms: the final gain is trained too
    wrt = (student.model.layers[0].mlp.up_proj.weight, student.model.norm.weight)
    whole = distillation_loss(student(ids), teacher(ids).detach())
    g_whole = torch.autograd.grad(whole, wrt)
    chunked = distillation_step_loss(student, teacher, ids, checkpointing=True, chunk=7)  # 80 rows: 11 uneven chunks
    g_chunked = torch.autograd.grad(chunked, wrt)
    assert float(chunked) == pytest.approx(float(whole), rel=1e-10)
    for a, b in zip(g_chunked, g_whole):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-12)


def test_divergence_after_a_checkpoint_restores_that_checkpoint(capsys, tiny, tmp_path, monkeypatch):  # noqa: F811
    import flowgeom.compress.heal as H

    folder = _compressed(capsys, tiny, tmp_path)
    real_loss, real_checkpoint = H.distillation_step_loss, H._checkpoint
    calls, saved = {"n": 0}, {}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss = real_loss(*args, **kwargs)
        return loss * float("nan") if calls["n"] == 7 else loss

    def spy(work, run, student, opt, identity, config):
        saved[run.step] = {k: p.detach().clone() for k, p in student.trainable.items()}
        real_checkpoint(work, run, student, opt, identity, config)

    monkeypatch.setattr(H, "distillation_step_loss", poisoned)
    monkeypatch.setattr(H, "_checkpoint", spy)
    out = tmp_path / "nan"
    with pytest.raises(FlowgeomError, match=r"diverged at step 7 \(KL nan.*tensors of step 4 were kept"):
        heal_folder(folder, out, _cfg(tiny))
    _, _, kept = read_factored(out)
    assert all(torch.equal(kept[k], saved[4][k]) for k in saved[4])
    assert (tmp_path / "nan.heal" / "checkpoint.safetensors").is_file()  # a diverged run keeps its state


# ---------------------------------------------------------------- levers: dense projections, sampled continuations

def test_sampled_rows_hold_the_fractions_on_average_and_depend_on_the_step_only():
    cfg = HealConfig(tokens=1 << 20, batch=4, on_policy=0.3, teacher_samples=0.2)
    draws = [sampled_rows(k, cfg) for k in range(2000)]
    assert draws == [sampled_rows(k, cfg) for k in range(2000)]  # a resumed run draws the same rows
    assert all(s + t <= 4 for s, t in draws)
    assert sum(s for s, _ in draws) / (4 * 2000) == pytest.approx(0.3, abs=0.01)
    assert sum(t for _, t in draws) / (4 * 2000) == pytest.approx(0.2, abs=0.01)
    assert all(sampled_rows(k, HealConfig(tokens=1 << 20, batch=4, on_policy=1.0, teacher_samples=0.0)) == (4, 0)
               for k in range(50))
    assert all(sampled_rows(k, HealConfig(tokens=1 << 20, batch=4, teacher_samples=0.0)) == (0, 0) for k in range(50))
    assert HealConfig().teacher_samples == 0.5 and HealConfig(seq_len=64).sample_length == 32  # the defaults


def test_with_samples_replaces_only_the_tails_of_the_sampled_rows(tiny):  # noqa: F811
    from flowgeom.compress.agreement import continue_tokens
    from flowgeom.nn.llama import load_llama

    teacher = load_llama(tiny)
    student = load_llama(tiny)
    cfg = HealConfig(tokens=1 << 20, seq_len=40, batch=4, on_policy=0.5, teacher_samples=0.5, sample_tokens=16)
    batch = torch.randint(0, 256, (4, 40), generator=torch.Generator().manual_seed(3))
    out = with_samples(batch, student, teacher, 0, cfg)
    assert torch.equal(out[:, :24], batch[:, :24]) and not torch.equal(out[:, 24:], batch[:, 24:])
    assert out.requires_grad is False and not out.is_inference()
    # the sampled tails are the models' own samples of the text before them, reproducible from (seed, step)
    assert torch.equal(out, with_samples(batch, student, teacher, 0, cfg))
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 0 + 104_729)
    want = continue_tokens(student, batch[:2, :24], 16, temperature=1.0, generator=gen)
    assert torch.equal(out[:2, 24:], want)


def test_train_dense_adds_the_projections_left_dense_and_writes_them(capsys, tiny, tmp_path):  # noqa: F811
    out = tmp_path / "w"
    code, _, err = _share(capsys, tiny, out, "--method", "whiten", "--budget", "0.2", "--roles", "q,gate")
    assert code == 0, err
    plain = load_student(out)
    both = load_student(out, train_dense=True, norms=True)
    extra = set(both.trainable) - set(plain.trainable)
    assert extra and all(".layers." in k for k in extra if not k.endswith("norm.weight"))
    assert any(k.endswith("down_proj.weight") for k in extra) and any(k.endswith("norm.weight") for k in extra)
    # nearly lossless (first KL ~1e-4): the 4x divergence guard would trip on noise; not what this test is about
    result = heal_folder(out, tmp_path / "h", _cfg(tiny, train_dense=True, norms=True, on_policy=0.5, diverge=1e6,
                                                  sample_tokens=16, tokens=4 * 64 * 2))
    assert result["steps"] == 4
    _, _, before = read_factored(out)
    _, _, after = read_factored(tmp_path / "h")
    moved = [k for k in extra if k in before and not torch.equal(before[k], after[k])]
    assert any(k.endswith("down_proj.weight") for k in moved)


@pytest.mark.parametrize("over, message", [
    (dict(on_policy=1.5), "--on-policy 1.5 is above 1"),
    (dict(on_policy=0.6, teacher_samples=0.6), "add up to more than the whole batch"),
    (dict(on_policy=0.5, sample_tokens=256), "leaves no text to continue"),
    (dict(teacher_samples=-0.1), "--teacher-samples"),
])
def test_bad_sampling_settings_are_refused(over, message):
    with pytest.raises(FlowgeomError, match=message):
        HealConfig(**over)
