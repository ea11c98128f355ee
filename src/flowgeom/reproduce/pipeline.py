"""The reproduce pipeline: plan → sweep → verdict → report.

:func:`run` selects the claims of the areas (:mod:`flowgeom.reproduce.registry`),
and :func:`reproduce` plans their grids, runs them as a resumable sweep
(:mod:`flowgeom.reproduce.sweep`), turns each claim's finished runs into a
verdict and renders ``report.md`` / ``report.html`` (:mod:`flowgeom.report`).
``flowgeom reproduce`` and ``flowgeom demo`` only parse arguments, call
:func:`run` and print its report.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flowgeom.errors import FlowgeomError
from flowgeom.files import read_json_object

DEFAULT_ROOT = Path("runs") / "reproduce"


def default_out(scale: str, resume: bool) -> Path:
    """A fresh timestamped folder, or with ``resume`` the latest one of this scale."""
    if resume:
        found = sorted(DEFAULT_ROOT.glob(f"{scale}-*"))
        if not found:
            raise FlowgeomError(f"--resume without --out: no earlier {scale} reproduction under {DEFAULT_ROOT}; "
                                "pass --out DIR of the sweep to continue")
        return found[-1]
    return DEFAULT_ROOT / f"{scale}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"


def claim_verdict(claim, specs, outcomes, out: Path):
    """The claim's Verdict from its finished runs (failures and unavailability become "not run")."""
    from flowgeom.reproduce.registry import RunRecord, Verdict
    from flowgeom.runs import RunFolder, confined

    if claim.unavailable:
        return Verdict("not run", "not run", how=claim.unavailable)
    records = []
    for spec, outcome in zip(specs, outcomes):
        if outcome.status == "failed":  # e.g. refused by the sweep manifest: its summary.json is not trusted
            continue
        summary = RunFolder(spec.path).summary()
        if summary is not None:
            records.append(RunRecord(spec.run_id, spec.config, summary, spec.path))
    failed = [o for o in outcomes if o.status == "failed"]
    if not records:
        reason = failed[0].error if failed else "no run finished"
        return Verdict("no finished run", "not run", how=f"every run failed; first error: {reason}")
    figures_dir = confined(out, out / "claims" / claim.id / "figures", "figures folder")  # a planted link: refused
    try:
        verdict = claim.verdict(records, figures_dir)
    except Exception as exc:  # noqa: BLE001 - a broken verdict must not hide the other claims
        return Verdict("verdict failed", "not run", how=f"the verdict function raised {type(exc).__name__}: {exc}")
    if failed:
        note = f"{len(failed)} of {len(specs)} runs failed; verdict from the {len(records)} finished"
        verdict = dataclasses.replace(verdict, how=f"{verdict.how}; {note}" if verdict.how else note)
    return verdict


