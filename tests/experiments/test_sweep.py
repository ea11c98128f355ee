"""Sweeps: deterministic run ids, resume after kill -9, failures reported, exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _sweep_fakes as fakes
from flowgeom.cli import build_parser
from flowgeom.cli.reproduce import run_reproduce
from flowgeom.errors import FlowgeomError
from flowgeom.reproduce.pipeline import reproduce
from flowgeom.reproduce.registry import Claim, Verdict, grid, run_id, select
from flowgeom.reproduce.sweep import execute, plan, run_sweep

PY = sys.executable
FLOWGEOM = [PY, "-c", "import sys; from flowgeom.cli import main; sys.exit(main())"]
HERE = Path(__file__).parent
REPO = HERE.parents[1]


def summaries(out: Path) -> dict[str, dict]:
    return {str(p.parent.relative_to(out)): json.loads(p.read_text()) for p in sorted(out.glob("runs/*/*/summary.json"))}


def args_for(*argv: str):
    return build_parser().parse_args(["reproduce", *argv])


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.sampled_from(["lr", "seed", "arch", "width"]),
                       st.one_of(st.integers(-5, 5), st.floats(0.001, 1.0), st.sampled_from(["mha", "ffn"])),
                       min_size=1))
def test_run_id_is_a_function_of_the_config(config):
    assert run_id(config) == run_id(dict(reversed(list(config.items()))))
    changed = dict(config)
    key = next(iter(changed))
    changed[key] = "other-value"
    assert run_id(changed) != run_id(config)
    assert "/" not in run_id(config) and " " not in run_id(config)


def test_grid_is_the_cartesian_product_in_order():
    g = grid(lr=[0.1, 0.2], seed=[0, 1, 2])
    assert len(g) == 6 and g[0] == {"lr": 0.1, "seed": 0} and g[-1] == {"lr": 0.2, "seed": 2}


def test_claim_rejects_bad_fields():
    with pytest.raises(FlowgeomError, match="area"):
        Claim(area="nope", id="x.y", seed="000", text="t", unavailable="r")
    with pytest.raises(FlowgeomError, match="run function"):
        Claim(area="laws", id="x.y", seed="000", text="t")
    with pytest.raises(FlowgeomError, match="must say how"):
        Verdict("m", "differs")
    with pytest.raises(FlowgeomError, match="unknown claim"):
        select([fakes.counter_claim()], ["fake.nothing"])


def test_kill9_then_resume_equals_an_uninterrupted_sweep(tmp_path):
    """kill -9 mid-run, then --resume: finished runs kept untouched, interrupted one continued, same summaries."""
    ref = tmp_path / "ref"
    assert run_reproduce(args_for("laws", "--out", str(ref)), claims=[fakes.counter_claim(sleep=0.05)]) == 0
    out = tmp_path / "killed"
    env = dict(os.environ, FAKE_SLEEP="0.05")
    cmd = [PY, str(HERE / "_sweep_fakes.py"), "reproduce", "laws", "--quick", "--out", str(out), "--json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    first, second = None, None
    while time.time() < deadline:
        done = sorted(out.glob("runs/*/*/summary.json"))
        ckpts = [p for p in out.glob("runs/*/*/checkpoint.safetensors") if not (p.parent / "summary.json").exists()]
        if done and ckpts and len(list(ckpts[0].parent.glob("metrics.jsonl"))) and \
                len((ckpts[0].parent / "metrics.jsonl").read_text().splitlines()) >= 3:
            first, second = done[0], ckpts[0].parent
            break
        time.sleep(0.01)
    assert first is not None, "the sweep never reached the middle of its second run"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (second / "summary.json").exists()
    first_mtime = first.stat().st_mtime_ns
    partial = len((second / "metrics.jsonl").read_text().splitlines())
    # An interrupted sweep without --resume is refused (exit 2), nothing touched.
    with pytest.raises(FlowgeomError, match="--resume"):
        run_reproduce(args_for("laws", "--out", str(out)), claims=[fakes.counter_claim(sleep=0.05)])
    r = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    payload = json.loads(r.stdout)
    assert payload["sweep"]["skipped"] >= 1 and payload["sweep"]["failed"] == 0
    assert first.stat().st_mtime_ns == first_mtime, "a finished run was rerun"
    timing = json.loads((second / "timing.json").read_text())
    assert timing["resumed"] is True and partial >= 3
    got, want = summaries(out), summaries(ref)
    assert got == want and len(got) == 3


def test_a_run_that_raises_is_reported_and_the_others_kept(tmp_path, capsys):
    claims = [fakes.boom_claim(), fakes.counter_claim()]
    code = run_reproduce(args_for("all", "--out", str(tmp_path)), claims=claims)
    assert code == 1
    text = capsys.readouterr().out
    assert "planted failure in run x=1" in text and "disk full" in text
    got = summaries(tmp_path)
    assert len(got) == 5  # 2 of 4 boom runs + 3 counter runs
    report = json.loads((tmp_path / "report.json").read_text())
    boom = next(c for c in report["claims"] if c["id"] == "fake.boom")
    assert boom["finished"] == 2 and len(boom["failed"]) == 2
    assert "2 of 4 runs failed" in boom["verdict"]["how"]
    assert "planted failure" in (tmp_path / "report.md").read_text()
    errors = sorted(tmp_path.glob("runs/fake.boom/*/error.txt"))
    assert len(errors) == 2 and "Traceback" in errors[0].read_text()
    # --resume retries only the failed runs (they fail again, the rest is kept).
    report = reproduce(claims, out=tmp_path, resume=True, show_progress=False)
    assert report["sweep"]["skipped"] == 5 and report["sweep"]["failed"] == 2


def test_unwritable_out_is_a_clear_exit_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = subprocess.run([*FLOWGEOM, "reproduce", "laws", "--out", str(blocker / "sub")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2
    assert "not writable" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("flowgeom: error: output folder")


def test_unavailable_claims_become_not_run_lines(tmp_path):
    report = reproduce([fakes.unavailable_claim(), fakes.counter_claim(n=2)], out=tmp_path, show_progress=False)
    missing = next(c for c in report["claims"] if c["id"] == "fake.missing")
    assert missing["verdict"]["verdict"] == "not run" and "not importable" in missing["verdict"]["how"]
    assert missing["runs"] == 0 and report["sweep"]["failed"] == 0


def test_process_pool_gives_the_same_summaries_and_reports_a_dead_worker(tmp_path):
    seq, pool = tmp_path / "seq", tmp_path / "pool"
    claims = [fakes.counter_claim(n=5), fakes.die_claim()]
    specs = plan([fakes.counter_claim(n=5)], scale="quick", out=seq)
    assert run_sweep(specs).ok
    res = run_sweep(plan(claims, scale="quick", out=pool), jobs=2)
    failed = {o.key.split("/")[0]: o for o in res.failed}
    assert list(failed) == ["fake.die"] and "worker process died" in failed["fake.die"].error
    assert len(res.outcomes) == 6
    got = {k: v for k, v in summaries(pool).items() if k.startswith("runs/fake.counter")}
    assert got == summaries(seq)
    assert len([k for k in summaries(pool) if k.startswith("runs/fake.die")]) == 2


def test_execute_skips_finished_runs(tmp_path):
    (spec,) = plan([fakes.counter_claim(n=2, seeds=(5,))], scale="quick", out=tmp_path)
    assert execute(spec, False).status == "finished"
    assert execute(spec, True).status == "skipped"


def test_unknown_claim_and_area_are_usage_errors(tmp_path):
    with pytest.raises(FlowgeomError, match="fake.counter"):
        run_reproduce(args_for("laws", "--only", "nope", "--out", str(tmp_path)), claims=[fakes.counter_claim()])
    with pytest.raises(SystemExit):
        args_for("physics")


def test_default_out_is_fresh_and_resume_finds_the_latest(tmp_path, monkeypatch):
    from flowgeom.reproduce import pipeline

    monkeypatch.setattr(pipeline, "DEFAULT_ROOT", tmp_path / "runs")
    with pytest.raises(FlowgeomError, match="no earlier quick reproduction"):
        pipeline.default_out("quick", True)
    fresh = pipeline.default_out("quick", False)
    assert fresh.parent == tmp_path / "runs" and fresh.name.startswith("quick-")
    for name in ("quick-20260101-000000", "quick-20260102-000000", "full-20270101-000000"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    assert pipeline.default_out("quick", True).name == "quick-20260102-000000"


def test_ray_backend_without_ray_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    specs = plan([fakes.counter_claim(n=1)], scale="quick", out=tmp_path)
    with pytest.raises(FlowgeomError, match=r"pip install 'ray==2.60.0'"):
        run_sweep(specs, backend="ray")
    with pytest.raises(FlowgeomError, match="backend"):
        run_sweep(specs, backend="slurm")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill a disk here: {r.stderr.strip() or r.returncode}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_reports_failures_keeps_results_and_resumes(tiny_disk, monkeypatch):
    out = tiny_disk / "sweep"
    claims = [fakes.counter_claim(n=2, seeds=(0,)), fakes.fill_claim()]
    monkeypatch.setenv("FAKE_FILL", "1")
    with pytest.raises(FlowgeomError) as err:
        run_reproduce(args_for("laws", "--out", str(out)), claims=claims)
    msg = str(err.value)
    assert "1 runs finished" in msg and "2 failed" in msg and "disk full" in msg and "report could not be written" in msg
    assert len(summaries(out)) == 1  # the run that finished before the disk filled up is kept
    for blob in out.glob("runs/fake.fill/*/blob.bin"):
        blob.unlink()
    monkeypatch.delenv("FAKE_FILL")
    assert run_reproduce(args_for("laws", "--out", str(out), "--resume"), claims=claims) == 0
    assert len(summaries(out)) == 3 and (out / "report.html").exists()
