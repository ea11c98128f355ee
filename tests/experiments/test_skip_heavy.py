"""The quick tour leaves out claims marked heavy; asking for them by id still runs them."""

import dataclasses

import _sweep_fakes as fakes

from flowgeom.reproduce.pipeline import run


def _claims():
    light = fakes.counter_claim(n=2, seeds=(0,))
    heavy = dataclasses.replace(fakes.boom_claim(), area="laws", id="fake.heavy", heavy="minutes of work")
    return [light, heavy]


def test_skip_heavy_runs_only_the_light_claims(tmp_path):
    report = run("laws", out=tmp_path / "tour", claims=_claims(), skip_heavy=True, show_progress=False)
    ran = {c["id"] for c in report["claims"]}
    assert ran == {"fake.counter"}


def test_heavy_claim_runs_when_not_skipped(tmp_path):
    report = run("laws", out=tmp_path / "all", claims=_claims(), show_progress=False)
    assert {c["id"] for c in report["claims"]} == {"fake.counter", "fake.heavy"}
