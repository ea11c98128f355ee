"""Continuity at the papers' scale: synthetic Llama-3.1-8B / Llama-3-70B checkpoints, streamed (issue 34).

    # 1. write a synthetic checkpoint (sharded bf16 + HF index + config.json), one shard at a time
    .venv/bin/python benchmarks/continuity_scale.py write --shape 8b --out /work/scratch/llama8b
    .venv/bin/python benchmarks/continuity_scale.py write --shape 70b --layers 4 --out /work/scratch/llama70b
    # 2. analyse it end to end through the CLI: time, peak RSS, planted verdicts, results folder
    .venv/bin/python benchmarks/continuity_scale.py run --dir /work/scratch/llama8b --results results/full/continuity-8b
    .venv/bin/python benchmarks/continuity_scale.py run --dir /work/scratch/llama70b   # per-layer time, extrapolated
    .venv/bin/python benchmarks/continuity_scale.py run --dir /work/scratch/llama8b --device cuda  # NOT YET RUN here
    # 3. flat vs decaying spectra at one shape (in process, interleaved, 1 BLAS thread)
    .venv/bin/python benchmarks/continuity_scale.py flat --shape 3072x3072 --layers 3 [--ks 1,2,4,8,16]

Shapes (``SHAPES``): Llama-3.1-8B has 32 layers, d 4096, 32 query / 8
key-value heads of 128 (q, o 4096x4096; k, v 1024x4096), MLP 14336 (gate,
up 14336x4096; down 4096x14336). Llama-3-70B has 80 layers, d 8192, 64 / 8
heads (k, v 1024x8192), MLP 28672. The 70B checkpoint may be written for a
few layers only (``--layers``): ``run`` then reports the time per layer and
extrapolates it to the 80 layers, and says so.

**Planted structure** (seed 001's pattern). Every matrix is
``W_l = U_l diag(s) V_l^T + N_l``: a Gaussian bulk ``N`` (entries
``N(0, 1/(sqrt(m) + sqrt(n))^2)``, spectrum edge ~1) plus ``RANK`` spikes on
a power-law decaying spectrum ``s_i = SPIKE i^-DECAY`` (all above the
bulk edge, like the heavy-tailed top of trained weights). The directions
that a role shares drift slowly from layer to layer,
``X_{l+1} = orth(X_l + DRIFT G / sqrt(dim))``: adjacent top vectors have
``|cos| ~ 1 / sqrt(1 + DRIFT^2) = 0.96``, against ``~0.8 / sqrt(dim)`` for
unrelated ones. q, k, gate and up share input directions ``V`` (the
residual stream they read), o and down share output directions ``U`` (the
stream they write), v shares nothing: the verdicts the analyzer must
recover are ``PLANTED``.

``run`` calls ``flowgeom continuity analyze DIR --json --out ... --figure
...`` in a child process (both threads unless ``--threads``), takes its
peak RSS (``ru_maxrss``, and /proc sampled every 50 ms) and CPU time (on a
shared machine, CPU / cores bounds what idle cores would take), and writes
into ``--results``: ``report.json``
(the analyzer's report without the per-pair lists, which stay in
``pairs.json``), ``table.md`` (roles x v1/u1/verdict and seconds per
layer by role), ``heatmap.png`` (the analyzer's figure) and ``run.json``
(command, machine, load, wall time, peak RSS, planted vs found). It never
copies the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROLES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
SHARED = {"q": "in", "k": "in", "gate": "in", "up": "in", "o": "out", "down": "out", "v": "none"}
PLANTED = {"in": "input-continuous", "out": "output-continuous", "none": "neither"}
SHAPES = {  # name: (layers, hidden, heads, kv_heads, head_dim, intermediate)
    "8b": (32, 4096, 32, 8, 128, 14336),
    "70b": (80, 8192, 64, 8, 128, 28672),
}
RANK, SPIKE, DECAY, DRIFT = 32, 8.0, 0.5, 0.3


def role_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """``{role: (out, in)}`` of one layer of ``shape`` (Llama layout, weights (out, in))."""
    _, d, h, kv, hd, mlp = SHAPES[shape]
    return {"q": (h * hd, d), "k": (kv * hd, d), "v": (kv * hd, d), "o": (d, h * hd), "gate": (mlp, d),
            "up": (mlp, d), "down": (d, mlp)}


def config_json(shape: str, layers: int) -> dict:
    """A Llama ``config.json`` for ``layers`` layers of ``shape`` (what the analyzer reads for heads and shapes)."""
    _, d, h, kv, hd, mlp = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d, "intermediate_size": mlp,
            "num_attention_heads": h, "num_key_value_heads": kv, "head_dim": hd, "num_hidden_layers": layers,
            "vocab_size": 128256, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
            "flowgeom_synthetic": f"benchmarks/continuity_scale.py {shape}: planted {SHARED}"}


def _orth(X: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(X).Q  # (dim, RANK), orthonormal columns


class _Role:
    """The drifting shared directions of one role; ``next()`` gives its next layer's bf16 matrix."""

    def __init__(self, role: str, m: int, n: int, seed: int):
        self.role, self.m, self.n = role, m, n
        self.g = torch.Generator().manual_seed(seed)
        self.U = _orth(torch.randn(m, RANK, generator=self.g))  # (m, RANK)
        self.V = _orth(torch.randn(n, RANK, generator=self.g))  # (n, RANK)
        self.s = SPIKE * torch.arange(1, RANK + 1, dtype=torch.float32) ** -DECAY  # (RANK,)

    def _drift(self, X: torch.Tensor) -> torch.Tensor:
        return _orth(X + DRIFT * torch.randn(X.shape, generator=self.g) / X.shape[0] ** 0.5)

    def next(self) -> torch.Tensor:
        shared = SHARED[self.role]
        self.U = self._drift(self.U) if shared == "out" else _orth(torch.randn(self.m, RANK, generator=self.g))
        self.V = self._drift(self.V) if shared == "in" else _orth(torch.randn(self.n, RANK, generator=self.g))
        W = torch.randn(self.m, self.n, generator=self.g)  # (m, n) bulk
        W.mul_(1.0 / (self.m ** 0.5 + self.n ** 0.5))
        W.addmm_(self.U * self.s, self.V.mT)  # + U diag(s) V^T
        return W.to(torch.bfloat16)


