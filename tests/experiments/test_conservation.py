"""Drift runs: tiny configs on real KJV text and MNIST; resume, divergence, grid, CLI."""

import json
import re

import pytest


from flowgeom.cli import main
from flowgeom.errors import FlowgeomError
from flowgeom.experiments.conservation import ARCHS, ConservationConfig, run_conservation
from flowgeom.experiments.conservation_grid import run_grid
from flowgeom.runs import RunFolder

TINY = dict(d_model=8, heads=2, d_k=4, d_hidden=8, n_layers=1, seq_len=8, batch=4, corpus_chars=5000, n_train=64,
            patch=14, experts=2, steps=12, log_every=2, checkpoint_every=4)


@pytest.mark.parametrize("arch", ["mha-sinusoidal-swiglu", "moe-top2-sigmoid", "vit"])
def test_run_writes_metrics_summary_and_figure(tmp_path, arch):
    cfg = ConservationConfig.for_arch(arch, **TINY, lr=0.1)
    summary = run_conservation(cfg, tmp_path / "r")
    run = RunFolder(tmp_path / "r")
    steps = [m["step"] for m in run.metrics()]
    assert steps == list(range(0, 13, 2)) and run.finished
    first, last = run.metrics()[0], run.metrics()[-1]
    assert all(v == 0.0 for k, v in first.items() if k.startswith(("eps/", "control/")))
    assert all(0 < last[k] < 1 for k in summary["families"]) and summary["controls"]
    assert ("refuted/moe.router_sum" in summary["refuted"]) == (arch == "moe-top2-sigmoid")
    assert (tmp_path / "r" / "figures" / "drift.png").stat().st_size > 1000


@pytest.mark.filterwarnings("ignore:flowgeom. conservation laws hold:UserWarning")  # the killed and resumed runs warn too
def test_resume_after_kill_gives_identical_metrics(tmp_path):
    # the plain-GD warning is once per monitor: each run warns, whatever ran before in this process
    cfg = ConservationConfig.for_arch("moe-top2-softmax", **TINY, lr=0.1, optimizer="momentum", weight_decay=0.01)
    with pytest.warns(UserWarning, match="plain gradient descent"):
        ref = run_conservation(cfg, tmp_path / "a")
    assert run_conservation(cfg, tmp_path / "b", stop_after=7) is None  # killed after step 7 (checkpoint at 4)
    killed = RunFolder(tmp_path / "b")
    assert not killed.finished and max(m["step"] for m in killed.metrics()) == 6
    with pytest.raises(FlowgeomError, match="--resume"):
        run_conservation(cfg, tmp_path / "b")
    resumed = run_conservation(cfg, tmp_path / "b", resume=True)
    assert RunFolder(tmp_path / "a").metrics() == killed.metrics()  # exact equality, every key
    assert resumed["final"] == ref["final"] and any(k.startswith("wd/") for k in ref["final"])


def test_metrics_records_carry_the_monitors_flags(tmp_path, monkeypatch):
    """What ConservationMonitor.step adds to every record (zero_baseline, low_precision) reaches metrics.jsonl."""
    import torch

    from flowgeom.experiments import conservation
    from flowgeom.laws import monitor

    monkeypatch.setattr(monitor, "ZERO_BASELINE", float("inf"))  # every law counts as zero at θ_0
    monkeypatch.setitem(conservation.DTYPES, "bfloat16", torch.bfloat16)  # half-precision weights
    cfg = ConservationConfig.for_arch("mha-rope-swiglu", **TINY, lr=0.05, dtype="bfloat16", weight_decay=0.01)
    with pytest.warns(Warning):
        run_conservation(cfg, tmp_path / "r")
    metrics = RunFolder(tmp_path / "r").metrics()
    assert [m["step"] for m in metrics] == list(range(0, TINY["steps"] + 1, TINY["log_every"]))
    names = metrics[0]["zero_baseline"]
    assert names and all(n.startswith(("eps/", "control/")) for n in names)
    assert all(m["zero_baseline"] == names and m["low_precision"] == ["bfloat16"] for m in metrics)
    assert all(any(k.startswith("wd/eps/") for k in m) for m in metrics)  # the weight-decay monitor's ε, prefixed
    assert not any(k.startswith("wd/") and k[3:] in ("step", "zero_baseline", "low_precision") for k in metrics[0])


