"""The conservation.drift verdict, per step size, on planted run summaries."""

from __future__ import annotations

import pytest

from flowgeom.reproduce.claims_conservation import BOUNDED, drift_verdict
from flowgeom.reproduce.registry import RunRecord


def _run(tmp_path, lr, seed, law, control):
    curve = [{"step": 0, "laws": None, "control": None}, {"step": 100, "laws": law, "control": control}]
    summary = {"arch": "mha-rope-swiglu", "laws": {"eps/attn.vo": law}, "controls": {"control/norm.q_proj": control},
               "curve": curve, "loss": 2.0, "steps": 100}
    return RunRecord(f"r{lr}-{seed}", {"lr": lr, "seed": seed}, summary, tmp_path)


@pytest.mark.parametrize("planted, verdict, needle", [
    ({0.03: (1e-3, 1e-2), 0.1: (2e-3, 3e-2)}, "reproduced", ""),
    ({0.03: (1e-3, 1e-2), 0.1: (2 * BOUNDED, 0.3)}, "differs", "small only at the smaller step sizes"),
    ({0.1: (3e-3, 2e-3)}, "differs", "too short"),
    ({0.1: (2 * BOUNDED, 0.3)}, "not reproduced", "reaches"),
])
def test_drift_verdict_judges_each_step_size(tmp_path, planted, verdict, needle):
    runs = [_run(tmp_path, lr, seed, *values) for lr, values in planted.items() for seed in (0, 1)]
    v = drift_verdict(runs, tmp_path / "figures")
    assert v.verdict == verdict
    assert needle in v.how
    assert (tmp_path / "figures" / "drift.png").is_file()
    if verdict == "differs" and len(planted) == 2:
        assert "lr=0.03: laws ≤ 1.0e-03, 10×–10× below" in v.how and "lr=0.1: the laws' relative error" in v.how
