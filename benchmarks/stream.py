"""Peak memory of ``compress run --stream`` on a synthetic Llama of ~3 GB float32, as a ratio to that size.

    .venv/bin/python benchmarks/stream.py [--work DIR] [--keep] [--threads 2] [--layers 13] [--limit 0.8]

1. Writes a Llama with SmolLM2's tokenizer and vocabulary (49,152), hidden 2048, intermediate 5632, 16 heads,
   4 KV heads, tied embeddings, ``--layers`` blocks (13: 2.75 GB float32) as float32 safetensors shards of
   ~``--shard-mb`` MB plus an index, into ``--work`` (default: a new temporary folder; deleted afterwards
   unless ``--keep``). Weights are N(0, 1/fan_in) (embeddings N(0, 1)), so activations stay of order one.
2. Runs ``flowgeom compress run DIR --out DIR/out --budget 0.2 --method whiten --allocate even --stream
   --calib-tokens 8192 --threads N --json`` in a fresh subprocess, which prints its own ``VmHWM`` (peak RSS,
   /proc/self/status) at the end (as benchmarks/heal.py does: ``ru_maxrss`` survives ``exec``, so a child
   forked from this process, which wrote the shards, could report this process's peak). 8,192 tokens: the
   Gram of down_proj's 5,632-wide input needs at least 5,632 to be full rank.
3. Prints peak RSS / float32 bytes (target <= 0.5), wall time, cores and load.

``--limit F`` also runs the command under ``RLIMIT_DATA`` = F x the float32 bytes (set in the child before
``exec``) and reports whether it finished. Since Linux 4.7 that limit counts every private writable mapping
(heap, torch's tensors, thread stacks) but not the shards, which ``safetensors.safe_open`` maps read-only: a
ceiling on the memory the process can fill, without root. ``RLIMIT_AS`` cannot stand in for it: torch and
glibc reserve address space they never touch and the read-only shard maps count, so at F < 1 the run
failed at open (F = 0.95: 2 s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CHILD = """
import sys
from flowgeom.cli import main
code = main(sys.argv[1:])
print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')))  # KiB
sys.exit(code)
"""


def llama_config(layers: int, vocab: int):
    from flowgeom.nn.llama import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=2048,
                       rope_theta=10000.0, tie_word_embeddings=True)


def write_model(folder: Path, cfg, tokenizer, shard_bytes: int, seed: int = 0) -> int:
    """Shards + index + config.json + tokenizer.json of a random ``cfg``; returns the float32 bytes."""
    from safetensors.torch import save_file

    from flowgeom.nn.llama import LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items() if k != "lm_head.weight"}
    shard, shards, weight_map, total = {}, [], {}, 0

    def flush():
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        shards.append(name)
        weight_map.update({k: name for k in shard})
        shard.clear()

    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            t = 0.5 + torch.rand(shape, generator=gen)
        else:  # (out, in) or the embeddings (vocab, d)
            t = torch.randn(shape, generator=gen) / (1.0 if "embed" in name else math.sqrt(shape[1]))
        shard[name] = t
        total += t.numel() * 4
        if sum(x.numel() * 4 for x in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg.to_hf()))
    tokenizer.save(str(folder / "tokenizer.json"))
    return total


def run_child(argv: list[str], limit: int | None) -> dict:
    """``flowgeom`` in a fresh process: exit code, peak RSS (bytes), wall seconds, its last stderr lines."""
    def cap():
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True,
                          preexec_fn=cap if limit else None)
    wall = time.perf_counter() - t0
    lines = proc.stdout.strip().splitlines()
    peak = int(lines[-1]) * 1024 if proc.returncode == 0 and lines and lines[-1].isdigit() else None
    return {"code": proc.returncode, "peak_rss_bytes": peak, "wall_s": wall,
            "stderr_tail": proc.stderr.strip().splitlines()[-3:]}


def machine() -> dict:
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return {"cpu": model, "cores": os.cpu_count(), "load": os.getloadavg(), "python": platform.python_version(),
            "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, help="folder for the synthetic model (default: a new temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the model and the compressed folder")
    ap.add_argument("--layers", type=int, default=13)
    ap.add_argument("--shard-mb", type=int, default=500)
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=float, help="also run under RLIMIT_DATA = this fraction of the float32 bytes")
    args = ap.parse_args()

    from flowgeom.data.tokens import load_tokenizer
    from flowgeom.io import builtin_path

    tokenizer = load_tokenizer(builtin_path("builtin:smollm2"))
    work = args.work or Path(tempfile.mkdtemp(prefix="flowgeom-stream-"))
    src = work / "model"
    try:
        t0 = time.perf_counter()
        size = write_model(src, llama_config(args.layers, tokenizer.get_vocab_size()), tokenizer,
                           args.shard_mb * 10**6)
        print(json.dumps({"model_float32_mb": size / 1e6, "shards": len(list(src.glob("model-*.safetensors"))),
                          "write_s": time.perf_counter() - t0, "machine_before": machine()}), flush=True)
        command = ["compress", "run", str(src), "--budget", "0.2", "--method", "whiten", "--allocate", "even",
                   "--stream", "--calib-tokens", str(args.calib_tokens), "--threads", str(args.threads), "--json",
                   "--force"]
        runs = {"stream": run_child([*command, "--out", str(work / "out")], None)}
        if args.limit:
            runs["stream_limited"] = run_child([*command, "--out", str(work / "out_limited")],
                                               int(args.limit * size))
            runs["stream_limited"]["limit_bytes"] = int(args.limit * size)
        for run in runs.values():
            if run["peak_rss_bytes"] is not None:
                run["peak_rss_mb"] = run["peak_rss_bytes"] / 1e6
                run["peak_over_float32"] = run["peak_rss_bytes"] / size
        print(json.dumps({"command": "flowgeom " + " ".join(command + ["--out", "OUT"]), "runs": runs,
                          "target_peak_over_float32": 0.5, "machine_after": machine()}, indent=1))
    finally:
        if not args.keep:  # what this script wrote: the whole temporary folder, or its three folders in --work
            for path in [work] if args.work is None else [src, work / "out", work / "out_limited"]:
                shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
