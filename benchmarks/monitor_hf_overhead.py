"""Overhead of ConservationMonitor on a ~10M-parameter transformers Llama training step (CPU, 1 thread).

The same SGD loop runs with and without ``monitor.step(k)`` in paired blocks
of ``--every`` steps (the monitored block holds exactly one due step),
adjacent in time and in alternating order, ``--pairs`` times. The ratio is
median(monitored block) / median(plain block) in CPU time of the process (1
thread); the paired estimate median(monitored − plain) / median(plain) is
more robust on a shared machine, since the two blocks of a pair see the same
load. Also printed: the CPU time of one due ``step()`` and of one not-due
call measured on their own, and the load average. Target: overhead ≤ 5%
measuring every step.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/monitor_hf_overhead.py [--every N] [--pairs P]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch

from flowgeom.hf.tiny import tiny_model
from flowgeom.laws.monitor import ConservationMonitor


def _llama() -> torch.nn.Module:
    return tiny_model("llama", seed=0, dtype=torch.float32, hidden_size=256, intermediate_size=688,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                      vocab_size=8000, max_position_embeddings=256)


def main(pairs: int = 16, every: int = 1) -> dict[str, float]:
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    model = _llama()
    model.train()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = ConservationMonitor(model, every=every, warn=False)
    ids = torch.randint(0, 8000, (4, 128), generator=torch.Generator().manual_seed(0))
    k = 0

    def block(with_monitor: bool) -> tuple[float, float]:
        """(CPU, wall) seconds of ``every`` steps; with the monitor, exactly one of them is due."""
        nonlocal k
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(every):
            if with_monitor:
                mon.step(k)
            k += 1
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        return time.process_time() - cpu, time.perf_counter() - wall

    block(False), block(True)  # warm-up
    base, monitored = [], []
    for r in range(pairs):
        for with_monitor in ((False, True) if r % 2 == 0 else (True, False)):
            (monitored if with_monitor else base).append(block(with_monitor))

    def timed(fn, count: int = 10) -> float:
        cpu = time.process_time()
        for _ in range(count):
            fn()
        return (time.process_time() - cpu) / count

    due = timed(lambda: mon.step(0))
    not_due = timed(lambda: mon.step(1), 1000) if every > 1 else float("nan")
    b_cpu, m_cpu = (statistics.median(x[0] for x in xs) for xs in (base, monitored))
    b_wall, m_wall = (statistics.median(x[1] for x in xs) for xs in (base, monitored))
    paired = statistics.median(m[0] - b[0] for m, b in zip(monitored, base)) / b_cpu
    step = b_cpu / every
    print(f"llama {n / 1e6:.1f}M params, batch 4×128, 1 thread, monitor every {every} step(s), "
          f"{len(mon.items)} tracked quantities, {pairs} pairs; "
          f"load average {load0:.1f} → {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"CPU time per step: without monitor {b_cpu / every * 1e3:.0f} ms, with {m_cpu / every * 1e3:.0f} ms, "
          f"ratio {m_cpu / b_cpu:.3f} (overhead {100 * (m_cpu / b_cpu - 1):+.1f}%); "
          f"paired overhead {100 * paired:+.1f}%")
    print(f"wall time per step: without {b_wall / every * 1e3:.0f} ms, with {m_wall / every * 1e3:.0f} ms, "
          f"ratio {m_wall / b_wall:.3f}")
    print(f"one due step() {due * 1e3:.1f} ms CPU = {100 * due / step:.2f}% of a step; "
          f"expected overhead every {every}: {100 * due / (every * step):.2f}%"
          + (f"; one not-due step() {not_due * 1e6:.1f} µs" if every > 1 else ""))
    return {"ratio_cpu": m_cpu / b_cpu, "paired": paired, "ratio_wall": m_wall / b_wall, "due_s": due, "step_s": step}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=16)
    args = parser.parse_args()
    main(pairs=args.pairs, every=args.every)
