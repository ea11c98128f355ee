"""Langevin step time against torch.optim.SGD on the same model (same process, interleaved repeats).

Prints two ratios (target: full training step ≤ 1.2× SGD's):

* ``train step``: forward + backward + optimiser step on a batch (what a user pays);
* ``optimizer.step() only``: the update alone. Langevin draws one N(0, 1)
  number per weight; on a CPU that costs ~50× an axpy, so this ratio is
  bounded below by the RNG, not by our code (on a GPU ``randn`` is memory-bound).

Also reports foreach vs the per-parameter loop, and the pure functional core
(``build``/``update`` with ``inplace=True``: it rebuilds the generator from
the state each step). Usage::

    .venv/bin/python benchmarks/langevin_step.py [--threads 1] [--repeats 7] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from flowgeom.langevin import Langevin, build


def make_model(width: int, depth: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # benchmark script, not library code
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


class _CoreOptimizer:
    """The functional core driven like an optimiser: ``params, state = update(state, params, grads, inplace=True)``."""

    def __init__(self, params: dict[str, torch.Tensor], dev: torch.device):
        self.params = params
        self.core = build(lr=1e-3, temperature=1e-4)
        self.state = self.core.init(params, generator=torch.Generator(device=dev).manual_seed(0))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            p.grad = None

    def step(self) -> None:
        grads = {n: p.grad for n, p in self.params.items()}
        _, self.state = self.core.update(self.state, self.params, grads, inplace=True)


def timed(fn, n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randn(args.batch, args.width, device=dev)
    y = torch.randn(args.batch, 1, device=dev)

    def setup(kind: str):
        model = make_model(args.width, args.depth, 0).to(dev)
        params = list(model.parameters())
        if kind == "sgd":
            opt = torch.optim.SGD(params, lr=1e-3, foreach=True)
        elif kind == "core":
            opt = _CoreOptimizer(dict(model.named_parameters()), dev)
        else:
            gen = torch.Generator(device=dev).manual_seed(0)
            opt = Langevin(params, lr=1e-3, temperature=1e-4, generator=gen, foreach=(kind == "langevin"))
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()

        def step_only():
            opt.step()
            sync()

        def train_step():
            opt.zero_grad(set_to_none=True)
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            sync()

        return step_only, train_step

    kinds = ("sgd", "langevin", "langevin_loop", "core")
    fns = {k: setup(k) for k in kinds}
    best = {(k, w): float("inf") for k in kinds for w in (0, 1)}
    for _ in range(args.repeats):  # interleave so machine load hits every variant alike
        for k in kinds:
            for w in (0, 1):
                best[(k, w)] = min(best[(k, w)], timed(fns[k][w], args.iters))
    n_params = sum(p.numel() for p in make_model(args.width, args.depth, 0).parameters())
    print(f"model: {args.depth}x Linear({args.width}) MLP, {n_params:,} params, batch {args.batch}, "
          f"threads {args.threads}, device {dev}")
    for w, name in ((1, "train step (fwd+bwd+step)"), (0, "optimizer.step() only")):
        sgd = best[("sgd", w)]
        print(f"{name:28s} SGD {sgd * 1e3:8.3f} ms | Langevin {best[('langevin', w)] * 1e3:8.3f} ms "
              f"ratio {best[('langevin', w)] / sgd:5.2f} | Langevin loop {best[('langevin_loop', w)] * 1e3:8.3f} ms "
              f"ratio {best[('langevin_loop', w)] / sgd:5.2f} | core {best[('core', w)] * 1e3:8.3f} ms "
              f"ratio {best[('core', w)] / sgd:5.2f}")


if __name__ == "__main__":
    main()
