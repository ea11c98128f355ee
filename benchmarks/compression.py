"""Factored checkpoints against dense: bytes on disk, peak RSS, forward time, and the time to make one.

    .venv/bin/python benchmarks/compression.py [--budget 0.2] [--method whiten] [--repeats 5]

1. ``compress run builtin:smollm2`` at the budget (calibration from the disk cache when present: the
   first run measures it, and prints the time of each stage), factored and ``--dense``.
2. Projection tensors on disk: factored bytes / dense float32 bytes.
3. Forward of a 512-token window, 1 BLAS thread, factored and dense reconstruction interleaved
   ``--repeats`` times in one process: the median ratio, next to the flop ratio of the projections.
4. Peak RSS of loading each model and running one forward, each in a fresh subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

RSS = """
import sys, torch
torch.set_num_threads(1)
from flowgeom.compress.folder import load_model
m = load_model(sys.argv[1])
with torch.inference_mode():
    m(torch.zeros(1, 512, dtype=torch.long))
print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')))  # KiB
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--method", default="whiten")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from flowgeom.compress.folder import dense_state, factored_llama, projection_bytes, read_factored
    from flowgeom.compress.run import CompressionConfig, run_compression
    from flowgeom.nn.llama import llama_from_state

    tmp = Path(tempfile.mkdtemp(prefix="fg-bench-"))
    stages: dict[str, float] = {}
    last = {"stage": None, "t": time.perf_counter()}

    def progress(stage: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if last["stage"] != stage:
            last.update(stage=stage, t0=now)
        stages[stage] = now - last["t0"]

    t0 = time.perf_counter()
    result = run_compression("builtin:smollm2", tmp / "factored",
                             CompressionConfig(method=args.method, budget=args.budget), progress=progress)
    total = time.perf_counter() - t0
    print(f"compress run --method {args.method} --budget {args.budget}: {total:.1f} s in all (calibration "
          f"{'from cache' if result.report.get('calib_cached') else 'measured'}: {result.report.get('calib_seconds', 0):.1f} s; "
          + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()) + ")")
    factored_bytes, dense_bytes = projection_bytes(tmp / "factored")
    print(f"projection tensors on disk: factored {factored_bytes / 1e6:.1f} MB / dense float32 {dense_bytes / 1e6:.1f} MB"
          f" = {factored_bytes / dense_bytes:.3f}")
    size = sum(p.stat().st_size for p in (tmp / "factored").iterdir())
    print(f"whole factored folder: {size / 1e6:.1f} MB")

    fact = factored_llama(tmp / "factored")
    dense = llama_from_state(fact.config, result.compressed.dense_state(result.state))
    x = torch.randint(0, fact.config.vocab_size, (1, 512))
    with torch.inference_mode():
        diff = float((fact(x) - dense(x)).abs().max())
        scale = float(dense(x).abs().max())
        fact64 = factored_llama(tmp / "factored", dtype=torch.float64)
        cfg, units, tensors = read_factored(tmp / "factored")  # the reconstruction of what is on disk, in float64
        dense64 = llama_from_state(cfg, dense_state(units, tensors, dtype=torch.float64), dtype=torch.float64)
        diff64 = float((fact64(x[:, :64]) - dense64(x[:, :64])).abs().max())
        del fact64, dense64
        times = {"factored": [], "dense": []}
        for _ in range(args.repeats):
            for name, model in (("factored", fact), ("dense", dense)):
                t = time.perf_counter()
                model(x)
                times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    p = result.compressed.plan
    print(f"logits max |factored - dense reconstruction|: float64 {diff64:.2e}, float32 {diff:.2e} (rounding of two "
          f"matmuls against one, on logits up to {scale:.1f})")
    print(f"forward, 512 tokens, 1 thread, median of {args.repeats} interleaved: factored {med['factored']:.3f} s, "
          f"dense {med['dense']:.3f} s, ratio {med['factored'] / med['dense']:.3f} (projection flop ratio "
          f"{p.stored_params / p.dense_params:.3f}; the lm_head and attention are not compressed)")
    dense_dir = tmp / "dense"
    from flowgeom.compress.write import save_llama_folder

    dense_dir.mkdir()
    save_llama_folder(dense_dir, fact.config.to_hf(), result.compressed.dense_state(result.state))
    rss = {}
    for name, folder in (("factored", tmp / "factored"), ("dense", dense_dir)):
        out = subprocess.run([sys.executable, "-c", RSS, str(folder)], capture_output=True, text=True, check=True)
        rss[name] = int(out.stdout.strip().splitlines()[-1]) / 1024
    print(f"peak RSS (load + one forward): factored {rss['factored']:.0f} MB, dense {rss['dense']:.0f} MB, "
          f"ratio {rss['factored'] / rss['dense']:.3f}")
    print(json.dumps({"total_s": total, "bytes_ratio": factored_bytes / dense_bytes,
                      "forward_ratio": med["factored"] / med["dense"], "rss_ratio": rss["factored"] / rss["dense"]}))


if __name__ == "__main__":
    main()
