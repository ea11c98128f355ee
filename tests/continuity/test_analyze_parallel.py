"""Roles analysed in parallel threads (``AnalyzeConfig.workers``, the CLI's ``--threads``).

The claim is strong: the report is the same, bit for bit, for any number of
workers (each role runs the same calls in the same order, with one BLAS
thread), errors surface exactly as in a serial run, and progress reaches
every layer of every role.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from synthetic_checkpoints import llama_state

from flowgeom.cli import main
from flowgeom.continuity import AnalyzeConfig, analyze
from flowgeom.continuity.analyze import role_memory
from flowgeom.errors import FlowgeomError


def _without_run_details(report: dict) -> dict:
    report = dict(report, config=dict(report["config"]))
    report.pop("seconds")
    report["config"].pop("workers")
    report["roles"] = {role: {k: v for k, v in r.items() if k not in ("seconds", "seconds_per_layer")}
                       for role, r in report["roles"].items()}  # wall times per role
    return report


@settings(max_examples=6, deadline=None)
@given(workers=st.integers(2, 5), dtype=st.sampled_from(["float32", "float64"]),
       solver=st.sampled_from(["dense", "krylov"]), spectra=st.booleans(), seed=st.integers(0, 1000))
def test_parallel_report_is_bit_identical_to_serial(workers, dtype, solver, spectra, seed):
    state = llama_state(layers=5, d=24, kv=8, hidden=40, seed=seed)
    config = dict(k=3, dtype=dtype, solver=solver, spectra=spectra, distances=(1, 2))
    serial = analyze(state, AnalyzeConfig(**config))
    parallel = analyze(state, AnalyzeConfig(**config, workers=workers))
    assert parallel["config"]["workers"] == workers
    assert list(parallel["roles"]) == list(serial["roles"]) == ["q", "k", "v", "o", "gate", "up", "down"]
    assert _without_run_details(parallel) == _without_run_details(serial)


def test_parallel_error_is_the_serial_one():
    """Two roles fail; both runs name the first failing role in layout order (q before down)."""
    state = llama_state(layers=4, d=16, kv=8, hidden=24, seed=1)
    state["model.layers.2.self_attn.q_proj.weight"] = torch.zeros(16, 16)
    state["model.layers.0.mlp.down_proj.weight"] = torch.zeros(16, 24)
    messages = []
    for workers in (1, 2, 7):
        with pytest.raises(FlowgeomError, match="all zeros") as exc:
            analyze(state, AnalyzeConfig(k=2, workers=workers))
        messages.append(str(exc.value))
    assert len(set(messages)) == 1 and "q_proj" in messages[0]


def test_progress_reaches_every_layer_from_the_worker_threads():
    calls, lock, threads = [], threading.Lock(), set()

    def progress(role, done, total):
        with lock:
            calls.append((role, done, total))
            threads.add(threading.current_thread().name)

    analyze(llama_state(layers=4, seed=2), AnalyzeConfig(k=2, workers=3), progress=progress)
    for role in ("q", "k", "v", "o", "gate", "up", "down"):
        assert [done for r, done, _ in calls if r == role] == [1, 2, 3, 4]
        assert {total for r, _, total in calls if r == role} == {4}
    assert all(name.startswith("flowgeom-analyze") for name in threads)


def test_workers_must_be_positive():
    with pytest.raises(FlowgeomError, match="--workers must be a whole number >= 1, got 0"):
        AnalyzeConfig(workers=0)


def test_cli_threads_do_not_change_the_report(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    save_file(llama_state(layers=4, d=24, kv=8, hidden=40, seed=3), path)
    reports = []
    for threads in ("1", str(min(2, os.cpu_count() or 1))):  # --threads may not exceed the machine's CPUs
        assert main(["continuity", "analyze", str(path), "--json", "--k", "2", "--spectra", "--threads", threads]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert [r["config"]["workers"] for r in reports] == [1, min(2, os.cpu_count() or 1)]
    assert _without_run_details(reports[0]) == _without_run_details(reports[1])


def test_workers_are_capped_by_free_memory_with_a_warning(monkeypatch):
    state = llama_state(layers=4, d=24, kv=8, hidden=40, seed=4)
    serial = analyze(state, AnalyzeConfig(k=2))
    window = role_memory((40, 24), stored=4, compute=8)  # the largest role (gate, up: 40 x 24), float64 compute
    # 80% of 3 windows (flowgeom.memory's one rule): room for two workers, not three
    monkeypatch.setattr("flowgeom.memory.available_memory", lambda device: 3 * window)
    capped = analyze(state, AnalyzeConfig(k=2, workers=5))
    assert any("analysed 2 role(s) at a time instead of 5" in w for w in capped["warnings"])
    capped["warnings"] = serial["warnings"]
    assert _without_run_details(capped) == _without_run_details(serial)


def test_an_error_stops_the_other_roles_within_a_layer():
    """q fails at its first layer while down (slowed by its progress callback) is running: down stops at its
    next layer instead of finishing its 12 (the queued roles are cancelled)."""
    state = llama_state(layers=12, d=24, kv=8, hidden=40, seed=6)
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(24, 24)
    seen, lock = {}, threading.Lock()

    def progress(role, done, total):
        with lock:
            seen[role] = done
        if role == "down":
            time.sleep(0.05)  # a slow role: 12 layers would take 0.6 s

    with pytest.raises(FlowgeomError, match="q_proj.*all zeros"):
        analyze(state, AnalyzeConfig(k=2, workers=2), progress=progress)
    assert seen.get("down", 0) < 12


def test_ctrl_c_stops_the_other_roles_within_a_layer():
    """A KeyboardInterrupt reaching the waiting caller (here raised by q's progress, re-raised by its future)
    propagates as is, and the running roles stop at their next layer."""
    seen, lock = {}, threading.Lock()

    def progress(role, done, total):
        with lock:
            seen[role] = done
        if role == "q":
            raise KeyboardInterrupt
        if role == "down":
            time.sleep(0.05)

    with pytest.raises(KeyboardInterrupt):
        analyze(llama_state(layers=12, d=24, kv=8, hidden=40, seed=7), AnalyzeConfig(k=2, workers=2),
                progress=progress)
    assert seen.get("down", 0) < 12


CHILD = r"""
import sys, time
from flowgeom.continuity import AnalyzeConfig, analyze
from flowgeom.continuity.analyze import role_memory

def progress(role, done, total):
    sys.stdout.write(f"{role} {done}\n")  # one write per line: the two workers' lines never interleave
    sys.stdout.flush()
    time.sleep(0.05)  # slow layers: the interrupt lands mid-run

try:
    analyze(sys.argv[1], AnalyzeConfig(k=2, workers=2), progress=progress)
    print("completed", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_a_real_sigint_ends_a_parallel_analysis_within_a_layer(tmp_path):
    """A child process analysing 7 roles x 12 layers with 2 workers gets SIGINT after its first layer: it ends
    with KeyboardInterrupt after a few more layers, instead of finishing the 12 of each running role."""
    path = tmp_path / "m.safetensors"
    save_file(llama_state(layers=12, d=24, kv=8, hidden=40, seed=8), path)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    first = child.stdout.readline()  # the first layer is done: imports are over, the pool is running
    assert first.split() and first.split()[1] == "1", first
    child.send_signal(signal.SIGINT)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 130 and "interrupted" in out and "completed" not in out
    layers = 1 + sum(1 for line in out.splitlines() if line.split()[-1].isdigit())
    assert layers < 12, f"{layers} layers analysed: a running role went on to its end after the interrupt: {out!r}"
