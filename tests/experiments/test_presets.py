"""One scale, one configuration: the CLI's ``--full``/``--quick`` trains exactly what the claims run.

Each test drives the real CLI (``flowgeom.cli.main``) with the experiment's training function replaced by
a recorder, and compares the recorded configs with the configs the claim's grid resolves to.
"""

from __future__ import annotations

import dataclasses

import pytest

from flowgeom.cli import main
from flowgeom.errors import FlowgeomError
from flowgeom.experiments import conservation, scaling
from flowgeom.reproduce import claims_conservation, claims_continuity, claims_langevin
from flowgeom.experiments import continuity_lm, continuity_mlp, darcy


class _Recorded(FlowgeomError):
    """Raised by a recorder to stop the CLI after the config is built (exit 2, one line)."""


def _claim(claims, claim_id):
    return next(c for c in claims() if c.id == claim_id)


def test_conserve_run_full_trains_the_claims_full_grid(conserve_run_configs, capsys):
    cli = conserve_run_configs("--full")
    claim = _claim(claims_conservation.claims, "conservation.drift")
    ours = [claims_conservation.drift_config(c) for c in claim.full]
    assert len(cli) == len(ours) == len(conservation.ARCHS) * len(conservation.FULL.lrs) * conservation.FULL.seeds
    assert set(cli) == set(ours)
    lm = next(c for c in ours if c.task == "lm")
    assert (lm.d_model, lm.n_layers, lm.steps) == (512, 12, 20_000)  # seed 000's 12-layer LM, not a smaller one


def test_conserve_run_quick_is_the_quick_claims_run(conserve_run_configs, capsys):
    cli = conserve_run_configs("--quick", "--arch", "mha-rope-swiglu", "--arch", "moe-top2-softmax", "--lr", "0.1")
    claim = _claim(claims_conservation.claims, "conservation.drift")
    assert set(cli) == {claims_conservation.drift_config(c) for c in claim.quick}


@pytest.mark.parametrize("claim_id", ["conservation.tau-squared"])
def test_conserve_scaling_full_is_the_claims_full_config(monkeypatch, tmp_path, capsys, claim_id):
    seen = []

    def record(cfg, out, *, resume=False, progress=None):
        seen.append(cfg)
        return {}

    monkeypatch.setattr(scaling, "run_scaling", record)
    claim = _claim(claims_conservation.claims, claim_id)
    for config in claim.full:
        assert main(["conserve", "scaling", "--full", "--arch", config["arch"], "--out", str(tmp_path), "--json"]) == 0
        assert seen[-1] == claims_conservation.scaling_config(config)
    assert len(seen) == len(conservation.LM_ARCHS)


def _record_then_stop(monkeypatch, module, name):
    seen = []

    def record(cfg, *args, **kwargs):
        seen.append(cfg)
        raise _Recorded("recorded")

    monkeypatch.setattr(module, name, record)
    return seen


def test_continuity_mlp_full_is_the_claims_full_config(monkeypatch, tmp_path, capsys):
    seen = _record_then_stop(monkeypatch, continuity_mlp, "train_mlp")
    claim = _claim(claims_continuity.claims, "continuity.mlp-ablation")
    for config in claim.full[:3]:
        assert main(["continuity", "train", "mlp", "--preset", "full", "--variant", config["variant"],
                     "--seed", str(config["seed"]), "--out", str(tmp_path / "r")]) == 2
        assert seen[-1] == claims_continuity.mlp_config(config)
    full = claims_continuity.mlp_config(claim.full[0])
    assert (full.depth, full.width, full.train_limit) == (16, 256, None)  # seed 001: 16 x 256 on all of MNIST
    assert continuity_mlp.variant_config("NoRes", "full") == dataclasses.replace(
        continuity_mlp.FULL, variant="NoRes", **continuity_mlp.VARIANTS["NoRes"])


def test_continuity_lm_full_is_the_claims_full_config(monkeypatch, tmp_path, capsys):
    seen = _record_then_stop(monkeypatch, continuity_lm, "train_lm")
    claim = _claim(claims_continuity.claims, "continuity.lm-projection")
    for config in claim.full:
        assert main(["continuity", "train", "lm", "--preset", "full", "--mlp", config["mlp"], "--seed",
                     str(config["seed"]), "--out", str(tmp_path / "r")]) == 2
        assert seen[-1] == claims_continuity.lm_run_config(config)
    assert seen[-1].n_layers == 8  # seed 001's small Llama


def test_langevin_darcy_full_is_the_claims_full_config(monkeypatch, tmp_path, capsys):
    seen = _record_then_stop(monkeypatch, darcy, "run")
    claim = _claim(claims_langevin.claims, "langevin.darcy")
    for config in claim.full:
        assert main(["langevin", "darcy", "--full", "--seed", str(config["seed"]), "--out", str(tmp_path / "r")]) == 2
        assert seen[-1] == claims_langevin.darcy_config(config)
    for config in claim.quick:
        assert main(["langevin", "darcy", "--quick", "--seed", str(config["seed"]), "--out", str(tmp_path / "r")]) == 2
        assert seen[-1] == claims_langevin.darcy_config(config)


def test_presets_are_frozen_dataclasses_with_a_nested_model():
    for preset in (conservation.QUICK, conservation.FULL):
        assert dataclasses.is_dataclass(preset) and isinstance(preset.model, conservation.ConservationConfig)
        with pytest.raises(dataclasses.FrozenInstanceError):
            preset.steps = 1  # type: ignore[misc]
    for module in (continuity_mlp, continuity_lm, darcy, scaling):
        assert dataclasses.is_dataclass(module.QUICK) and type(module.QUICK) is type(module.FULL)
        assert module.QUICK != module.FULL


def test_scaling_divergence_is_one_error_line(tmp_path, capsys):
    """A step size that blows the laws up ends in one error line and exit 2, not in slopes without meaning."""
    rc = main(["conserve", "scaling", "--arch", "mha-rope-swiglu", "--tau", "1e5", "--tau", "1e4", "--tau", "1e3",
               "--steps", "3", "--decay-steps", "4", "--out", str(tmp_path / "s"), "--json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("flowgeom: error: scaling run mha-rope-swiglu τ=")
    assert "diverged" in err[0] and "--tau" in err[0] and not (tmp_path / "s" / "scaling.json").exists()
