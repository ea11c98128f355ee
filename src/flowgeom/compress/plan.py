"""Compress a model's projections: plans (space, grouping, rank per unit) and their factorisation.

Seed 001's design implication: adjacent layers share singular directions, so
a group of g adjacent layers can share one rank-r basis in the space where the
role is continuous (:data:`SEED_SPACE`; Q, K, Gate, Up: input space; O, Down:
output space). A *unit* is one role (q, k, v, o, gate, up, down) over a
group of consecutive layers, stored as one basis and one coefficient matrix
per layer (:class:`~flowgeom.compress.factorize.Factors`). A method decides the units
and their ranks (:func:`plan`); :func:`compress` factorises them with the
calibration Grams, optionally sequentially (each group re-calibrated on the
already-compressed earlier blocks) and with Basis Sharing's least-squares refit.

Methods (``ratio`` c = fraction of the in-scope projection parameters saved):

* ``svd`` - data-free truncated SVD per layer (the floor);
* ``whiten`` - SVD-LLM: per layer, truncation-aware whitening;
* ``basis-sharing`` - Basis Sharing (Wang et al., ICLR 2025): q, k, v, gate, up
  share one whitened input-space basis per group of g layers, o and down are
  whitened per layer; rank ``floor((1-c) d_in d_out g / (d_in + d_out g))``;
* ``share`` - whitened sharing in a space chosen per role (``spaces``; the
  seed's: q, k, gate, up input, o, down output, V per layer);
* ``continuity`` - flowgeom's: per role the space the analyzer measures as
  continuous; adjacent layers aligned above chance share a basis where the
  whitened loss of one shared basis beats two separate ones at the same cost;
  the budget split evenly (ranks reallocated by whitened loss measured worse).

Budgets are met per role by the rank rule (floor: never over); the achieved
fraction is reported next to the asked one (:attr:`Plan.saved_fraction`).
:func:`allocate_by_loss` keeps a plan's units (spaces, groups) and moves their
ranks model-wide by the calibration loss each whitened component costs
(:mod:`flowgeom.compress.allocate`); a unit whose factoring would save nothing
is then left dense (:attr:`Plan.dense`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flowgeom.compress import allocate as A
from flowgeom.compress import factorize as fz
from flowgeom.compress.arch import (ROLE_GRAM, ROLES, SEED_SPACE, arch_of, role_shapes, role_state, set_role_weight,
                                    weight_key)
from flowgeom.compress.calibrate import Calibration, calibrate, sensitivity
from flowgeom.compress.store import FactorFiles, GramFiles, TensorFiles
from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.memory import trim_heap

METHODS = ("svd", "whiten", "basis-sharing", "share", "continuity")
BS_SHARED = ("q", "k", "v", "gate", "up")  # Basis Sharing's default: these share, o and down stay per layer
PAIR_THRESHOLD = 3.0  # a pair is a sharing candidate when its subspace alignment is 3x chance (the analyzer's rule)


def opposite(space: str) -> str:
    """``input`` <-> ``output`` (strategy (b) of the sharing experiment)."""
    if space not in fz.SPACES:
        raise choice_error("space", space, fz.SPACES)
    return fz.SPACES[1 - fz.SPACES.index(space)]


def layer_groups(n_layers: int, group: int) -> list[list[int]]:
    """``[[0..g-1], [g..2g-1], ...]``; the last group holds the remainder (a single layer shares nothing)."""
    if not 1 <= group <= n_layers:
        raise FlowgeomError(f"--group {group} is outside 1..{n_layers}, the number of layers of the model; "
                            "pass a smaller --group")
    return [list(range(s, min(s + group, n_layers))) for s in range(0, n_layers, group)]


@dataclass(frozen=True)
class Unit:
    role: str
    space: str  # input | output
    layers: tuple[int, ...]
    rank: int
    shape: tuple[int, int]  # (m, n) of each layer's matrix

    @property
    def dense_params(self) -> int:
        return len(self.layers) * self.shape[0] * self.shape[1]

    @property
    def stored_params(self) -> int:
        return self.rank * fz.stored_per_rank(*self.shape, len(self.layers), self.space)


@dataclass(frozen=True)
class Plan:
    method: str
    ratio: float  # asked-for fraction saved
    units: tuple[Unit, ...]
    notes: tuple[str, ...] = ()
    dense: tuple[Unit, ...] = ()  # in scope but left dense: factoring them at their allocated rank saves nothing

    @property
    def dense_params(self) -> int:
        return sum(u.dense_params for u in self.units + self.dense)

    @property
    def stored_params(self) -> int:
        return sum(u.stored_params for u in self.units) + sum(u.dense_params for u in self.dense)

    @property
    def saved_fraction(self) -> float:
        return 1 - self.stored_params / self.dense_params

    def by_role(self) -> dict[str, dict]:
        """Per role: space(s), groups, ranks, asked and obtained saved fraction."""
        out: dict[str, dict] = {}
        for u in self.units + self.dense:
            r = out.setdefault(u.role, {"spaces": [], "groups": [], "ranks": [], "dense": 0, "stored": 0,
                                        "shape": list(u.shape), "dense_layers": []})
            r["dense"] += u.dense_params
            if u in self.dense:  # kept dense: full rank, no error
                r["dense_layers"] += list(u.layers)
                r["stored"] += u.dense_params
                r.setdefault("rel_error", []).extend(0.0 for _ in u.layers)
                continue
            r["spaces"].append(u.space)
            r["groups"].append(list(u.layers))
            r["ranks"].append(u.rank)
            r["stored"] += u.stored_params
        for r in out.values():
            r["saved_fraction"] = 1 - r["stored"] / r["dense"]
            r["space"] = (r["spaces"][0] if len(set(r["spaces"])) == 1 else "mixed") if r["spaces"] else "dense"
            if not r["ranks"]:  # every layer of the role kept dense
                r["ranks"] = [min(r["shape"])]
        return out


@dataclass
class Compressed:
    """Factors per unit (float32) and what was measured while making them."""

    plan: Plan
    factors: list[fz.Factors]
    notes: list[str] = field(default_factory=list)

    def dense_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` with every compressed projection replaced by its dense reconstruction (float32)."""
        out = dict(state)
        for unit, f in zip(self.plan.units, self.factors):
            for l, w in zip(unit.layers, f.dense()):
                out[weight_key(l, unit.role)] = w.float().contiguous()
        return out


