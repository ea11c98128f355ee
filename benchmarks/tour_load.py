"""The quick tour under load: wall and CPU time idle against beside two busy-loop processes.

    python benchmarks/tour_load.py                       # a subset of the tour's runs: --jobs 1 against the default
    python benchmarks/tour_load.py --variant one=:1 --variant two=:2 --repeats 3
    python benchmarks/tour_load.py --tour                # the whole of `flowgeom demo`'s sweep (many minutes)
    git archive OLD src | tar -x -C /tmp/old             # then time that checkout's code beside this one:
    python benchmarks/tour_load.py --variant old=/tmp/old/src:1 --variant new=:2

Each measurement is a fresh child process ``flowgeom reproduce all --quick
--only … [--jobs J] --out TMP`` (its imports included, as a user pays them),
for each ``--variant NAME=SRC:JOBS`` (SRC: a ``src/`` folder put first on
PYTHONPATH, empty for the installed flowgeom; JOBS: a number, or ``auto``
for no ``--jobs`` flag, i.e. the default of ``flowgeom reproduce``, 1),
timed by this process, which also starts the load: ``--busy`` processes
``python3 -c 'while True: pass'`` (default 2, one per core of the 2-core
machine), killed when the child ends. Configurations and loads are
interleaved, repeat by repeat, so that slow drift of the machine's other work
spoils both sides alike; ``uptime``'s one-minute load average is printed with
every line.

Printed per configuration: wall and CPU seconds (user + system of the child
and its workers, from ``wait4``), idle and loaded, and the ratios
loaded / idle. With ``n`` cores and ``b`` busy loops, a program that uses the
cores fairly slows by at most ``(n + b) / n`` (2× for two loops on two cores)
and its CPU time stays the same; CPU time that grows under load is threads
spinning while they wait for a descheduled partner (OpenMP, OpenBLAS).

What "idle" means here: nothing of ours beside the child. On a shared machine
other people's work is there too; the load average says how much.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The default subset: short runs of two kinds (six law counts in float64, two tiny monitored LM trainings), under a
# minute idle at 2 cores, so that a loaded repeat stays within minutes.
SUBSET = ("laws.mha", "laws.moe-softmax", "laws.mha-rope", "conservation.drift")
BUSY = "while True: pass"


def load_average() -> float:
    return os.getloadavg()[0]


def run_child(args: list[str], *, env: dict[str, str], busy: int) -> tuple[float, float, int]:
    """``(wall s, cpu s, exit code)`` of one child process, with ``busy`` busy loops beside it."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        time.sleep(0.2 if busy else 0.0)  # the loops are running before the child starts
        t0 = time.perf_counter()
        child = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - t0
        child.returncode = os.waitstatus_to_exitcode(status)
        err = child.stderr.read().decode(errors="replace") if child.stderr else ""
        if child.returncode not in (0, 1):  # 1: a claim "not reproduced" at quick scale is still a full run
            print(err[-2000:], file=sys.stderr)
        return wall, usage.ru_utime + usage.ru_stime, child.returncode
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=list(SUBSET), help=f"claim ids (default {' '.join(SUBSET)})")
    ap.add_argument("--tour", action="store_true", help="every claim the demo runs (overrides --only)")
    ap.add_argument("--variant", action="append", default=None, metavar="NAME=SRC:JOBS",
                    help="a configuration to time (repeatable; default: the installed flowgeom at --jobs 1 and at one run "
                         "per core)")
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes for the loaded side (default 2)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", default=None, help="keep the sweep folders under this folder")
    args = ap.parse_args()

    cores = len(os.sched_getaffinity(0))
    variants = {}
    for item in args.variant or ["jobs-1=:1", f"jobs-{cores}=:{cores}"]:
        name, _, rest = item.partition("=")
        src, _, jobs = rest.rpartition(":")
        env = dict(os.environ)
        if src:
            env["PYTHONPATH"] = os.pathsep.join([str(Path(src).resolve()), env.get("PYTHONPATH", "")])
        variants[name] = (env, jobs or "auto", src or "the installed flowgeom")
    only: list[str] = []
    if args.tour:
        from flowgeom.reproduce.registry import AREAS, load_claims

        only = [c.id for c in load_claims(list(AREAS)) if not c.heavy and not c.unavailable]
    else:
        only = list(args.only)
    root = Path(args.keep or tempfile.mkdtemp(prefix="tour-load-"))
    print(f"cores available: {cores}; busy loops on the loaded side: {args.busy}; claims: {' '.join(only)}")
    for name, (_, jobs, src) in variants.items():
        print(f"variant {name}: code {src}, --jobs {jobs}")
    print(f"python {sys.version.split()[0]}")
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for rep in range(args.repeats):
        for name, (env, jobs, _) in variants.items():
            for busy in (0, args.busy):
                out = root / f"{name}-b{busy}-r{rep}"
                shutil.rmtree(out, ignore_errors=True)
                cmd = [sys.executable, "-m", "flowgeom", "reproduce", "all", "--quick", "--out", str(out)]
                cmd += [] if jobs == "auto" else ["--jobs", jobs]
                for cid in only:
                    cmd += ["--only", cid]
                before = load_average()
                wall, cpu, code = run_child(cmd, env=env, busy=busy)
                results.setdefault((name, busy), []).append((wall, cpu))
                print(f"repeat {rep} {name:>12} busy={busy}: wall {wall:7.1f} s  cpu {cpu:7.1f} s  exit {code}  "
                      f"(load average {before:.1f} before, {load_average():.1f} after)", flush=True)
                if not args.keep:
                    shutil.rmtree(out, ignore_errors=True)
    print("\nmedian over repeats; ratio = loaded / idle")
    print(f"{'variant':>12} {'idle wall':>10} {'loaded wall':>12} {'wall ratio':>11} {'idle cpu':>9} {'loaded cpu':>11} "
          f"{'cpu ratio':>10}")
    for name in variants:
        idle, loaded = results[(name, 0)], results[(name, args.busy)]
        iw, lw = statistics.median(w for w, _ in idle), statistics.median(w for w, _ in loaded)
        ic, lc = statistics.median(c for _, c in idle), statistics.median(c for _, c in loaded)
        print(f"{name:>12} {iw:10.1f} {lw:12.1f} {lw / iw:10.2f}x {ic:9.1f} {lc:11.1f} {lc / ic:9.2f}x")
    fair = (cores + args.busy) / cores
    print(f"fair share: at most {fair:.1f}x wall, 1.0x cpu ({args.busy} busy loops on {cores} cores)")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
