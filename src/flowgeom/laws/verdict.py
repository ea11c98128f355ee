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

**Plain SGD with the exact prediction.** Where the monitor saw the optimiser's
steps (:class:`flowgeom.laws.predict.SGDPrediction`), a record carries
``pred/<family>`` and ``pred_excess/<family>``, and a quadratic family's
verdict is no longer the ratio heuristic: "held" when the measured h equals
the predicted h(θ_0) + Σ τ²·h(g) to round-off (``pred_excess`` ≤ 1), "broken"
when it is beyond (``basis="prediction"``). A fixed threshold would call the
expected O(τ²k) drift of a long run or a large step "broken"; the prediction
does not. Linear families (degree 1) keep the ratio: they do not move under
SGD, and their round-off (e.g. transformers' float32 router softmax in a
float64 model) is not the weights' round-off the tolerance counts.

What to expect depends on the optimiser (:func:`describe_optimizer`, which
unwraps ``accelerate``'s ``AcceleratedOptimizer`` and any object holding an
``.optimizer``):

- plain SGD: the laws are conserved up to the O(τ²k) finite-step term, which
  the monitor predicts exactly when it sees the steps: held;
- SGD + weight decay λ: quadratic laws decay as e^{−2λt} (Kunin et al., ICLR
  2021, "Neural Mechanics"): broken unless the monitor rescales them
  (``ConservationMonitor(weight_decay=λ, lr=τ)``);
- SGD + momentum β: the gradient-flow laws are lost (Marcotte et al., ICML
  2024, "Keep the momentum": momentum conserves other, fewer quantities; a
  ReLU network keeps none), so drift is expected, not a failure; compare with
  the predicted curve of :mod:`flowgeom.laws.predict`;
- Adam / AdamW / others: the step is not along the gradient, so nothing is
  conserved and there is no prediction of the drift: broken, expected.
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
    "sgd": ("held", "plain SGD: the laws are conserved up to the O(τ²k) finite-step term; expect held (judged "
                    "by the ratio, a heuristic: the steps' gradients were not seen, so the exact drift Σ τ²·h(g) is "
                    "unknown)"),
    "sgd+wd": ("broken", f"SGD with weight decay: quadratic laws decay as e^(−2λt) ({KUNIN}); expect broken "
                         "unless the monitor rescales them (weight_decay=λ, lr=τ)"),
    "momentum": ("broken", f"SGD with momentum: the gradient-flow laws are lost under momentum ({MARCOTTE}); "
                           f"drift is expected, not a failure; compare with the predicted drift ({KUNIN})"),
    "adam": ("broken", "Adam-type optimiser: the step is not along the gradient, so no law of gradient flow "
                       "is conserved and flowgeom has no prediction of the drift; expect broken (not a failure)"),
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
    predicted: float = math.nan  # ε of the exact plain-SGD prediction (nan: none)
    basis: str = "ratio"    # what decided the verdict: "ratio" (ε_law/ε_control) or "prediction" (within round-off)
    excess: float = math.nan     # ‖h − ĥ‖ / round-off tolerance, worst law of the family (≤ 1: held; nan: none)

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
    ``control/…`` key of the record is averaged. A non-linear family with
    ``pred_excess/<family>`` in the record is judged by the exact plain-SGD
    prediction instead (module docstring).
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
        fam = key[4:]
        excess = record.get(f"pred_excess/{fam}")
        if isinstance(excess, (int, float)) and key not in linear:
            predicted = float(record.get(f"pred/{fam}", math.nan))
            verdict = "held" if excess <= 1.0 else "broken"
            out.append(Verdict(fam, eps, control, ratio, verdict, False, predicted, "prediction", float(excess)))
        else:
            out.append(Verdict(fam, eps, control, ratio, verdict, key in linear))
    return out


def _optimizer_text(info: OptimizerInfo | None) -> str:
    if info is None:
        return ""
    hp = [f"lr={info.lr:g}"] if info.lr is not None else []
    hp += [f"momentum={info.momentum:g}"] if info.momentum else []
    hp += [f"weight_decay={info.weight_decay:g}"] if info.weight_decay else []
    return f"{info.name}({', '.join(hp)}): " if hp else f"{info.name}: "


def _head(verdicts: Sequence[Verdict], info: OptimizerInfo | None, step: int | None, reference: str | None) -> str:
    """``step 40 (from …), SGD(lr=0.01): 3 law families held, 0 broken``."""
    held = sum(v.verdict == "held" for v in verdicts)
    broken = sum(v.verdict == "broken" for v in verdicts)
    at = f"step {step}" if step is not None else ""
    at += f" ({reference})" if reference else ""
    at += ", " if at else ""
    if not held and not broken:
        return f"{at}{_optimizer_text(info)}no verdict yet (the controls have not moved)"
    return f"{at}{_optimizer_text(info)}{held} law famil{'y' if held == 1 else 'ies'} held, {broken} broken"


