"""ConservationCallback in a real transformers.Trainer on a tiny random Llama (CPU, a few seconds)."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments  # noqa: E402

from flowgeom.errors import FlowgeomError  # noqa: E402
from flowgeom.integrations import ConservationCallback  # noqa: E402
from flowgeom.integrations.writers import read_csv  # noqa: E402

from integrations_data import TokenData  # noqa: E402


def _args(out, **kw):
    base = dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, optim="sgd", learning_rate=0.05,
                lr_scheduler_type="constant", logging_steps=2, save_strategy="no", report_to=[], use_cpu=True,
                disable_tqdm=True, dataloader_num_workers=0, seed=0, max_grad_norm=0.0)
    base.update(kw)
    return TrainingArguments(**base)


def _train(model, args, cb, **train_kw):
    trainer = Trainer(model=model, args=args, train_dataset=TokenData(), callbacks=[cb])
    trainer.train(**train_kw)
    return trainer


def test_sgd_holds_logs_reach_the_trainer_and_files_are_written(tmp_path, tiny_llama, capsys):
    model = tiny_llama()
    cb = ConservationCallback(every=1)
    trainer = _train(model, _args(tmp_path, learning_rate=0.001), cb)
    # it moved itself in front of the reporting callbacks, so they see its values
    assert trainer.callback_handler.callbacks[0] is cb
    # Trainer(optim="sgd") hands out accelerate's AcceleratedOptimizer: seen through as plain SGD
    assert cb.session.info.name == "SGD" and cb.session.info.kind == "sgd"
    s = cb.summary
    assert s["optimizer"]["expected"] == "held"
    assert {v["verdict"] for v in s["verdicts"]} == {"held"}, s["line"]
    assert "as expected" in s["line"] and s["line"] in capsys.readouterr().err
    # the per-family values reached the Trainer's logs at each logging step
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and not any("flowgeom/eps/attn.vo" in h for h in logged)  # log_history is copied before on_log
    out = tmp_path / "flowgeom"
    rows = read_csv(out / "metrics.csv")
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert any("@" in k for k in rows[6])  # per block in the CSV
    summary = json.loads((out / "summary.json").read_text())
    assert summary["line"] == s["line"]
    assert (out / "figures" / "conservation.png").stat().st_size > 0
    # the ratio is ε_law / ε_control of the same record
    last = cb.monitor.last
    v = next(v for v in s["verdicts"] if v["family"] == "attn.vo")
    assert v["eps"] == last["eps/attn.vo"] and math.isclose(last["ratio/attn.vo"], v["ratio"])


def test_values_reach_tensorboard_through_the_trainer(tmp_path, tiny_llama, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # transformers 5: no logging_dir argument
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = ConservationCallback(every=1)
    _train(tiny_llama(), _args(tmp_path, report_to=["tensorboard"]), cb)
    runs = [d for d, _, files in os.walk(tmp_path / "tb") if any(f.startswith("events.out") for f in files)]
    acc = EventAccumulator(runs[0])
    acc.Reload()
    tags = acc.Tags()["scalars"]
    ours = [t for t in tags if "flowgeom/" in t]
    assert any(t.endswith("flowgeom/eps/attn.vo") for t in ours), tags
    assert any(t.endswith("flowgeom/ratio/mlp.gated") for t in ours)
    ev = acc.Scalars(next(t for t in ours if t.endswith("flowgeom/eps/attn.vo")))
    assert [e.step for e in ev] == [2, 4, 6]
    assert ev[-1].value == pytest.approx(cb.session.history[-1]["eps/attn.vo"], rel=1e-6)


def test_values_reach_an_offline_wandb_run_through_the_trainer(tmp_path, tiny_llama, monkeypatch):
    pytest.importorskip("wandb")
    from wandb_offline import read_history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cb = ConservationCallback(every=1)
    _train(tiny_llama(), _args(tmp_path, report_to=["wandb"], run_name="fg"), cb)
    import wandb

    wandb.finish()  # the Trainer leaves its run open until the process exits
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = [r for r in read_history(run_dir) if "train/flowgeom/eps/attn.vo" in r]
    assert [r["train/global_step"] for r in rows] == [2, 4, 6]
    assert rows[-1]["train/flowgeom/eps/attn.vo"] == pytest.approx(cb.session.history[-1]["eps/attn.vo"], rel=1e-9)


def test_adamw_breaks_as_expected(tmp_path, tiny_llama):
    cb = ConservationCallback(every=3)
    _train(tiny_llama(), _args(tmp_path, optim="adamw_torch", learning_rate=1e-3), cb)
    s = cb.summary
    assert s["optimizer"]["kind"] == "adam" and s["optimizer"]["expected"] == "broken"
    assert all(v["verdict"] == "broken" for v in s["verdicts"]), s["line"]
    assert "as expected" in s["line"]
    assert cb.session.predictor is None  # no modified equation for Adam


def test_momentum_verdict_cites_marcotte_and_prediction_agrees(tmp_path, tiny_llama):
    cb = ConservationCallback(every=2)
    args = _args(tmp_path, optim_args="momentum=0.9", weight_decay=0.1, learning_rate=0.02, max_steps=10)
    _train(tiny_llama(), args, cb)
    s = cb.summary
    assert s["optimizer"]["kind"] == "momentum"
    assert "Marcotte" in s["line"] and "Kunin" in s["line"]
    errs = s["prediction"]["pred_err"]
    assert set(errs) >= {"attn.vo", "mlp.gated"}
    assert max(errs.values()) < 0.2, errs  # predicted vs measured drift within 20% of the drift


@pytest.mark.filterwarnings("ignore:ConservationCallback could not move")  # on_train_begin called directly below
def test_resume_keeps_theta0_and_refuses_another_model(tmp_path, tiny_llama):
    args = _args(tmp_path, max_steps=6, save_strategy="steps", save_steps=3, optim_args="momentum=0.9",
                 learning_rate=0.01)
    cb = ConservationCallback(every=1)
    _train(tiny_llama(), args, cb)
    full = cb.session.history[-1]
    assert (tmp_path / "checkpoint-3" / "flowgeom_monitor.safetensors").is_file()
    # resume from step 3: θ_0 comes from the checkpoint, so step 6 reads the same ε as the unbroken run
    cb2 = ConservationCallback(every=1)
    _train(tiny_llama(), args, cb2, resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert cb2.session.history[-1]["step"] == 6
    assert cb2.session.history[-1]["eps/attn.vo"] == pytest.approx(full["eps/attn.vo"], rel=1e-4)
    # the predicted drift continued from its saved state (h, ḣ), not from a new start
    assert cb2.session.predictor.steps == 6
    assert cb2.session.history[-1]["pred/attn.vo"] == pytest.approx(full["pred/attn.vo"], rel=1e-4)
    assert cb2.session.history[0]["step"] == 1  # the history before the checkpoint came back too
    # a checkpoint of another model (different shapes) is refused, not silently re-based
    other = tiny_llama(intermediate_size=48)
    from transformers import TrainerControl, TrainerState

    state = TrainerState()
    state.global_step = 3  # what the Trainer sets when resuming from checkpoint-3
    with pytest.raises(FlowgeomError, match="another model"):
        ConservationCallback(every=1).on_train_begin(args, state, TrainerControl(), model=other,
                                                     optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    # a checkpoint moved elsewhere is found through resume_from=
    moved = tmp_path / "moved" / "checkpoint-3"
    shutil.copytree(tmp_path / "checkpoint-3", moved)
    (tmp_path / "checkpoint-3" / "flowgeom_monitor.safetensors").unlink()
    cb4 = ConservationCallback(every=1, resume_from=moved)
    _train(tiny_llama(), _args(tmp_path / "other_out", max_steps=6, optim_args="momentum=0.9", learning_rate=0.01),
           cb4, resume_from_checkpoint=str(moved))
    assert torch.equal(cb4.monitor.h0, cb2.monitor.h0)


@pytest.mark.filterwarnings("ignore:ConservationCallback could not move")  # hooks called directly, no Trainer
def test_bad_inputs_are_one_clear_error(tmp_path, tiny_llama):
    with pytest.raises(FlowgeomError, match="every"):
        ConservationCallback(every=0)
    cb = ConservationCallback()
    args = _args(tmp_path)
    from transformers import TrainerControl, TrainerState

    with pytest.raises(FlowgeomError, match="no conservation law"):
        cb.on_train_begin(args, TrainerState(), TrainerControl(), model=torch.nn.Linear(3, 3),
                          optimizer=torch.optim.SGD(torch.nn.Linear(3, 3).parameters(), lr=0.1))
    model = tiny_llama()
    with pytest.raises(FlowgeomError, match="cannot see the optimiser"):
        cb.on_train_begin(args, TrainerState(), TrainerControl(), model=model, optimizer=object())
    with pytest.raises(FlowgeomError, match="trains none"):
        cb.on_train_begin(args, TrainerState(), TrainerControl(), model=model,
                          optimizer=torch.optim.SGD(torch.nn.Linear(3, 3).parameters(), lr=0.1))
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(FlowgeomError, match="cannot be written"):
        ConservationCallback(out=str(blocked / "sub")).on_train_begin(
            args, TrainerState(), TrainerControl(), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    # a resumed run whose checkpoint has no monitor state is refused (rebase=True accepts a new θ_0)
    state = TrainerState()
    state.global_step = 3
    with pytest.raises(FlowgeomError, match="rebase=True"):
        cb.on_train_begin(args, state, TrainerControl(), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ok = ConservationCallback(rebase=True)
    from flowgeom.laws.locate import FlowgeomWarning

    with pytest.warns(FlowgeomWarning, match="could not move ahead"):  # not called by a Trainer: said, not silent
        ok.on_train_begin(args, state, TrainerControl(), model=model,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert ok.monitor is not None
