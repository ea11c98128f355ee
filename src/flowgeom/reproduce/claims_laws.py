"""Claims of seed 000 about the closed-form laws (the ``laws`` area of ``flowgeom reproduce``).

One run = one zoo architecture at one size and seed. It evaluates three
independent things and writes them to ``summary.json``:

- the catalogue's count (:func:`flowgeom.laws.catalogue`);
- the orthogonality check of every law, control and refuted claim
  (:func:`flowgeom.laws.check`, float64 autograd; a law passes at ≤ 1e-10);
- the numeric engine's count D − dim Lie(W)(θ) (:func:`flowgeom.laws.count`),
  when that module is importable; otherwise the verdict says it was skipped.

The verdict compares the count the *seed's* formula gives with the measured
(numeric, else catalogue) count, and requires every claimed law to pass the
check and every control to fail it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flowgeom.reproduce.registry import Claim, RunRecord, Verdict, grid
from flowgeom.runs import RunFolder

TOLERANCE = 1e-10
CONTROL_FLOOR = 1e-3


def _numeric_count():
    """The engine's ``count`` if it has landed, else None (the claim runs on the catalogue alone)."""
    try:
        from flowgeom.laws.count import count
    except Exception:  # noqa: BLE001 - the engine is optional here
        return None
    return count


CHECK_FIELDS = 32  # gradient fields of the orthogonality check


def laws_size(config: Mapping[str, Any]) -> float:
    """The run's cost for the progress ETA (:mod:`flowgeom.reproduce.cost`): the check's fields × D² for the
    model's D parameters (the numeric count's Jacobians are D × D)."""
    from flowgeom.nn import build
    from flowgeom.reproduce.cost import LAW_FIELD, work

    options = {k: v for k, v in config.items() if k not in ("arch", "seed")}
    dim = sum(p.numel() for p in build(config["arch"], seed=config["seed"], **options).parameters())
    return work(CHECK_FIELDS, dim * dim, overhead=LAW_FIELD)


def run_laws(config: Mapping[str, Any], folder: RunFolder, resume: bool) -> dict[str, Any]:
    """Catalogue, check and numeric count of ``config = {"arch", "seed", **size options}``.

    Stateless and a few seconds long: an interrupted run simply starts over.
    """
    from flowgeom.laws import catalogue, check
    from flowgeom.nn import build

    options = {k: v for k, v in config.items() if k not in ("arch", "seed")}
    model = build(config["arch"], seed=config["seed"], **options)
    entry = catalogue(model)
    t0 = time.perf_counter()
    report = check(model, entry.laws + entry.controls + entry.refuted, n_fields=CHECK_FIELDS, seed=config["seed"])
    check_seconds = time.perf_counter() - t0
    by_status = {s: [v for v in report.verdicts if v.status == s] for s in ("law", "control", "refuted")}
    summary: dict[str, Any] = {
        "arch": config["arch"], "parameters": sum(p.numel() for p in model.parameters()),
        "catalogue_count": entry.count,
        "families": {law.family: 0 for law in entry.laws},
        "check_max_violation": report.max_violation, "check_passed": report.passed,
        "control_violation": min((v.max_violation for v in by_status["control"]), default=None),
        "refuted": {v.name: v.max_violation for v in by_status["refuted"]},
        "numeric_count": None, "numeric_note": "",
    }
    for law in entry.laws:
        summary["families"][law.family] += law.count
    count = _numeric_count()
    count_seconds = None
    if count is None:
        summary["numeric_note"] = "numeric engine flowgeom.laws.count not available"
    else:
        t0 = time.perf_counter()
        try:
            result = count(model, seed=config["seed"])
            summary["numeric_count"] = int(result.laws)
            summary["ranks_by_depth"] = list(result.ranks_by_depth)
        except Exception as exc:  # noqa: BLE001 - an engine failure is a finding, not a crash
            summary["numeric_note"] = f"numeric count failed: {type(exc).__name__}: {exc}"
        count_seconds = time.perf_counter() - t0
    folder.log({"step": 0, "check_seconds": check_seconds, "count_seconds": count_seconds})
    return summary


# ---- the seed's counts -------------------------------------------------------------------------


def _seed_ffn(c: Mapping[str, Any]) -> int:
    return 0


def _seed_swiglu(c: Mapping[str, Any]) -> int:
    return c["d_hidden"]