# ---------------------------------------------------------------- plans

def _fixed_units(role: str, space: str, shape: tuple[int, int], groups: Sequence[Sequence[int]],
                 ratio: float) -> list[Unit]:
    units = []
    for g in groups:
        rank = fz.rank_for_ratio(*shape, len(g), ratio, space)
        if rank < 1:
            raise FlowgeomError(f"a saving of {ratio:g} leaves no rank for role {role} ({shape[0]}x{shape[1]}) in a "
                                f"group of {len(g)}; ask for a smaller saving")
        units.append(Unit(role, space, tuple(g), rank, shape))
    return units


def plan(method: str, state: Mapping[str, torch.Tensor], *, n_layers: int, ratio: float,
         roles: Sequence[str] = ROLES, group: int = 2, spaces: Mapping[str, str] | None = None,
         calib: Calibration | None = None, continuity: Mapping[str, Mapping] | None = None) -> Plan:
    """The units of ``method`` at saving ``ratio`` (see the module docstring).

    ``spaces`` (method ``share``): role -> input/output/none (none: per layer, whitened). ``continuity``
    (method ``continuity``): the analyzer's per-role measurements, ``{role: {"space": ..., "pairs": {(a, b):
    above_chance}}}`` (:func:`continuity_evidence`); ``calib`` is needed by ``continuity``.
    """
    if method not in METHODS:
        raise choice_error("method", method, METHODS)
    if not 0.0 < ratio < 1.0:
        raise FlowgeomError(f"budget {ratio!r} must be a fraction in (0, 1); e.g. 0.2 saves 20% of the projections")
    shapes = role_shapes(state, roles, n_layers)
    singles = [[l] for l in range(n_layers)]
    units: list[Unit] = []
    if method in ("svd", "whiten"):
        for role in roles:
            units += _fixed_units(role, "input", shapes[role], singles, ratio)
    elif method == "basis-sharing":
        for role in roles:
            grouped = role in BS_SHARED
            units += _fixed_units(role, "input", shapes[role], layer_groups(n_layers, group) if grouped else singles,
                                  ratio)
    elif method == "share":
        spaces = dict(SEED_SPACE if spaces is None else spaces)
        for role in roles:
            space = spaces.get(role, "none")
            if space == "none":
                units += _fixed_units(role, "input", shapes[role], singles, ratio)
            else:
                units += _fixed_units(role, space, shapes[role], layer_groups(n_layers, group), ratio)
    else:
        if calib is None or continuity is None:
            raise FlowgeomError("the continuity method needs calibration Grams and the analyzer's measurements")
        return _continuity_plan(state, shapes, n_layers, ratio, calib, continuity)
    return Plan(method, ratio, tuple(units))


