"""Overhead of ConservationMonitor on a ~10M-parameter transformers Llama training step (CPU, 1 thread).

The same SGD loop runs with and without ``monitor.step(k)`` (measured every
step, the worst case), interleaved in pairs and repeated; the script prints
the median step time of each and their ratio. Target: overhead ≤ 5%.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/monitor_hf_overhead.py [EVERY]
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

from flowgeom.hf.tiny import tiny_model
from flowgeom.laws.monitor import ConservationMonitor


def main(repeats: int = 5, steps: int = 4, every: int = 1) -> float:
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=0, dtype=torch.float32, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                       vocab_size=8000, max_position_embeddings=256)
    model.train()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = ConservationMonitor(model, every=every, warn=False)
    ids = torch.randint(0, 8000, (4, 128), generator=torch.Generator().manual_seed(0))

    def run(with_monitor: bool) -> float:
        start = time.perf_counter()
        for k in range(steps):
            if with_monitor:
                mon.step(k)
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        return (time.perf_counter() - start) / steps

    run(False), run(True)  # warm-up
    base, monitored = [], []
    for _ in range(repeats):
        base.append(run(False))
        monitored.append(run(True))
    b, m = statistics.median(base), statistics.median(monitored)
    print(f"llama {n / 1e6:.1f}M params, batch 4×128, 1 thread, monitor every {every} step(s), "
          f"{len(mon.items)} tracked quantities")
    print(f"step without monitor {b * 1e3:.1f} ms, with {m * 1e3:.1f} ms, ratio {m / b:.3f} "
          f"(overhead {100 * (m / b - 1):+.1f}%)")
    return m / b


if __name__ == "__main__":
    import sys

    main(every=int(sys.argv[1]) if len(sys.argv) > 1 else 1)
