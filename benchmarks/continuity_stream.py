"""Peak memory and read throughput when streaming a synthetic sharded safetensors checkpoint.

    .venv/bin/python benchmarks/continuity_stream.py [--gb 2.1] [--dir /tmp] [--threads 2]

Writes a Llama-shaped checkpoint (float32, 7 roles, GQA k/v, shards of 4
layers + model.safetensors.index.json) of about ``--gb`` GB into a temporary
folder (deleted afterwards), then in fresh subprocesses measures

* peak anonymous RSS of the full analysis (float32 compute, sampled every
  5 ms from /proc/self/status), against the model size and the size of two
  layers of the largest role, measured two ways: above a process that only
  imports torch and flowgeom, and above the same process after it analysed a
  tiny 2-layer checkpoint first (so BLAS/LAPACK buffers and lazy imports,
  which do not grow with the model, are already paid);
* read throughput: every tensor through ``SafetensorsSource.load`` vs a raw
  ``read()`` of the same shard files, both on a warm page cache.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
from safetensors.torch import save_file

ROLES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def shapes(d: int, hidden: int, kv: int) -> dict[str, tuple[int, int]]:
    return {"q": (d, d), "k": (kv, d), "v": (kv, d), "o": (d, d), "gate": (hidden, d), "up": (hidden, d),
            "down": (d, hidden)}


def write_checkpoint(folder: Path, layers: int, d: int, hidden: int, kv: int, per_shard: int = 4) -> int:
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    n_shards = -(-layers // per_shard)
    for s in range(n_shards):
        fname = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        tensors = {}
        for layer in range(s * per_shard, min(layers, (s + 1) * per_shard)):
            for role, name in ROLES.items():
                t = torch.randn(*shapes(d, hidden, kv)[role], generator=g) / d ** 0.5
                tensors[f"model.layers.{layer}.{name}.weight"] = t
                total += t.numel() * 4
        save_file(tensors, folder / fname)
        weight_map |= {k: fname for k in tensors}
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total


CHILD = textwrap.dedent("""
    import sys, threading, time, torch
    def rss_anon():  # anonymous RSS (excludes mmapped file pages, which are page cache)
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    peak = [0]
    def sample():
        while True:
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.005)
    threading.Thread(target=sample, daemon=True).start()
    torch.set_num_threads(int(sys.argv[3]))
    from threadpoolctl import threadpool_limits
    threadpool_limits(int(sys.argv[3]), user_api="blas")
    from flowgeom.continuity import AnalyzeConfig, analyze, open_source
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "analyze-warm":  # tiny checkpoint first, then count only what the big one adds
        analyze(sys.argv[4], AnalyzeConfig(k=4, dtype="float32"))
        time.sleep(0.02)
        base = peak[0] = rss_anon()
    t0 = time.perf_counter()
    if mode.startswith("analyze"):
        analyze(path, AnalyzeConfig(k=4, dtype="float32"))
    elif mode == "load":
        src = open_source(path)
        for name in src.shapes:
            src.load(name)
    elif mode == "raw":
        import glob
        for f in sorted(glob.glob(path + "/*.safetensors")):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    time.sleep(0.02)
    print(time.perf_counter() - t0, peak[0] - (base if mode == "analyze-warm" else 0))
""")


def child(mode: str, path: Path, threads: int, *extra: Path) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(path), str(threads), *map(str, extra)],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    secs, rss = out.stdout.split()[-2:]
    return float(secs), int(rss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.1, help="approximate checkpoint size (default 2.1 GB)")
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--dir", default=None, help="where to create the temporary folder (check df -h first)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 avoids LAPACK spin on busy machines)")
    args = ap.parse_args()
    per_layer = sum(m * n for m, n in shapes(args.d, args.hidden, args.kv).values()) * 4
    layers = max(2, round(args.gb * 1e9 / per_layer))
    free = shutil.disk_usage(args.dir or tempfile.gettempdir()).free
    if free < 1.5 * layers * per_layer:
        raise SystemExit(f"not enough free disk ({free / 1e9:.1f} GB) for a {layers * per_layer / 1e9:.1f} GB checkpoint")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, tempfile.TemporaryDirectory() as tiny:
        folder = Path(tmp)
        size = write_checkpoint(folder, layers, args.d, args.hidden, args.kv)
        write_checkpoint(Path(tiny), 2, 64, 128, 16)
        largest = max(m * n for m, n in shapes(args.d, args.hidden, args.kv).values()) * 4
        _, rss0 = child("none", folder, args.threads)
        t_an, rss = child("analyze", folder, args.threads)
        _, grown = child("analyze-warm", folder, args.threads, Path(tiny))
        child("raw", folder, args.threads)  # warm the page cache
        t_raw, _ = child("raw", folder, args.threads)
        t_load, rss_load = child("load", folder, args.threads)
        mb = 1e-6
        print(f"checkpoint: {layers} layers x 7 roles (d={args.d}, hidden={args.hidden}, kv={args.kv}), "
              f"{size / 1e9:.2f} GB float32 in {-(-layers // 4)} shards")
        print(f"analysis (k=4, float32, {args.threads} threads): {t_an:.1f}s")
        print(f"peak anonymous RSS above import baseline: {(rss - rss0) * mb:.0f} MB  (baseline {rss0 * mb:.0f} MB)")
        print(f"  = {(rss - rss0) / size:.3f} x model size; {(rss - rss0) / (2 * largest):.2f} x two layers of the "
              f"largest role ({2 * largest * mb:.0f} MB float32)")
        print(f"peak anonymous RSS added by the big checkpoint after a tiny warm-up analysis: {grown * mb:.0f} MB "
              f"= {grown / (2 * largest):.2f} x two layers of the largest role")
        print(f"read throughput (warm cache): safetensors load {size / t_load / 1e9:.2f} GB/s vs raw read "
              f"{size / t_raw / 1e9:.2f} GB/s (ratio {t_raw / t_load:.2f}); load-only peak RSS "
              f"{(rss_load - rss0) * mb:.0f} MB")


if __name__ == "__main__":
    main()