def resolve_spaces(space: str | None, roles: Sequence[str], evidence: Mapping[str, Mapping] | None
                   ) -> dict[str, str]:
    """Role -> input/output/none for method ``share``: seed (V per layer), opposite, one space, or auto."""
    space = space or "seed"
    if space == "seed":
        return {r: SEED_SPACE.get(r, "none") for r in roles}
    if space == "opposite":
        return {r: opposite(SEED_SPACE[r]) if r in SEED_SPACE else "none" for r in roles}
    if space == "auto":
        return {r: evidence[r]["space"] for r in roles}
    return {r: space for r in roles}


def _spectrum(mats: torch.Tensor, grams: torch.Tensor, space: str) -> torch.Tensor:
    """The group's whitened ``σ_i^2`` (all of them, descending) in ``space``: the loss each rank removes."""
    return fz.spectrum(mats, grams, space)[: min(mats.shape[1:])]


def _continuity_plan(state, shapes, n_layers, ratio, calib, evidence) -> Plan:
    """Per role: the measured space; adjacent pairs aligned above chance share a basis when, at the rank the
    budget gives each, the shared basis loses less whitened loss than two per-layer bases; every unit takes
    the rank rule's rank (uniform ratio). Ranks reallocated across layers by whitened loss were measured
    worse than uniform ranks on SmolLM2 (docs/benchmarks.md), so the budget is split evenly."""
    notes, units = [], []
    for role, (m, n) in shapes.items():
        ev = evidence.get(role, {})
        space = ev.get("space", "input")
        mats = torch.stack([state[weight_key(l, role)] for l in range(n_layers)])
        grams = calib.role_grams(role, range(n_layers))
        k_pair = fz.rank_for_ratio(m, n, 2, ratio, space)
        k_one = fz.rank_for_ratio(m, n, 1, ratio, space)
        groups: list[list[int]] = []
        l = 0
        while l < n_layers:
            if l + 1 < n_layers and k_pair > 0 and ev.get("pairs", {}).get((l, l + 1), False):
                pair = [l, l + 1]
                lost_shared = float(_spectrum(mats[pair], grams[pair], space)[k_pair:].sum())
                lost_separate = sum(float(_spectrum(mats[[i]], grams[[i]], space)[k_one:].sum()) for i in pair)
                if lost_shared < lost_separate:
                    groups.append(pair)
                    l += 2
                    continue
            groups.append([l])
            l += 1
        merged = sum(len(g) == 2 for g in groups)
        if merged:
            notes.append(f"{role}: {merged} adjacent pair(s) share a {space}-space basis")
        units += _fixed_units(role, space, (m, n), groups, ratio)
    return Plan("continuity", ratio, tuple(units), tuple(notes))


def with_rank(plan_: Plan, rank: int) -> Plan:
    """``plan_`` with one rank for every unit (``--rank``), refused above a unit's bound."""
    for u in plan_.units:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= min(u.shape):
            raise FlowgeomError(f"--rank {rank} is above the rank bound {min(u.shape)} of role {u.role} "
                                f"({u.shape[0]}x{u.shape[1]}); pass --rank <= {min(u.shape)} or leave {u.role} "
                                "out of --roles")
    return Plan(plan_.method, plan_.ratio, tuple(Unit(u.role, u.space, u.layers, rank, u.shape)
                                                 for u in plan_.units), plan_.notes)


