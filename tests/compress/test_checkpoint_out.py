"""Writing compressed checkpoint folders: a writer killed outright leaves nothing behind for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.compress.write import sweep_dead_writers, write_folder

_WRITER = """
import sys, time
from pathlib import Path
from flowgeom.compress.write import write_folder

def fill(tmp):
    (tmp / "model.safetensors").write_bytes(b"x" * 4096)
    print("filling", flush=True)
    time.sleep(60)

write_folder(Path(sys.argv[1]), fill, force=True)
"""


def _killed_writer(out: Path) -> None:
    """A real process that starts writing ``out`` and is SIGKILLed mid-fill (no cleanup can run)."""
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "filling"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_killed_writers_temporary_folder_is_swept_by_the_next_write(tmp_path):
    out = tmp_path / "out"
    _killed_writer(out)
    left = _hidden(tmp_path)
    assert len(left) == 1 and left[0].startswith(".out.w") and left[0].endswith(".tmp")  # the litter is real
    assert not out.exists()  # and nothing half-written took the name
    write_folder(out, lambda tmp: (tmp / "model.safetensors").write_bytes(b"new"), force=False)
    assert (out / "model.safetensors").read_bytes() == b"new" and _hidden(tmp_path) == []


def test_live_writers_and_other_folders_are_left_alone(tmp_path):
    out = tmp_path / "out"
    live = tmp_path / f".out.w{os.getppid()}.abc123.tmp"  # the test runner's parent: alive
    mine = tmp_path / f".out.w{os.getpid()}.zz_9.tmp"  # this very process
    other = tmp_path / ".out.w5.w999999.q.tmp"  # the temp of a folder named "out.w5", not of "out"
    plain = tmp_path / ".out.notes"
    for folder in (live, mine, other, plain):
        folder.mkdir()
    assert sweep_dead_writers(out) == []
    assert all(p.exists() for p in (live, mine, other, plain))


def test_a_folder_moved_aside_by_a_dead_writer_is_put_back(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    time.sleep(0.05)
    dead = proc.pid  # exited and reaped: no process has this pid now (pids are not reused this fast)
    aside = tmp_path / f".out.w{dead}.k3y.old"
    aside.mkdir()
    (aside / "model.safetensors").write_bytes(b"previous")
    assert sweep_dead_writers(out) == []
    assert (out / "model.safetensors").read_bytes() == b"previous" and not aside.exists()
    stale = tmp_path / f".out.w{dead}.k3y.tmp"
    stale.mkdir()
    assert sweep_dead_writers(out) == [stale] and not stale.exists() and out.exists()


_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8, torch.bool]


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text("abcxyz._0123", min_size=1, max_size=6),
                       st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 4), max_size=3)),
                       min_size=1, max_size=6))
def test_streamed_safetensors_are_byte_for_byte_safetensors_own(spec):
    """The one-tensor-at-a-time writer gives exactly the bytes of safetensors.torch.save (read back equal too)."""
    import io

    from safetensors.torch import load, save

    from flowgeom.compress.write import stream_safetensors

    g = torch.Generator().manual_seed(len(spec))
    tensors = {k: (torch.randn(shape, generator=g, dtype=torch.float64) * 50).to(dtype) for k, (dtype, shape) in spec.items()}
    fh = io.BytesIO()
    stream_safetensors(fh, tensors, {"format": "pt"})
    assert fh.getvalue() == save(tensors, metadata={"format": "pt"})
    back = load(fh.getvalue())
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
