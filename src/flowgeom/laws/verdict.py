"""A verdict per law family, and what to expect from the optimiser.

A raw ε says little on its own: under AdamW every ε sits at 0.2–0.6, like the
controls; under SGD the laws sit 100–300× below them. The verdict compares
each law family with the controls of the same blocks (‖W‖²_F of the block's
matrices, which move at first order in the step):

    ratio = ε_law / ε_control,   "held" if ratio < HELD_THRESHOLD, else "broken".

HELD_THRESHOLD = 0.1: a conserved law drifts as O(τ²k) while its control
moves as O(τk), so their ratio is O(τ) (measured 3e-3–1e-2 for SGD on the tiny
transformers models); a law that moves at a tenth of its control's rate is
no longer distinguishable from an ordinary function of the weights. A ratio
cannot be formed while the controls have not moved (step 0): the verdict is
then "n/a".

What to expect depends on the optimiser (:func:`describe_optimizer`, which
unwraps ``accelerate``'s ``AcceleratedOptimizer`` and any object holding an
``.optimizer``):

- plain SGD: the laws are conserved up to the O(τ²k) finite-step term: held;
- SGD + weight decay λ: quadratic laws decay as e^{−2λt} (Kunin et al., ICLR
  2021, "Neural Mechanics"): broken unless the monitor rescales them
  (``ConservationMonitor(weight_decay=λ, lr=τ)``);
- SGD + momentum β: the gradient-flow laws are lost (Marcotte et al., ICML
  2024, "Keep the momentum": momentum conserves other, fewer quantities; a
  ReLU network keeps none), so drift is expected, not a failure; compare with
  the predicted curve of :mod:`flowgeom.laws.predict`;
- Adam / AdamW / others: the step is not along the gradient, so nothing is
  conserved: broken, expected.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from flowgeom.errors import FlowgeomError

HELD_THRESHOLD = 0.1  # ε_law / ε_control below this: "held" (module docstring says why 0.1)

KUNIN = "Kunin et al., ICLR 2021 (Neural Mechanics)"
MARCOTTE = "Marcotte et al., ICML 2024 (Keep the momentum)"

KINDS = ("sgd", "sgd+wd", "momentum", "adam", "other")

EXPECT = {
    "sgd": ("held", "plain SGD: the laws are conserved up to the O(τ²k) finite-step term; expect held"),
    "sgd+wd": ("broken", f"SGD with weight decay: quadratic laws decay as e^(−2λt) ({KUNIN}); expect broken "
                         "unless the monitor rescales them (weight_decay=λ, lr=τ)"),
    "momentum": ("broken", f"SGD with momentum: the gradient-flow laws are lost under momentum ({MARCOTTE}); "
                           f"drift is expected, not a failure; compare with the predicted drift ({KUNIN})"),
    "adam": ("broken", "Adam-type optimiser: the step is not along the gradient, so no law of gradient flow "
                       "is conserved; expect broken (not a failure)"),
    "other": ("unknown", "optimiser not recognised: the laws are guaranteed only for plain SGD; no expectation"),
}


@dataclass(frozen=True)
class OptimizerInfo:
    """What the monitor needs to know of an optimiser: its class, kind and hyper-parameters (first group)."""

    name: str                   # class name of the unwrapped optimiser, e.g. "SGD", "AdamW"
    kind: str                   # one of KINDS
    lr: float | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    dampening: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise FlowgeomError(f"unknown optimiser kind {self.kind!r}; choose one of: {', '.join(KINDS)}")

    @property
    def expected(self) -> str:
        """"held", "broken" or "unknown": the verdict this optimiser should give."""
        return EXPECT[self.kind][0]

    @property
    def explanation(self) -> str:
        return EXPECT[self.kind][1]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "expected": self.expected, "explanation": self.explanation}


def unwrap_optimizer(optimizer: Any) -> Any:
    """The innermost optimiser: follows ``.optimizer`` (accelerate's AcceleratedOptimizer, any holder) and
    ``._optimizer`` (Lightning's LightningOptimizer, whose class is renamed ``Lightning<SGD>`` and which
    copies the inner optimiser's attributes, ``param_groups`` included) down to a ``torch.optim.Optimizer``."""
    seen = set()
    while True:  # wrappers subclass torch.optim.Optimizer too (AcceleratedOptimizer): unwrap while there is an inner
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None or inner is optimizer or id(inner) in seen:
            return optimizer
        seen.add(id(optimizer))
        optimizer = inner


def describe_optimizer(optimizer: Any) -> OptimizerInfo:
    """Classify ``optimizer`` (wrappers unwrapped). Raises when no optimiser with ``param_groups`` is inside."""
    inner = unwrap_optimizer(optimizer)
    groups = getattr(inner, "param_groups", None)
    if not isinstance(groups, Sequence) or not groups or not all(isinstance(g, Mapping) for g in groups):
        raise FlowgeomError(f"the monitor cannot see the optimiser {type(optimizer).__name__} (no torch-style "
                            "param_groups, also after unwrapping .optimizer); pass optimizer_kind= one of "
                            f"{', '.join(KINDS)} to say what it is")
    name = type(inner).__name__
    g0 = groups[0]
    lr = g0.get("lr")
    lr = float(lr) if isinstance(lr, (int, float)) else None
    wd = max(float(g.get("weight_decay", 0.0) or 0.0) for g in groups)
    if name == "SGD":
        beta = max(float(g.get("momentum", 0.0) or 0.0) for g in groups)
        kind = "momentum" if beta > 0 else ("sgd+wd" if wd > 0 else "sgd")
        return OptimizerInfo(name, kind, lr, beta, wd, bool(g0.get("nesterov", False)),
                             float(g0.get("dampening", 0.0) or 0.0))
    if "adam" in name.lower() or name in ("Adafactor", "Lion", "RMSprop", "Adagrad", "Adadelta", "NAdam", "RAdam"):
        return OptimizerInfo(name, "adam", lr, 0.0, wd)
    return OptimizerInfo(name, "other", lr, 0.0, wd)


def info_of_kind(kind: str, *, lr: float | None = None) -> OptimizerInfo:
    """An :class:`OptimizerInfo` from a kind alone (an optimiser the monitor cannot see, or a checkpoint series)."""
    names = {"sgd": "SGD", "sgd+wd": "SGD+weight decay", "momentum": "SGD+momentum", "adam": "Adam-type",
             "other": "unknown optimiser"}
    if kind not in names:
        raise FlowgeomError(f"unknown optimiser kind {kind!r}; choose one of: {', '.join(KINDS)}")
    return OptimizerInfo(names[kind], kind, lr)


@dataclass(frozen=True)
class Verdict:
    """One law family's verdict at one step."""

    family: str             # e.g. "attn.qk_rope"
    eps: float              # ε of the laws (mean over blocks)
    control: float          # ε of the controls of the same blocks (mean)
    ratio: float            # eps / control (nan when the controls have not moved)
    verdict: str            # "held" | "broken" | "n/a"
    linear: bool = False    # degree-1 laws: ε at round-off under SGD (no O(τ²k) term)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mean(values: Iterable[float]) -> float:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def family_verdicts(record: Mapping[str, Any], *, controls_of: Mapping[str, Sequence[str]] | None = None,
                    threshold: float = HELD_THRESHOLD, linear: Iterable[str] = ()) -> list[Verdict]:
    """The verdict of every ``eps/<family>`` in ``record``.

    ``controls_of`` maps ``eps/<family>`` to the control keys of its blocks
    (:meth:`ConservationMonitor.controls_of`); without it every per-family
    ``control/…`` key of the record is averaged.
    """
    if not 0 < threshold < 1:
        raise FlowgeomError(f"threshold must lie in (0, 1), got {threshold}")
    fams = sorted(k for k in record if k.startswith("eps/") and "@" not in k)
    all_controls = [k for k in record if k.startswith("control/") and "@" not in k]
    linear = set(linear)
    out = []
    for key in fams:
        keys = controls_of.get(key, ()) if controls_of is not None else all_controls
        control = _mean(record.get(c, math.nan) for c in (keys or all_controls))
        eps = float(record[key])
        ratio = eps / control if control > 0 else math.nan
        verdict = "n/a" if math.isnan(ratio) else ("held" if ratio < threshold else "broken")
        out.append(Verdict(key[4:], eps, control, ratio, verdict, key in linear))
    return out


def summary_line(verdicts: Sequence[Verdict], info: OptimizerInfo | None, *, step: int | None = None,
                 threshold: float = HELD_THRESHOLD, rescaled: bool = False) -> str:
    """One line: ``flowgeom: step 50, SGD(lr=0.1, momentum=0.9): 0 law families held, 3 broken (…) — as expected: …``.

    ``rescaled``: the monitor tracks e^{dλt}·h (``weight_decay=λ``), so SGD + weight decay should hold.
    """
    held = [v for v in verdicts if v.verdict == "held"]
    broken = [v for v in verdicts if v.verdict == "broken"]
    at = f"step {step}, " if step is not None else ""
    opt = ""
    if info is not None:
        hp = [f"lr={info.lr:g}"] if info.lr is not None else []
        hp += [f"momentum={info.momentum:g}"] if info.momentum else []
        hp += [f"weight_decay={info.weight_decay:g}"] if info.weight_decay else []
        opt = f"{info.name}({', '.join(hp)}): " if hp else f"{info.name}: "
    if not held and not broken:
        counts = "no verdict yet (the controls have not moved)"
    else:
        worst = max(verdicts, key=lambda v: -1.0 if math.isnan(v.ratio) else v.ratio)
        counts = (f"{len(held)} law famil{'y' if len(held) == 1 else 'ies'} held, {len(broken)} broken "
                  f"(held: ε_law/ε_control < {threshold:g}; worst {worst.family} {worst.ratio:.2g})")
    expect = ""
    if info is not None:
        expected, why = info.expected, info.explanation
        if rescaled and info.kind == "sgd+wd":
            expected, why = "held", "SGD with weight decay, laws rescaled by e^(dλt): expect held"
        if expected == "unknown" or not (held or broken):
            expect = f" — note: {why}"
        elif all(v.verdict == expected for v in held + broken):
            expect = f" — as expected: {why}"
        else:
            off = [v.family for v in held + broken if v.verdict != expected]
            expect = f" — NOT as expected for {', '.join(off[:3])} (expected {expected}): {why}"
    return f"flowgeom: {at}{opt}{counts}{expect}"