def _predicted(verdicts: Sequence[Verdict]) -> tuple[list[Verdict], list[Verdict], Verdict | None]:
    """The families judged by the exact prediction, those of them broken, and the one to quote."""
    exact = [v for v in verdicts if v.basis == "prediction"]
    broken = [v for v in exact if v.verdict == "broken"]
    quote = max(broken or exact, key=lambda v: v.eps) if exact else None
    return exact, broken, quote


def _expect(verdicts: Sequence[Verdict], info: OptimizerInfo | None, rescaled: bool) -> tuple[str, str]:
    """(short tag, explanation) of the expected behaviour: ``as expected``, ``NOT as expected for …``, ``note``."""
    exact, bad, quote = _predicted(verdicts)
    rest = [v for v in verdicts if v.basis != "prediction" and v.verdict in ("held", "broken")]
    if exact:  # plain SGD, steps seen: the verdict is the prediction's (the linear families keep their ratio)
        off_rest = [v.family for v in rest if v.verdict != "held"]
        if not bad and not off_rest:
            return (f"as expected (discretisation drift, predicted {quote.predicted:.3e}, measured {quote.eps:.3e}; "
                    f"largest: {quote.family})", "")
        if bad:
            return (f"NOT as expected for {', '.join(v.family for v in bad[:3])}",
                    f"measured {quote.eps:.3e} exceeds the predicted discretisation drift {quote.predicted:.3e} "
                    f"({quote.family}) beyond round-off; plain SGD moves a conserved quadratic law by exactly "
                    "Σ τ²·h(g), so something else moved the weights")
        return (f"NOT as expected for {', '.join(off_rest[:3])} (expected held)",
                "plain SGD keeps a linear law exactly (no τ² term)")
    if info is None:
        return "", ""
    held = [v for v in verdicts if v.verdict == "held"]
    broken = [v for v in verdicts if v.verdict == "broken"]
    expected, why = info.expected, info.explanation
    if rescaled and info.kind == "sgd+wd":
        expected, why = "held", "SGD with weight decay, laws rescaled by e^(dλt): expect held"
    if expected == "unknown" or not (held or broken):
        return "note", why
    if all(v.verdict == expected for v in held + broken):
        return "as expected", why
    off = [v.family for v in held + broken if v.verdict != expected]
    return f"NOT as expected for {', '.join(off[:3])} (expected {expected})", why


def summary_line(verdicts: Sequence[Verdict], info: OptimizerInfo | None, *, step: int | None = None,
                 threshold: float = HELD_THRESHOLD, rescaled: bool = False, reference: str | None = None) -> str:
    """One line: ``flowgeom: step 50, SGD(lr=0.1, momentum=0.9): 0 law families held, 3 broken (…) — as expected: …``.

    ``rescaled``: the monitor tracks e^{dλt}·h (``weight_decay=λ``), so SGD + weight decay should hold.
    ``reference``: what ε is measured from, when it is not θ_0 (said after the step).
    Families judged by the exact plain-SGD prediction give
    ``… — as expected (discretisation drift, predicted X, measured Y): …``.
    """
    head = _head(verdicts, info, step, reference)
    decided = [v for v in verdicts if v.verdict in ("held", "broken")]
    if decided:
        exact, _, _ = _predicted(verdicts)
        if exact:
            head += " (held: the measured drift is the predicted Σ τ²·h(g) to round-off)"
        else:
            worst = max(verdicts, key=lambda v: -1.0 if math.isnan(v.ratio) else v.ratio)
            head += f" (held: ε_law/ε_control < {threshold:g}; worst {worst.family} {worst.ratio:.2g})"
    tag, why = _expect(verdicts, info, rescaled)
    expect = (f" — {tag}" + (f": {why}" if why else "")) if tag else ""
    return f"flowgeom: {head}{expect}"


def summary_title(verdicts: Sequence[Verdict], info: OptimizerInfo | None, *, step: int | None = None,
                  rescaled: bool = False, reference: str | None = None) -> str:
    """The short form of :func:`summary_line` for a figure: the counts, then the expectation's tag (two lines)."""
    tag, _ = _expect(verdicts, info, rescaled)
    head = _head(verdicts, info, step, reference)
    return f"{head}\n{tag}" if tag and tag != "note" else head
