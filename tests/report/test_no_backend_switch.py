"""Library code never switches matplotlib's global backend (figures use the object API)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent('''
    import importlib, json, pkgutil, sys
    import matplotlib
    import flowgeom

    before = matplotlib.get_backend()
    failed, names = [], []
    for info in pkgutil.walk_packages(flowgeom.__path__, "flowgeom."):
        if info.name.endswith("__main__"):
            continue  # runs the CLI on import
        names.append(info.name)
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # reported, so an import bug fails the test loudly
            failed.append(f"{info.name}: {type(exc).__name__}: {exc}")
    after_import = matplotlib.get_backend()

    out = sys.argv[1]
    from flowgeom.report.figures import curves, log_bars, paired_bars
    from flowgeom.experiments.langevin_rate import plot_rate
    from flowgeom.experiments.conservation import plot_run
    curves(out + "/curves.png", {"a": ([1, 2, 3], [1.0, 0.5, 0.2])}, title="t", xlabel="x", ylabel="y", logy=True)
    log_bars(out + "/bars.png", {"g": {"law": 1e-16, "control": 0.3}}, title="t", ylabel="y", threshold=1e-8)
    paired_bars(out + "/paired.png", ["a", "b"], [1, 2], [2, 1], names=("seed", "ours"), title="t", ylabel="y")
    plot_rate({"time": [0, 1, 2], "suboptimality": {"log": [1.0, 0.3, 0.1]}, "log_inv_eps": [1.0, 2.0],
               "tau": {"log": [0.5, None]}}, out + "/rate.png")
    plot_run([{"step": 0, "ffn/w": 1e-3}, {"step": 5, "ffn/w": 2e-3}], out + "/run.png", title="t")
    import matplotlib.pyplot  # noqa: F401 - pyplot is only imported here, by the test itself
    print(json.dumps({"before": before, "after_import": after_import, "after_figures": matplotlib.get_backend(),
                      "pyplot_figures": matplotlib.pyplot.get_fignums(), "failed": failed, "n": len(names)}))
''')


def test_imports_and_figures_leave_backend_alone(tmp_path):
    env = {**os.environ, "MPLBACKEND": "svg", "OMP_NUM_THREADS": "1"}  # anything but Agg: a switch shows
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["failed"] == []
    assert report["n"] > 50
    assert report["before"] == report["after_import"] == report["after_figures"] == "svg"
    assert report["pyplot_figures"] == []
    for name in ("curves", "bars", "paired", "rate", "run"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
