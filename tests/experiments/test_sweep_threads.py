"""A local sweep never asks for more threads than its cores: jobs × threads ≤ cores, workers that do not spin.

The run function reports, from inside the run, the thread counts and the
OpenMP wait policy it sees, so these tests check what a run really gets, in
this process (``--jobs 1``) and in spawned pool workers (``--jobs 2``).
"""

from __future__ import annotations

import os

import pytest

from flowgeom.reproduce import sweep
from flowgeom.reproduce.registry import Claim, Verdict
from flowgeom.reproduce.sweep import plan, run_sweep, thread_budget, worker_env


def env_run(config, folder, resume: bool) -> dict:
    import torch

    return {"torch_threads": torch.get_num_threads(), "pid": os.getpid(),
            **{k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS")}}


def _verdict(runs, figures_dir):
    return Verdict("-", "reproduced")


def _claim(n: int) -> Claim:
    return Claim("laws", "laws.threads", "000", "threads", quick=tuple({"i": i} for i in range(n)), run=env_run,
                 verdict=_verdict)


@pytest.mark.parametrize(("jobs", "cores", "want"), [
    (1, 2, (1, 2)), (2, 2, (2, 1)), (8, 2, (2, 1)), (3, 8, (3, 2)), (4, 1, (1, 1)), (0, 4, (1, 4)),
])
def test_thread_budget_keeps_jobs_times_threads_within_the_cores(jobs, cores, want):
    got = thread_budget(jobs, cores)
    assert got == want and got[0] * got[1] <= cores


def test_the_budget_reads_the_cores_this_process_may_use():
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    assert sweep.available_cores() == len(os.sched_getaffinity(0))


def test_worker_env_keeps_what_the_user_set():
    env = worker_env(3, {"OMP_NUM_THREADS": "7"})
    assert env == {"MKL_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}


def test_one_job_runs_here_at_every_core_and_restores_torch(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(sweep, "available_cores", lambda: 3)
    before = torch.get_num_threads()
    specs = plan([_claim(1)], scale="quick", out=tmp_path)
    res = run_sweep(specs, jobs=1)
    summary = sweep.RunFolder(specs[0].path).summary()
    assert res.ok and summary["torch_threads"] == 3 and summary["pid"] == os.getpid()
    assert torch.get_num_threads() == before


def test_pool_workers_start_with_their_share_of_threads_and_passive_waits(tmp_path, monkeypatch):
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sweep, "available_cores", lambda: 4)
    specs = plan([_claim(3)], scale="quick", out=tmp_path)
    res = run_sweep(specs, jobs=8)  # capped at the 4 cores: 4 workers at 1 thread each
    assert res.ok
    summaries = [sweep.RunFolder(s.path).summary() for s in specs]
    for s in summaries:
        assert s["pid"] != os.getpid()
        assert (s["torch_threads"], s["OMP_NUM_THREADS"], s["OPENBLAS_NUM_THREADS"], s["OMP_WAIT_POLICY"]) == \
            (1, "1", "1", "PASSIVE")
    assert "OMP_WAIT_POLICY" not in os.environ  # the parent's environment is as it was


def test_two_workers_on_four_cores_get_two_threads_each(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(sweep, "available_cores", lambda: 4)
    specs = plan([_claim(2)], scale="quick", out=tmp_path)
    assert run_sweep(specs, jobs=2).ok
    assert {(s["torch_threads"], s["OMP_NUM_THREADS"]) for s in (sweep.RunFolder(p.path).summary() for p in specs)} \
        == {(2, "2")}
