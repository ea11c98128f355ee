"""The Darcy-flow attention experiment of seed ``004_…`` (its §4, "Resultados empíricos").

Protocol:

1. **Pretraining.** The whole :class:`~flowgeom.experiments.darcy_model.DarcyViT`
   is trained with Adam on normalised targets ``(u − μ)/σ``.
2. **Langevin phase**, once per regulariser in ``regs`` (``none``, ``log``,
   ``power``): start from the pretrained weights, re-draw ``W_Q, W_K``
   (``reinit_qk``), freeze everything else and train ``W_Q, W_K`` only with
   :class:`~flowgeom.langevin.Langevin` on
   ``MSE(batch) + R(W_Q) + R(W_K)``. Every arm sees the same batches and the
   same noise.

Logged every ``log_every`` steps (``metrics.jsonl``): train/test RMSE (data
units), relative L2 error ``‖û − u‖/‖u‖`` (mean over samples), the gap
``test RMSE − train RMSE``, ``‖W_Q‖_F``, ``‖W_K‖_F``. The summary adds the
convergence-rate table: time (steps) for the train MSE to reach
``L* + ε`` against ``log(1/ε)``, with ``L*`` the pretrained model's train MSE.

Runs write one :class:`~flowgeom.runs.RunFolder`; a checkpoint every
``checkpoint_every`` steps makes ``resume=True`` continue a killed run and
end with exactly the metrics of an uninterrupted one (on CPU). A chain that
blows up (non-finite loss, weights or metrics) stops its arm with the shared
divergence line of :mod:`flowgeom.experiments.training` logged (plus
``event: "blew_up"``) and the metrics kept; the other arms still run. A
diverged pretraining raises :class:`FlowgeomError` after logging that line.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from flowgeom.data.darcy import DarcySet, generate, load_shipped
from flowgeom.errors import FlowgeomError, choice_error, positive_int
from flowgeom.experiments.darcy_model import DarcyViT, init_, uniform_
from flowgeom.experiments.presets import scales
from flowgeom.experiments.training import Diverged, Step, checkpoint_state, restore_checkpoint, train_loop
from flowgeom.langevin import Langevin, Regularizer, check_loss, select
from flowgeom.langevin.optimizer import check_hyper
from flowgeom.langevin.regularizers import KINDS
from flowgeom.runs import RunFolder

DATA = ("shipped", "generated")


@dataclass(frozen=True)
class DarcyConfig:
    data: str = "shipped"  # shipped (neuraloperator wheel, 16²) or generated (our FD solver)
    n_train: int = 1000  # training samples used
    n_test: int = 50  # test samples used
    resolution: int = 16  # grid size (shipped: 16)
    patch: int = 4  # patch side; tokens = (resolution/patch)²
    d_model: int = 32  # token width
    d_k: int = 16  # rows of W_Q, W_K
    d_mlp: int = 64  # MLP hidden width
    batch_size: int = 64  # minibatch for both phases
    pretrain_steps: int = 1500  # Adam steps of phase 1
    pretrain_lr: float = 3e-3  # Adam learning rate
    steps: int = 6000  # Langevin steps per arm (phase 2)
    lr: float = 0.05  # Langevin step size η
    temperature: float = 1e-4  # Langevin temperature s (Gibbs ∝ exp(−2V/s))
    regs: tuple[str, ...] = ("none", "log", "power")  # phase-2 arms
    lam: float = 1e-3  # regulariser λ
    eps: float = 0.5  # power regulariser ε
    reinit_qk: bool = True  # re-draw W_Q, W_K before phase 2
    log_every: int = 100  # steps between metric lines
    checkpoint_every: int = 500  # steps between resume checkpoints
    seed: int = 0  # every random draw derives from it

    def __post_init__(self) -> None:
        if self.data not in DATA:
            raise choice_error("data", self.data, DATA)
        object.__setattr__(self, "regs", tuple(self.regs))
        for reg in self.regs:
            if reg not in KINDS:
                raise choice_error("regulariser", reg, KINDS)
        if not self.regs:
            raise FlowgeomError("regs must name at least one arm (none, log, power, frobenius)")
        check_hyper(self.lr, self.temperature)
        if any(r != "none" for r in self.regs):
            Regularizer("power" if "power" in self.regs else "log", lam=self.lam, eps=self.eps)
        positive = ("n_train", "n_test", "resolution", "patch", "d_model", "d_k", "d_mlp", "batch_size",
                    "log_every", "checkpoint_every")
        for name in positive:
            positive_int(getattr(self, name), name)
        if self.pretrain_steps < 0 or self.steps < 1:
            raise FlowgeomError("need pretrain_steps >= 0 and steps >= 1")
        if not (self.pretrain_lr > 0):
            raise FlowgeomError(f"pretrain_lr must be > 0, got {self.pretrain_lr}")
        if self.data == "shipped" and (self.resolution != 16 or self.n_train > 1000 or self.n_test > 50):
            raise FlowgeomError("the shipped set is 16x16 with 1000 train / 50 test samples; "
                                "use --data generated for other sizes")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DarcyConfig:
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise FlowgeomError(f"unknown Darcy config keys: {', '.join(sorted(unknown))}")
        return cls(**raw)


# quick (the defaults): d_model 32, 1500 Adam + 3 × 6000 Langevin steps (about a minute on one core).
QUICK = DarcyConfig()
# full: d_model 64, 6000 Adam + 3 × 40,000 Langevin steps.
FULL = DarcyConfig(d_model=64, d_k=32, d_mlp=128, pretrain_steps=6000, steps=40000, log_every=200,
                   checkpoint_every=2000)
# cpu = full: the whole two-phase protocol already fits one CPU core (~35 min a seed), so the CPU scale runs it
# unchanged (the claim: one seed; --full: three).
CPU = FULL
PRESETS = scales(quick=QUICK, cpu=CPU, full=FULL)


# -- data and evaluation ----------------------------------------------------------------------
def load_data(cfg: DarcyConfig) -> tuple[DarcySet, DarcySet]:
    if cfg.data == "shipped":
        train, test = load_shipped("train", 16), load_shipped("test", 16)
        return (DarcySet(train.a[: cfg.n_train], train.u[: cfg.n_train], train.source),
                DarcySet(test.a[: cfg.n_test], test.u[: cfg.n_test], test.source))
    both = generate(cfg.n_train + cfg.n_test, resolution=cfg.resolution, seed=cfg.seed)
    return (DarcySet(both.a[: cfg.n_train], both.u[: cfg.n_train], both.source),
            DarcySet(both.a[cfg.n_train :], both.u[cfg.n_train :], both.source))


@torch.no_grad()
def evaluate(model: DarcyViT, data: DarcySet, mu: float, sigma: float) -> dict[str, float]:
    """RMSE and relative L2 error in data units; ``mse_norm`` on the normalised scale."""
    pred = model(data.a) * sigma + mu  # (N, res, res)
    err = pred - data.u
    rel = (err.flatten(1).norm(dim=1) / data.u.flatten(1).norm(dim=1)).mean()
    mse = err.pow(2).mean()
    return {"rmse": float(mse.sqrt()), "rel_l2": float(rel), "mse_norm": float(mse) / sigma**2}


# -- the protocol --------------------------------------------------------------------------------
@dataclass
class _State:
    stage: int = 0  # 0 = pretraining, i >= 1 = arm regs[i-1]
    step: int = 0  # step inside the stage
    pretrained: dict[str, torch.Tensor] | None = None
    results: dict[str, Any] | None = None


def _stage_start(cfg: DarcyConfig, stage: int) -> int:
    """First tick of ``stage``: each stage has ``steps + 1`` ticks (the last is the final evaluation)."""
    return 0 if stage == 0 else cfg.pretrain_steps + 1 + (stage - 1) * (cfg.steps + 1)


def run(cfg: DarcyConfig, out: str | Path, *, resume: bool = False, device: str = "cpu",
        stop_after: int | None = None, progress=None) -> dict[str, Any]:
    """Run (or resume) the protocol in ``out`` and return ``summary.json``'s content.

    ``stop_after`` (tests) aborts after that many steps of the whole protocol
    (pretraining, then the arms, counted as one tick sequence) as a kill would:
    the run folder keeps its last checkpoint and its metrics, and
    :class:`FlowgeomError` is not raised; the function returns ``{}``.
    """
    folder = RunFolder(out)
    folder.start(asdict(cfg), resume=resume)
    if folder.finished:
        return folder.summary() or {}
    train, test = load_data(cfg)
    dev = torch.device(device)
    train = DarcySet(train.a.to(dev), train.u.to(dev), train.source)
    test = DarcySet(test.a.to(dev), test.u.to(dev), test.source)
    mu, sigma = float(train.u.mean()), float(train.u.std())
    target = (train.u - mu) / sigma  # (N, res, res)

    model = DarcyViT(resolution=cfg.resolution, patch=cfg.patch, d_model=cfg.d_model, d_k=cfg.d_k,
                     d_mlp=cfg.d_mlp)
    init_(model, torch.Generator().manual_seed(cfg.seed))
    model.to(dev)
    state = _State(results={})
    ckpt = folder.load_checkpoint() if resume else None
    if ckpt is not None:
        state = _State(ckpt["stage"], ckpt["step"], ckpt["pretrained"], ckpt["results"])
        folder.truncate_metrics(after_step=_stage_start(cfg, state.stage) + state.step - 1, key="tick")
    elif resume:
        folder.truncate_metrics(after_step=-1, key="tick")

    for stage in range(state.stage, len(cfg.regs) + 1):
        if not _run_stage(cfg, folder, model, state, stage, ckpt if stage == state.stage else None,
                          train, test, target, mu, sigma, stop_after, progress):
            return {}  # stopped by the kill hook
        ckpt = None
    from flowgeom.experiments.darcy_report import convergence_rate, figures, summarise

    summary = summarise(cfg, folder.metrics(), state.results)
    summary["rate"] = convergence_rate(cfg, folder.metrics(), summary["pretrain"]["train_mse_norm"])
    summary["data"] = {"train": train.source, "test": test.source, "u_mean": mu, "u_std": sigma}
    figures(folder, summary)
    folder.finish(summary)
    return summary


def _run_stage(cfg, folder, model, state, stage, ckpt, train, test, target, mu, sigma, stop_after, progress) -> bool:
    """Run one stage (pretraining or one arm) as one :func:`~flowgeom.experiments.training.train_loop`.

    Its ticks are the stage's steps ``0 … total`` (the last only measures),
    numbered ``tick = _stage_start + step`` in the metrics. Returns ``False``
    when the kill hook ``stop_after`` (counted in ticks of the whole
    protocol) stopped it.
    """
    reg_name = "pretrain" if stage == 0 else cfg.regs[stage - 1]
    total = cfg.pretrain_steps if stage == 0 else cfg.steps
    batch_gen = torch.Generator().manual_seed(cfg.seed + 1)
    if stage == 0:
        params = list(model.parameters())
        for p in params:
            p.requires_grad_(True)
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=cfg.pretrain_lr)
        reg = None
    else:
        model.load_state_dict(state.pretrained)
        qk = select(model, preset="qk")
        if cfg.reinit_qk:
            init = torch.Generator().manual_seed(cfg.seed + 2)
            for w in qk.values():
                uniform_(w, 1 / math.sqrt(w.shape[1]), init)
        for p in model.parameters():
            p.requires_grad_(False)
        params = list(qk.values())
        for p in params:
            p.requires_grad_(True)
        opt = Langevin(params, lr=cfg.lr, temperature=cfg.temperature, seed=cfg.seed + 3,
                       generator=torch.Generator(device=params[0].device).manual_seed(cfg.seed + 3))
        reg = Regularizer(reg_name, lam=cfg.lam, eps=cfg.eps) if reg_name != "none" else None
    start_step = 0
    if ckpt is not None and ckpt["step"] > 0:  # mid-stage; at step 0 everything is re-derived
        start_step = restore_checkpoint(ckpt, model=model, optimizer=opt, generator=batch_gen)
    base = _stage_start(cfg, stage)
    qk_params = select(model, preset="qk")
    task = progress.add_task(reg_name, total=total, completed=start_step) if progress else None
    phase = "pretrain" if stage == 0 else "langevin"

    def update(step: int) -> None:
        idx = torch.randint(len(train), (cfg.batch_size,), generator=batch_gen).to(train.a.device)
        opt.zero_grad(set_to_none=True)
        loss = (model(train.a[idx]) - target[idx]).pow(2).mean()
        if reg is not None:
            loss = loss + reg.penalty(qk_params.values())
        try:
            check_loss(loss, step)
        except FlowgeomError as exc:
            raise Diverged(str(exc), loss=float(loss.detach())) from exc
        loss.backward()
        try:
            opt.step()
        except FlowgeomError as exc:  # Langevin's check: a parameter became non-finite
            raise Diverged(str(exc)) from exc

    def log(line: dict[str, Any]) -> None:
        folder.log(line)  # the line is kept even when its metrics are non-finite
        if not line.get("diverged") and not all(math.isfinite(v) for v in line.values() if isinstance(v, float)):
            raise Diverged(f"metrics became non-finite at step {line['step']}")

    def save(step: int) -> None:
        folder.save_checkpoint(checkpoint_state(step, model=model, optimizer=opt, generator=batch_gen, stage=stage,
                                                pretrained=state.pretrained, results=state.results))

    end = train_loop(Step(update=update), steps=total, start=start_step, log=log, log_every=cfg.log_every,
                     context=lambda step: {"tick": base + step, "phase": phase, "reg": reg_name, "step": step},
                     hooks=(lambda tick: _metrics(model, train, test, mu, sigma, qk_params),),
                     checkpoint=save, checkpoint_every=cfg.checkpoint_every,
                     stop_after=None if stop_after is None else stop_after - base,
                     progress=(lambda done: progress.update(task, completed=done)) if progress else None,
                     diverged_extra={"event": "blew_up"})
    if end.status == "stopped":
        return False
    if end.status == "diverged":
        if stage == 0:
            raise FlowgeomError(f"pretraining diverged: {end.message}; metrics kept in {folder.path}")
        state.results[reg_name] = {"status": "diverged", "step": end.step, "message": end.message}
        return True
    if stage == 0:
        state.pretrained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        state.results[reg_name] = {"status": "ok"}
    folder.save_checkpoint(checkpoint_state(0, model=model, optimizer={}, generator=batch_gen, stage=stage + 1,
                                            pretrained=state.pretrained, results=state.results))
    return True


def _metrics(model, train, test, mu, sigma, qk_params) -> dict[str, float]:
    tr, te = evaluate(model, train, mu, sigma), evaluate(model, test, mu, sigma)
    return {"train_rmse": tr["rmse"], "train_rel_l2": tr["rel_l2"], "train_mse_norm": tr["mse_norm"],
            "test_rmse": te["rmse"], "test_rel_l2": te["rel_l2"], "gap": te["rmse"] - tr["rmse"],
            "wq_norm": float(qk_params["attn.q_proj.weight"].detach().norm()),
            "wk_norm": float(qk_params["attn.k_proj.weight"].detach().norm())}