def _seed_mha(c: Mapping[str, Any]) -> int:
    return c["heads"] * (c["d_k"] * (c["d_k"] + 1) // 2 + c["d_v"] * (c["d_v"] + 1) // 2)


def _seed_rope(c: Mapping[str, Any]) -> int:
    return c["heads"] * (c["d_k"] // 2 + c["d_v"] * (c["d_v"] + 1) // 2)


def _seed_moe(c: Mapping[str, Any]) -> int:
    """Seed 000: every expert's SwiGLU laws plus Σ_i W_i (d, +1 with a router bias), for either gate."""
    return c["experts"] * c["d_hidden"] + c["d_model"] + int(bool(c.get("router_bias")))


def _label(config: Mapping[str, Any]) -> str:
    skip = ("arch", "seed")
    return " ".join(f"{k}={v}" for k, v in config.items() if k not in skip and v is not None) + f" s{config['seed']}"


def _measured(s: Mapping[str, Any]) -> int:
    return s["numeric_count"] if s["numeric_count"] is not None else s["catalogue_count"]


def _figures(claim_id: str, runs: Sequence[RunRecord], seed_counts: list[int], figures_dir: Path) -> tuple[Path, ...]:
    from flowgeom.report.figures import log_bars, paired_bars

    labels = [_label(r.config) for r in runs]
    groups = {}
    for lab, r in zip(labels, runs):
        g = {"claimed laws (max)": r.summary["check_max_violation"]}
        if r.summary["control_violation"] is not None:
            g["non-conserved control"] = r.summary["control_violation"]
        for name, v in r.summary["refuted"].items():
            g["seed's router law Σ W_i"] = v
        groups[lab] = g
    viol = log_bars(figures_dir / f"{claim_id}-violation.png", groups, title=f"{claim_id}: orthogonality check "
                    "(float64)", ylabel="max |<∇h, ∇f>| / norms", threshold=TOLERANCE, threshold_label="tolerance 1e-10")
    counts = paired_bars(figures_dir / f"{claim_id}-counts.png", labels, seed_counts,
                         [_measured(r.summary) for r in runs], names=("seed's formula", "measured"),
                         title=f"{claim_id}: number of independent laws", ylabel="laws")
    return viol, counts


def law_verdict(claim_id: str, seed_count: Callable[[Mapping[str, Any]], int]):
    """A verdict function comparing ``seed_count(config)`` with the measured count and the check."""

    def verdict(runs: Sequence[RunRecord], figures_dir: Path) -> Verdict:
        runs = sorted(runs, key=lambda r: _label(r.config))
        expected = [seed_count(r.config) for r in runs]
        measured = [_measured(r.summary) for r in runs]
        numeric = all(r.summary["numeric_count"] is not None for r in runs)
        worst = max(r.summary["check_max_violation"] for r in runs)
        controls = [r.summary["control_violation"] for r in runs if r.summary["control_violation"] is not None]
        refuted = [v for r in runs for v in r.summary["refuted"].values()]
        table = tuple({
            "config": _label(r.config), "D": r.summary["parameters"], "seed count": e,
            "catalogue": r.summary["catalogue_count"], "numeric": r.summary["numeric_count"] if numeric else "-",
            "max violation": r.summary["check_max_violation"], "control": r.summary["control_violation"],
        } for r, e in zip(runs, expected))
        source = "numeric engine" if numeric else "catalogue (numeric engine unavailable)"
        text = (f"{len(runs)} sizes/seeds: counts {measured} ({source}) vs seed {expected}; claimed laws' max "
                f"violation {worst:.1e}" + (f", controls ≥ {min(controls):.1e}" if controls else "")
                + (f"; seed's router law violation {max(refuted):.2f}" if refuted else ""))
        figs = _figures(claim_id, runs, expected, figures_dir)
        problems = []
        if worst > TOLERANCE:
            problems.append(f"a claimed law fails the check (violation {worst:.1e} > {TOLERANCE:.0e})")
        if controls and min(controls) < CONTROL_FLOOR:
            problems.append(f"a control passed the check ({min(controls):.1e}): the check cannot discriminate")
        if measured != expected:
            diff = [f"{m} vs {e}" for m, e in zip(measured, expected) if m != e]
            if refuted and max(refuted) > CONTROL_FLOOR:
                return Verdict(text, "not reproduced", how=(
                    f"the seed's router law Σ_i W_i is not conserved under this gate (violation up to "
                    f"{max(refuted):.2f}, O(1)); measured counts {', '.join(diff)} (measured vs seed)"), figures=figs,
                    table=table)
            problems.append(f"counts differ from the seed's formula: {', '.join(diff)} (measured vs seed)")
        if problems:
            return Verdict(text, "not reproduced", how="; ".join(problems), figures=figs, table=table)
        how = "" if numeric else "numeric engine unavailable: counts from the catalogue, each law verified by the check"
        return Verdict(text, "reproduced", how=how, figures=figs, table=table)

    return verdict


def _runs(variants: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> tuple[dict[str, Any], ...]:
    return tuple({**v, "seed": s} for v in variants for s in seeds)


def claims() -> list[Claim]:
    ffn_q = grid(arch=["ffn"], activation=["gelu", "silu"], d_model=[6], d_hidden=[8])
    ffn_f = grid(arch=["ffn"], activation=["gelu", "silu"], d_model=[4, 6, 8], d_hidden=[6, 10])
    swi_q = grid(arch=["swiglu"], d_model=[6], d_hidden=[4, 8])
    swi_f = grid(arch=["swiglu"], d_model=[4, 6, 8], d_hidden=[4, 8, 12])
    mha = [{"arch": "mha", "positions": "none", "d_model": 6, "heads": 2, "d_k": 2, "d_v": 3},
           {"arch": "mha", "positions": "none", "d_model": 8, "heads": 3, "d_k": 2, "d_v": 2}]
    mha_f = mha + [{"arch": "mha", "positions": "none", "d_model": 8, "heads": 2, "d_k": 3, "d_v": 3}]
    sin = [dict(c, positions="sinusoidal") for c in mha]
    sin_f = [dict(c, positions="sinusoidal") for c in mha_f]
    rope = [{"arch": "mha", "positions": "rope", "d_model": 6, "heads": 2, "d_k": 4, "d_v": 3},
            {"arch": "mha", "positions": "rope", "d_model": 8, "heads": 2, "d_k": 2, "d_v": 2}]
    rope_f = rope + [{"arch": "mha", "positions": "rope", "d_model": 8, "heads": 3, "d_k": 4, "d_v": 2}]
    moe = [{"arch": "moe", "gate": "softmax", "top_k": None, "router_bias": False, "d_model": 4, "d_hidden": 3,
            "experts": 3}, {"arch": "moe", "gate": "softmax", "top_k": 2, "router_bias": False, "d_model": 4,
                            "d_hidden": 3, "experts": 3}]
    moe_f = moe + [dict(c, router_bias=True) for c in moe] + [dict(c, d_model=5, experts=4) for c in moe]
    sig = [dict(c, gate="sigmoid") for c in moe]
    sig_f = [dict(c, gate="sigmoid") for c in moe_f]
    q, f = (0,), (0, 1, 2)
    spec = [
        ("laws.ffn-smooth", "FFNs with GELU or SiLU activations have no non-trivial conservation law: only the "
         "constant functions are conserved.", ffn_q, ffn_f, _seed_ffn),
        ("laws.swiglu", "SwiGLU FFNs have non-trivial laws: ‖A_{:,i}‖² − ‖C_{i,:}‖² for each hidden unit i "
         "(m laws).", swi_q, swi_f, _seed_swiglu),
        ("laws.mha", "Multi-head attention (the open multi-head case, now solved): the laws are Q_iᵀQ_i − K_iᵀK_i "
         "and V_iᵀV_i − O_iᵀO_i for each head i.", mha, mha_f, _seed_mha),
        ("laws.mha-sinusoidal", "A sinusoidal positional encoding is a fixed bijective shift of the input: the "
         "laws are identical to vanilla MHA.", sin, sin_f, _seed_mha),
        ("laws.mha-rope", "RoPE changes the laws: ‖Q_i^(j)‖²_F − ‖K_i^(j)‖²_F for each 2×2 block j, plus "
         "V_iᵀV_i − O_iᵀO_i per head.", rope, rope_f, _seed_rope),
        ("laws.moe-softmax", "Mixture of experts, dense or sparse top-k with a softmax gate: each expert's SwiGLU "
         "laws plus one gate invariant, the sum of the gate weight vectors Σ_i W_i; top-k has the same laws as "
         "dense.", moe, moe_f, _seed_moe),
        ("laws.moe-sigmoid", "Replacing the softmax gate by a normalised sigmoid gate does not change the "
         "conservation laws: they are identical to the softmax case (including Σ_i W_i).", sig, sig_f, _seed_moe),
    ]
    return [Claim(area="laws", id=cid, seed="000", text=text, quick=_runs(qv, q), full=_runs(fv, f), run=run_laws,
                  verdict=law_verdict(cid, seed_fn), size=laws_size) for cid, text, qv, fv, seed_fn in spec]
