"""Overhead of ConservationMonitor against one training step of the quick LM.

Usage: .venv/bin/python benchmarks/monitor_overhead.py [--threads 1] [--reps 60] [--arch mha-rope-swiglu]

The step (forward, backward, SGD update on a KJV batch) and the monitor's
measurement (float64 copies of the law parameters, every law, the segmented
ε reduction) are timed interleaved in the same process, so machine load hits
both alike; the ratio of medians is printed for a measurement every step and
amortised over ``every`` = 10 steps (the experiments' default). Also timed: the
exact plain-SGD prediction's work at every optimiser step (h of the step's
gradient and the weights' norms, what the monitor's step hook does), which is
paid at every step whatever ``every`` is.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--arch", default="mha-rope-swiglu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")

    from flowgeom.experiments.conservation import ConservationConfig, build_task
    from flowgeom.laws.monitor import ConservationMonitor

    cfg = ConservationConfig.for_arch(args.arch)  # the quick LM of `flowgeom conserve run --quick`
    task = build_task(cfg)
    model = task.model
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(0)
    mon = ConservationMonitor(model, warn=False, optimizer=opt, predict=False)
    mon._track_sgd(opt)  # the step hook, timed by hand below: it fires inside opt.step()
    mon.close()

    def train_step() -> None:
        x, y = task.batch(gen)
        loss = task.loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(5):  # warm-up
        train_step()
        mon.measure()
    steps, measures, predicts = [], [], []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        train_step()
        t1 = time.perf_counter()
        mon.measure()
        t2 = time.perf_counter()
        mon._sgd_step(opt)  # the hook's work after this step (its gradients are still there)
        t3 = time.perf_counter()
        steps.append(t1 - t0)
        measures.append(t2 - t1)
        predicts.append(t3 - t2)
    step, meas, pred = statistics.median(steps), statistics.median(measures), statistics.median(predicts)
    n_laws = sum(t.law.count for t in mon.items)
    print(f"quick LM {args.arch}: {sum(p.numel() for p in model.parameters())} parameters, "
          f"{len(mon.items)} tracked quantities ({n_laws} scalars), batch {cfg.batch}×{cfg.seq_len}, "
          f"{args.threads} thread(s)")
    print(f"training step  median {step * 1e3:8.2f} ms")
    print(f"monitor        median {meas * 1e3:8.2f} ms")
    print(f"overhead every step     : {100 * meas / step:6.2f} %  (target ≤ 5 %)")
    print(f"overhead every 10 steps : {10 * meas / step:6.2f} %")
    print(f"plain-SGD prediction median {pred * 1e3:8.2f} ms per optimiser step: {100 * pred / step:6.2f} %")


if __name__ == "__main__":
    main()
