"""Overhead of ConservationCallback on a transformers Trainer step (~10M-parameter Llama, CPU, 1 thread).

The same Trainer (optim="sgd", batch 4×128) runs with and without
``ConservationCallback(every=1)`` in blocks of ``--block`` steps, alternating
which goes first, ``--pairs`` times. A timing callback at the end of the
callback list reads the process CPU time at every ``on_step_end``; the cost
of a step is the time between two of them (forward, backward, optimiser, the
callbacks, the Trainer's logging), the first step of each block dropped
(warm-up). Printed: median step time of each, their ratio, and the paired
estimate median(monitored − plain block medians) / plain, and the ratio of
mean step times (the one to read with ``--every`` > 1, where most steps do
not measure). Target: ≤ 1.05 measuring every step.

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python benchmarks/trainer_callback_overhead.py [--pairs 6] [--block 6] [--predict auto|on|off] [--every 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: one BLAS thread
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from flowgeom.hf.tiny import tiny_model  # noqa: E402
from flowgeom.integrations import ConservationCallback  # noqa: E402


def _llama() -> torch.nn.Module:
    """The ~10M-parameter Llama of benchmarks/monitor_hf_overhead.py (float32, training mode)."""
    model = tiny_model("llama", seed=0, dtype=torch.float32, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                       vocab_size=8000, max_position_embeddings=256)
    return model.train()


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.ids = torch.randint(0, 8000, (n, 128), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimer(TrainerCallback):
    """CPU seconds between consecutive on_step_end calls (the whole step, callbacks included)."""

    def __init__(self):
        self.marks: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append(time.process_time())

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]  # drops the first (warm-up) step


def block(model, out: str, steps: int, monitored: bool, predict: str, every: int = 1) -> list[float]:
    timer = StepTimer()
    callbacks = [ConservationCallback(every=every, out=os.path.join(out, "fg"), predict=predict, figure=False)] \
        if monitored else []
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=4, optim="sgd",
                             learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=10, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Data(4 * steps), callbacks=callbacks)
    trainer.add_callback(timer)  # last in the list: its on_step_end follows ours
    trainer.train()
    return timer.steps()


def main(pairs: int = 6, steps: int = 6, predict: str = "auto", every: int = 1) -> dict[str, float]:
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    load0 = os.getloadavg()[0]
    model = _llama()
    n = sum(p.numel() for p in model.parameters())
    plain, monitored, paired = [], [], []
    with tempfile.TemporaryDirectory() as out:
        block(model, out, 3, True, predict)  # warm-up both paths
        block(model, out, 3, False, predict)
        for r in range(pairs):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {m: block(model, out, steps, m, predict, every) for m in order}
            plain += got[False]
            monitored += got[True]
            paired.append(statistics.median(got[True]) - statistics.median(got[False]))
    b, m = statistics.median(plain), statistics.median(monitored)
    ratio, paired_ratio = m / b, 1 + statistics.median(paired) / b
    mean_ratio = statistics.fmean(monitored) / statistics.fmean(plain)  # with every > 1 the median misses the due steps
    print(f"llama {n / 1e6:.1f}M params, batch 4×128, 1 thread, Trainer(optim='sgd'), ConservationCallback(every={every}, "
          f"predict={predict!r}); {pairs} interleaved pairs of {steps}-step blocks")
    print(f"median step: plain {b * 1e3:.1f} ms, monitored {m * 1e3:.1f} ms -> ratio {ratio:.3f} "
          f"(paired estimate {paired_ratio:.3f}; ratio of means {mean_ratio:.3f}); load average {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    return {"plain_s": b, "monitored_s": m, "ratio": ratio, "paired_ratio": paired_ratio, "mean_ratio": mean_ratio}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--block", type=int, default=6, help="steps per block (the first of each is dropped)")
    ap.add_argument("--predict", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--every", type=int, default=1, help="measure every N steps (default 1: the target's setting)")
    a = ap.parse_args()
    main(a.pairs, a.block, a.predict, a.every)
