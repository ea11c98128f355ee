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


# ---------------------------------------------------------------- one preset per scale, everywhere

EXPERIMENTS = ("conservation", "scaling", "continuity_mlp", "continuity_lm", "darcy", "sharing", "langevin_rate")
TRAINING_CLAIMS = ("conservation.drift", "conservation.tau-squared", "conservation.sigmoid-router",
                   "continuity.mlp-ablation", "continuity.lm-projection", "langevin.darcy")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_owns_one_frozen_preset_per_scale(name):
    import importlib

    from flowgeom.experiments.presets import SCALES, preset

    module = importlib.import_module(f"flowgeom.experiments.{name}")
    assert tuple(module.PRESETS) == SCALES
    kinds = {type(p) for p in module.PRESETS.values()}
    assert len(kinds) == 1 and dataclasses.is_dataclass(module.PRESETS["quick"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        module.PRESETS["quick"].seed = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        module.PRESETS["huge"] = module.PRESETS["quick"]  # read-only: a preset is changed in its module only
    with pytest.raises(FlowgeomError, match="unknown preset 'huge'; choose one of: quick, cpu, full"):
        preset(module.PRESETS, "huge")
    with pytest.raises(FlowgeomError, match="unknown .*'no_such_field'"):
        preset(module.PRESETS, "quick", no_such_field=1)


def _claims_by_id():
    from flowgeom.reproduce.registry import AREAS, load_claims

    return {c.id: c for c in load_claims(list(AREAS))}


def test_training_claims_spell_a_scale_never_a_preset_number():
    """Every run of a training claim names the scale it runs at and only what it selects (arch, variant, seed…)."""
    from flowgeom.experiments.presets import SCALES

    selections = {"scale", "arch", "lr", "seed", "variant", "mlp", "decay_steps"}
    claims = _claims_by_id()
    for cid in TRAINING_CLAIMS:
        for scale in SCALES:
            for config in claims[cid].grid(scale) if scale != "cpu" else claims[cid].cpu:
                assert config["scale"] == scale and set(config) <= selections, (cid, scale, config)
    router = [c for s in ("quick", "full") for c in claims["conservation.sigmoid-router"].grid(s)]
    assert all(c["decay_steps"] == claims_conservation.ROUTER_DECAY_STEPS for c in router)  # the τ grid only


@pytest.mark.parametrize("scale", ["quick", "cpu", "full"])
def test_every_claim_grid_trains_what_the_cli_trains_at_that_scale(scale, monkeypatch, tmp_path, capsys,
                                                                    conserve_run_configs):
    """Claim by claim, each run of the ``scale`` grid is what the experiment's command trains at ``--scale``
    (selecting, with flags, only what the claim selects: architecture, variant, MLP, seed)."""
    claims = _claims_by_id()
    flag, out = f"--{scale}", str(tmp_path / "r")

    def grid(cid):
        return claims[cid].cpu if scale == "cpu" else claims[cid].grid(scale)

    # conservation.drift: one `conserve run` over the claim's architectures, SGD, the preset's lrs and seeds
    drift = grid("conservation.drift")
    archs = list(dict.fromkeys(c["arch"] for c in drift))
    cli = conserve_run_configs(flag, *[x for a in archs for x in ("--arch", a)])
    assert len(cli) == len(drift) and set(cli) == {claims_conservation.drift_config(c) for c in drift}

    seen = []
    monkeypatch.setattr(scaling, "run_scaling", lambda cfg, out, *, resume=False, progress=None: seen.append(cfg) or {})
    for cid in ("conservation.tau-squared", "conservation.sigmoid-router"):
        for c in grid(cid):
            extra = ["--decay-steps", str(c["decay_steps"])] if "decay_steps" in c else []
            assert main(["conserve", "scaling", flag, "--arch", c["arch"], *extra, "--out", out, "--json"]) == 0
            assert seen[-1] == claims_conservation.scaling_config(c)

    seen = _record_then_stop(monkeypatch, continuity_mlp, "train_mlp")
    for c in grid("continuity.mlp-ablation"):
        assert main(["continuity", "train", "mlp", flag, "--variant", c["variant"], "--seed", str(c["seed"]),
                     "--out", out]) == 2
        assert seen[-1] == claims_continuity.mlp_config(c) == continuity_mlp.variant_config(c["variant"], scale,
                                                                                             seed=c["seed"])
    seen = _record_then_stop(monkeypatch, continuity_lm, "train_lm")
    for c in grid("continuity.lm-projection"):
        assert main(["continuity", "train", "lm", flag, "--mlp", c["mlp"], "--seed", str(c["seed"]), "--out", out]) == 2
        assert seen[-1] == claims_continuity.lm_run_config(c)
        assert seen[-1].steps == continuity_lm.PRESETS[scale].steps
    seen = _record_then_stop(monkeypatch, darcy, "run")
    for c in grid("langevin.darcy"):
        assert main(["langevin", "darcy", flag, "--seed", str(c["seed"]), "--out", out]) == 2
        assert seen[-1] == claims_langevin.darcy_config(c) == dataclasses.replace(darcy.PRESETS[scale], seed=c["seed"])


def test_quick_claims_train_the_quick_presets():
    """The numbers the quick claims train are the presets' (they once trained 300 MLP / 200 LM steps against
    presets of 600 / 400)."""
    claims = _claims_by_id()
    mlp = [claims_continuity.mlp_config(c) for c in claims["continuity.mlp-ablation"].quick]
    assert {(c.steps, c.log_every, c.train_limit) for c in mlp} == {
        (continuity_mlp.QUICK.steps, continuity_mlp.QUICK.log_every, continuity_mlp.QUICK.train_limit)}
    (lm,) = [claims_continuity.lm_run_config(c) for c in claims["continuity.lm-projection"].quick]
    assert lm == continuity_lm.QUICK
    drift = [claims_conservation.drift_config(c) for c in claims["conservation.drift"].quick]
    assert {(c.steps, c.lr) for c in drift} == {(conservation.QUICK.steps, lr) for lr in conservation.QUICK.lrs}
    (tau,) = [claims_conservation.scaling_config(c) for c in claims["conservation.tau-squared"].quick]
    assert tau.decay_steps == scaling.QUICK.decay_steps


def test_langevin_rate_flags_default_to_its_preset():
    from flowgeom.cli import build_parser
    from flowgeom.experiments import langevin_rate

    args = build_parser(("langevin",)).parse_args(["langevin", "rate"])
    quick = langevin_rate.PRESETS["quick"]
    for name in ("loss", "chains", "start_radius", "lr", "temperature", "steps", "lam", "eps", "seed"):
        assert getattr(args, name) == getattr(quick, name), name
    assert tuple(args.regs) == quick.regs
