"""Drift of the conservation laws during real training.

Seed 000 measures how far discrete training drifts from the invariants of
gradient flow with the *conservation error* of a law family in a block,

    ε(k) = (1/N) Σ_i ‖h_i(θ_k) − h_i(θ_0)‖ / ‖h_i(θ_0)‖,

where h_1..h_N are the family's laws in that block (one per attention head,
one vector of m scalars for a SwiGLU, ...). For plain gradient descent with
step τ a quadratic law changes by exactly τ²·q(∇L) per step
(h(θ − τg) − h(θ) = −τ⟨∇h, g⟩ + τ² q(g), and ⟨∇h, g⟩ = 0), so
ε(k) = O(τ²k); a non-conserved *control* (e.g. ‖W_Q‖²_F) moves at first
order, O(τk).

**Linear laws** (``law.degree == 1``: the MoE router sum Σ_e W_e, a frozen
top-1 router, the k bias of attention without RoPE) have no τ² term:
h(θ − τg) = h(θ) − τ⟨∇h, g⟩ = h(θ) exactly, so every discrete GD/SGD step
keeps them and their ε is float round-off (in transformers' routers, whose
softmax runs in float32, ~1e-9 relative per step in a float64 model), not an
O(τ²k) drift. Their check is ‖Δh‖/(τ‖∇L‖) ≪ 1 over one step, never a slope
of 2 in τ; :meth:`ConservationMonitor.linear_families` names them.

**The exact plain-SGD prediction.** Given a plain ``torch.optim.SGD`` (no
momentum, no weight decay; wrappers are unwrapped), the monitor hooks the
optimiser's step (``register_step_post_hook``: the gradient the step used,
after clipping and accumulation, and that step's learning rate) and
accumulates ĥ_k = h(θ_0) + Σ_j τ_j²·h(g_j) beside the measured h(θ_k)
(:class:`flowgeom.laws.predict.SGDPrediction`; one more law evaluation per
optimiser step, ``predict=False`` to skip it). Every record then carries
``pred/<family>`` (ε of ĥ), ``pred_err/<family>`` (‖h − ĥ‖/‖h − h_0‖) and
``pred_excess/<family>`` (the gap over its round-off tolerance), and the
verdict of a quadratic family is "held" exactly when the measured drift is the
predicted discretisation drift to round-off. :meth:`close` removes the hook.

**Only plain GD / SGD.** Momentum and Adam change the direction of the
step (no longer a combination of the model's Jacobian rows), so the first-
order term no longer vanishes; weight decay adds −λθ to the flow. For the
flow θ̇ = −∇L(θ) − λθ a law h homogeneous of degree d (d = 2 for every
quadratic law of the catalogue, d = 1 for the router sum) obeys
ḣ = ⟨∇h, −∇L⟩ − λ⟨∇h, θ⟩ = −dλh (Euler), so e^{dλt}·h(θ_t) is conserved:
pass ``weight_decay=λ`` (and the step size ``lr`` so that t = k·τ, or pass
``time=`` to :meth:`ConservationMonitor.step`). For the *discrete* SGD
update with decoupled weight decay, θ' = (1 − τλ)θ − τg, homogeneity gives
h(θ') = (1 − τλ)^d·h(θ − τg/(1 − τλ)) = (1 − τλ)^d·(h(θ) + O(τ²)), so
``rescale="sgd"`` tracks (1 − τλ)^{−dk}·h(θ_k), conserved up to the same
O(τ²k) as plain GD (the flow factor e^{dλkτ} leaves an extra O(τλ²t) from
discretising the decay itself).

Use in any PyTorch loop (the record of step k is θ after k updates, so
measure right after ``opt.step()``; θ_0 is taken at construction)::

    mon = ConservationMonitor(model, every=10, run=run_folder, optimizer=opt)
    for k in range(steps):
        loss = ...; loss.backward(); opt.step(); opt.zero_grad()
        mon.step(k + 1)             # measures (and logs) when (k + 1) % every == 0
    print(mon.summary()["line"])    # held / broken per law family, and what the optimiser should give

:meth:`ConservationMonitor.verdicts` and :meth:`~ConservationMonitor.summary`
turn the last record into a verdict per law family (ε_law / ε_control against
:data:`flowgeom.laws.verdict.HELD_THRESHOLD`) and the behaviour expected from
the optimiser (:mod:`flowgeom.laws.verdict`). Training-framework callbacks and
loggers live in :mod:`flowgeom.integrations`.

Evaluation is vectorised: same-shaped laws (e.g. the V/O law of every K/V
group of every layer) are stacked once into float64 — only the slices they
read — and evaluated by one kernel call per group
(:mod:`flowgeom.laws.batched`), then one segmented reduction gives all the
ε's. A step that is not due costs one modulo. Keys of a record: ``eps/<family>`` (mean over all
blocks), ``eps/<family>@<block>``, ``control/<family>[@<block>]`` (relative
change of the non-conserved controls), ``refuted/<family>[@<block>]``
(claims the catalogue measured false, e.g. the sigmoid-gate router sum),
and ``uncovered: [{block, reason}]`` when some blocks of the model have no
verified law (they are named, warned about once, and not measured; see
:func:`flowgeom.laws.locate.locate_blocks`; also ``monitor.uncovered``).

**A law that is zero at θ_0** has no relative error: Qwen3's per-head
QK-norm law ‖γ_q^(j)‖² − ‖γ_k^(j)‖² is exactly 0 for transformers' ones
initialisation, and ε would be (a rounding-sized change) / 0. When
‖h(θ_0)‖ ≤ 1e-8·S, with S = (Σ_p ‖p‖²_F)^(d/2) over the parameters p the
law reads and d its degree (S bounds ‖h‖ for every difference-of-squares law
of the catalogue), that law's ε divides by S instead: the change relative to
the energy of the weights it reads (of its whole block when those are all
zero, as for the k-bias law of a zero-initialised GPT-2/BERT/GPT-NeoX
bias). Such laws are named once
(:class:`~flowgeom.laws.locate.FlowgeomWarning`), in ``monitor.zero_baseline``
and under ``zero_baseline`` in every record.

**Half-precision weights.** The laws are exact for gradient flow; weights
stored in bfloat16/float16 are rounded at every step (2^-8 / 2^-11
relative), which moves every law by that much and swallows small updates
(a control can then move less than a law). The monitor warns once and puts
the dtypes under ``low_precision`` in every record (``monitor.low_precision``);
measure with float32 weights, e.g. float32 master weights under autocast.
"""

