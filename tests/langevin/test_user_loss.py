"""A user's own loss in the Villani probe: (loss_fn, θ₀), FILE.py:NAME, the PEFT LoRA example (real peft)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from flowgeom.errors import FlowgeomError
from flowgeom.langevin import Regularizer, load_objective, loss_objective, objective, probe
from flowgeom.langevin.user_loss import lora_pairs

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "langevin_lora.py"


def test_a_tensor_theta0_starts_the_rays_and_gives_the_textbook_verdicts():
    start = torch.tensor([3.0, -1.0, 2.0, 0.5], dtype=torch.float64)
    quad = probe(loss_objective(lambda x: x.pow(2).sum(), start, name="quad"), rays=2)
    norm = probe(loss_objective(lambda x: x.pow(2).sum().sqrt(), start, name="norm"), rays=2)
    assert quad.verdict == "holds" and norm.verdict == "fails"
    # the first point of each ray is θ₀ + 1·u, |u| = 1: at distance exactly 1 from θ₀ (not from a random point)
    u_first = quad.paths[0].radius[0]
    assert abs(u_first - float(start.norm())) <= 1.0 + 1e-9
    assert quad.paths[0].value[0] == pytest.approx(u_first ** 2)


def test_lora_pairs_are_found_by_peft_names_and_shapes():
    shapes = {"base_model.model.up.lora_A.default.weight": (2, 4), "base_model.model.up.lora_B.default.weight": (8, 2),
              "m.lora_A.weight": (3, 5), "m.lora_B.weight": (7, 3),
              "bad.lora_A.weight": (3, 5), "bad.lora_B.weight": (7, 2),  # ranks disagree: not a pair
              "lonely.lora_A.default.weight": (2, 4), "x.weight": (4, 4)}
    assert lora_pairs(shapes) == [("base_model.model.up.lora_A.default.weight",
                                   "base_model.model.up.lora_B.default.weight"),
                                  ("m.lora_A.weight", "m.lora_B.weight")]


def test_factory_errors_name_the_file_and_the_fix(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent("""
        import torch

        def needs_args(x):
            return x

        def wrong():
            return 3

        def float32_model():
            lin = torch.nn.Linear(2, 1)
            return (lambda p: torch.func.functional_call(lin, p, (torch.ones(1, 2, dtype=torch.float32),)).sum(),
                    {k: v.detach() for k, v in lin.named_parameters()})

        def not_scalar():
            return (lambda x: x * 2, torch.ones(3))

        def nan_loss():
            return (lambda x: x.sum() * float("nan"), torch.ones(3))

        def detached():
            return (lambda x: x.detach().pow(2).sum(), torch.ones(3))
        """))
    cases = {
        "needs_args": "cannot be built without arguments",
        "wrong": "returned a int; NAME must be a zero-argument factory returning (loss_fn, theta0) or a "
                 "flowgeom.langevin.Objective",
        "float32_model": "loss_fn raised RuntimeError: ",
        "not_scalar": "loss_fn must return a real scalar tensor, got a tensor of shape [3]",
        "nan_loss": "loss_fn is nan at theta0",
        "detached": "loss_fn's value does not depend on theta through torch autograd",
        "missing": "has no attribute 'missing'; candidates: detached, float32_model, nan_loss, needs_args, not_scalar, "
                   "wrong",
    }
    for name, fragment in cases.items():
        with pytest.raises(FlowgeomError) as info:
            load_objective(f"{path}:{name}")
        assert fragment in str(info.value), (name, str(info.value))
    with pytest.raises(FlowgeomError, match="build the model in float64"):
        load_objective(f"{path}:float32_model")
    with pytest.raises(FlowgeomError, match=r"path/to/file.py:NAME"):
        objective("nonsense")


def test_a_loss_that_raises_far_out_is_one_error_naming_the_radius():
    def loss(x):
        if x.norm() > 100:
            raise OverflowError("too far")
        return x.pow(2).sum()

    with pytest.raises(FlowgeomError, match=r"mine: loss_fn raised OverflowError: too far at ‖θ‖ = [0-9.e+]+ in float64"):
        probe(loss_objective(loss, torch.ones(3, dtype=torch.float64), name="mine"), rays=1)


def test_factory_randomness_is_seeded_and_the_global_stream_untouched(tmp_path):
    path = tmp_path / "rnd.py"
    path.write_text("import torch\n\ndef make():\n    return (lambda x: x.pow(2).sum(), torch.randn(5))\n")
    before = torch.random.get_rng_state()
    a, b, c = (load_objective(f"{path}:make", seed=s) for s in (0, 0, 1))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(a.theta0["theta"], b.theta0["theta"]) and not torch.equal(a.theta0["theta"], c.theta0["theta"])


# -- the PEFT LoRA example (docs/langevin.md) ----------------------------------------------------------------------

def _example():
    pytest.importorskip("peft")
    return load_objective(f"{EXAMPLE}:make")


def test_peft_lora_orbit_keeps_the_unregularised_loss_and_b_a():
    obj = _example()
    names = sorted(obj.shapes)
    assert names == ["base_model.model.down.lora_A.default.weight", "base_model.model.down.lora_B.default.weight",
                     "base_model.model.up.lora_A.default.weight", "base_model.model.up.lora_B.default.weight"]
    assert obj.orbit_fn is not None and obj.orbit_dim == 2
    g = torch.Generator().manual_seed(3)
    theta = torch.randn(obj.dim, generator=g, dtype=torch.float64)  # B ≠ 0 (PEFT starts at B = 0)
    moved = obj.orbit(theta, 2.5)
    assert (moved - theta).norm() > 5 * theta.norm()  # far along the orbit (e^2.5 ≈ 12 on one direction)
    assert float(obj.flat(moved)) == pytest.approx(float(obj.flat(theta)), rel=1e-10)
    p, q = obj.unflatten(theta), obj.unflatten(moved)
    for module in ("up", "down"):
        a, b = (f"base_model.model.{module}.lora_{x}.default.weight" for x in "AB")
        assert torch.allclose(q[b] @ q[a], p[b] @ p[a], rtol=1e-10, atol=1e-12)


def test_peft_lora_regularised_holds_unregularised_fails():
    obj = _example()
    plain = probe(obj, rays=2)
    assert plain.verdict == "fails"
    [orbit] = [p for p in plain.paths if p.kind == "orbit"]
    assert orbit.verdict == "fails" and not orbit.confining and plain.orbit_integral["verdict"] == "diverges"
    for kind in ("log", "power"):
        regular = probe(obj.with_regularizer(Regularizer(kind, lam=0.01)), rays=2)
        assert regular.verdict == "holds", (kind, [(p.kind, p.reason) for p in regular.paths])
        assert regular.orbit_integral["verdict"] == "converges"


def test_cli_probes_the_example_and_refuses_both_sources(capsys):
    from flowgeom.cli import main

    pytest.importorskip("peft")
    argv = ["langevin", "villani", f"{EXAMPLE}:make", "--rays", "1"]
    assert main(argv) == 0 and "verdict fails" in capsys.readouterr().out
    assert main(argv + ["--reg", "log"]) == 0 and "verdict holds" in capsys.readouterr().out
    assert main(argv + ["--loss", "lora"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"flowgeom: error: give either a built-in --loss or your own '{EXAMPLE}:make', not both"]