def _relative(path: str | Path, out: Path) -> str:
    """A figure path relative to the report folder when it lies inside it (else absolute)."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(out.resolve()))
    except ValueError:
        return str(path)


def _run_seconds(specs) -> float:
    total = 0.0
    for spec in specs:
        path = spec.path / "timing.json"
        if path.exists():
            seconds = read_json_object(path, fix=f"delete {spec.path} and run it again").get("seconds", 0.0)
            total += float(seconds) if isinstance(seconds, (int, float)) and math.isfinite(seconds) else 0.0
    return total


def reproduce(claims: Sequence[Any], *, out: str | Path, scale: str = "quick", backend: str = "local", jobs: int = 1,
              resume: bool = False, command_line: str = "", areas: Sequence[str] = (), show_progress: bool = True
              ) -> dict[str, Any]:
    """Sweep ``claims`` into ``out``, judge them and write the report; returns ``report.json``'s content.

    The returned dict also holds ``"paths"`` (report.md, report.html) and
    ``"sweep"`` (per-run outcomes; ``sweep["failed"]`` counts failures).
    """
    from flowgeom.reproduce.registry import SEEDS
    from flowgeom.reproduce.sweep import check_out, plan, run_sweep, thread_budget
    from flowgeom.report.machine import machine_info
    from flowgeom.report.render import REPORT_JSON, write_report
    from flowgeom.runs import atomic_write_json

    out = Path(out)
    specs = plan(claims, scale=scale, out=out)
    check_out(out, specs, resume=resume)
    if show_progress:  # only once --out is known to be usable: a refusal stays one line
        print(f"reproducing {len(claims)} claims ({scale}) into {out}", file=sys.stderr)
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    from rich.console import Console

    from flowgeom.reproduce.progress import Ticker

    # Lines, never silent for more than ~10 s: a run can take minutes (reproduce/progress.py)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    ticker = Ticker(len(specs), lambda line: err.print(line, markup=False),
                    jobs=thread_budget(jobs)[0] if backend == "local" else 1,
                    groups={spec.key: spec.claim_id for spec in specs}, sizes={spec.key: spec.size for spec in specs})

    def on_start(spec):
        if show_progress:
            ticker.start(spec.key, f"{spec.claim_id} {spec.run_id[-8:]}")

    def on_done(spec, outcome):
        if show_progress:
            ticker.done(spec.key, f"{spec.claim_id} {spec.run_id[-8:]}", outcome.status, outcome.seconds,
                        outcome.error or "")

    if show_progress:
        with ticker:
            result = run_sweep(specs, backend=backend, jobs=jobs, resume=resume, on_start=on_start, on_done=on_done)
    else:
        result = run_sweep(specs, backend=backend, jobs=jobs, resume=resume, on_start=on_start, on_done=on_done)
    by_claim: dict[str, list] = {}
    outcome_of = {o.key: o for o in result.outcomes}
    for spec in specs:
        by_claim.setdefault(spec.claim_id, []).append(spec)
    rows = []
    for claim in claims:
        cspecs = by_claim.get(claim.id, [])
        outcomes = [outcome_of[s.key] for s in cspecs]
        verdict = claim_verdict(claim, cspecs, outcomes, out).as_dict()
        verdict["figures"] = [_relative(f, out) for f in verdict["figures"]]
        rows.append({
            "id": claim.id, "area": claim.area, "seed": claim.seed, "seed_title": SEEDS[claim.seed],
            "text": claim.text, "command": claim.command(scale), "verdict": verdict, "runs": len(cspecs),
            "finished": sum((s.path / "summary.json").exists() for s in cspecs), "seconds": _run_seconds(cspecs),
            "failed": [{"run": o.key, "error": o.error} for o in outcomes if o.status == "failed"],
        })
    report = {
        "title": f"flowgeom reproduction of the seeds ({scale})", "command": command_line or f"flowgeom reproduce "
        f"--{scale} --out {out}", "scale": scale, "backend": backend, "started": f"{started:%Y-%m-%d %H:%M:%S}",
        "seconds": time.perf_counter() - t0, "areas": list(dict.fromkeys(areas or [c.area for c in claims])),
        "machine": machine_info(), "claims": rows, "failures": [o.as_dict() for o in result.failed],
    }
    try:
        atomic_write_json(out / "sweep.json", result.as_dict(), root=out)
        atomic_write_json(out / REPORT_JSON, report, root=out)
        md, page = write_report(out)
    except FlowgeomError as exc:
        counts = result.as_dict()
        first = f"; first failure {result.failed[0].key}: {result.failed[0].error}" if result.failed else ""
        raise FlowgeomError(f"{counts['finished'] + counts['skipped']} runs finished (kept in {out / 'runs'}), "
                            f"{counts['failed']} failed{first}; the report could not be written: {exc}") from exc
    return report | {"paths": {"markdown": str(md), "html": str(page)}, "sweep": result.as_dict()}


def _with_cpu_grid(claims: Sequence[Any], only: Sequence[str] | None) -> list[Any]:
    """The claims that have a CPU-scale grid; naming one that has none with ``--only`` is an error."""
    missing = [c.id for c in claims if not c.cpu and not c.unavailable]
    if only and missing:
        raise FlowgeomError(f"claim(s) {', '.join(missing)} have no CPU-scale grid; run them with --quick, or --full "
                            "on a machine that fits the seeds' configurations")
    kept = [c for c in claims if c.cpu]
    if not kept:
        raise FlowgeomError("no selected claim has a CPU-scale grid; choose another area or --quick/--full")
    return kept


def run(area: str = "all", *, scale: str = "quick", out: str | Path | None = None, backend: str = "local",
        jobs: int = 1, resume: bool = False, only: Sequence[str] | None = None, show_progress: bool = True,
        claims: Sequence[Any] | None = None, skip_heavy: bool = False) -> dict[str, Any]:
    """Reproduce the claims of ``area`` (one area or ``"all"``) at ``scale``; returns :func:`reproduce`'s report.

    ``claims`` replaces the registry's claims (tests); ``out`` defaults to a
    fresh timestamped folder (with ``resume``, the latest one of this scale).
    ``skip_heavy`` leaves out the claims marked ``heavy`` (the quick tour).
    """
    from flowgeom.reproduce.registry import AREAS, load_claims, select

    areas = list(AREAS) if area == "all" else [area]
    if claims is None:
        claims = load_claims(areas)
    else:
        claims = [c for c in claims if c.area in areas]
    claims = select(claims, only)
    if skip_heavy:
        claims = [c for c in claims if not c.heavy]
    if scale == "cpu":
        claims = _with_cpu_grid(claims, only)
    out = Path(out) if out else default_out(scale, resume)
    line = " ".join(["flowgeom reproduce", area, f"--{scale}", "--out", str(out), "--backend", backend]
                    + (["--jobs", str(jobs)] if jobs != 1 else [])
                    + [f"--only {c}" for c in only or []])
    return reproduce(claims, out=out, scale=scale, backend=backend, jobs=jobs, resume=resume, command_line=line,
                     areas=areas, show_progress=show_progress)