def continuity_evidence(state: Mapping[str, torch.Tensor], roles: Sequence[str], n_layers: int) -> dict[str, dict]:
    """Per role, from :func:`flowgeom.continuity.analyze`: the space measured as continuous (``space``, with the
    verdict and v1/u1 ratios to chance) and, per adjacent pair, whether its subspace alignment in that space
    is above chance (``pairs``)."""
    from flowgeom.continuity import AnalyzeConfig, analyze

    sub = {weight_key(l, r): state[weight_key(l, r)] for r in roles for l in range(n_layers)}
    report = analyze(sub, AnalyzeConfig(roles=tuple(roles), gram=False, dtype="float32"))
    out = {}
    for role in roles:
        r = report["roles"][role]
        verdict = r["verdict"]
        if verdict == "input-continuous":
            space, guessed = "input", False
        elif verdict == "output-continuous":
            space, guessed = "output", False
        else:
            space, guessed = ("input" if r["v1_ratio"] >= r["u1_ratio"] else "output"), True
        key = "subspace_in" if space == "input" else "subspace_out"
        chance = r["metrics"][key]["baseline"]  # the alignment of random matrices of this shape
        pairs = {(p["a"], p["b"]): p[key] > PAIR_THRESHOLD * chance for p in r["pairs"] if p["distance"] == 1}
        out[role] = {"space": space, "verdict": verdict, "guessed": guessed, "v1_ratio": r["v1_ratio"],
                     "u1_ratio": r["u1_ratio"], "pairs": pairs}
    return out


# ---------------------------------------------------------------- factorisation

def _unit_factors(unit: Unit, state: Mapping[str, torch.Tensor], grams: torch.Tensor | None,
                  refit: bool) -> fz.Factors:
    mats = torch.stack([state[weight_key(l, unit.role)] for l in unit.layers])
    f = fz.factorize(mats, grams, unit.rank, unit.space)
    if refit and grams is not None and len(unit.layers) > 1:
        f = fz.refit(f, mats, grams)
    return f


def _as_float(f: fz.Factors) -> fz.Factors:
    """The factors as stored: balanced (trainable, :func:`~flowgeom.compress.factorize.balance`), float32."""
    f = fz.balance(f)
    return fz.Factors(f.space, f.basis.float().contiguous(), tuple(c.float().contiguous() for c in f.coeffs),
                      f.sigma.float(), f.shift)


def _shift_note(unit: Unit, f: fz.Factors) -> str | None:
    return (f"{unit.role} layers {list(unit.layers)}: the Gram was not positive definite; shifted by {f.shift:.3g} "
            "(SVD-LLM's jitter) before whitening") if f.shift else None


def compress(plan_: Plan, state: Mapping[str, torch.Tensor], calib: Calibration | None, *, refit: bool = False,
             progress: Callable[[int, int], None] | None = None,
             full: Mapping[tuple, fz.Factors] | None = None) -> Compressed:
    """Factorise every unit of ``plan_`` with the Grams of ``calib`` (None: data-free, method ``svd``).
    ``full`` (:func:`allocate_by_loss`'s full-rank factors by unit key): truncated instead of factorised again."""
    factors, notes = [], []
    full = {} if full is None or refit else full
    for i, unit in enumerate(plan_.units):
        key = (unit.role, unit.space, unit.layers)
        if key in full:
            f = truncate(full[key], unit.rank)
        else:
            f = _unit_factors(unit, state, None if calib is None else calib.role_grams(unit.role, unit.layers), refit)
        if (note := _shift_note(unit, f)) is not None:
            notes.append(note)
        factors.append(_as_float(f))
        trim_heap()
        if progress:
            progress(i + 1, len(plan_.units))
    return Compressed(plan_, factors, notes)


def calibration_groups(plan_: Plan, n_layers: int) -> list[list[int]]:
    """The finest runs of consecutive blocks such that no unit of ``plan_`` spans two runs."""
    cut = set(range(1, n_layers))
    for u in plan_.units:
        cut -= set(range(min(u.layers) + 1, max(u.layers) + 1))
    edges = [0, *sorted(cut), n_layers]
    return [list(range(a, b)) for a, b in zip(edges, edges[1:])]


