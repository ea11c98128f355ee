"""flowgeom ``continuity analyze --spectra`` against weightwatcher 0.7.7 on the same matrices: values and speed.

    .venv/bin/python benchmarks/weightwatcher_compare.py [--source builtin:smollm2] [--ww-python /tmp/wwenv/bin/python]
                                                         [--rounds 3] [--threads 1] [--no-timing] [--no-values]

weightwatcher is not a flowgeom dependency. It is used when ``import
weightwatcher`` works in this interpreter or in ``--ww-python`` (a throwaway
venv: ``python3 -m venv /tmp/wwenv && /tmp/wwenv/bin/pip install torch==2.13.0
weightwatcher==0.7.7 safetensors``); otherwise the script says so and exits 0.

1. **Same matrices.** Every matrix the analyzer resolves (SmolLM2: 210
   dequantised Q4_1 projections; MiniLM: 36 BERT projections) is written,
   as float32, to one safetensors file with Llama names
   (``model.layers.L.self_attn.q_proj.weight`` ...). weightwatcher gets them
   as ``nn.Linear`` layers (bias-free) of one module, flowgeom reads the file.
2. **Values.** Per matrix: alpha, stable rank and entropy of flowgeom
   (``--dtype float32`` and ``float64``) against weightwatcher's
   ``analyze()`` defaults (``alpha``, ``stable_rank``, ``entropy``), and
   whether both chose the same ``xmin``.
3. **Speed**, end to end, as a user runs it, interleaved ``--rounds`` times,
   ``--threads`` threads each (default 1; with more, weightwatcher is also
   timed at 1 thread and the ratio is taken against its faster run):
   ``flowgeom continuity analyze SOURCE --spectra --json`` (the CLI:
   process start, opening the checkpoint, dequantising, all metrics;
   ``--threads N`` analyses N roles at once) against a Python process that
   loads the safetensors file
   into ``nn.Linear`` layers and runs ``WeightWatcher(model).analyze()``
   (weightwatcher's fastest input; it cannot read GGUF itself). Wall and
   CPU seconds (children's ``rusage``) are printed, with the load average.
   The same command without ``--spectra`` runs in the rounds too: the last
   line is what ``--spectra`` adds to it, end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HF = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
      "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}

WW_WORKER = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from torch import nn
from safetensors.torch import load_file
import weightwatcher as ww
import logging
logging.getLogger("weightwatcher").setLevel(logging.ERROR)
tensors = load_file(sys.argv[1])
model = nn.Module()
names = []
for i, (name, w) in enumerate(tensors.items()):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    model.add_module(f"m{i}", lin)
    names.append(name)
details = ww.WeightWatcher(model=model).analyze()
rows = []
for _, r in details.iterrows():
    idx = int(str(r["name"]).lstrip("m"))
    rows.append({"tensor": names[idx], "alpha": float(r["alpha"]), "xmin": float(r["xmin"]), "D": float(r["D"]),
                 "stable_rank": float(r["stable_rank"]), "entropy": float(r["entropy"]),
                 "n_tail": int(r["num_pl_spikes"])})
json.dump({"rows": rows, "seconds": time.perf_counter() - t0, "version": ww.__version__}, open(sys.argv[2], "w"))
"""


def ww_python(arg: str | None) -> str | None:
    """An interpreter that imports weightwatcher: this one, or ``arg`` (None if neither)."""
    for exe in ([sys.executable] + ([arg] if arg else [])):
        if exe and shutil.which(exe) or (exe and Path(exe).exists()):
            ok = subprocess.run([exe, "-c", "import weightwatcher"], capture_output=True).returncode == 0
            if ok:
                return exe
    return None


def export(source: str, path: Path) -> list[tuple[str, str, int]]:
    """The analyzer's matrices of ``source`` as float32 safetensors with Llama names; ``[(name, role, layer)]``."""
    from safetensors.torch import save_file

    from flowgeom.continuity import open_source
    from flowgeom.continuity.layouts import hints_for
    from flowgeom.continuity.naming import resolve_roles

    src = open_source(source)
    layout = resolve_roles(src.shapes, hints=hints_for(source))
    tensors, names = {}, []
    for role, refs in layout.roles.items():
        for ref in refs:
            name = f"model.layers.{ref.layer}.{HF[role]}.weight"
            tensors[name] = ref.load(src).float().contiguous()
            names.append((name, role, ref.layer))
    save_file(tensors, str(path))
    return names


def flowgeom_values(path: Path, dtype: str) -> dict[str, dict]:
    from flowgeom.continuity import AnalyzeConfig, analyze

    report = analyze(path, AnalyzeConfig(dtype=dtype, spectra=True))
    out = {}
    for role, r in report["roles"].items():
        for s in r["spectra"]:
            out[f"model.layers.{s['layer']}.{HF[role]}.weight"] = s
    return out


