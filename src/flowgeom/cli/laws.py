"""``flowgeom laws list|show`` (catalogue) and the engine's ``count|discover``."""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape

from flowgeom.cli._common import add_json, add_seed, area, command, console, positive_int, print_json
from flowgeom.cli.zoo_options import add_size_options, size_options


def _law_dict(law) -> dict[str, Any]:
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
    from flowgeom.errors import positive_int
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
        "laws": [_law_dict(law) for law in entry.laws],
        "count": entry.count,
        "check": report.as_dict() | {"max_violation": report.max_violation, "passed": report.passed},
        "controls": [_law_dict(c) | {"violation": by_name["control", c.name].max_violation} for c in entry.controls],
        "refuted": [_law_dict(r) | {"violation": by_name["refuted", r.name].max_violation} for r in entry.refuted],
        "notes": list(entry.notes),
    }


def catalogue_rows(*, seed: int = 0) -> list[dict[str, Any]]:
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


def print_catalogue_table(rows: list[dict[str, Any]] | None = None) -> None:
    from rich.table import Table

    rows = rows if rows is not None else catalogue_rows()
    table = Table(title="flowgeom law catalogue (default sizes; check in float64, tolerance 1e-10)")
    for col in ("architecture", "law families", "count", "at size", "D", "max violation", "control", "verdict"):
        table.add_column(col, justify="right" if col in ("at size", "D") else "left")
    for r in rows:
        verdict = "laws hold" if r["passed"] else "[red]FAILS[/red]"
        if r["refuted"]:
            verdict += f"; seed's router law refuted (violation {r['refuted'][0]['violation']:.1e})"
        control = f"{r['control_violation']:.1e}" if r["control_violation"] is not None else "-"
        table.add_row(r["label"], ", ".join(r["families"]) or "(none)", r["count_formula"], str(r["count"]),
                      str(r["parameters"]), f"{r['max_violation']:.1e}", control, verdict)
    console().print(table)


def _list(args: argparse.Namespace) -> int:
    rows = catalogue_rows(seed=args.seed)
    if args.json:
        print_json(rows)
    else:
        print_catalogue_table(rows)
    return 0


def _show(args: argparse.Namespace) -> int:
    d = describe(args.arch, size_options(args), seed=args.seed, n_fields=args.fields)
    if args.json:
        print_json(d)
        return 0 if d["check"]["passed"] else 1
    out = console()
    opts = ", ".join(f"{k}={v}" for k, v in d["options"].items())
    out.print(f"[bold]{d['arch']}[/bold] ({opts}); D = {d['parameters']} parameters")
    out.print(f"{d['count']} independent conservation laws:")
    for law in d["laws"]:
        out.print(f"  {law['count']:>4}  " + escape(law["formula"]) + (f"  ({law['note']})" if law.get("note") else ""))
    if not d["laws"]:
        out.print("  (none: only constant functions are conserved)")
    chk = d["check"]
    out.print(f"check: {chk['fields']} random fields × {chk['points']} parameter points, {chk['dtype']}: "
              f"max relative violation {chk['max_violation']:.2e} (tolerance {chk['tolerance']:.0e}) -> "
              + ("[green]PASSED[/green]" if chk["passed"] else "[red]FAILED[/red]"))
    for c in d["controls"]:
        out.print(f"control {escape(c['name'])} (not conserved): violation {c['violation']:.2e}")
    for r in d["refuted"]:
        out.print(f"[yellow]refuted claim[/yellow] {escape(r['name'])}: violation {r['violation']:.2e} — {r['note']}")
    for note in d["notes"]:
        out.print(f"note: {note}")
    return 0 if chk["passed"] else 1


def register(sub) -> None:
    from flowgeom.nn.zoo import ARCHITECTURES

    verbs = area(sub, "laws", "conservation laws: catalogue, check, numeric count and discovery")
    p = command(verbs, "list", help="every zoo architecture with its laws, counts and check verdict",
                example="flowgeom laws list\nflowgeom laws list --json", func=_list)
    add_json(p)
    add_seed(p)
    p = command(verbs, "show", help="one architecture's laws, counts and the check's violation figure",
                example="flowgeom laws show swiglu --d-hidden 16\nflowgeom laws show mha --heads 2 --d-k 4 --positions rope --json",
                func=_show)
    p.add_argument("arch", metavar="ARCH", help="one of: " + ", ".join(ARCHITECTURES))
    p.add_argument("--fields", type=positive_int(maximum=MAX_FIELDS), default=64,
                   help=f"random (input, output direction) pairs per point, 1..{MAX_FIELDS:,} (default 64)")
    add_size_options(p)
    add_json(p)
    add_seed(p)
    from flowgeom.cli.laws_engine import register_verbs  # an import bug fails loudly, never drops commands

    register_verbs(verbs)
