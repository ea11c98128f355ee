"""The memory helper lives in a neutral module: `flowgeom langevin …` no longer imports the laws package."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowgeom.memory import FALLBACK_BYTES, available_memory


def test_langevin_villani_runs_without_importing_laws():
    code = ("import sys\nfrom flowgeom.cli import main\n"
            "rc = main(['langevin', 'villani', '--loss', 'norm2', '--rays', '2', '--points', '6', '--json'])\n"
            "print('RC', rc, sorted(m for m in sys.modules if m.startswith('flowgeom.laws')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "RC 0 []"


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux /proc/meminfo only")
def test_available_memory_reads_the_os(monkeypatch):
    have = available_memory(torch.device("cpu"))
    assert isinstance(have, int) and 0 < have
    with open("/proc/meminfo") as fh:
        kib = next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable:"))
    assert abs(have - kib * 1024) < 2**30  # the same reading, give or take what moved in between

    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr("builtins.open", no_proc)
    assert available_memory(torch.device("cpu")) == FALLBACK_BYTES
