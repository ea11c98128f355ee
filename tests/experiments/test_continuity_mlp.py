"""Residual-MLP continuity runs: resume equality, NaN stop, seeds, ablation table (tiny configs)."""

import json
import math

import pytest
import torch

from flowgeom.errors import FlowgeomError
from flowgeom.experiments.continuity_loop import make_optimizer, train_tracked
from flowgeom.experiments.continuity_mlp import (CORE, VARIANTS, format_ablation, run_ablation, summarise_run,
                                                 train_mlp, variant_config)
from flowgeom.runs import RunFolder

TINY = dict(width=16, depth=3, steps=6, batch=16, log_every=2, ckpt_every=3, train_limit=256, test_limit=128)


@pytest.fixture(scope="module")
def data():
    """Real MNIST, loaded once for the module (the run configs below use the same limits)."""
    from flowgeom.experiments.continuity_mlp import _mnist

    dev = torch.device("cpu")
    return _mnist("train", TINY["train_limit"], None, dev), _mnist("test", TINY["test_limit"], None, dev)


def lines(folder):
    return (folder / "metrics.jsonl").read_text().splitlines()


def test_resume_after_kill_reproduces_the_uninterrupted_run(tmp_path, data):
    cfg = variant_config("Res+ReLU", **TINY)
    full = train_mlp(cfg, tmp_path / "full", data=data)
    assert full["status"] == "finished"
    assert train_mlp(cfg, tmp_path / "cut", stop_after=5, data=data) is None  # "killed" after 5 updates, checkpoint at 3
    assert not RunFolder(tmp_path / "cut").finished
    assert len(lines(tmp_path / "cut")) == 3  # steps 0, 2, 4 logged; 4 is after the checkpoint
    resumed = train_mlp(cfg, tmp_path / "cut", resume=True, data=data)
    assert lines(tmp_path / "cut") == lines(tmp_path / "full")
    assert resumed["eval"] == full["eval"]
    assert train_mlp(cfg, tmp_path / "cut", resume=True, data=data) == resumed  # finished: not retrained
    with pytest.raises(FlowgeomError, match="--resume"):
        train_mlp(cfg, tmp_path / "full", data=data)


def test_same_seed_same_numbers_other_seed_other_numbers(tmp_path, data):
    cfg = variant_config("Res+None", **TINY)
    train_mlp(cfg, tmp_path / "a", data=data)
    train_mlp(cfg, tmp_path / "b", data=data)
    train_mlp(variant_config("Res+None", **{**TINY, "seed": 1}), tmp_path / "c", data=data)
    assert lines(tmp_path / "a") == lines(tmp_path / "b")
    assert lines(tmp_path / "a") != lines(tmp_path / "c")


def test_nan_stop_keeps_metrics(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
    calls = {"n": 0}

    def loss_fn(m, batch):
        calls["n"] += 1
        loss = m(batch[0]).square().mean()
        return loss * math.nan if calls["n"] == 4 else loss

    run = RunFolder(tmp_path / "nan")
    summary = train_tracked(run, config={"x": 1}, model=model, optimizer=make_optimizer("sgd", model.parameters(), lr=0.1),
                            next_batch=lambda g: (torch.randn(4, 3, generator=g),), loss_fn=loss_fn,
                            roles={"w": [model[0].weight, model[1].weight]}, steps=10, log_every=1, ckpt_every=5, seed=0)
    assert summary["status"] == "nan" and summary["step"] == 3
    assert "lower the learning rate" in summary["message"]
    recs = run.metrics()
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    assert all("continuity" in r for r in recs[:3]) and recs[3]["loss"] is None  # NaN is written as null
    assert run.summary()["status"] == "nan"


def test_diverging_mlp_stops_with_nan_status(tmp_path, data):
    cfg = variant_config("Res+None", **{**TINY, "optimizer": "sgd", "lr": 1e12, "steps": 12})
    summary = train_mlp(cfg, tmp_path / "div", data=data)
    assert summary["status"] == "nan"
    assert len(RunFolder(tmp_path / "div").metrics()) >= 2


def test_ablation_rows_and_table(tmp_path):
    rows = run_ablation(tmp_path, variants=("NoRes", "Res+Radial"), **TINY)
    assert [r["variant"] for r in rows] == ["NoRes", "Res+Radial"]
    for row in rows:
        assert row["status"] == "finished"
        assert 0 <= row["w_v1"] <= 1 and 0 <= row["g_v1"] <= 1 and 0 <= row["acc"] <= 1
        assert row["baseline"] == pytest.approx(0.2, abs=0.05)  # E|cos| in 16-D ≈ 0.2
    text = format_ablation(rows)
    assert "NoRes" in text and "~0.05 (chance)" in text
    cfg = json.loads((tmp_path / "nores" / "config.json").read_text())
    assert cfg["residual"] is False and cfg["activation"] == "relu"
    assert summarise_run(RunFolder(tmp_path / "nores")) == rows[0]


def test_variants_and_errors():
    assert set(CORE) <= set(VARIANTS)
    assert variant_config("Res+ReLU Adam-b2=0").optimizer == "adam_b2_0"
    assert variant_config("Res+ReLU init0.5").init_scale == 0.5
    assert variant_config("Res+ReLU+LN", preset="full").train_limit is None
    with pytest.raises(FlowgeomError, match="unknown variant"):
        variant_config("Res+Tanh")
    with pytest.raises(FlowgeomError, match="unknown preset"):
        variant_config("NoRes", preset="huge")
    with pytest.raises(FlowgeomError, match="unknown MLP run option"):
        variant_config("NoRes", widht=3)
    with pytest.raises(FlowgeomError, match="depth"):
        variant_config("NoRes", depth=1)
    with pytest.raises(FlowgeomError, match="unknown optimizer"):
        make_optimizer("lbfgs", [torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def test_adam_beta2_zero_steps_are_sign_like():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = make_optimizer("adam_b2_0", [p], lr=0.1)
    p.grad = torch.tensor([1e-3, -5.0, 2.0])
    opt.step()
    assert torch.allclose(p.detach(), torch.tensor([-0.1, 0.1, -0.1]), atol=1e-4)


@pytest.mark.slow
def test_quick_demo_contract(tmp_path):
    from flowgeom.experiments.continuity_mlp import quick_demo

    small = {k: TINY[k] for k in ("width", "depth", "train_limit", "test_limit", "batch")}
    result = quick_demo(tmp_path, steps=2, log_every=1, **small)
    assert [r["variant"] for r in result["rows"]] == list(CORE)
    assert (tmp_path / "continuity_ablation.png").stat().st_size > 1000
    assert "Res+Radial" in result["table"] and result["seed_claims"]["NoRes"]
