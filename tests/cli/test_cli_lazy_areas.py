"""The CLI imports only the area a command names (fixed cost), and still lists every area when asked."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = '''
import json, sys
from flowgeom.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # argparse's --help and usage errors
    code = exc.code
print(json.dumps({"code": code, "areas": sorted(m for m in sys.modules if m.startswith("flowgeom.cli.")
                                                  and m.split(".")[2] in ("laws", "conserve", "continuity",
                                                                         "langevin", "reproduce", "demo"))}))
'''


def _run(*argv: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *argv], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout + proc.stderr


def test_command_imports_only_its_area():
    report, out = _run("--debug", "langevin", "villani", "--loss", "norm2", "--rays", "1", "--points", "4",
                       "--probes", "2", "--json")
    assert report == {"code": 0, "areas": ["flowgeom.cli.langevin"]}, out


def test_top_level_help_and_typo_see_every_area():
    report, out = _run("--help", "laws")
    assert len(report["areas"]) == 6 and "conserve" in out and "reproduce" in out
    report, out = _run("lws", "list")
    assert report["code"] == 2 and len(report["areas"]) == 6
    assert "invalid choice: 'lws'" in out and "'continuity'" in out
