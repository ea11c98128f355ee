"""``flowgeom conserve drift``: the laws' drift over saved checkpoints (HF Trainer, save_pretrained, safetensors)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from flowgeom.cli import main  # noqa: E402
from flowgeom.errors import FlowgeomError  # noqa: E402
from flowgeom.integrations.checkpoints import checkpoint_drift  # noqa: E402
from flowgeom.laws.monitor import ConservationMonitor  # noqa: E402
from integrations_data import TokenData  # noqa: E402


def _sgd_series(tmp_path, model, steps=(0, 3, 6), lr=0.001, momentum=0.0):
    """save_pretrained folders of a plain SGD loop at ``steps``; returns them and the in-loop monitor's records."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    mon = ConservationMonitor(model, warn=False)
    data = TokenData()
    folders, records = [], {}
    for k in range(max(steps) + 1):
        if k in steps:
            folder = tmp_path / f"step{k}"
            model.save_pretrained(folder)
            folders.append(folder)
            records[k] = mon.step(k)
        batch = data[slice(4 * k % 64, 4 * k % 64 + 4)]
        model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        opt.step()
        opt.zero_grad()
    return folders, records


def test_drift_equals_the_in_loop_monitor_and_gives_verdicts(tmp_path, tiny_llama, capsys):
    folders, records = _sgd_series(tmp_path, tiny_llama())
    # save_pretrained folders carry no step (no trainer_state.json, no checkpoint-N name): the order given
    out = checkpoint_drift([str(f) for f in reversed(folders)], optimizer_kind="sgd")
    assert out["steps"] == [0, 1, 2] and out["checkpoints"][0].endswith("step6")
    folders_sorted = [str(f) for f in folders]
    out = checkpoint_drift(folders_sorted, optimizer_kind="sgd", figure=tmp_path / "drift.png")
    for rec, k in zip(out["records"], (0, 3, 6)):
        for key in ("eps/attn.vo", "eps/mlp.gated", "control/norm.W_V"):
            assert rec[key] == pytest.approx(records[k][key], rel=1e-9, abs=1e-15)
    s = out["summary"]
    assert {v["verdict"] for v in s["verdicts"]} == {"held"} and "as expected" in s["line"]
    assert (tmp_path / "drift.png").stat().st_size > 0
    rc = main(["conserve", "drift", *folders_sorted, "--optimizer", "sgd", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert rc == 0 and payload["summary"]["line"] == s["line"]
    assert main(["conserve", "drift", *folders_sorted]) == 0
    text = capsys.readouterr().out
    assert "attn.vo" in text and "held" in text and "step0" in text


def test_trainer_checkpoints_sorted_by_step_and_optimizer_read_from_the_callback(tmp_path, tiny_llama, capsys):
    from transformers import Trainer, TrainingArguments

    from flowgeom.integrations import ConservationCallback

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=4, optim="adamw_torch",
                             learning_rate=1e-3, save_strategy="steps", save_steps=4, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0)
    Trainer(model=tiny_llama(), args=args, train_dataset=TokenData(), callbacks=[ConservationCallback(every=4)]).train()
    paths = sorted(str(p) for p in tmp_path.glob("checkpoint-*"))  # the shell's order: checkpoint-12 first
    assert paths[0].endswith("checkpoint-12")
    out = checkpoint_drift(paths)
    assert out["steps"] == [4, 8, 12]
    assert out["summary"]["optimizer"]["kind"] == "adam"  # from flowgeom_monitor.safetensors
    assert all(v["verdict"] == "broken" for v in out["summary"]["verdicts"])
    assert "as expected" in out["summary"]["line"]


def test_bare_safetensors_need_a_config(tmp_path, tiny_llama):
    folders, records = _sgd_series(tmp_path, tiny_llama(), steps=(0, 4))
    files = []
    for f in folders:
        dst = tmp_path / "bare" / f"{f.name}.safetensors"
        dst.parent.mkdir(exist_ok=True)
        shutil.copy(f / "model.safetensors", dst)
        files.append(str(dst))
    with pytest.raises(FlowgeomError, match="--config"):
        checkpoint_drift(files)
    out = checkpoint_drift(files, config=folders[0] / "config.json")
    assert out["records"][1]["eps/attn.vo"] == pytest.approx(records[4]["eps/attn.vo"], rel=1e-9)


def test_sharded_checkpoints_and_only_law_tensors_read(tmp_path, tiny_llama):
    model = tiny_llama()
    folders, records = _sgd_series(tmp_path, model, steps=(0, 2))
    sharded = tmp_path / "sharded"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(folders[1]).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    out = checkpoint_drift([folders[0], sharded])
    assert out["records"][1]["eps/attn.vo"] == pytest.approx(records[2]["eps/attn.vo"], rel=1e-9)
    # a later checkpoint's other tensors are checked by shape only, never loaded: NaN embeddings do not matter
    from safetensors.torch import load_file, save_file

    state = load_file(str(folders[1] / "model.safetensors"))
    state["model.embed_tokens.weight"] = torch.full_like(state["model.embed_tokens.weight"], float("nan"))
    save_file(state, str(folders[1] / "model.safetensors"), metadata={"format": "pt"})
    again = checkpoint_drift(folders)
    assert again["records"][1]["eps/attn.vo"] == pytest.approx(records[2]["eps/attn.vo"], rel=1e-9)


def test_bad_series_are_one_clear_error_and_exit_2(tmp_path, tiny_llama, capsys):
    folders, _ = _sgd_series(tmp_path, tiny_llama(), steps=(0, 1))
    other = tmp_path / "wider"
    tiny_llama(intermediate_size=48).save_pretrained(other)
    with pytest.raises(FlowgeomError, match="shape .* series must be one model"):
        checkpoint_drift([folders[0], other])
    from flowgeom.hf.tiny import tiny_model

    qwen = tmp_path / "qwen"
    tiny_model("qwen2", seed=0, dtype=torch.float32).save_pretrained(qwen)
    with pytest.raises(FlowgeomError, match="one model family"):
        checkpoint_drift([folders[0], qwen])
    with pytest.raises(FlowgeomError, match="at least 2"):
        checkpoint_drift([folders[0]])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FlowgeomError, match="no model.safetensors"):
        checkpoint_drift([folders[0], empty])
    truncated = tmp_path / "trunc"
    shutil.copytree(folders[1], truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(FlowgeomError, match="not a readable safetensors"):
        checkpoint_drift([folders[0], truncated])
    for argv in (["conserve", "drift", str(folders[0]), str(other)],
                 ["conserve", "drift", str(folders[0]), "--threshold", "2"],
                 ["conserve", "drift", str(folders[0]), str(tmp_path / "nope")],
                 ["conserve", "drift", str(folders[0]), str(folders[1]), "--figure", str(tmp_path / "f.txt")]):
        with pytest.raises(SystemExit) as exc:
            raise SystemExit(main(argv))
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err and err[-1].startswith(("flowgeom", "usage")) and "Traceback" not in "\n".join(err)


def test_a_trainer_output_folder_points_to_its_checkpoint_folders(tmp_path, tiny_llama, capsys):
    out = tmp_path / "out"
    model = tiny_llama()
    for step in (10, 5, 15):  # checkpoint-10 sorts before checkpoint-5 in the shell: listed by step
        model.save_pretrained(out / f"checkpoint-{step}")
    (out / "runs").mkdir()  # TensorBoard logs beside them are not checkpoints
    capsys.readouterr()  # transformers' save progress
    expected = "(checkpoint-5, checkpoint-10, checkpoint-15), e.g. flowgeom conserve drift"
    for argv in (["conserve", "drift", str(out)], ["conserve", "drift", str(out), str(out / "checkpoint-5")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err and str(out / "checkpoint-*") in err, err
        assert ".bin" not in err
    model.save_pretrained(out)  # trainer.save_model() put the final weights into the output folder too
    capsys.readouterr()
    assert main(["conserve", "drift", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-10", "checkpoint-15", "checkpoint-5", "config.json",
                                                     "generation_config.json", "model.safetensors", "runs"]


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["conserve", "drift", "--help"])
    assert exc.value.code == 0
    assert "example:" in capsys.readouterr().out


def test_conserve_run_gives_a_verdict_and_the_expected_behaviour(tmp_path, capsys):
    rc = main(["conserve", "run", "--quick", "--arch", "mha-rope-swiglu", "--steps", "4", "--lr", "0.01", "--seeds",
               "1", "--regime", "sgd", "--optimizer", "adam", "--out", str(tmp_path), "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert rc == 0 and payload["verdict"]["optimizer"]["kind"] == "adam"
    (run,) = payload["runs"]
    assert {v["family"] for v in run["verdicts"]} == {k[4:] for k in run if k.startswith("eps/") and "@" not in k}
    assert all(v["verdict"] == "broken" for v in run["verdicts"]) and "as expected" in payload["verdict"]["line"]