from __future__ import annotations

import hashlib
import math
import re
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flowgeom.errors import FlowgeomError, finite_number, positive_int
from flowgeom.laws.batched import BatchedLaws
from flowgeom.laws.law import CatalogueEntry, Law
from flowgeom.laws.locate import FlowgeomWarning, Uncovered, locate_blocks
from flowgeom.laws.predict import SGDPrediction
from flowgeom.laws.verdict import (
    HELD_THRESHOLD, OptimizerInfo, Verdict, describe_optimizer, family_verdicts, summary_line, summary_title,
    unwrap_optimizer,
)

ZERO_BASELINE = 1e-8  # ‖h(θ_0)‖ at or below this times the law's parameter scale: normalise by the scale

PLAIN_GD_WARNING = (
    "flowgeom: conservation laws hold for plain gradient descent / SGD only; momentum, Adam and "
    "weight decay break them (for weight decay pass weight_decay=λ to track the rescaled laws e^{dλt}·h)"
)


def warn_plain_gd_only(optimizer: torch.optim.Optimizer | None = None, *, stacklevel: int = 2) -> bool:
    """Warn unless ``optimizer`` is plain SGD (no momentum, no weight decay); True when it is not.

    No state: every call warns. :class:`ConservationMonitor` warns once per
    monitor (a second monitor warns again; Python's default filter shows a
    warning once per call site).
    """
    if optimizer is not None and is_plain_sgd(optimizer):
        return False
    warnings.warn(PLAIN_GD_WARNING, UserWarning, stacklevel=stacklevel + 1)
    return True


def is_plain_sgd(optimizer: Any) -> bool:
    """True for ``torch.optim.SGD`` with momentum 0 and weight decay 0 in every group.

    Wrappers are looked through (accelerate's ``AcceleratedOptimizer``, which
    ``transformers.Trainer(optim="sgd")`` hands out, and any object holding an
    ``.optimizer``): their type is not SGD but their steps are.
    """
    from flowgeom.laws.verdict import unwrap_optimizer

    optimizer = unwrap_optimizer(optimizer)
    return type(optimizer) is torch.optim.SGD and all(
        g.get("momentum", 0) == 0 and g.get("weight_decay", 0) == 0 for g in optimizer.param_groups
    )