def write(shape: str, out: Path, layers: int | None, seed: int) -> None:
    """Write ``layers`` layers of ``shape``: one shard per layer, each written and freed before the next."""
    from safetensors.torch import save_file

    total_layers = SHAPES[shape][0]
    layers = layers or total_layers
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise SystemExit(f"{out} already holds .safetensors files; pass an empty folder")
    shapes = role_shapes(shape)
    roles = {r: _Role(r, *shapes[r], seed=seed * 1000 + i) for i, r in enumerate(ROLES)}
    d = SHAPES[shape][1]
    weight_map, size, t0 = {}, 0, time.perf_counter()
    for layer in range(layers):
        fname = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        tensors = {f"model.layers.{layer}.{ROLES[r]}.weight": roles[r].next() for r in ROLES}
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        tensors[f"model.layers.{layer}.post_attention_layernorm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        size += sum(t.numel() * 2 for t in tensors.values())
        weight_map |= {name: fname for name in tensors}
        del tensors
        print(f"layer {layer + 1}/{layers} written ({size / 1e9:.1f} GB, {time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(config_json(shape, layers), indent=1))
    print(f"{out}: {layers} of {total_layers} layers of {shape}, {size / 1e9:.1f} GB bf16 in {layers} shards, "
          f"{time.perf_counter() - t0:.0f} s")


def _rss_sampler(pid: int, peak: list[int], stop: threading.Event) -> None:
    """Peak resident set of process ``pid`` (VmHWM when readable, else sampled VmRSS) into ``peak[0]``."""
    while not stop.is_set():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(("VmHWM:", "VmRSS:")):
                    peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        except OSError:
            return
        stop.wait(0.05)


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
            "load_before": os.getloadavg(), "torch": torch.__version__, "python": platform.python_version()}


def run(folder: Path, results: Path | None, device: str, threads: int, extra: list[str]) -> None:
    """Analyse ``folder`` through the CLI in a child process; print and (optionally) write the results."""
    cfg = json.loads((folder / "config.json").read_text())
    shape = next(name for name, s in SHAPES.items() if s[1] == cfg["hidden_size"])
    layers = cfg["num_hidden_layers"]
    tmp = results or Path(f"/tmp/continuity-scale-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "flowgeom", "continuity", "analyze", str(folder), "--json",
           "--out", str(tmp / "full-report.json"), "--figure", str(tmp / "heatmap.png"), "--device", device,
           "--threads", str(threads), "--progress", "lines", *extra]
    machine = _machine()
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=None)  # progress line goes to our stderr
    peak, stop = [0], threading.Event()
    sampler = threading.Thread(target=_rss_sampler, args=(child.pid, peak, stop), daemon=True)
    sampler.start()
    _, status, usage = os.wait4(child.pid, 0)  # the child's own CPU time and peak RSS (ru_maxrss, KiB)
    child.returncode = rc = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    stop.set()
    peak[0] = max(peak[0], usage.ru_maxrss * 1024)
    cpu = usage.ru_utime + usage.ru_stime
    if rc:
        raise SystemExit(f"analyze failed (exit {rc}): {' '.join(cmd)}")
    machine["load_after"] = os.getloadavg()
    report = json.loads((tmp / "full-report.json").read_text())
    layers = report["layers"]  # what was analysed (--max-layers may take fewer than the checkpoint holds)
    rows, ok = [], 0
    for role, r in report["roles"].items():
        want = PLANTED[SHARED[role]]
        ok += r["verdict"] == want
        rows.append({"role": role, "shape": r["shape"], "v1": r["v1"], "u1": r["u1"], "v1_ratio": r["v1_ratio"],
                     "u1_ratio": r["u1_ratio"], "verdict": r["verdict"], "planted": want,
                     "seconds_per_layer": r.get("seconds_per_layer")})
    total = SHAPES[shape][0]
    summary = {
        "command": " ".join(["flowgeom", *cmd[3:]]), "shape": shape, "layers_analysed": layers,
        "layers_model": total, "wall_s": wall, "analysis_s": report["seconds"], "cpu_s": cpu, "peak_rss_bytes": peak[0],
        "cpu_bound_2_idle_cores_s": cpu / 2,
        "extrapolated_model_s": wall / layers * total if layers < total else None,
        "planted_recovered": f"{ok}/{len(rows)}", "device": device, "threads": threads, "machine": machine,
        "roles": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "roles"}, indent=1))
    lines = _table(summary)
    print("\n".join(lines))
    if results:
        pairs = {role: r.pop("pairs") for role, r in report["roles"].items()}
        (results / "report.json").write_text(json.dumps(report, indent=1))
        (results / "pairs.json").write_text(json.dumps(pairs))
        (results / "run.json").write_text(json.dumps(summary, indent=1))
        (results / "table.md").write_text("\n".join(lines) + "\n")
        (results / "full-report.json").unlink()


