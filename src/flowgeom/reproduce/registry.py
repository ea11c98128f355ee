"""The plug-in interface of ``flowgeom reproduce``: claims, their grids and verdicts.

Every headline result of the three seeds is one :class:`Claim`. A claim
carries the seed's statement, a *quick* and a *full* grid of run configs
(plain JSON-able dicts, e.g. architecture × lr × seed), a ``run`` function
that executes one config into one :class:`~flowgeom.runs.RunFolder`, and a
``verdict`` function that turns the finished runs' summaries into our
measured figure, a verdict and figures.

An area (``laws``, ``conservation``, ``continuity``, ``langevin``) is added by
writing one adapter module ``flowgeom.reproduce.claims_<area>`` with a
function ``claims() -> list[Claim]``. An adapter whose underlying API is
missing still lists its claims, with ``unavailable`` set to the reason, so
the report says "not run (reason)" instead of the sweep crashing.

Contract of the two functions (both must be module-level, so that process
pools and Ray can pickle them by reference):

``run(config, folder, resume) -> summary``
    ``folder.start`` has already been called; write metrics with
    ``folder.log`` and checkpoints with ``folder.save_checkpoint``; when
    ``resume`` is true the folder holds an interrupted attempt: continue from
    ``folder.load_checkpoint()`` (and ``folder.truncate_metrics``). Return the
    summary dict; the sweep writes it last with ``folder.finish``. The summary
    must depend only on the config (no timings, no paths), so that a resumed
    sweep ends with the same summaries as an uninterrupted one.

``verdict(runs, figures_dir) -> Verdict``
    ``runs`` is a list of :class:`RunRecord` (finished runs only); write any
    figure as PNG under ``figures_dir`` and list the paths.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.experiments.presets import SCALES as PRESET_SCALES
from flowgeom.runs import RunFolder, to_json

AREAS = ("laws", "conservation", "continuity", "langevin")
AREA_SEED = {"laws": "000", "conservation": "000", "continuity": "001", "langevin": "004"}
# quick: laptop minutes; cpu: the paper-scale protocol cut to what 2 CPU cores train in about two hours (the
# seed's model where it fits, else the largest that does, fewer seeds); full: the seeds' own configurations.
# The scales of the experiments' presets (flowgeom.experiments.presets), which every claim's grids read.
SCALES = PRESET_SCALES
VERDICTS = ("reproduced", "not reproduced", "differs", "not run")
SEEDS = {
    "000": "Conservation Laws for Modern Neural Architectures (seed 000)",
    "001": "Why Geometric Continuity Emerges in Deep Networks (seed 001)",
    "004": "Convergent Stochastic Training of Attention and LoRA (seed 004)",
}

Config = Mapping[str, Any]
RunFn = Callable[[Config, RunFolder, bool], Mapping[str, Any]]


@dataclass(frozen=True)
class RunRecord:
    """One finished run as the verdict sees it."""

    run_id: str
    config: dict[str, Any]
    summary: dict[str, Any]
    path: Path


@dataclass(frozen=True)
class Verdict:
    """What we measured for one claim and how it compares with the seed.

    ``verdict`` is one of ``reproduced`` / ``not reproduced`` / ``differs`` /
    ``not run``; ``how`` says in what way (required unless reproduced).
    ``table`` is an optional list of rows (dicts with the same keys) shown
    under the claim.
    """

    measured: str
    verdict: str
    how: str = ""
    figures: tuple[Path, ...] = ()
    table: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise choice_error("verdict", self.verdict, VERDICTS)
        if self.verdict != "reproduced" and not self.how:
            raise FlowgeomError(f"a {self.verdict!r} verdict must say how (the `how` field is empty)")

    def as_dict(self) -> dict[str, Any]:
        return {"measured": self.measured, "verdict": self.verdict, "how": self.how,
                "figures": [str(p) for p in self.figures], "table": [dict(r) for r in self.table]}


def _no_verdict(runs: Sequence[RunRecord], figures_dir: Path) -> Verdict:
    return Verdict("no verdict function", "not run", how="the adapter gives no verdict function")


@dataclass(frozen=True)
class Claim:
    """One headline result of a seed, with the grids that reproduce it.

    ``area`` is one of :data:`AREAS`; ``id`` is unique and file-name safe
    (``area.name``); ``seed`` is the seed's number (``"000"``); ``text`` the
    claim as the seed states it (in English); ``quick``/``full`` the config
    grids (``cpu`` the CPU-scale cut of ``full``, see :data:`SCALES`); ``unavailable`` a reason the claim cannot run here (then ``run``
    is never called).
    """

    area: str
    id: str
    seed: str
    text: str
    quick: tuple[Config, ...] = ()
    full: tuple[Config, ...] = ()
    run: RunFn | None = None
    verdict: Callable[[Sequence[RunRecord], Path], Verdict] = _no_verdict
    unavailable: str = ""
    cpu: tuple[Config, ...] = ()  # empty: the claim has no CPU-scale grid and `--cpu` leaves it out
    heavy: str = ""  # why the quick tour (`make demo`) leaves it out, e.g. minutes of real-model evaluation
    # the cost of one run in the progress ETA's unit, optimiser steps x (trained parameters + a per-step overhead)
    # (flowgeom.reproduce.cost); None: the ETA expects the mean of the claim's finished runs
    size: Callable[[Config], float] | None = None

    def run_size(self, config: Config) -> float | None:
        """``size(config)``, or None when the claim has none or it cannot be computed (the ETA is only a guess)."""
        if self.size is None:
            return None
        try:
            value = float(self.size(config))
        except Exception:  # noqa: BLE001 - a size is a hint for the progress line, never a reason to fail a sweep
            return None
        return value if value > 0 and value != float("inf") else None

    def __post_init__(self):
        if self.area not in AREAS:
            raise choice_error("area", self.area, AREAS)
        if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", self.id):
            raise FlowgeomError(f"claim id {self.id!r} must be lower-case letters, digits, '.', '_' or '-'")
        if self.seed not in SEEDS:
            raise choice_error("seed", self.seed, SEEDS)
        if not self.unavailable and (self.run is None or not (self.quick or self.full)):
            raise FlowgeomError(f"claim {self.id}: a runnable claim needs a run function and a config grid")

    def grid(self, scale: str) -> tuple[Config, ...]:
        if scale not in SCALES:
            raise choice_error("scale", scale, SCALES)
        if scale == "cpu":
            return tuple(self.cpu)
        return tuple(self.quick if scale == "quick" else (self.full or self.quick))

    def command(self, scale: str) -> str:
        """The command line that reruns exactly this claim."""
        return f"flowgeom reproduce {self.area} --{scale} --only {self.id}"


def grid(**axes: Iterable[Any]) -> tuple[dict[str, Any], ...]:
    """Cartesian product of keyword axes, as config dicts (first axis slowest).

    >>> grid(lr=[0.1, 0.2], seed=[0, 1])[1]
    {'lr': 0.1, 'seed': 1}
    """
    names = list(axes)
    return tuple(dict(zip(names, values)) for values in itertools.product(*(list(axes[n]) for n in names)))


def run_id(config: Config) -> str:
    """A deterministic, file-name-safe id of a config: readable slug + 8 hex of its hash.

    Key order does not matter; any change of a value changes the id.
    """
    canonical = to_json(dict(config), sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha1(canonical.encode()).hexdigest()[:8]
    parts = []
    for key in sorted(config):
        value = config[key]
        if isinstance(value, (dict, list, tuple)):
            value = json.dumps(value, sort_keys=True, default=str)
        parts.append(f"{key}={value}")
    slug = re.sub(r"[^A-Za-z0-9=.,_-]+", "_", "_".join(parts))[:60].strip("_")
    return f"{slug}-{digest}" if slug else digest


def unavailable(area: str, reason: str, specs: Sequence[tuple[str, str, str]]) -> list[Claim]:
    """Claims ``(id, seed, text)`` of an area that cannot run here, all for ``reason``."""
    return [Claim(area=area, id=cid, seed=seed, text=text, unavailable=reason) for cid, seed, text in specs]


def guarded(area: str, seed: str, claim_id: str, text: str, what: str, build: Callable[[], Claim]) -> list[Claim]:
    """``[build()]``, or one "not run" placeholder saying why ``what`` cannot be set up here.

    ``build`` imports the experiment it needs, so a missing or changed area
    marks its own claim as not run and never stops the others.
    """
    try:
        return [build()]
    except Exception as exc:  # noqa: BLE001 - any failure to set up means "not run", with the reason
        return unavailable(area, f"{what} unavailable ({exc})", [(claim_id, seed, text)])


def load_claims(areas: Sequence[str]) -> list[Claim]:
    """Every claim of ``areas`` from their adapter modules ``claims_<area>``.

    An adapter that cannot be imported yields one "not run" placeholder claim
    naming the import error, so one broken area never stops the others.
    """
    out: list[Claim] = []
    for area in areas:
        if area not in AREAS:
            raise choice_error("area", area, AREAS + ("all",))
        try:
            module = importlib.import_module(f"flowgeom.reproduce.claims_{area}")
            found = list(module.claims())
        except Exception as exc:  # noqa: BLE001 - any adapter failure becomes a "not run" line
            found = unavailable(area, f"adapter failed to load: {type(exc).__name__}: {exc}",
                                [(f"{area}.adapter", AREA_SEED[area], f"every claim of the {area} area")])
        out.extend(found)
    ids = [c.id for c in out]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise FlowgeomError(f"duplicate claim ids {', '.join(dupes)}; every claim id must be unique")
    return out


def select(claims: Sequence[Claim], only: Sequence[str] | None) -> list[Claim]:
    """The claims whose id is in ``only`` (all when ``only`` is empty); unknown ids are an error."""
    if not only:
        return list(claims)
    known = {c.id for c in claims}
    for cid in only:
        if cid not in known:
            raise choice_error("claim", cid, sorted(known))
    return [c for c in claims if c.id in set(only)]