@dataclass(frozen=True)
class Tracked:
    """One monitored quantity: a law (or control / refuted claim) with its report group."""

    law: Law
    kind: str    # "eps" | "control" | "refuted"
    family: str  # report family, e.g. "attn.qk" or "norm.q_proj"
    block: str   # module path, e.g. "layers.0.self_attn"


def _block_of(law: Law) -> str:
    """The report block of a law: the module ``locate`` found it at, else read from its first parameter's name."""
    if law.block:
        return law.block
    name = law.params[0]
    if ".lora_" in name:  # …q_proj.lora_A.default.weight: the adapted module …q_proj
        return name.split(".lora_", 1)[0]
    module = name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
    return re.sub(r"\.experts\.\d+$", "", module)  # an expert's laws belong to its MoE


def _tracked(entry: CatalogueEntry, include_refuted: bool) -> list[Tracked]:
    out = [Tracked(law, "eps", law.family, _block_of(law)) for law in entry.laws]
    for law in entry.controls:
        leaf = law.params[0].rsplit(".", 2)[-2] if "." in law.params[0] else law.params[0]
        family = law.family if law.family.startswith("norm.") else f"norm.{leaf}"
        out.append(Tracked(law, "control", family, _block_of(law)))
    if include_refuted:
        out += [Tracked(law, "refuted", law.family, _block_of(law)) for law in entry.refuted]
    return out


def homogeneity_degree(law: Law, params: Mapping[str, Tensor]) -> int:
    """The degree d with h(sθ) = s^d h(θ), measured at s = 2 (raises if h is not homogeneous)."""
    p = {n: params[n].detach().double() for n in law.params}
    h1 = law.evaluate(p)
    h2 = law.evaluate({n: 2 * v for n, v in p.items()})
    n1 = float(h1.norm())
    if n1 == 0.0:
        raise FlowgeomError(f"law {law.name!r} is zero at θ; its homogeneity degree cannot be measured")
    d = round(math.log2(float(h2.norm()) / n1))
    if not torch.allclose(h2, (2.0 ** d) * h1, rtol=1e-9, atol=1e-12 * n1):
        raise FlowgeomError(f"law {law.name!r} is not homogeneous; the weight-decay rescaling e^(dλt)·h needs one")
    return d