def _table(summary: dict) -> list[str]:
    s = summary
    head = [f"# synthetic Llama-{s['shape']} ({s['layers_analysed']} of {s['layers_model']} layers, bf16, planted)",
            "", f"command: `{s['command']}`", "",
            f"wall {s['wall_s']:.1f} s (analysis {s['analysis_s']:.1f} s; CPU {s['cpu_s']:.0f} s, i.e. >= "
            f"{s['cpu_bound_2_idle_cores_s']:.0f} s on 2 idle cores), peak RSS {s['peak_rss_bytes'] / 1e9:.2f} GB, "
            f"{s['threads']} threads on {s['machine']['cpus']} CPUs, load average before "
            f"{s['machine']['load_before'][0]:.2f}, after {s['machine']['load_after'][0]:.2f}; planted verdicts "
            f"recovered {s['planted_recovered']}"]
    if s["extrapolated_model_s"]:
        head.append(f"extrapolated to all {s['layers_model']} layers: {s['extrapolated_model_s'] / 60:.1f} min "
                    f"(wall / {s['layers_analysed']} x {s['layers_model']}; measured on a subset of layers)")
    head += ["", "| role | shape | v1 (x chance) | u1 (x chance) | verdict | planted | s / layer |",
             "|---|---|---|---|---|---|---|"]
    for r in s["roles"]:
        spl = f"{r['seconds_per_layer']:.2f}" if r["seconds_per_layer"] is not None else "-"
        head.append(f"| {r['role']} | {r['shape'][0]}x{r['shape'][1]} | {r['v1']:.3f} ({r['v1_ratio']:.0f}x) | "
                    f"{r['u1']:.3f} ({r['u1_ratio']:.0f}x) | {r['verdict']} | {r['planted']} | {spl} |")
    return head