def test_divergence_stops_at_the_step_and_keeps_metrics(tmp_path):
    cfg = ConservationConfig.for_arch("mha-none-swiglu", **{**TINY, "log_every": 1}, lr=1e4)
    with pytest.raises(FlowgeomError, match=r"diverged at step (\d+)") as info:
        run_conservation(cfg, tmp_path / "r")
    step = int(re.search(r"step (\d+)", str(info.value)).group(1))
    metrics = RunFolder(tmp_path / "r").metrics()
    assert [m["step"] for m in metrics] == list(range(step + 1))
    assert metrics[-1]["diverged"] and all(m["loss"] == m["loss"] and abs(m["loss"]) < float("inf") for m in metrics[:-1])
    assert not RunFolder(tmp_path / "r").finished


def test_config_validation():
    with pytest.raises(FlowgeomError, match="optimizer"):
        ConservationConfig(optimizer="lbfgs")
    with pytest.raises(FlowgeomError, match="lr"):
        ConservationConfig(lr=float("nan"))
    with pytest.raises(FlowgeomError, match="architecture"):
        ConservationConfig.for_arch("gpt5")


def test_grid_folders_and_rows(tmp_path):
    rows = run_grid(ConservationConfig(**TINY, full_batch=True), tmp_path, archs=["mha-rope-swiglu"], lrs=[0.05, 0.1],
                    seeds=[0, 1])
    assert len(rows) == 4 and {r["seed"] for r in rows} == {0, 1}
    assert all((tmp_path / "mha-rope-swiglu" / f"lr={r['lr']:g}" / f"seed={r['seed']}" / "summary.json").exists() for r in rows)
    by_lr = {lr: [r["eps/swiglu.up_down"] for r in rows if r["lr"] == lr] for lr in (0.05, 0.1)}
    assert min(by_lr[0.1]) > max(by_lr[0.05])  # more drift with a larger step


def test_cli_run_json_and_divergence_exit(tmp_path, capsys):
    args = ["conserve", "run", "--arch", "mha-rope-swiglu", "--lr", "0.1", "--steps", "6", "--regime", "gd",
            "--out", str(tmp_path / "o"), "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"][0]["regime"] == "gd" and out["figures"]["gd"].endswith("drift_gd.png")
    assert main(args + ["--resume"]) == 0  # finished runs are reused
    capsys.readouterr()
    code = main(["conserve", "run", "--arch", "mha-none-swiglu", "--lr", "1e5", "--steps", "30", "--regime", "sgd",
                 "--out", str(tmp_path / "d"), "--json"])
    assert code == 2 and "diverged" in capsys.readouterr().err


def test_arch_help_lists_the_architectures(tmp_path, capsys):
    """``--help`` says "see `--arch help`": it lists every name and runs nothing."""
    assert main(["conserve", "run", "--arch", "help", "--out", str(tmp_path / "o")]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(ARCHS) and not (tmp_path / "o").exists()


def test_all_named_archs_build():
    assert set(ARCHS) >= {"mha-none-swiglu", "mha-sinusoidal-swiglu", "mha-rope-swiglu", "moe-dense-softmax",
                          "moe-top2-softmax", "moe-dense-sigmoid", "moe-top2-sigmoid", "vit"}


def test_vit_on_a_local_cifar_folder(tmp_path):
    import pickle

    import numpy as np

    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(tmp_path / name, "wb") as fh:
            pickle.dump({b"data": rng.integers(0, 256, (8, 3072), dtype=np.uint8), b"labels": [i % 10 for i in range(8)]}, fh)
    cfg = ConservationConfig.for_arch("vit", **{**TINY, "patch": 8}, data=str(tmp_path), lr=0.05)
    summary = run_conservation(cfg, tmp_path / "run")
    assert summary["final"]["step"] == TINY["steps"] and "eps/attn.qk" in summary["families"]
    with pytest.raises(FlowgeomError, match="--patch"):
        run_conservation(cfg.replace(patch=7), tmp_path / "bad")
