"""The Darcy protocol on a tiny config: completes, resumes exactly, survives a blown-up chain, validates."""

from __future__ import annotations

import json

import pytest
import torch

from flowgeom.cli import main
from flowgeom.errors import FlowgeomError
from flowgeom.experiments.darcy import DarcyConfig, run
from flowgeom.runs import RunFolder

TINY = DarcyConfig(n_train=64, n_test=16, d_model=8, d_k=4, d_mlp=8, batch_size=16, pretrain_steps=30, steps=40,
                   lr=0.05, temperature=1e-3, log_every=10, checkpoint_every=10)


def test_tiny_run_completes(tmp_path):
    summary = run(TINY, tmp_path / "a")
    assert set(summary["arms"]) == {"none", "log", "power"}
    assert all(arm["status"] == "ok" for arm in summary["arms"].values())
    for key in ("test_rmse", "test_rel_l2", "gap", "wq_norm", "wk_norm"):
        assert all(key in arm for arm in summary["arms"].values())
    assert summary["pretrain"]["test_rmse"] < 0.5  # data std is 0.34: the pretrained model learned something
    ticks = [m["tick"] for m in RunFolder(tmp_path / "a").metrics()]
    assert ticks == sorted(ticks) and len(ticks) == len(set(ticks))
    for name in ("darcy_norms.png", "darcy_errors.png"):
        assert (tmp_path / "a" / "figures" / name).stat().st_size > 1000
    assert run(TINY, tmp_path / "a", resume=True) == summary  # a finished run is not redone


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("ref") / "run"
    return run(TINY, path), RunFolder(path).metrics()


@pytest.mark.parametrize("stop", [17, 31 + 25, 31 + 41 + 3])  # pretraining, first arm, second arm
def test_resume_after_kill_is_exact(tmp_path, stop, reference):
    assert run(TINY, tmp_path / "b", stop_after=stop) == {}
    assert not RunFolder(tmp_path / "b").finished
    resumed = run(TINY, tmp_path / "b", resume=True)
    assert RunFolder(tmp_path / "b").metrics() == reference[1]
    assert resumed == reference[0]


def test_resume_refuses_other_config(tmp_path):
    run(TINY, tmp_path / "c", stop_after=5)
    with pytest.raises(FlowgeomError, match="differs"):
        run(DarcyConfig(**{**TINY.__dict__, "lam": 0.5}), tmp_path / "c", resume=True)
    with pytest.raises(FlowgeomError, match="--resume"):
        run(TINY, tmp_path / "c")


def test_blow_up_is_reported_and_metrics_kept(tmp_path):
    cfg = DarcyConfig(**{**TINY.__dict__, "lr": 1e20, "temperature": 1e20, "regs": ("none", "power")})
    summary = run(cfg, tmp_path / "d")
    assert summary["arms"]["none"]["status"] == "diverged"
    assert "blew up" in summary["arms"]["none"]["message"] or "loss became" in summary["arms"]["none"]["message"]
    events = [m for m in RunFolder(tmp_path / "d").metrics() if m.get("event") == "blew_up"]
    assert events and events[0]["reg"] == "none"
    assert any(m.get("reg") == "none" and "test_rmse" in m for m in RunFolder(tmp_path / "d").metrics())


@pytest.mark.parametrize("bad", [dict(lam=0.0), dict(eps=-1.0), dict(temperature=-1.0), dict(lr=0.0),
                                 dict(regs=("bogus",)), dict(data="mnist"), dict(resolution=32), dict(patch=3)])
def test_bad_config(bad):
    with pytest.raises(FlowgeomError):
        DarcyConfig(**{**TINY.__dict__, **bad})
        if "patch" in bad:  # the model checks divisibility
            run(DarcyConfig(**{**TINY.__dict__, **bad}), "/nonexistent")


def test_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse usage error: exit 2, before anything is written
        main(["langevin", "darcy", "--out", str(tmp_path / "e"), "--lam", "-1"])
    assert exc.value.code == 2 and "--lam" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
    assert main(["langevin", "villani", "--loss", "norm1", "--json", "--points", "6", "--rays", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"] == "fails"
    code = main(["langevin", "darcy", "--out", str(tmp_path / "f"), "--steps", "20", "--pretrain-steps", "20",
                 "--regs", "none,log", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["arms"]) == {"none", "log"}