def flat(shape: tuple[int, int], layers: int, reps: int, k: int = 8) -> None:
    """Time ``layers`` Gaussian (flat) vs planted (decaying) float32 matrices of ``shape``, interleaved, 1 thread,
    ``k`` top pairs (issue 41: every k from 1 to 16 within 10 s at 3 x 3072^2; ``--ks 1,2,4,8,16`` sweeps it)."""
    from threadpoolctl import threadpool_limits

    from flowgeom.continuity import AnalyzeConfig, analyze

    m, n = shape
    g = torch.Generator().manual_seed(0)
    flat_sd = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(m, n, generator=g) for i in range(layers)}
    role = _Role("down", m, n, seed=1)
    decay_sd = {f"model.layers.{i}.mlp.down_proj.weight": role.next().float() for i in range(layers)}
    cfg = AnalyzeConfig(dtype="float32", workers=1, k=k)
    times, cpu = {"flat": [], "decaying": []}, {"flat": [], "decaying": []}
    depth = {}
    torch.set_num_threads(1)
    with threadpool_limits(1):
        for _ in range(reps):
            for name, sd in (("flat", flat_sd), ("decaying", decay_sd)):
                t0, c0 = time.perf_counter(), time.process_time()
                rep = analyze(sd, cfg)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                depth[name] = [s["krylov_depth"] for s in rep["roles"]["down"]["spectra"]]
    best, cpu = {k: min(v) for k, v in times.items()}, {k: min(v) for k, v in cpu.items()}
    print(f"{layers} x {m}x{n} float32, k={k}, 1 thread, best of {reps} (load {os.getloadavg()[0]:.2f}): "
          f"flat {best['flat']:.2f} s wall / {cpu['flat']:.2f} s CPU (Krylov depth {depth['flat']}), decaying "
          f"{best['decaying']:.2f} s / {cpu['decaying']:.2f} s (depth {depth['decaying']}); flat / decaying = "
          f"{best['flat'] / best['decaying']:.2f} wall, {cpu['flat'] / cpu['decaying']:.2f} CPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a synthetic sharded bf16 checkpoint")
    w.add_argument("--shape", choices=SHAPES, required=True)
    w.add_argument("--out", type=Path, required=True, help="an empty folder (never inside the repository)")
    w.add_argument("--layers", type=int, default=None, help="write only the first N layers (default: all)")
    w.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="analyse a written checkpoint through the CLI; time, RSS, verdicts")
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--results", type=Path, default=None, help="folder for table, figure, report (small files)")
    r.add_argument("--device", default="cpu", help="cpu or cuda (cuda: written, not yet run on this project's VMs)")
    r.add_argument("--threads", type=int, default=os.cpu_count())
    r.add_argument("extra", nargs="*", help="more analyze flags after --, e.g. -- --roles q,k")
    f = sub.add_parser("flat", help="flat (Gaussian) vs decaying spectra at one shape, in process")
    f.add_argument("--shape", default="3072x3072", help="MxN (default 3072x3072)")
    f.add_argument("--layers", type=int, default=3)
    f.add_argument("--reps", type=int, default=2)
    f.add_argument("--ks", default="8", help="top-k values to time, e.g. 1,2,4,8,16 (default 8)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cmd == "write":
        write(args.shape, args.out, args.layers, args.seed)
    elif args.cmd == "run":
        run(args.dir, args.results, args.device, args.threads, args.extra)
    else:
        m, n = (int(x) for x in args.shape.lower().split("x"))
        for k in (int(x) for x in args.ks.split(",")):
            flat((m, n), args.layers, args.reps, k)


if __name__ == "__main__":
    main()
