"""Real processes, killed or racing: no torn file, and a killed run resumes to what an uninterrupted one writes.

* Two processes write the same file at once (``runs.atomic_write_bytes``)
  while this one reads it: every read is one writer's complete payload.
* A writer SIGKILLed halfway through a file leaves the previous file intact
  (and only its own temporary file beside it).
* A run folder (config, metrics lines, checkpoints) SIGKILLed at a random
  moment: its checkpoint decodes, its metrics are whole lines, and resuming
  from the checkpoint ends with exactly the files of an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowgeom.runs import RunFolder, atomic_write_bytes

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
SIZE = 1 << 16  # bytes per payload: large enough that a non-atomic write would be seen half done

WRITER = """
import sys
from flowgeom.runs import atomic_write_bytes
target, mark, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    atomic_write_bytes(target, bytes([mark]) * {size} + i.to_bytes(4, "big"))
""".format(size=SIZE)

HALF_WRITER = """
import sys, time
from pathlib import Path
from flowgeom.runs import atomic_write
target, ready = sys.argv[1], Path(sys.argv[2])
def write(fh):
    fh.write(b"N" * {half})
    fh.flush()
    ready.write_text("half written")
    time.sleep(60)  # killed here
    fh.write(b"N" * {half})
atomic_write(target, write)
""".format(half=SIZE // 2)

RUN = """
import sys, torch
from pathlib import Path
from flowgeom.runs import RunFolder
run, ready, steps = RunFolder(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
run.start({"steps": steps}, resume=False)
for step in range(steps):
    run.log({"step": step, "loss": 1.0 / (step + 1)})
    run.save_checkpoint({"step": step, "w": torch.full((4096,), float(step))})
    if step == 5:
        ready.write_text("running")
run.finish({"last": steps - 1})
"""


def child(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stderr=subprocess.PIPE,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.005)


@pytest.mark.slow  # two interpreters importing torch at once: ~3 s idle, more on a loaded machine
def test_two_writers_at_once_never_show_a_torn_file(tmp_path):
    target = tmp_path / "out" / "report.bin"
    n = 15
    writers = [child(WRITER, target, mark, n) for mark in (1, 2)]
    seen = set()
    while any(w.poll() is None for w in writers):
        try:
            data = target.read_bytes()
        except FileNotFoundError:  # before the first rename
            continue
        assert len(data) == SIZE + 4 and data[:SIZE] == data[:1] * SIZE, "a reader saw a torn file"
        seen.add(data[0])
        time.sleep(0.001)  # leave the two writers the CPU
    assert [w.wait() for w in writers] == [0, 0], [w.stderr.read().decode() for w in writers]
    data = target.read_bytes()
    assert data[:SIZE] == data[:1] * SIZE and int.from_bytes(data[SIZE:], "big") == n - 1
    assert seen <= {1, 2} and sorted(p.name for p in target.parent.iterdir()) == ["report.bin"]


def test_a_writer_killed_halfway_leaves_the_old_file(tmp_path):
    target = tmp_path / "summary.json"
    atomic_write_bytes(target, b'{"old": true}\n')
    proc = child(HALF_WRITER, target, tmp_path / "ready")
    wait_for(tmp_path / "ready", proc)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert target.read_bytes() == b'{"old": true}\n'  # never half of the new one
    [tmp] = [p for p in tmp_path.iterdir() if p.name.startswith(".summary.json.")]
    assert tmp.stat().st_size == SIZE // 2  # the killed writer's own temporary file, never read as the result
    atomic_write_bytes(target, b'{"new": true}\n')  # the next writer is not disturbed by it
    assert target.read_bytes() == b'{"new": true}\n'


def _resume(path: Path, steps: int) -> None:
    """What an experiment's --resume does: continue after the checkpoint, drop the metrics logged after it."""
    run = RunFolder(path)
    run.start({"steps": steps}, resume=True)
    state = run.load_checkpoint()
    first = 0 if state is None else state["step"] + 1
    run.truncate_metrics(after_step=first - 1)
    for step in range(first, steps):
        run.log({"step": step, "loss": 1.0 / (step + 1)})
        run.save_checkpoint({"step": step, "w": torch.full((4096,), float(step))})
    run.finish({"last": steps - 1})


def test_a_run_killed_at_a_random_moment_resumes_to_the_uninterrupted_files(tmp_path):
    steps = 40
    ref = tmp_path / "ref"
    _resume(ref, steps)  # no checkpoint yet: this is the uninterrupted run
    killed = tmp_path / "killed"
    proc = child(RUN, killed, tmp_path / "ready", steps)
    wait_for(tmp_path / "ready", proc)
    time.sleep(random.Random(os.getpid()).uniform(0.0, 0.05))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    run = RunFolder(killed)
    state = run.load_checkpoint()  # decodes: a checkpoint is never torn
    records = run.metrics()  # whole lines only (a line cut by the kill is skipped)
    assert state is not None and [r["step"] for r in records] == list(range(len(records)))
    assert state["step"] <= records[-1]["step"] <= state["step"] + 1
    _resume(killed, steps)
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        assert (killed / name).read_bytes() == (ref / name).read_bytes(), name
    assert torch.equal(run.load_checkpoint()["w"], RunFolder(ref).load_checkpoint()["w"])
