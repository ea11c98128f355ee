"""The ``cpu`` scale: the paper-scale protocols cut to what 2 CPU cores train, the same in the CLI and the claims.

As in ``test_presets.py``, the CLI drives a recorder in place of the training function, and the
recorded configs are compared with what the claims' ``cpu`` grids resolve to.
"""

from __future__ import annotations

import pytest

from flowgeom.cli import main
from flowgeom.experiments import conservation, continuity_lm, continuity_mlp
from flowgeom.reproduce import claims_conservation, claims_continuity
from flowgeom.reproduce.pipeline import run
from flowgeom.reproduce.registry import AREAS, load_claims

CPU_CLAIMS = {"conservation.drift", "continuity.mlp-ablation", "continuity.lm-projection", "continuity.sharing",
              "langevin.darcy"}


def _claim(claims, claim_id):
    return next(c for c in claims() if c.id == claim_id)


def test_exactly_the_part2_claims_have_a_cpu_grid():
    claims = load_claims(list(AREAS))
    assert {c.id for c in claims if c.cpu} == CPU_CLAIMS
    for c in claims:
        assert c.grid("cpu") == tuple(c.cpu)


def test_mlp_cpu_grid_is_the_seeds_model_with_every_variant_the_issue_names():
    claim = _claim(claims_continuity.claims, "continuity.mlp-ablation")
    configs = [claims_continuity.mlp_config(c) for c in claim.cpu]
    assert {c.variant for c in configs} == set(continuity_mlp.CORE) | set(claims_continuity.SCALE_VARIANTS)
    for cfg in configs:
        assert (cfg.depth, cfg.width, cfg.train_limit, cfg.test_limit) == (16, 256, None, None)
        assert (cfg.steps, cfg.log_every) == (continuity_mlp.CPU.steps, continuity_mlp.CPU.log_every)
    by_variant = {c.variant: c for c in configs}
    assert by_variant["Res+ReLU init2"].init_scale == 2.0
    assert by_variant["Res+ReLU Adam-b2=0"].optimizer == "adam_b2_0"


def test_lm_cpu_preset_sits_between_quick_and_full():
    claim = _claim(claims_continuity.claims, "continuity.lm-projection")
    (cfg,) = [claims_continuity.lm_run_config(c) for c in claim.cpu]
    assert cfg == continuity_lm.CPU
    assert continuity_lm.QUICK.d_model < cfg.d_model < continuity_lm.FULL.d_model
    assert cfg.n_layers == continuity_lm.FULL.n_layers == 8


def test_drift_cpu_grid_is_longer_sgd_on_the_two_named_architectures():
    claim = _claim(claims_conservation.claims, "conservation.drift")
    configs = [claims_conservation.drift_config(c) for c in claim.cpu]
    assert {(c.positions, c.mlp, c.top_k) for c in configs} == {("rope", "swiglu", None), ("none", "moe", 2)}
    assert all(not c.full_batch and c.steps == conservation.CPU.steps for c in configs)
    assert conservation.CPU.steps >= 10 * conservation.QUICK.steps


def test_conserve_run_cpu_trains_the_claims_cpu_grid(conserve_run_configs, capsys):
    seen = conserve_run_configs("--cpu", "--arch", "mha-rope-swiglu", "--arch", "moe-top2-softmax")
    claim = _claim(claims_conservation.claims, "conservation.drift")
    assert set(seen) == {claims_conservation.drift_config(c) for c in claim.cpu}


@pytest.mark.parametrize("flag", ["--cpu", "--preset=cpu"])
def test_continuity_train_cpu_flag_and_preset_alias_agree(monkeypatch, tmp_path, capsys, flag):
    from flowgeom.errors import FlowgeomError

    seen = []

    def record(cfg, *args, **kwargs):
        seen.append(cfg)
        raise FlowgeomError("recorded")

    monkeypatch.setattr(continuity_lm, "train_lm", record)
    assert main(["continuity", "train", "lm", flag, "--out", str(tmp_path / "r")]) == 2
    assert seen == [continuity_lm.CPU]


def test_two_scale_flags_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "laws", "--cpu", "--full"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_only_a_claim_without_cpu_grid_is_one_clear_error(tmp_path, capsys):
    assert main(["reproduce", "laws", "--cpu", "--only", "laws.mha", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "laws.mha" in err and "no CPU-scale grid" in err
    assert not (tmp_path / "o").exists()  # refused before any folder is made


def test_area_without_cpu_claims_is_refused():
    from flowgeom.errors import FlowgeomError

    with pytest.raises(FlowgeomError, match="no selected claim has a CPU-scale grid"):
        run("laws", scale="cpu", out="unused", show_progress=False)
