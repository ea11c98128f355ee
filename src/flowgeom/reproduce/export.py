"""Copy a finished reproduction's small outputs to a folder meant for version control.

A sweep folder holds checkpoints (megabytes to gigabytes) next to the
results that matter: the report, each run's config, summary, metrics and
figures. :func:`export_results` copies the latter, so that ``results/full/``
can be committed and its numbers traced to the command that made them,
while checkpoints, and anything larger than ``max_bytes``, stay behind and
are listed in the export's ``EXPORT.json``.
"""

from __future__ import annotations

from pathlib import Path

from flowgeom.errors import FlowgeomError
from flowgeom.runs import atomic_write_bytes, atomic_write_json

KEPT_SUFFIXES = (".json", ".jsonl", ".md", ".html", ".png", ".svg", ".csv", ".txt")
MAX_BYTES = 2_000_000  # per file: a figure or a long metrics log, never a checkpoint


def check_export(out: str | Path, dest: str | Path) -> None:
    """Refuse, before any run starts, an export folder that overlaps the sweep or is a file."""
    src, dst = Path(out).resolve(), Path(dest).resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise FlowgeomError(f"--export {dest} overlaps the sweep folder {out}; choose a separate folder")
    if dst.exists() and not dst.is_dir():
        raise FlowgeomError(f"--export {dest} is a file; give a folder")


def export_results(out: str | Path, dest: str | Path, *, max_bytes: int = MAX_BYTES) -> dict[str, list[str]]:
    """Copy ``out``'s small result files to ``dest`` (same relative paths); returns ``{"copied", "left"}``.

    ``dest`` may exist (a re-export replaces the files it copies) but must not
    lie inside ``out`` or hold it; symlinks are never followed, so an export
    cannot pull in files from outside the sweep.
    """
    out, dest = Path(out), Path(dest)
    check_export(out, dest)
    if not (out / "report.json").is_file():
        raise FlowgeomError(f"{out} holds no report.json; export a folder written by `flowgeom reproduce`")
    copied, left = [], []
    for path in sorted(out.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        rel = path.relative_to(out)
        if path.suffix not in KEPT_SUFFIXES or path.stat().st_size > max_bytes:
            left.append(str(rel))
            continue
        # root=dest: a link planted in dest (at the file or a folder on the way) is refused, never followed
        atomic_write_bytes(dest / rel, path.read_bytes(), root=dest, what="--export file")  # <= max_bytes
        copied.append(str(rel))
    atomic_write_json(dest / "EXPORT.json", {"source": str(out), "copied": len(copied), "left_behind": left,
                                             "rule": f"kept {', '.join(KEPT_SUFFIXES)} files up to {max_bytes} bytes"},
                      root=dest, what="--export file")
    return {"copied": copied, "left": left}
