"""ConservationLightningCallback in a real Lightning Trainer around a tiny transformers Llama (CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

from flowgeom.errors import FlowgeomError  # noqa: E402
from flowgeom.integrations import ConservationLightningCallback  # noqa: E402
from flowgeom.integrations.writers import read_csv  # noqa: E402
from integrations_data import TokenData  # noqa: E402


class LitLM(L.LightningModule):
    def __init__(self, model, opt="sgd", lr=0.001, momentum=0.0):
        super().__init__()
        self.model, self.opt, self.lr, self.momentum = model, opt, lr, momentum

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        if self.opt == "adam":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def _fit(tmp_path, module, cb, *, steps=6, ckpt_path=None, loggers=False, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=[cb], logger=loggers,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                            enable_checkpointing=False, log_every_n_steps=1, **kw)
        loader = torch.utils.data.DataLoader(TokenData(), batch_size=4)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def test_sgd_held_logged_to_tensorboard_and_files(tmp_path, tiny_llama):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = ConservationLightningCallback(every=2)
    tb = TensorBoardLogger(str(tmp_path / "tb"), name="run")
    _fit(tmp_path, LitLM(tiny_llama()), cb, loggers=[tb])
    s = cb.summary
    assert s["optimizer"]["kind"] == "sgd" and {v["verdict"] for v in s["verdicts"]} == {"held"}, s["line"]
    acc = EventAccumulator(tb.log_dir)
    acc.Reload()
    ev = acc.Scalars("flowgeom/eps/attn.vo")
    assert [e.step for e in ev] == [2, 4, 6]
    assert ev[-1].value == pytest.approx(cb.session.history[-1]["eps/attn.vo"], rel=1e-6)
    assert sorted(read_csv(tmp_path / "flowgeom" / "metrics.csv")) == [2, 4, 6]
    assert (tmp_path / "flowgeom" / "summary.json").is_file()


def test_gradient_accumulation_measures_once_per_optimiser_step(tmp_path, tiny_llama):
    cb = ConservationLightningCallback(every=2)
    _fit(tmp_path, LitLM(tiny_llama(), lr=0.01, momentum=0.9), cb, steps=6, accumulate_grad_batches=2)
    assert [h["step"] for h in cb.session.history] == [2, 4, 6]
    assert cb.session.predictor.steps == 6  # one predictor step per optimiser step, not per batch
    assert "pred/attn.vo" in cb.session.history[-1]


def test_adamw_broken_and_state_dict_resume(tmp_path, tiny_llama):
    cb = ConservationLightningCallback(every=1)
    trainer = _fit(tmp_path, LitLM(tiny_llama(), opt="adam"), cb, steps=3)
    assert all(v["verdict"] == "broken" for v in cb.summary["verdicts"])
    ckpt = tmp_path / "c.ckpt"
    trainer.save_checkpoint(ckpt)
    # resume: θ_0 and the history come from the checkpoint (the resumed weights are θ_3, not θ_0)
    again = ConservationLightningCallback(every=1)
    _fit(tmp_path / "r", LitLM(tiny_llama(), opt="adam"), again, steps=6, ckpt_path=str(ckpt))
    assert [h["step"] for h in again.session.history] == [1, 2, 3, 4, 5, 6]
    assert torch.equal(again.monitor.h0, cb.monitor.h0)
    assert again.session.history[2] == cb.session.history[2]
    assert again.session.history[-1]["eps/attn.vo"] > cb.session.history[-1]["eps/attn.vo"] > 0


class _FakeTrainer:
    def __init__(self, root, optimizer, step=0):
        self.default_root_dir, self.optimizers, self.global_step = str(root), [optimizer], step


def test_foreign_or_missing_state_is_refused(tmp_path, tiny_llama):
    model = LitLM(tiny_llama())
    cb = ConservationLightningCallback(every=1)
    cb.on_fit_start(_FakeTrainer(tmp_path / "a", torch.optim.SGD(model.parameters(), lr=0.1)), model)
    saved = cb.state_dict()
    other = LitLM(tiny_llama(intermediate_size=48))
    refuse = ConservationLightningCallback(every=1)
    refuse.load_state_dict(saved)
    with pytest.raises(FlowgeomError, match="another model"):
        refuse.on_fit_start(_FakeTrainer(tmp_path / "b", torch.optim.SGD(other.parameters(), lr=0.1)), other)
    # a resumed run (global_step > 0) whose checkpoint holds no monitor state: refused unless rebase=True
    fresh = ConservationLightningCallback(every=1)
    trainer = _FakeTrainer(tmp_path / "c", torch.optim.SGD(model.parameters(), lr=0.1), step=3)
    fresh.on_fit_start(trainer, model)
    with pytest.raises(FlowgeomError, match="rebase=True"):
        fresh.on_train_start(trainer, model)
    two = _FakeTrainer(tmp_path / "d", torch.optim.SGD(model.parameters(), lr=0.1))
    two.optimizers.append(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(FlowgeomError, match="2 optimisers"):
        ConservationLightningCallback().on_fit_start(two, model)