def compare(ww_rows: list[dict], fg: dict[str, dict], label: str) -> None:
    da, ds, de, same_xmin, rows = [], [], [], 0, []
    for r in ww_rows:
        s = fg[r["tensor"]]
        if s["alpha"] is None or r["alpha"] < 0:
            rows.append((r["tensor"], r["alpha"], s["alpha"]))
            continue
        da.append(abs(s["alpha"] - r["alpha"]))
        ds.append(abs(s["stable_rank"] - r["stable_rank"]) / r["stable_rank"])
        de.append(abs(s["entropy"] - r["entropy"]))
        same = s["alpha_n_tail"] == r["n_tail"]  # same x_min candidate (values differ by the eigenvalue error)
        same_xmin += same
        if not same or da[-1] > 1e-5:
            rows.append((r["tensor"], r["alpha"], s["alpha"], r["xmin"], s["alpha_xmin"]))
    n = len(da)
    print(f"{label}: {n} matrices; |d alpha| max {max(da):.2e} median {statistics.median(da):.2e}; "
          f"{sum(x <= 1e-5 for x in da)}/{n} within 1e-5; same xmin {same_xmin}/{n}; "
          f"stable rank rel. diff max {max(ds):.1e}; entropy |diff| max {max(de):.1e}")
    for row in rows[:8]:
        print("   differs:", row)


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """Wall and CPU seconds (user + sys of the child) of one subprocess run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{cmd[:3]} failed: {proc.stderr[-500:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default="builtin:smollm2")
    ap.add_argument("--ww-python", default="/tmp/wwenv/bin/python")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="BLAS/OpenMP threads of both sides (default 1, the project's rule for timings)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-values", action="store_true", help="skip the per-matrix value comparison")
    args = ap.parse_args()
    exe = ww_python(args.ww_python)
    if exe is None:
        print(f"weightwatcher is not importable here nor in {args.ww_python}: skipped (it is not a flowgeom "
              "dependency; see this script's docstring to install it in a throwaway venv)")
        return 0
    n = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n, MKL_NUM_THREADS=n)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        names = export(args.source, path)
        out = Path(tmp) / "ww.json"
        wall, cpu = timed([exe, "-c", WW_WORKER, str(path), str(out)], env)
        ww_out = json.loads(out.read_text())
        print(f"{args.source}: {len(names)} matrices; weightwatcher {ww_out['version']} analyze() {wall:.1f} s wall")
        if len(ww_out["rows"]) != len(names):
            print(f"   weightwatcher analysed {len(ww_out['rows'])} of {len(names)} matrices")
        for dtype in () if args.no_values else ("float32", "float64"):
            compare(ww_out["rows"], flowgeom_values(path, dtype), f"flowgeom --dtype {dtype} vs weightwatcher")
        if args.no_timing:
            return 0
        flowgeom = [str(Path(sys.executable).with_name("flowgeom")), "continuity", "analyze"]
        one = dict(env, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        plain = "flowgeom CLI, no --spectra"
        runs = {"flowgeom CLI on " + args.source: (flowgeom + [args.source, "--spectra", "--json", "--threads", n], env),
                plain: (flowgeom + [args.source, "--json", "--threads", n], env),
                "flowgeom CLI on the safetensors": (flowgeom + [str(path), "--spectra", "--json", "--threads", n], env),
                f"weightwatcher, {n} thread(s)": ([exe, "-c", WW_WORKER, str(path), str(out)], env)}
        if args.threads > 1:  # weightwatcher runs slower with 2 BLAS threads on 2 cores: compare with its best
            runs["weightwatcher, 1 thread"] = ([exe, "-c", WW_WORKER, str(path), str(out)], one)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
        load_before = os.getloadavg()[0]
        for _ in range(args.rounds):  # interleaved: slow drifts of the machine load hit every row alike
            for key, (cmd, run_env) in runs.items():
                times[key].append(timed(cmd, run_env))
        medians = {key: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
                   for key, ts in times.items()}
        ww_key = min((key for key in runs if key.startswith("weightwatcher")), key=lambda key: medians[key][0])
        ww_wall, ww_cpu = medians[ww_key]
        print(f"end to end, flowgeom at {n} thread(s), {args.rounds} interleaved rounds on {cpu_model()} "
              f"({os.cpu_count()} cores), 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
              f"(median wall / median CPU seconds; ratios against the fastest weightwatcher row, {ww_key!r}):")
        for key, (wall, cpu) in medians.items():
            print(f"  {key:42s} {wall:7.2f} s  {cpu:7.2f} s CPU   weightwatcher / this: {ww_wall / wall:5.2f}x wall, "
                  f"{ww_cpu / cpu:5.2f}x CPU")
        spectra_wall, spectra_cpu = medians["flowgeom CLI on " + args.source]
        print(f"--spectra adds {100 * (spectra_wall / medians[plain][0] - 1):+.1f}% wall, "
              f"{100 * (spectra_cpu / medians[plain][1] - 1):+.1f}% CPU to the command (target <= 20%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
