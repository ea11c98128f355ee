"""Conservation drift in real training (seed 000's experiments at laptop scale).

One run trains a decoder LM on real English text (KJV, or a local
WikiText-103 / PTB path) or a ViT on real MNIST (or a local CIFAR-10 /
ImageNet-style folder) and records, every ``log_every`` steps, the
conservation error ε(k) of every law family (see
:mod:`flowgeom.laws.monitor`) next to the non-conserved controls.

- ``full_batch=True``: gradient descent on a fixed training set of ``batch``
  examples (the seed's proxy for the continuous flow);
  ``full_batch=False``: mini-batch SGD, a fresh batch per step.
- ``optimizer``: ``sgd`` (the laws' setting), ``momentum`` (0.9) or ``adam``
  — the last two break the laws at first order; ``weight_decay`` λ breaks
  them too, and the run also records the rescaled laws e^{dλt}·h (keys
  ``wd/…``; the flow's factor, exact as τ → 0) and, for constant-step SGD,
  (1 − τλ)^{−dk}·h (keys ``wd-sgd/…``, conserved up to O(τ²k) like plain GD).
- ``schedule``: ``constant`` τ or ``inverse`` τ_k = τ_0/(k+1) (Σ τ_k² < ∞,
  so the error stays bounded).

One run = one :class:`flowgeom.runs.RunFolder`; checkpoints hold the model,
optimiser, data generator and the monitor's θ_0 reference, so a killed run
resumed with ``resume=True`` ends with exactly the metrics of an
uninterrupted one (CPU, same seed). A non-finite loss stops the run at the
step where it appears with :class:`FlowgeomError`; the metrics up to that
step stay on disk, the last line being the shared divergence line of
:mod:`flowgeom.experiments.training` (``diverged: true``, ``message``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flowgeom.errors import FlowgeomError, choice_error, finite_number, positive_int, require_choices
from flowgeom.experiments.presets import scales
from flowgeom.experiments.training import Step, Tick, checkpoint_state, loss_hook, restore_checkpoint, train_loop
from flowgeom.laws.monitor import ConservationMonitor
from flowgeom.runs import RunFolder, atomic_write_figure

TASKS = ("lm", "vit")
OPTIMIZERS = ("sgd", "momentum", "adam")
SCHEDULES = ("constant", "inverse")
DTYPES = {"float32": torch.float32, "float64": torch.float64}

# Named LM block variants: the attention positions and the MLP of every decoder layer.
LM_ARCHS: dict[str, dict[str, Any]] = {
    "mha-none-swiglu": {"positions": "none", "mlp": "swiglu"},
    "mha-sinusoidal-swiglu": {"positions": "sinusoidal", "mlp": "swiglu"},
    "mha-rope-swiglu": {"positions": "rope", "mlp": "swiglu"},
    "moe-dense-softmax": {"positions": "none", "mlp": "moe", "gate": "softmax", "top_k": None},
    "moe-top2-softmax": {"positions": "none", "mlp": "moe", "gate": "softmax", "top_k": 2},
    "moe-dense-sigmoid": {"positions": "none", "mlp": "moe", "gate": "sigmoid", "top_k": None},
    "moe-top2-sigmoid": {"positions": "none", "mlp": "moe", "gate": "sigmoid", "top_k": 2},
}
ARCHS: dict[str, dict[str, Any]] = {**{k: {"task": "lm", **v} for k, v in LM_ARCHS.items()}, "vit": {"task": "vit"}}


@dataclass(frozen=True)
class ConservationConfig:
    task: str = "lm"               # lm | vit
    data: str = "default"          # lm: kjv | text file/folder; vit: mnist | CIFAR-10 / class folder ("default": kjv / mnist)
    corpus_chars: int = 200_000    # lm: first characters of the corpus used (0 = all)
    n_train: int = 2048            # vit: training images used
    # model
    positions: str = "rope"        # lm attention positions: none | sinusoidal | rope
    mlp: str = "swiglu"            # lm MLP: swiglu | moe
    gate: str = "softmax"          # moe router: softmax | sigmoid (normalised)
    top_k: int | None = None       # moe routing: None = dense
    experts: int = 4               # moe experts
    d_model: int = 32              # residual width
    n_layers: int = 2              # blocks
    heads: int = 2                 # attention heads
    d_k: int = 16                  # head dim
    d_hidden: int = 64             # MLP hidden width (per expert)
    seq_len: int = 32              # lm context
    patch: int = 7                 # vit patch side
    # training
    optimizer: str = "sgd"         # sgd | momentum | adam
    lr: float = 0.1                # τ (τ_0 for the inverse schedule)
    schedule: str = "constant"     # constant | inverse (τ_k = τ_0/(k+1))
    weight_decay: float = 0.0      # λ (decoupled from the loss: θ ← θ − τ(∇L + λθ) for sgd)
    steps: int = 200               # k runs 0..steps
    batch: int = 32                # batch size (= training-set size when full_batch)
    full_batch: bool = False       # GD on a fixed set of `batch` examples instead of SGD
    seed: int = 0
    log_every: int = 10            # monitor period
    checkpoint_every: int = 50     # checkpoint period (steps)
    dtype: str = "float32"         # float32 | float64
    device: str = "cpu"

    def __post_init__(self):
        require_choices(self, task=TASKS, optimizer=OPTIMIZERS, schedule=SCHEDULES, dtype=DTYPES, mlp=("swiglu", "moe"))
        for name in ("steps", "batch", "log_every", "checkpoint_every", "d_model", "n_layers", "heads", "d_k",
                     "d_hidden", "seq_len", "experts", "n_train", "patch"):
            positive_int(getattr(self, name), name)
        finite_number(self.lr, "lr", positive=True, fix="pass the step size τ > 0")
        finite_number(self.weight_decay, "weight_decay", minimum=0.0, fix="pass λ >= 0, or 0")

    @classmethod
    def for_arch(cls, arch: str, **overrides: Any) -> ConservationConfig:
        """The config of a named architecture (see :data:`ARCHS`) with ``overrides``."""
        if arch not in ARCHS:
            raise choice_error("architecture", arch, ARCHS)
        return cls(**{**ARCHS[arch], **overrides})

    def replace(self, **changes: Any) -> ConservationConfig:
        return dataclasses.replace(self, **changes)


REGIMES = ("gd", "sgd")  # full-batch gradient descent on a fixed set, mini-batch SGD


@dataclass(frozen=True)
class ConservationPreset:
    """One scale of the experiment: the lr × seed × regime grid around one nested run config.

    ``model`` carries every per-run field (model size, data size, batch, logging);
    ``steps`` overrides its ``steps``. ``flowgeom conserve run --quick|--cpu|--full``
    and the ``conservation.drift`` claim both build their runs with :meth:`run_config`
    (the grid: :func:`flowgeom.experiments.conservation_grid.run_drift_grid`), so a
    scale trains the same models everywhere.
    """

    lrs: tuple[float, ...]
    seeds: int
    steps: int
    regimes: tuple[str, ...]
    model: ConservationConfig

    def base(self, *, regime: str = "sgd", **changes: Any) -> ConservationConfig:
        """The nested run config of one regime (``gd`` = full batch) with ``changes``, before arch, lr and seed."""
        if regime not in REGIMES:
            raise choice_error("regime", regime, REGIMES)
        return self.model.replace(**{"steps": self.steps, **changes}, full_batch=regime == "gd")

    def run_config(self, arch: str, *, lr: float, seed: int, regime: str = "sgd", **changes: Any) -> ConservationConfig:
        """The config of one run of the grid: :meth:`base` on architecture ``arch`` at step size ``lr``."""
        return with_arch(self.base(regime=regime, **changes), arch, lr=lr, seed=seed)


def with_arch(base: ConservationConfig, arch: str, *, lr: float, seed: int) -> ConservationConfig:
    """``base`` on the named architecture ``arch`` (see :data:`ARCHS`) at step size ``lr`` and ``seed``."""
    if arch not in ARCHS:
        raise choice_error("architecture", arch, ARCHS)
    return base.replace(**ARCHS[arch], lr=lr, seed=seed)


# quick: one step size, 100 steps, GD and SGD on every architecture (16 runs, ~20 s of CPU). lr 0.1 is the step
# size the quick claim (`reproduce --quick`, `make demo`) has always trained; the preset's grid used to be
# (0.05, 0.2), which no claim ran. Add step sizes with `--lr`.
QUICK = ConservationPreset(lrs=(0.1,), seeds=1, steps=100, regimes=("gd", "sgd"), model=ConservationConfig())
# full: paper scale (seed 000): a 12-layer LM on WikiText-103 (data=PATH) and a ViT on ImageNet (data=PATH, patch=16).
FULL = ConservationPreset(
    lrs=(0.01, 0.03, 0.1), seeds=10, steps=20_000, regimes=("gd", "sgd"),
    model=ConservationConfig(d_model=512, n_layers=12, heads=8, d_k=64, d_hidden=1376, seq_len=256, batch=64,
                             corpus_chars=0, n_train=1_281_167, log_every=100, checkpoint_every=1000),
)
# cpu: between the two for 2 CPU cores: the quick model trained 20x longer, long enough to separate laws from
# controls (~1 min a run on one core).
CPU = ConservationPreset(lrs=(0.03, 0.1), seeds=2, steps=2000, regimes=("sgd",),
                         model=ConservationConfig(log_every=50, checkpoint_every=500))
PRESETS = scales(quick=QUICK, cpu=CPU, full=FULL)


# ---------------------------------------------------------------- data and model

@dataclass
class Task:
    model: nn.Module
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@functools.lru_cache(maxsize=4)
def _corpus(source: str, chars: int) -> tuple[int, torch.Tensor]:
    """(vocabulary size, token ids) of the first ``chars`` characters (0 = all) of a corpus; cached per process."""
    from flowgeom.data.text import CharVocab, load_text

    text = load_text("kjv" if source == "default" else source, split="train")
    text = text[:chars] if chars else text
    vocab = CharVocab.from_text(text)
    return vocab.size, vocab.encode(text)


@functools.lru_cache(maxsize=4)
def _images(source: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardised float64 images (N C H W) and labels of the first ``n`` training images; cached."""
    from flowgeom.data.images import load_images

    images, labels = load_images("mnist" if source == "default" else source, "train", limit=n)
    x = images.to(torch.float64) / 255.0
    return (x - x.mean()) / x.std(), labels


