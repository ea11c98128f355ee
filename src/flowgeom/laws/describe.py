"""The law catalogue as plain data: one zoo architecture's laws with the check's verdict, every
catalogue row, and the numeric count next to the catalogue's, for the CLI, the demo and the docs.

The memory the check needs is estimated first (:func:`check_memory`) and refused
with the numbers and the fix when it would not fit, instead of being killed.
"""

from __future__ import annotations

from typing import Any

from flowgeom.errors import positive_int

def law_dict(law) -> dict[str, Any]:
    """A law's name, family, formula, count (and note) as plain data."""
    out = {"name": law.name, "family": law.family, "formula": law.formula, "count": law.count}
    if law.note:
        out["note"] = law.note
    return out


MAX_FIELDS = 100_000


def check_memory(arch: str, options: dict[str, Any], *, n_fields: int) -> tuple[int, int]:
    """(bytes, D): what :func:`flowgeom.laws.check` needs for ``arch``, estimated (for real when the module is small, else on the meta device).

    The check holds two reverse-mode Jacobians: the fields (n_fields, D) and
    the law gradients (law components, D); with autograd's intermediates the
    measured peak is about 4 × 8 bytes × D × (n_fields + components)
    (swiglu --d-hidden 1000 and 3000: 0.5 and 3.8 GiB above the interpreter),
    plus the activations: the batched backward pushes n_fields cotangents through the
    n_fields-sample batch, so they grow as n_fields² × one sample's forward
    (mha, 64 fields, --seq-len 150 / 500: 4.9 / 23 GiB measured, 10 / 110 GiB
    estimated: deliberately pessimistic, a refusal beats the OOM killer).
    """
    import torch

    from flowgeom.laws import catalogue
    from flowgeom.laws.fields import forward_bytes
    from flowgeom.laws.target import require_buildable, small_config
    from flowgeom.nn.zoo import config

    require_buildable(arch, options)
    cfg = config(arch, **options)
    if small_config(cfg):
        # Small enough to run for real. Counting on the meta device (or under a dispatch mode)
        # imports all of torch._dynamo (1–4 s), longer than the whole check at this size.
        model = cfg.build().double()
        x = model.sample_input(1, torch.Generator())  # (1, ...)
        per_sample = saved_bytes(model, x.double() if x.is_floating_point() else x)
    else:
        with torch.device("meta"):
            model = cfg.build()
        x = model.sample_input(1, torch.Generator()).to("meta")  # (1, ...) shapes only
        per_sample = forward_bytes(model.double(), x.double() if x.is_floating_point() else x)
    entry = catalogue(model)
    components = sum(law.count for law in entry.laws + entry.controls + entry.refuted)
    d = sum(p.numel() for p in model.parameters())
    activations = n_fields * (3 + n_fields) * per_sample  # the B batched cotangents each flow back through B samples
    return 4 * 8 * d * (n_fields + components) + activations, d


def saved_bytes(model, x) -> int:
    """Bytes of the tensors autograd saves for backward in one forward ``model(x)`` (real tensors).

    The activations a reverse-mode Jacobian keeps, seen through autograd's own pack hook:
    no dispatch mode, so nothing imports ``torch._dynamo``.
    """
    import torch

    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return total


def require_check_memory(arch: str, options: dict[str, Any], *, n_fields: int, max_memory: int | None = None) -> None:
    """FlowgeomError with the estimate, the free memory and the fix when the check would not fit."""
    from flowgeom.memory import require

    positive_int(n_fields, "--fields", maximum=MAX_FIELDS)
    need, d = check_memory(arch, options, n_fields=n_fields)
    require(need, f"checking {arch} (D = {d:,} parameters) with --fields {n_fields:,}",
            "pass smaller size options or fewer --fields", limit=max_memory)


def describe(arch: str, options: dict[str, Any], *, seed: int = 0, n_fields: int = 64) -> dict[str, Any]:
    """Catalogue entry of one architecture plus the check's verdict, as plain data."""
    from flowgeom.laws import catalogue, check
    from flowgeom.nn import build
    from flowgeom.nn.zoo import config

    require_check_memory(arch, options, n_fields=n_fields)
    model = build(arch, seed=seed, **options)
    entry = catalogue(model)
    report = check(model, entry.laws + entry.controls + entry.refuted, n_fields=n_fields, seed=seed)
    by_name = {(v.status, v.name): v for v in report.verdicts}
    return {
        "arch": arch,
        "options": dict(vars(config(arch, **options))),
        "parameters": sum(p.numel() for p in model.parameters()),
        "laws": [law_dict(law) for law in entry.laws],
        "count": entry.count,
        "check": report.as_dict() | {"max_violation": report.max_violation, "passed": report.passed},
        "controls": [law_dict(c) | {"violation": by_name["control", c.name].max_violation} for c in entry.controls],
        "refuted": [law_dict(r) | {"violation": by_name["refuted", r.name].max_violation} for r in entry.refuted],
        "notes": list(entry.notes),
    }


def catalogue_rows(*, seed: int = 0) -> list[dict[str, Any]]:
    """One row per catalogue variant (:data:`~flowgeom.laws.catalogue.VARIANTS`): its law families, count and check."""
    from flowgeom.laws.catalogue import VARIANTS

    rows = []
    for v in VARIANTS:
        d = describe(v.arch, dict(v.options), seed=seed, n_fields=32)
        rows.append({
            "label": v.label, "arch": v.arch, "options": dict(v.options), "count_formula": v.count_formula,
            "families": sorted({law["family"] for law in d["laws"]}), "count": d["count"], "parameters": d["parameters"],
            "max_violation": d["check"]["max_violation"], "passed": d["check"]["passed"],
            "control_violation": min((c["violation"] for c in d["controls"]), default=None),
            "refuted": [{"name": r["name"], "violation": r["violation"]} for r in d["refuted"]],
        })
    return rows


def count_rows(*, seed: int = 0, on_row=None) -> list[dict]:
    """Catalogue count vs numeric count for every catalogue variant (for ``make demo``).

    ``on_row(i, total, row)`` is called after each row (the demo's progress line).
    """
    from flowgeom.laws.catalogue import VARIANTS
    from flowgeom.laws.count import count
    from flowgeom.nn import build

    rows = []
    for v in VARIANTS:
        res = count(build(v.arch, seed=seed, **dict(v.options)), seed=seed)
        finding = v.arch == "moe" and dict(v.options).get("gate") == "sigmoid"
        rows.append({"label": v.label, "arch": v.arch, "options": dict(v.options), "formula": v.count_formula,
                     "parameters": res.parameters, "catalogue": res.expected, "numeric": res.laws,
                     "ranks_by_depth": res.ranks_by_depth, "gap_ratio": res.gap["ratio"], "seconds": res.seconds,
                     "match": res.expected == res.laws, "finding": finding})
        if on_row is not None:
            on_row(len(rows), len(VARIANTS), rows[-1])
    return rows
