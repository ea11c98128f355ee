"""Writing a compressed checkpoint folder: never over its source, never half-written.

:func:`check_out_folder` runs before any work: ``out`` may not be the source,
lie inside the source folder, or contain the source (replacing ``out`` would
delete it); an existing non-empty ``out`` needs ``force``. :func:`write_folder`
fills a hidden temporary sibling folder and renames it into place, so a
reader sees the old folder or the complete new one; with ``force`` the old
folder is moved aside first and deleted only after the rename succeeded.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from flowgeom.errors import FlowgeomError


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_out_folder(source: Path, out: Path, *, force: bool) -> None:
    """Refuse an ``out`` that would overwrite or contain ``source``, or a non-empty ``out`` without ``force``."""
    src, dst = source.resolve(), out.resolve()
    src_folder = src if src.is_dir() else None
    if dst == src or (src_folder is not None and _inside(dst, src_folder)):
        raise FlowgeomError(f"--out {out} is the source or inside the source folder {src_folder or src}; compression "
                            "never writes over its source: pick a folder elsewhere")
    if _inside(src, dst):
        raise FlowgeomError(f"--out {out} contains the source {source}; writing there would replace it: pick "
                            "another folder")
    if dst.exists() and not dst.is_dir():
        raise FlowgeomError(f"--out {out} exists and is not a folder; pick a folder name")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise FlowgeomError(f"--out {out} exists and is not empty; pass --force to replace it, or pick a new folder")


def write_folder(out: Path, fill: Callable[[Path], None], *, force: bool) -> None:
    """Call ``fill(tmp)`` on a fresh temporary folder next to ``out``, then rename it to ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    old = None
    try:
        fill(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint folder is an ordinary folder
        if out.exists():
            if any(out.iterdir()) and not force:  # appeared meanwhile
                raise FlowgeomError(f"--out {out} became non-empty while writing; pass --force or pick another folder")
            old = out.parent / f".{out.name}.old-{tmp.name}"
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            old.rename(out)  # put the previous folder back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_llama_folder(folder: Path, config_json: dict, state: dict, *, tokenizer=None,
                      report: dict | None = None) -> None:
    """HF Llama layout in ``folder``: ``model.safetensors`` (float32, contiguous), ``config.json``,
    ``tokenizer.json`` and ``flowgeom_share.json`` (the compression report) when given.

    With tied embeddings ``lm_head.weight`` is not written (HF convention).
    """
    from safetensors.torch import save_file

    from flowgeom.runs import to_json

    tensors = {k: v.float().contiguous() for k, v in state.items()
               if not (k == "lm_head.weight" and config_json.get("tie_word_embeddings"))}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(str(folder / "tokenizer.json"))
    if report is not None:
        (folder / "flowgeom_share.json").write_text(to_json(report, indent=2) + "\n")