def _lm_task(cfg: ConservationConfig, dtype: torch.dtype, device: torch.device) -> Task:
    from flowgeom.data.text import lm_batch
    from flowgeom.nn.lm import LMConfig, TinyLM

    vocab_size, tokens = _corpus(cfg.data, cfg.corpus_chars)
    lm_cfg = LMConfig(vocab=vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, heads=cfg.heads, d_k=cfg.d_k,
                      d_hidden=cfg.d_hidden, seq_len=cfg.seq_len, positions=cfg.positions, mlp=cfg.mlp,
                      experts=cfg.experts, top_k=cfg.top_k, gate=cfg.gate)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = TinyLM(lm_cfg).to(device=device, dtype=dtype)
    fixed = lm_batch(tokens, batch=cfg.batch, seq_len=cfg.seq_len, generator=torch.Generator().manual_seed(cfg.seed + 7919))

    def batch(gen: torch.Generator):
        x, y = fixed if cfg.full_batch else lm_batch(tokens, batch=cfg.batch, seq_len=cfg.seq_len, generator=gen)
        return x.to(device), y.to(device)

    def loss(logits, y):  # logits (B, T, V), y (B, T)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return Task(model, batch, loss)


def _vit_task(cfg: ConservationConfig, dtype: torch.dtype, device: torch.device) -> Task:
    from flowgeom.nn.vit import ViT, ViTConfig

    x_all, labels = _images(cfg.data, cfg.n_train)
    x_all = x_all.to(dtype)  # (N, C, H, W)
    C, H = x_all.shape[1], x_all.shape[2]
    if H % cfg.patch:
        raise FlowgeomError(f"patch={cfg.patch} does not divide the image side {H}; pick a divisor (--patch)")
    vit_cfg = ViTConfig(image_size=H, channels=C, patch=cfg.patch, d_model=cfg.d_model, n_layers=cfg.n_layers,
                        heads=cfg.heads, d_k=cfg.d_k, d_hidden=cfg.d_hidden, n_classes=int(labels.max()) + 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = ViT(vit_cfg, generator=torch.Generator().manual_seed(cfg.seed)).to(device=device, dtype=dtype)
    n = min(cfg.batch, len(x_all))

    def batch(gen: torch.Generator):
        idx = torch.arange(n) if cfg.full_batch else torch.randint(0, len(x_all), (cfg.batch,), generator=gen)
        return x_all[idx].to(device), labels[idx].to(device)

    return Task(model, batch, F.cross_entropy)


def build_task(cfg: ConservationConfig) -> Task:
    device = torch.device(cfg.device)
    return (_lm_task if cfg.task == "lm" else _vit_task)(cfg, DTYPES[cfg.dtype], device)


def make_optimizer(cfg: ConservationConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    momentum = 0.9 if cfg.optimizer == "momentum" else 0.0
    return torch.optim.SGD(params, lr=cfg.lr, momentum=momentum, weight_decay=cfg.weight_decay)


def step_size(cfg: ConservationConfig, k: int) -> float:
    """τ_k: constant, or τ_0/(k+1)."""
    return cfg.lr / (k + 1) if cfg.schedule == "inverse" else cfg.lr


# ---------------------------------------------------------------- one run

FLAGS = ("uncovered", "zero_baseline", "low_precision")  # what ConservationMonitor.step adds to every record


def _record(monitors: Mapping[str, ConservationMonitor], k: int, time: float) -> dict[str, Any]:
    """Every monitor's :meth:`~ConservationMonitor.step` record at step ``k`` and flow time ``time``.

    The main monitor (prefix ``""``) gives its record whole, flags included; the
    weight-decay monitors (``wd/``, ``wd-sgd/``) add their ε's with their prefix.
    """
    rec: dict[str, Any] = {}
    for prefix, mon in monitors.items():
        measured = mon.step(k, time=time)
        rec.update(measured if not prefix else
                   {prefix + key: v for key, v in measured.items() if key != "step" and key not in FLAGS})
    return rec


def run_conservation(cfg: ConservationConfig, out: str | Path, *, resume: bool = False,
                     stop_after: int | None = None, progress: Callable[[int, int], None] | None = None
                     ) -> dict[str, Any] | None:
    """Train once and write the run folder ``out``; returns the summary.

    The ticks are :func:`~flowgeom.experiments.training.train_loop`'s: tick
    ``k`` logs ``step``, flow ``time``, the batch loss at ``θ_k`` and every
    monitor's ε(k); the last tick (``k = steps``) only measures.
    ``progress(done, steps)`` is called after each update.
    ``stop_after`` (tests only) returns ``None`` after that many optimiser
    steps without finishing, as a kill would. A finished run is not redone.
    """
    run = RunFolder(out)
    run.start(dataclasses.asdict(cfg), resume=resume)
    if run.finished:
        return run.summary()
    task = build_task(cfg)
    model = task.model
    opt = make_optimizer(cfg, model.parameters())
    # every=1: the loop decides which ticks are measured. warn=True: the monitor warns (once) when the optimiser is
    # not plain SGD, and about each block no law covers (also listed in the summary). predict=False: the runs
    # record ε and its slopes; the exact plain-SGD prediction (one more law evaluation per step) is not needed here.
    monitors = {"": ConservationMonitor(model, every=1, per_block=True, warn=True, optimizer=opt, predict=False)}
    if cfg.weight_decay:
        monitors["wd/"] = ConservationMonitor(model, every=1, per_block=False, warn=False,
                                              weight_decay=cfg.weight_decay, lr=cfg.lr)
        if cfg.optimizer == "sgd" and cfg.schedule == "constant" and cfg.lr * cfg.weight_decay < 1:
            monitors["wd-sgd/"] = ConservationMonitor(model, every=1, per_block=False, warn=False,
                                                      weight_decay=cfg.weight_decay, lr=cfg.lr, rescale="sgd")
    gen = torch.Generator().manual_seed(cfg.seed)
    start, time = 0, 0.0  # time: Σ τ_k of the updates done (the flow time of θ_k)
    ckpt = run.load_checkpoint() if resume else None
    if ckpt is not None:
        start = restore_checkpoint(ckpt, model=model, optimizer=opt, generator=gen)
        for prefix, mon in monitors.items():
            mon.load_state_dict(ckpt["monitors"][prefix])
        time = ckpt["time"]
    run.truncate_metrics(after_step=start - 1)

    def forward(k: int) -> float:
        """The batch loss at θ_k, and its gradients unless k is the last tick (which only measures)."""
        x, y = task.batch(gen)
        loss = task.loss(model(x), y)
        if k < cfg.steps:
            opt.zero_grad(set_to_none=True)
            loss.backward()
        return float(loss.detach())

    def update(k: int) -> None:
        nonlocal time
        tau = step_size(cfg, k)
        for group in opt.param_groups:
            group["lr"] = tau
        opt.step()
        time += tau

    def save(k: int) -> None:
        run.save_checkpoint(checkpoint_state(k, model=model, optimizer=opt, generator=gen, time=time,
                                             monitors={p: m.state_dict() for p, m in monitors.items()}))

    def measure(tick: Tick) -> dict[str, Any]:
        return _record(monitors, tick.step, time)

    end = train_loop(Step(forward=forward, update=update), steps=cfg.steps, start=start, log=run.log,
                     log_every=cfg.log_every, context=lambda k: {"step": k, "time": time},
                     hooks=(loss_hook, measure), checkpoint=save, checkpoint_every=cfg.checkpoint_every,
                     stop_after=stop_after,
                     progress=None if progress is None else lambda done: progress(done, cfg.steps))
    if end.status == "stopped":
        return None
    if end.status == "diverged":
        raise FlowgeomError(f"training diverged at step {end.step}: the loss is {end.loss} (lr={cfg.lr}); metrics up "
                            f"to step {end.step} are in {run.path}; lower --lr")
    metrics = run.metrics()
    summary = {"final": metrics[-1], "steps": cfg.steps, "families": monitors[""].families("eps"),
               "controls": monitors[""].families("control"), "refuted": monitors[""].families("refuted"),
               "uncovered": monitors[""].uncovered_list()}
    figure = plot_run(metrics, run.figures / "drift.png", title=_title(cfg))
    summary["figure"] = str(figure)
    run.finish(summary)
    return summary


def _title(cfg: ConservationConfig) -> str:
    model = f"ViT ({cfg.data})" if cfg.task == "vit" else f"LM {cfg.positions}/{cfg.mlp}" + (
        f" {cfg.gate}{'' if cfg.top_k is None else f' top-{cfg.top_k}'}" if cfg.mlp == "moe" else "")
    regime = "GD" if cfg.full_batch else "SGD"
    return f"{model}, {regime} {cfg.optimizer} τ={cfg.lr:g} λ={cfg.weight_decay:g} seed {cfg.seed}"


# ---------------------------------------------------------------- figure of one run

def plot_run(metrics: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """ε(k) per law family (solid), controls (dashed), refuted claims (dotted); log scale."""
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend switch

    keys = sorted({k for m in metrics for k in m if "/" in k and "@" not in k})
    steps = [m["step"] for m in metrics]
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    for key in keys:
        ys = [max(m.get(key, float("nan")), 1e-18) for m in metrics]
        style = ":" if key.startswith("refuted/") else "--" if key.startswith("control/") else "-"
        ax.plot(steps[1:], ys[1:], style, label=key)
    ax.set_yscale("log")
    ax.set_xlabel("step k")
    ax.set_ylabel("relative drift ε(k)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return atomic_write_figure(path, fig, dpi=110)