def compress_sequential(plan_: Plan, model, ids: torch.Tensor, *, refit: bool = False, batch: int = 4,
                        progress: Callable[[int, int], None] | None = None,
                        state: Mapping[str, torch.Tensor] | None = None) -> tuple[Compressed, Calibration]:
    """Factorise ``plan_`` group by group, each group's Grams measured on the outputs of the already-compressed
    blocks before it (SVD-LLM's and Basis Sharing's sequential calibration). ``model`` (any family of
    :mod:`flowgeom.compress.arch`) is modified in place: its projections become the dense reconstructions.
    ``state``: its role weights before that (default: copied from ``model``); the Grams wait on disk."""
    arch = arch_of(model.config)
    n_layers = len(model.get_submodule(arch.layers))
    if state is None:
        state = role_state(arch, {k: v.detach().clone() for k, v in model.state_dict().items()}, n_layers)
    by_first: dict[int, list[int]] = {}
    for i, u in enumerate(plan_.units):
        by_first.setdefault(min(u.layers), []).append(i)
    factors: list[fz.Factors | None] = [None] * len(plan_.units)
    notes: list[str] = []

    def on_group(layers: list[int], grams: list[dict[str, torch.Tensor]]) -> None:
        local = {l: g for l, g in zip(layers, grams)}
        for l in layers:
            for i in by_first.get(l, []):
                unit = plan_.units[i]
                g = torch.stack([local[x][ROLE_GRAM[unit.role]] for x in unit.layers])
                f = _unit_factors(unit, state, g, refit)
                if (note := _shift_note(unit, f)) is not None:
                    notes.append(note)
                factors[i] = _as_float(f)
                for x, w in zip(unit.layers, factors[i].dense()):
                    set_role_weight(model, arch, x, unit.role, w)

    calib = calibrate(model, ids, groups=calibration_groups(plan_, n_layers), batch=batch, on_group=on_group,
                      progress=progress, store=GramFiles(TensorFiles.temporary(), n_layers))
    return Compressed(plan_, [f for f in factors], notes), calib


# ---------------------------------------------------------------- loss-aware ranks

ALLOCATIONS = ("even", "loss")
LOSS_SCORE, LOSS_RULE = "taylor", "lagrange"  # the measured best (docs/compression.md)


def full_factors(plan_: Plan, state: Mapping[str, torch.Tensor], calib: Calibration, *,
                 out: list | None = None) -> Sequence[fz.Factors]:
    """Every unit of ``plan_`` factorised at full rank (``min(m, n)``), float32: all its components, appended
    to ``out`` one unit at a time (default a list; a :class:`~flowgeom.compress.store.FactorFiles` keeps them
    on disk, ~1.5x the projections' size)."""
    out = [] if out is None else out
    for u in plan_.units + plan_.dense:
        mats = torch.stack([state[weight_key(l, u.role)] for l in u.layers])
        out.append(_as_float(fz.factorize(mats, calib.role_grams(u.role, u.layers), min(u.shape), u.space)))
        trim_heap()  # the unit's float64 temporaries
    return out


class FullFactors(Mapping):
    """Unit key ``(role, space, layers)`` -> its full-rank factors, read from ``factors`` when asked for."""

    def __init__(self, keys: Sequence[tuple], factors: Sequence[fz.Factors]):
        self.index, self.factors = {k: i for i, k in enumerate(keys)}, factors

    def __getitem__(self, key: tuple) -> fz.Factors:
        return self.factors[self.index[key]]

    def __iter__(self):
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)


def truncate(f: fz.Factors, rank: int) -> fz.Factors:
    """The first ``rank`` components of ``f`` (what :func:`fz.factorize` gives at that rank)."""
    if f.space == "input":
        return fz.Factors("input", f.basis[:rank].contiguous(), tuple(c[:, :rank].contiguous() for c in f.coeffs),
                          f.sigma, f.shift)
    return fz.Factors("output", f.basis[:, :rank].contiguous(), tuple(c[:rank].contiguous() for c in f.coeffs),
                      f.sigma, f.shift)


