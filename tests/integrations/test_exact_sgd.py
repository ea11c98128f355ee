"""The exact plain-SGD prediction on real transformers models: plain loops, the HF Trainer, Lightning (float64)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")
from flowgeom.hf.tiny import tiny_model  # noqa: E402
from flowgeom.laws.monitor import ConservationMonitor  # noqa: E402
from integrations_data import TokenData  # noqa: E402


def _quadratic(mon):
    return sorted({t.family for t in mon.items if t.kind == "eps" and t.law.degree == 2})


def _check_exact(rec, families, *, rel=1e-6):
    for fam in families:
        assert rec[f"eps/{fam}"] > 0, (fam, rec)
        assert rec[f"pred_err/{fam}"] < rel, (fam, rec)  # ‖h − ĥ‖ / ‖h − h_0‖
        assert rec[f"pred/{fam}"] == pytest.approx(rec[f"eps/{fam}"], rel=rel)


def _model(family):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tiny_model(family, seed=0, dtype=torch.float64)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_two_hf_families_in_a_plain_loop(family):
    model = _model(family)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = ConservationMonitor(model, optimizer=opt, warn=False)
    data = TokenData()
    for k in range(20):
        batch = data[slice(4 * k % 64, 4 * k % 64 + 4)]
        model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the step uses the clipped gradient
        opt.step()
        opt.zero_grad(set_to_none=True)
    rec = mon.step(20)
    fams = _quadratic(mon)
    assert {"attn.vo"} <= set(fams) and len(fams) >= 2, fams
    _check_exact(rec, fams)
    assert "as expected (discretisation drift" in mon.summary()["line"]


def test_trainer_float64_gpt2_with_clipping_and_a_schedule(tmp_path):
    """The issue's run in float64: Trainer(optim="sgd"), linear decay of lr, max_grad_norm=1 (clipping active)."""
    from transformers import Trainer, TrainingArguments

    from flowgeom.integrations import ConservationCallback

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=20, per_device_train_batch_size=4, optim="sgd",
                             learning_rate=1e-2, max_grad_norm=1.0, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, seed=0, logging_steps=1)
    cb = ConservationCallback(every=5)
    trainer = Trainer(model=_model("gpt2"), args=args, train_dataset=TokenData(n=128), callbacks=[cb])
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert max(norms) > 1.0 and len(set(lrs)) > 1  # clipped steps and a changing τ: both must be in the prediction
    last = cb.session.monitor.last
    _check_exact(last, _quadratic(cb.session.monitor))
    s = cb.summary
    assert s["prediction"]["steps"] == 20 and "as expected (discretisation drift" in s["line"]


def test_lightning_clips_after_its_hook_and_the_prediction_still_uses_the_clipped_gradient(tmp_path):
    """Lightning clips after on_before_optimizer_step: the monitor reads the gradient from the optimiser's own step."""
    L = pytest.importorskip("lightning")
    from flowgeom.integrations import ConservationLightningCallback

    class Lit(L.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    cb = ConservationLightningCallback(every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=1, callbacks=[cb], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                            enable_checkpointing=False, gradient_clip_val=0.1)  # every gradient is clipped
        lit = Lit(_model("llama"))
        trainer.fit(lit, torch.utils.data.DataLoader(TokenData(), batch_size=4))
    _check_exact(cb.session.monitor.last, _quadratic(cb.session.monitor))
    # the last step's gradient is still there, clipped to 0.1; an unclipped one is far larger
    params = [p for p in lit.parameters() if p.grad is not None]
    assert float(torch.nn.utils.get_total_norm([p.grad for p in params])) == pytest.approx(0.1, rel=1e-6)
    lit.zero_grad()
    batch = TokenData()[0:4]
    lit.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    assert float(torch.nn.utils.get_total_norm([p.grad for p in params])) > 1.0


def test_a_trainer_resume_continues_the_prediction(tmp_path):
    """12 steps in one go, and 6 + a resume from checkpoint-6: the same prediction, still exact."""
    from transformers import Trainer, TrainingArguments

    from flowgeom.integrations import ConservationCallback

    def run(out, **train_kw):
        args = TrainingArguments(output_dir=str(out), max_steps=12, per_device_train_batch_size=4, optim="sgd",
                                 learning_rate=1e-2, save_steps=6, report_to=[], use_cpu=True, disable_tqdm=True,
                                 dataloader_num_workers=0, seed=0)
        cb = ConservationCallback(every=6)
        Trainer(model=_model("gpt2"), args=args, train_dataset=TokenData(n=128), callbacks=[cb]).train(**train_kw)
        return cb

    whole = run(tmp_path)
    resumed = run(tmp_path, resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    a, b = whole.session.monitor.last, resumed.session.monitor.last
    assert resumed.session.monitor.prediction.steps == 12
    _check_exact(b, ["attn.vo"])  # (the Q/K law barely moves in 12 steps: its drift is near float64 round-off)
    assert all(b[f"pred_excess/{f}"] < 1 for f in _quadratic(resumed.session.monitor))
    assert b["pred/attn.vo"] == pytest.approx(a["pred/attn.vo"], rel=1e-9)
    assert b["eps/attn.vo"] == pytest.approx(a["eps/attn.vo"], rel=1e-9)
