"""``--backend ray``: one task per run on a local 2-CPU Ray instance on loopback; same results as local."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import _sweep_fakes as fakes
from flowgeom.reproduce.sweep import plan, python_path, run_sweep

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ray==2.60.0' to run the Ray backend test)")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": python_path()}})
    yield
    ray.shutdown()


def _summaries(out: Path) -> dict[str, dict]:
    return {str(p.parent.relative_to(out)): json.loads(p.read_text()) for p in sorted(out.glob("runs/*/*/summary.json"))}


def test_ray_backend_matches_local_and_reports_a_dead_worker(tmp_path, local_ray):
    claims = [fakes.counter_claim(n=6), fakes.boom_claim(), fakes.die_claim()]
    # (the dying run would kill this very process on the sequential local backend)
    local = run_sweep(plan(claims[:2], scale="quick", out=tmp_path / "local"), backend="local")
    remote = run_sweep(plan(claims, scale="quick", out=tmp_path / "ray"), backend="ray")
    got = _summaries(tmp_path / "ray")
    assert {k: v for k, v in got.items() if not k.startswith("runs/fake.die")} == _summaries(tmp_path / "local")
    assert len(got) == 3 + 2 + 2
    failed = {o.key: o.error for o in remote.failed}
    assert len(failed) == 3
    (dead,) = [e for k, e in failed.items() if k.startswith("fake.die")]
    assert "Ray worker failed" in dead
    assert sorted(k for k in failed if k.startswith("fake.boom")) == sorted(o.key for o in local.failed
                                                                            if o.key.startswith("fake.boom"))
    # resume on Ray: finished runs are skipped, not rerun
    again = run_sweep(plan(claims[:1], scale="quick", out=tmp_path / "ray"), backend="ray", resume=True)
    assert [o.status for o in again.outcomes] == ["skipped"] * 3