class Probes(Mapping):
    """Per (layer, role): ``(P (m, r), Q (r, n))`` with ``W_l = P Q`` component by component (allocate's
    docstring), taken from the unit's factors when asked for (a lazy ``factors`` is read one unit at a time)."""

    def __init__(self, units: Sequence[Unit], factors: Sequence[fz.Factors]):
        self.factors = factors
        self.where = {(l, u.role): (i, j) for i, u in enumerate(units) for j, l in enumerate(u.layers)}

    def __getitem__(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor]:
        i, j = self.where[key]
        f = self.factors[i]
        return (f.coeffs[j], f.basis) if f.space == "input" else (f.basis, f.coeffs[j])

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def probes(units: Sequence[Unit], factors: Sequence[fz.Factors]) -> Probes:
    """The :class:`Probes` of ``units`` factorised as ``factors``."""
    return Probes(units, factors)


def speed_cap(shape: tuple[int, int], flops: float) -> int:
    """The largest rank whose two factored products take at most ``flops`` x the dense product's multiply-adds
    per token: ``k (m + n) <= flops m n``. Two thin GEMMs run below one square GEMM's rate, so a factored
    projection saving few flops runs slower than dense; ``flops`` < 1 keeps those dense."""
    m, n = shape
    return int(flops * m * n) // (m + n)


def candidates(units: Sequence[Unit], sens: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
               score: str = LOSS_SCORE, flops: float = 1.0) -> list:
    """One :class:`~flowgeom.compress.allocate.Candidate` per unit: its layers' estimates summed; ranks capped
    by :func:`speed_cap` when ``flops`` < 1."""
    out = []
    for u in units:
        first = sum(sens[(l, u.role)][0] for l in u.layers)
        fisher = sum(sens[(l, u.role)][1] for l in u.layers)
        out.append(A.Candidate(A.component_cost(first, fisher, score), fz.stored_per_rank(*u.shape, len(u.layers), u.space),
                             u.dense_params, None if flops >= 1.0 else speed_cap(u.shape, flops)))
    return out


def with_ranks(plan_: Plan, units: Sequence[Unit], ranks: Sequence[int | None], note: str) -> Plan:
    """``plan_`` with ``units`` at ``ranks`` (None: left dense)."""
    kept = tuple(Unit(u.role, u.space, u.layers, k, u.shape) for u, k in zip(units, ranks) if k is not None)
    dense = tuple(u for u, k in zip(units, ranks) if k is None)
    return Plan(plan_.method, plan_.ratio, kept, plan_.notes + (note,), dense)


def allocate_by_loss(plan_: Plan, state: Mapping[str, torch.Tensor], calib: Calibration, model: Callable[[], Any],
                     ids: torch.Tensor, *, score: str = LOSS_SCORE, rule: str = LOSS_RULE,
                     progress: Callable[[int, int], None] | None = None, cache: dict | None = None,
                     flops: float = 1.0) -> tuple[Plan, dict]:
    """``plan_``'s units (same spaces and groups) with ranks chosen by the loss each component costs
    (:mod:`flowgeom.compress.allocate`), at the savings ``plan_.ratio`` asks of the same scope. ``model()``
    builds the model of ``state``'s weights (any family), whose calibration gradients on ``ids`` score the
    components; ``cache`` keeps the estimates per unit layout (a sweep measures them once); ``flops`` < 1
    caps every unit's rank at :func:`speed_cap` (units that would save less are kept dense)."""
    units = plan_.units + plan_.dense
    key = tuple((u.role, u.space, u.layers) for u in units)
    if cache is not None and key in cache:
        sens, loss = cache[key]
    else:
        factors = full_factors(plan_, state, calib, out=FactorFiles(TensorFiles.temporary()))  # on disk
        sens, loss = sensitivity(model(), ids, probes(units, factors), progress=progress)
        if cache is not None:
            cache[key] = (sens, loss)
            cache["full"] = FullFactors(key, factors)  # the latest layout's, for compress(full=...)
    cands = candidates(units, sens, "first" if rule == "zero-sum" else score, flops)
    scope = sum(u.dense_params for u in units)
    target = math.ceil(plan_.ratio * scope)
    ranks = A.allocate(cands, target, rule)
    n_dense = sum(k is None for k in ranks)
    new = with_ranks(plan_, units, ranks, f"ranks allocated by the calibration loss ({score}, {rule}); "
                                          f"{n_dense} projection group(s) left dense")
    return new, {"calib_loss": loss, "grad_tokens": int(ids.numel()), "predicted_loss_increase":
                 A.predicted(cands, ranks), "dense_units": n_dense}