class ConservationMonitor:
    """Record ε(k) per law family and block (and the controls) during training.

    ``laws``: ``None`` (locate every zoo / HF-named block, see
    :func:`flowgeom.laws.locate.locate`), a :class:`CatalogueEntry`, or a
    sequence of :class:`Law`. θ_0 is the model's parameters at construction
    (or at :meth:`reset`). ``run`` (a :class:`flowgeom.runs.RunFolder`)
    receives each record through ``run.log``. ``per_block=False`` keeps only
    the per-family means. ``predict`` (with a plain-SGD ``optimizer``): accumulate
    the exact discretisation drift Σ τ²·h(g) from the optimiser's steps (module docstring).
    """

    def __init__(self, model: nn.Module, laws: CatalogueEntry | Sequence[Law] | None = None, *, every: int = 1,
                 run: Any = None, optimizer: torch.optim.Optimizer | None = None, weight_decay: float = 0.0,
                 lr: float | None = None, include_refuted: bool = True, per_block: bool = True,
                 heads: int | None = None, positions: str | None = None, warn: bool = True,
                 rescale: str = "flow", predict: bool = True):
        positive_int(every, "every", fix="measure every N >= 1 steps")
        weight_decay = finite_number(weight_decay, "ConservationMonitor weight_decay", minimum=0.0,
                                     fix="pass the optimiser's weight decay λ >= 0, or 0")
        if lr is not None:
            lr = finite_number(lr, "ConservationMonitor lr", positive=True, fix="pass the step size τ > 0, or None")
        if rescale not in ("flow", "sgd"):
            raise FlowgeomError(f"unknown rescale {rescale!r}; choose flow (e^(dλt)) or sgd ((1−τλ)^(−dk))")
        if rescale == "sgd" and weight_decay and not (lr and 0 < lr * weight_decay < 1):
            raise FlowgeomError(f"rescale='sgd' needs lr with 0 < lr·weight_decay < 1, got lr={lr}")
        self.uncovered: tuple[Uncovered, ...] = ()
        if laws is None:
            found = locate_blocks(model, heads=heads, positions=positions, warn=warn)
            laws, self.uncovered = found.entry, found.uncovered
        entry = laws if isinstance(laws, CatalogueEntry) else CatalogueEntry(tuple(laws), (), ())
        self.notes = entry.notes
        self.items = _tracked(entry, include_refuted)
        if not any(t.kind == "eps" for t in self.items):
            missed = "; ".join(f"{u.block}: {u.reason}" for u in self.uncovered[:3])
            raise FlowgeomError(f"no conservation law found in {type(model).__name__}: it holds no zoo block, no block of "
                                "a supported HF family and no HF-named attention (q/k/v/o_proj) or gated MLP "
                                "(gate/up/down_proj)" + (f"; uncovered: {missed}" if missed else ""))
        self.model, self.every, self.run, self.per_block, self._warn = model, every, run, per_block, warn
        self._warned: set[str] = set()  # the kinds of warning this monitor gave (each at most once per monitor)
        self.weight_decay, self.lr, self.rescale = float(weight_decay), lr, rescale
        self.optimizer_info: OptimizerInfo | None = describe_optimizer(optimizer) if optimizer is not None else None
        self.last: dict[str, Any] | None = None  # the latest record (verdicts() reads it)
        if warn and not (optimizer is not None and is_plain_sgd(optimizer)):
            self._warn_once("plain_gd", PLAIN_GD_WARNING, UserWarning)
        named = dict(model.named_parameters())
        missing = sorted({n for t in self.items for n in t.law.params} - set(named))
        if missing:
            raise FlowgeomError(f"laws read parameters the model lacks: {', '.join(missing[:5])}; "
                                "build the laws from this model (ConservationMonitor(model))")
        self._names = sorted({n for t in self.items for n in t.law.params})
        self._params = [named[n] for n in self._names]
        meta = [n for n, p in zip(self._names, self._params) if p.is_meta]
        if meta:
            raise FlowgeomError(f"{meta[0]} (and {len(meta) - 1} more) is on the meta device (no values); materialise "
                                "the model (load its weights) before building the monitor")
        odd = [(n, p.dtype) for n, p in zip(self._names, self._params) if not p.dtype.is_floating_point]
        if odd:  # complex h has no real ε; integer weights do not flow
            raise FlowgeomError(f"{odd[0][0]} (and {len(odd) - 1} more) has dtype {str(odd[0][1]).replace('torch.', '')}"
                                "; the conservation laws are defined for real floating-point weights: convert the "
                                "model with .float() (or .double()) before building the monitor")
        if warn and not any(p.requires_grad for p in self._params):
            self._warn_once("frozen", f"no parameter the laws read requires grad ({len(self._params)} frozen, e.g. "
                            f"{self._names[0]}): training cannot move them, so every ε will be 0 and say nothing "
                            "about the laws; unfreeze them (requires_grad_(True)) or monitor the trained part")
        self.low_precision = sorted({str(p.dtype).replace("torch.", "") for p in self._params
                                     if p.dtype in (torch.float16, torch.bfloat16)})
        if self.low_precision and warn:  # the laws are exact for the flow; half-precision weights are not
            worst = max(torch.finfo(getattr(torch, d)).eps / 2 for d in self.low_precision)  # unit roundoff
            self._warn_once("low_precision", f"the laws read {' and '.join(self.low_precision)} weights: every step "
                            f"rounds them by up to {worst:.1e} relative, so ε measures that rounding as much as the "
                            "flow's O(τ²k) drift (it can exceed the controls); train with float32 weights (e.g. "
                            "float32 master weights under autocast) to measure the laws")
        self._batched = BatchedLaws([t.law for t in self.items], self._detached())
        counts = [t.law.count for t in self.items]
        self._seg = torch.repeat_interleave(torch.arange(len(self.items)), torch.tensor(counts))  # (total,)
        keys = self._group_keys()
        self._keys = sorted({k for ks in keys for k in ks})
        index = {k: i for i, k in enumerate(self._keys)}
        self._pairs = [(j, index[k]) for j, ks in enumerate(keys) for k in ks]  # (item, group) memberships
        self._pair_item = torch.tensor([j for j, _ in self._pairs])
        self._pair_group = torch.tensor([g for _, g in self._pairs])
        self._group_size = torch.zeros(len(self._keys), dtype=torch.float64).index_add_(
            0, self._pair_group, torch.ones(len(self._pairs), dtype=torch.float64))
        self._degree = None
        if self.weight_decay:
            p = dict(zip(self._names, self._params))
            degs = torch.tensor([float(homogeneity_degree(t.law, p)) for t in self.items], dtype=torch.float64)
            self._degree = degs[self._seg]  # (total,)
        self.prediction: SGDPrediction | None = None  # the exact plain-SGD drift (module docstring)
        self._hook = None
        self._trains = optimizer is not None  # a training monitor; without an optimiser a saved prediction is replayed
        self.reset()
        if predict and optimizer is not None and is_plain_sgd(optimizer) and not self.weight_decay:
            self._track_sgd(unwrap_optimizer(optimizer))

    def _track_sgd(self, optimizer: torch.optim.Optimizer) -> None:
        """Feed :attr:`prediction` from every step of ``optimizer`` (a weak reference: a dropped monitor unhooks)."""
        self.prediction = SGDPrediction(self)
        ref = weakref.ref(self)

        def after_step(opt, args, kwargs):  # torch calls it after each opt.step(): .grad is what the step used
            mon = ref()
            if mon is None:
                handle.remove()
            else:
                mon._sgd_step(opt)

        handle = optimizer.register_step_post_hook(after_step)
        self._hook = handle

    @torch.no_grad()
    def _sgd_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Advance the prediction by h(Δ), Δ_p = τ_p·g_p: the step just taken (see :mod:`flowgeom.laws.predict`)."""
        pr = self.prediction
        if pr is None:
            return
        if not is_plain_sgd(optimizer):  # momentum or weight decay switched on mid-run: no exact prediction left
            self.close()
            self.prediction = None
            self._warn_once("prediction_lost", "the optimiser is no longer plain SGD (momentum or weight decay was "
                            "set during training): the exact plain-SGD prediction stops here", stacklevel=4)
            return
        rate = {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}
        grads = {n: (p.grad, rate[id(p)]) for n, p in zip(self._names, self._params)
                 if p.grad is not None and id(p) in rate}
        rates = {r for _, r in grads.values()}
        if len(rates) <= 1:  # one learning rate for every law: h(τg) = τ²·h(g), no scaled copy of the gradients
            tau = rates.pop() if rates else 0.0
            drive = self.values_at({n: g for n, (g, _) in grads.items()}) * tau ** 2
        else:
            drive = self.values_at({n: g * r for n, (g, r) in grads.items()})
        pr.advance(drive, pr.scale(self._params))

    def close(self) -> None:
        """Stop following the optimiser's steps (removes the step hook; the records so far stay)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _group_keys(self) -> list[tuple[str, ...]]:
        keys = []
        for t in self.items:
            family = f"{t.kind}/{t.family}"
            keys.append((family, f"{family}@{t.block}") if self.per_block else (family,))
        return keys

    def _detached(self) -> dict[str, Tensor]:
        return {n: w.detach() for n, w in zip(self._names, self._params)}

    @torch.no_grad()
    def values(self) -> Tensor:
        """Every tracked quantity at the current θ, float64, concatenated: (total,).

        Same-shaped laws are evaluated together (:class:`flowgeom.laws.batched.BatchedLaws`):
        one float64 stack of the slices they read, one kernel call per group.
        """
        return self._batched(self._detached())

    @torch.no_grad()
    def values_at(self, tensors: Mapping[str, Tensor]) -> Tensor:
        """Every tracked quantity evaluated at ``tensors`` (by parameter name; missing ones are zeros): (total,).

        For a quadratic law h(θ) = θᵀMθ this is h of e.g. the gradient or the momentum buffer, the
        finite-step term h(θ − τg) − h(θ) = τ²·h(g) of :mod:`flowgeom.laws.predict`.
        """
        full = {n: (tensors[n].detach() if tensors.get(n) is not None else torch.zeros_like(p))
                for n, p in zip(self._names, self._params)}
        return self._batched(full)

    @property
    def param_names(self) -> list[str]:
        """The parameters the tracked quantities read (sorted)."""
        return list(self._names)

    def fingerprint(self) -> str:
        """A digest of what is tracked (law names, counts, parameter names and shapes): equal states only."""
        h = hashlib.sha256()
        for t in self.items:
            h.update(f"{t.kind}|{t.family}|{t.block}|{t.law.name}|{t.law.count}\n".encode())
        for n, p in zip(self._names, self._params):
            h.update(f"{n}|{tuple(p.shape)}\n".encode())
        return h.hexdigest()

    def reset(self) -> None:
        """Take the current parameters as θ_0 (refused when the laws are not finite there)."""
        h0 = self.values()
        if not bool(torch.isfinite(h0).all()):
            bad = [n for n, p in zip(self._names, self._params) if not bool(torch.isfinite(p.detach()).all())]
            what = (f"{', '.join(bad[:3])} contain{'s' if len(bad) == 1 else ''} NaN or Inf" if bad
                    else "a law overflowed float64")
            raise FlowgeomError(f"the laws are not finite at θ_0 ({what}): every ε would be NaN; fix or re-initialise "
                                "the weights before building the monitor (or call reset() once they are finite)")
        self.h0 = h0
        self._set_denominators()
        if getattr(self, "prediction", None) is not None:
            self.prediction.reset()

    def _set_denominators(self, warn: bool = True) -> None:
        """ε's denominator per item: ‖h(θ_0)‖, or the parameter scale where h(θ_0) ≈ 0 (module docstring)."""
        norm = self._segment_norm(self.h0)

        def sq(p: Tensor) -> float:
            return float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64)) ** 2

        own_sq = {n: sq(p) for n, p in zip(self._names, self._params)}  # only what the laws read

        def energy(t: Tracked) -> float:
            """Σ‖p‖² of the parameters the law reads; of its whole block when those are all zero (a zero-init bias)."""
            own = sum(own_sq[n] for n in set(t.law.params))
            if own > 0 or not t.block:
                return own
            return sum(sq(p) for n, p in self.model.named_parameters() if n.startswith(t.block + "."))

        scale = torch.tensor([energy(t) ** (t.law.degree / 2) for t in self.items], dtype=torch.float64)
        zero = norm <= ZERO_BASELINE * scale
        self._h0_norm = torch.where(zero, scale, norm)
        self.zero_baseline = list(dict.fromkeys(f"{t.kind}/{t.family}@{t.block}"
                                                for t, z in zip(self.items, zero.tolist()) if z))
        if self.zero_baseline and warn and self._warn:
            self._warn_once("zero_baseline", f"{len(self.zero_baseline)} law(s) are zero at θ_0 "
                            f"({', '.join(self.zero_baseline[:3])}{', …' if len(self.zero_baseline) > 3 else ''}): "
                            "their ε is relative to the scale of the weights they read (or of their block), not to "
                            "‖h(θ_0)‖ (monitor.zero_baseline)", stacklevel=4)

    def _warn_once(self, kind: str, message: str, category: type[Warning] = FlowgeomWarning, *,
                   stacklevel: int = 3) -> None:
        """Warn about ``kind`` the first time this monitor meets it (a new monitor warns again; no global state).

        ``stacklevel`` counts from this method (3: the caller of the method that calls it).
        """
        if kind in self._warned:
            return
        self._warned.add(kind)
        warnings.warn(message, category, stacklevel=stacklevel)

    def _segment_norm(self, v: Tensor) -> Tensor:
        sq = torch.zeros(len(self.items), dtype=torch.float64).index_add_(0, self._seg, v * v)
        return sq.sqrt()

    @torch.no_grad()
    def measure(self, *, time: float = 0.0, decay_log: float | None = None, values: Tensor | None = None
                ) -> dict[str, float]:
        """ε of every group now (or of ``values``, a :meth:`values` result taken earlier).

        With weight decay each law is rescaled by e^{d·s}: s = λ·``time`` (flow),
        or ``decay_log`` when given (e.g. −k·log(1 − τλ) for discrete SGD).
        """
        v = self.values() if values is None else values
        if self._degree is not None:
            s = self.weight_decay * time if decay_log is None else decay_log
            v = v * torch.exp(self._degree * s)
        return self.aggregate(self.relative(v))

    def relative(self, v: Tensor, reference: Tensor | None = None) -> Tensor:
        """‖v_i − ref_i‖ / (ε's denominator) per tracked item: (items,). ``reference`` defaults to h(θ_0)."""
        ref = self.h0 if reference is None else reference
        return self._segment_norm(v - ref) / self._h0_norm.clamp_min(torch.finfo(torch.float64).tiny)

    def aggregate(self, per_item: Tensor, prefix: str | None = None) -> dict[str, float]:
        """Mean of a per-item quantity (items,) over each record group; keys renamed ``<prefix>/…`` if given."""
        sums = torch.zeros(len(self._keys), dtype=torch.float64).index_add_(0, self._pair_group, per_item[self._pair_item])
        out = dict(zip(self._keys, (sums / self._group_size).tolist()))
        if prefix is None:
            return out
        return {f"{prefix}/{k.split('/', 1)[1]}": v for k, v in out.items() if k.startswith("eps/")}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def step(self, step: int, *, time: float | None = None, extra: Mapping[str, Any] | None = None,
             values: Tensor | None = None) -> dict[str, Any] | None:
        """Measure at ``step`` when it is due: returns the record (also logged to ``run``), else None.

        ``time`` defaults to ``step * lr`` (needed only with weight decay).
        """
        if not self.due(step):
            return None
        if time is None:
            if self.weight_decay and self.lr is None:
                raise FlowgeomError("with weight_decay the monitor needs lr= (t = k·lr) or step(..., time=t)")
            time = step * (self.lr or 0.0)
        decay_log = None
        if self.rescale == "sgd" and self.weight_decay:
            decay_log = -step * math.log1p(-self.lr * self.weight_decay)
        values = self.values() if values is None else values
        record = {"step": step, **(extra or {}), **self.measure(time=time, decay_log=decay_log, values=values)}
        if self.prediction is not None and self.prediction.steps:
            record.update(self.prediction.compare(values, self.prediction.scale(self._params)))
        if self.uncovered:
            record["uncovered"] = self.uncovered_list()
        if self.zero_baseline:
            record["zero_baseline"] = list(self.zero_baseline)
        if self.low_precision:
            record["low_precision"] = list(self.low_precision)
        if self.run is not None:
            self.run.log(record)
        self.last = record
        return record

    def controls_of(self) -> dict[str, list[str]]:
        """For each ``eps/<family>``, the ``control/<family>`` keys that have a control in one of its blocks.

        Block-level, not per matrix: a single ‖W‖² can barely move early in training (its first-order change
        2⟨W, ΔW⟩ is small while the gradient is nearly orthogonal to a random W; ‖W_Q‖² on the tiny Llama), which
        made the ratio of the Q/K law swing across the threshold under plain SGD; the block's controls together
        are steadier.
        """
        if getattr(self, "_controls_of", None) is None:  # fixed by the items: built once, read at every verdict
            self._controls_of = self._build_controls_of()
        return self._controls_of

    def _build_controls_of(self) -> dict[str, list[str]]:
        blocks: dict[str, set[str]] = {}
        for t in self.items:
            if t.kind == "eps":
                blocks.setdefault(f"eps/{t.family}", set()).add(t.block)
        return {fam: sorted({f"control/{t.family}" for t in self.items if t.kind == "control" and t.block in bl})
                for fam, bl in blocks.items()}

    def verdicts(self, record: Mapping[str, Any] | None = None, *, threshold: float = HELD_THRESHOLD) -> list[Verdict]:
        """Held / broken per law family: ε_law / ε_control of ``record`` (default: the last one) against ``threshold``."""
        record = self.last if record is None else record
        if record is None:
            raise FlowgeomError("no record yet: call monitor.step(k) after an optimiser step before asking for verdicts")
        return family_verdicts(record, controls_of=self.controls_of(), threshold=threshold,
                               linear=self.linear_families())

    def summary(self, optimizer: Any = None, *, record: Mapping[str, Any] | None = None,
                threshold: float = HELD_THRESHOLD, reference: str | None = None) -> dict[str, Any]:
        """``{step, verdicts, optimizer, line, title}``: the verdicts, one line with the optimiser's expected
        behaviour, and its short form (a figure's title).

        ``optimizer`` defaults to the one given at construction (wrappers are unwrapped). ``reference``
        names what ε is measured from when it is not this monitor's θ_0 (e.g. "from checkpoint-20; θ₀ unknown").
        """
        info = describe_optimizer(optimizer) if optimizer is not None else self.optimizer_info
        record = self.last if record is None else record
        verdicts = self.verdicts(record, threshold=threshold)
        step = record.get("step") if record is not None else None
        line = summary_line(verdicts, info, step=step, threshold=threshold, rescaled=bool(self.weight_decay),
                            reference=reference)
        title = summary_title(verdicts, info, step=step, rescaled=bool(self.weight_decay), reference=reference)
        return {"step": step, "threshold": threshold, "verdicts": [v.as_dict() for v in verdicts],
                "optimizer": info.as_dict() if info is not None else None, "line": line, "title": title}

    def uncovered_list(self) -> list[dict[str, str]]:
        """The blocks no law covers, as ``[{block, reason}]`` (they are not measured)."""
        return [u.as_dict() for u in self.uncovered]

    def linear_families(self) -> list[str]:
        """The ``eps/<family>`` keys whose laws are all linear (degree 1): ε at round-off, not O(τ²k)."""
        degrees: dict[str, set[int]] = {}
        for t in self.items:
            if t.kind == "eps":
                degrees.setdefault(f"eps/{t.family}", set()).add(t.law.degree)
        return sorted(k for k, d in degrees.items() if d == {1})

    def families(self, kind: str = "eps") -> list[str]:
        """The per-family keys of one kind ("eps", "control", "refuted")."""
        return [k for k in self._keys if k.startswith(kind + "/") and "@" not in k]

    def state_dict(self) -> dict[str, Tensor]:
        """θ_0's law values, ε's denominators and the plain-SGD prediction (for resume: restore before continuing)."""
        digest = torch.tensor(list(bytes.fromhex(self.fingerprint())), dtype=torch.uint8)
        state = {"h0": self.h0.clone(), "denominator": self._h0_norm.clone(), "fingerprint": digest}
        if self.prediction is not None:
            state.update({f"sgd_{k}": v for k, v in self.prediction.state_dict().items()})
        return state

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore θ_0's values and denominators; a state saved for other laws or shapes is refused."""
        digest = state.get("fingerprint")
        if digest is not None and bytes(digest.to(torch.uint8).tolist()).hex() != self.fingerprint():
            raise FlowgeomError("the saved monitor state was taken on another model (its laws or parameter shapes "
                                "differ); resume with the model it was saved for, or start a new θ_0 without it")
        h0 = state["h0"]
        if h0.shape != self.h0.shape:
            raise FlowgeomError(f"monitor state has {h0.numel()} values, this monitor tracks {self.h0.numel()}; "
                                "it was saved for another model")
        self.h0 = h0.to(torch.float64).clone()
        self._set_denominators(warn=False)  # names the zero-baseline laws; their scale was taken at θ_0:
        denominator = state.get("denominator")
        if denominator is not None:  # (states saved before it existed recompute it at the current θ)
            if denominator.shape != self._h0_norm.shape:
                raise FlowgeomError(f"monitor state has {denominator.numel()} denominators, this monitor tracks "
                                    f"{self._h0_norm.numel()} laws; it was saved for another model")
            self._h0_norm = denominator.to(torch.float64).clone()
        saved = {k[4:]: v for k, v in state.items() if k.startswith("sgd_")}
        if saved and (self._hook is not None or not self._trains):
            # the prediction continues (a resume that follows the steps again) or is replayed (no optimiser:
            # conserve drift reads it from a checkpoint); a training monitor that does not follow the steps
            # (predict=False, not plain SGD) leaves it, since it would not move
            if self.prediction is None:
                self.prediction = SGDPrediction(self)
            self.prediction.load_state_dict(saved)
        elif not saved and self.prediction is not None:  # saved without it: the steps before the resume are unknown
            self.close()
            self.prediction = None
