"""Fixed cost of each ``flowgeom`` command against ``python -c "import torch"``.

Every command is a fresh subprocess (what a user pays at the shell): its wall
time against the baseline ``python -c "import torch"`` run in the same loop,
interleaved (each round runs every command once, in a shuffled order, so
machine load hits them alike), repeated, median per command. Prints the
median seconds and the ratio to the baseline, and the extra seconds above it.
Commands are tiny on purpose: what remains is start-up (imports, parser
construction, warm-ups), not work. Usage::

    .venv/bin/python benchmarks/cli_fixed_cost.py [--repeats 7] [--json]

``python -X importtime -m flowgeom ARGS 2> imports.txt`` then shows where
the import time of one command goes. Target: each command ≤ 1.3× the baseline
(the ``target`` column).

What is left above ``import torch``: ``laws count`` calls reverse-mode
``torch.func`` (``grad`` inside ``vmap``/``jvp``), whose first call enters
``torch._dynamo.compiled_autograd._disable()`` in functorch's
``_autograd_grad`` and so imports all of ``torch._dynamo`` (1–4 s, once per
process). ``laws list/show`` and ``langevin villani`` avoid it (plain
``torch.autograd``); the count engine's forward-over-reverse brackets are
vmapped ``torch.func`` transforms with no plain-autograd equivalent, so avoiding
that import there needs a rewrite of ``laws/fields.py`` or a patched torch.
``continuity analyze`` pays for ``scipy.linalg`` (its LAPACK kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET = 1.3  # each command's median against the baseline's
BASELINE = ("import torch", [sys.executable, "-c", "import torch"])
COMMANDS = {
    "flowgeom --help": ["--help"],
    "laws list": ["laws", "list"],
    "laws show relu2": ["laws", "show", "relu2"],
    "laws count relu2": ["laws", "count", "relu2", "--d-in", "4", "--width", "4", "--d-out", "3"],
    "continuity analyze minilm": ["continuity", "analyze", "builtin:minilm", "--k", "2"],
    "langevin villani tiny": ["langevin", "villani", "--loss", "norm2", "--rays", "1", "--points", "4",
                              "--probes", "2"],
}


def flowgeom_cmd(args: list[str]) -> list[str]:
    exe = Path(sys.executable).with_name("flowgeom")
    return [str(exe), *args] if exe.exists() else [sys.executable, "-m", "flowgeom", *args]


def wall(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", nargs="*", help="command names to run (default: all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmds = {BASELINE[0]: BASELINE[1]}
    cmds.update({name: flowgeom_cmd(a) for name, a in COMMANDS.items() if not args.only or name in args.only})
    times: dict[str, list[float]] = {name: [] for name in cmds}
    rng = random.Random(0)
    for name, cmd in cmds.items():  # warm the file cache once, untimed
        wall(cmd, env)
    for _ in range(args.repeats):
        order = list(cmds)
        rng.shuffle(order)
        for name in order:
            times[name].append(wall(cmds[name], env))
    base = statistics.median(times[BASELINE[0]])
    rows = {name: {"median_s": statistics.median(t), "ratio": statistics.median(t) / base,
                   "extra_s": statistics.median(t) - base, "min_s": min(t)} for name, t in times.items()}
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'command':30s} {'median s':>9s} {'min s':>7s} {'x import torch':>14s} {'extra s':>8s}  target "
          f"({args.repeats} interleaved repeats, load {os.getloadavg()[0]:.1f})")
    for name, r in rows.items():
        verdict = "" if name == BASELINE[0] else ("met" if r["ratio"] <= TARGET else "NOT met")
        print(f"{name:30s} {r['median_s']:9.2f} {r['min_s']:7.2f} {r['ratio']:14.2f} {r['extra_s']:8.2f}  {verdict}")


if __name__ == "__main__":
    main()
