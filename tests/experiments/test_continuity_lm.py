"""Llama-style LM continuity runs on a tiny config: roles, pattern summary, resume, seeds."""

import pytest

from flowgeom.errors import FlowgeomError
from flowgeom.experiments.continuity_lm import LM_MLPS, lm_config, projection_pattern, role_parameters, train_lm
from flowgeom.nn.lm import TinyLM
from flowgeom.runs import RunFolder

TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void. " * 8
TINY = dict(n_layers=3, d_model=16, heads=2, d_k=8, d_hidden=24, seq_len=16, batch=4, steps=5, log_every=2,
            ckpt_every=2, lr=1e-2)


def test_roles_follow_the_mlp_ablation():
    cfg = lm_config(**TINY)
    roles = role_parameters(TinyLM(cfg.model_config(40)))
    assert list(roles) == ["q", "k", "v", "o", "gate", "up", "down"]
    assert all(len(ps) == 3 for ps in roles.values())
    assert roles["gate"][0].shape == (24, 16) and roles["down"][0].shape == (16, 24)
    gelu = role_parameters(TinyLM(lm_config(**TINY, mlp="gelu").model_config(40)))
    assert list(gelu) == ["q", "k", "v", "o", "up", "down"]


def test_train_pattern_and_exact_resume(tmp_path):
    cfg = lm_config(**TINY)
    full = train_lm(cfg, tmp_path / "full", text=TEXT)
    assert full["status"] == "finished"
    assert train_lm(cfg, tmp_path / "cut", text=TEXT, stop_after=3) is None
    train_lm(cfg, tmp_path / "cut", text=TEXT, resume=True)
    a = (tmp_path / "full" / "metrics.jsonl").read_text()
    assert a == (tmp_path / "cut" / "metrics.jsonl").read_text()
    pattern = projection_pattern(RunFolder(tmp_path / "full").metrics())
    assert set(pattern) == {"q", "k", "v", "o", "gate", "up", "down"}
    for p in pattern.values():
        assert p["verdict"] in ("input-continuous", "output-continuous", "input+output-continuous", "neither")
        assert 0 <= p["v1"] <= 1 and 0 <= p["grad_v1_init"] <= 1 and p["dw_ratio"] > 0
        assert p["v1_x"] == pytest.approx(p["v1"] / p["v1_baseline"])
    assert pattern["q"]["seed"] == "input" and pattern["o"]["seed"] == "output" and pattern["v"]["seed"] == "low"
    config = RunFolder(tmp_path / "full").path.joinpath("config.json").read_text()
    assert '"params"' in config and '"vocab"' in config


def test_same_seed_same_numbers(tmp_path):
    cfg = lm_config(**{**TINY, "steps": 3})
    train_lm(cfg, tmp_path / "a", text=TEXT)
    train_lm(cfg, tmp_path / "b", text=TEXT)
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == (tmp_path / "b" / "metrics.jsonl").read_text()


def test_presets_and_errors():
    full = lm_config("full")
    assert full.n_layers == 8 and full.d_model == 576
    n = sum(p.numel() for p in TinyLM(full.model_config(200)).parameters())
    assert 30e6 < n < 36e6  # the seed's ~34M scale
    quick = sum(p.numel() for p in TinyLM(lm_config("quick").model_config(80)).parameters())
    assert 2e6 < quick < 6e6
    assert set(LM_MLPS) == {"swiglu", "gelu", "relu", "silu", "identity"}
    with pytest.raises(FlowgeomError, match="unknown mlp"):
        lm_config(mlp="moe")
    with pytest.raises(FlowgeomError, match="unknown LM run option"):
        lm_config(layers=3)
    with pytest.raises(FlowgeomError, match="n_layers"):
        lm_config(n_layers=1)
