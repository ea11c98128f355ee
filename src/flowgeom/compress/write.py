"""Writing a compressed checkpoint folder: never over its source, never half-written.

:func:`check_out_folder` runs before any work: ``out`` may not be the source,
lie inside the source folder, or contain the source (replacing ``out`` would
delete it); an existing non-empty ``out`` needs ``force``. :func:`write_folder`
fills a hidden temporary sibling folder and renames it into place, so a
reader sees the old folder or the complete new one; with ``force`` the old
folder is moved aside first and deleted only after the rename succeeded.

A writer killed outright (SIGKILL, power loss) cannot clean up: its
temporary folder, a full checkpoint's worth of bytes, would stay beside
``out`` for ever. The folder names carry the writer's pid
(``.OUT.wPID.XXXX.tmp``, and ``.OUT.wPID.XXXX.old`` for a replaced folder),
so the next :func:`write_folder` for the same ``out`` removes the leftovers of
writers that are no longer running, and puts a moved-aside folder back when
its writer died before the new one took its place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

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


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_dead_writers(out: Path) -> list[Path]:
    """Remove the temporary folders that killed writers of ``out`` left beside it (module docstring);
    a moved-aside previous ``out`` goes back in place if ``out`` is missing. Returns what was removed."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.w(\d+)\.[a-z0-9_]+\.(tmp|old)")  # mkdtemp's letters
    removed = []
    for path in sorted(out.parent.iterdir()) if out.parent.is_dir() else ():
        match = pattern.fullmatch(path.name)
        if not match or not path.is_dir() or int(match[1]) == os.getpid() or _running(int(match[1])):
            continue
        if match[2] == "old" and not out.exists():
            path.rename(out)  # its writer died between moving the old folder aside and renaming the new one in
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def write_folder(out: Path, fill: Callable[[Path], None], *, force: bool) -> None:
    """Call ``fill(tmp)`` on a fresh temporary folder next to ``out``, then rename it to ``out``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_dead_writers(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.w{os.getpid()}.", suffix=".tmp"))
    old = None
    try:
        fill(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint folder is an ordinary folder
        if out.exists():
            if any(out.iterdir()) and not force:  # appeared meanwhile
                raise FlowgeomError(f"--out {out} became non-empty while writing; pass --force or pick another folder")
            old = tmp.with_suffix(".old")
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            old.rename(out)  # put the previous folder back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# torch dtype -> safetensors' name, for the dtypes flowgeom writes, in safetensors' own order of its
# Dtype enum reversed (the order it lays tensors out in: by dtype, then by name)
_SAFETENSORS_DTYPES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
                       torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_RANK = {dtype: i for i, dtype in enumerate(_SAFETENSORS_DTYPES)}


def stream_safetensors(fh, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to the binary file ``fh`` in the safetensors format, one tensor at a time.

    Byte for byte what ``safetensors.torch.save`` returns (metadata first, tensors by
    dtype then name, the header padded with spaces to 8 bytes), but never
    the whole file in memory: ``safetensors`` writes to a path or to bytes only, and the
    write must go through the one output helper (an open file).
    """
    odd = next((k for k, t in tensors.items() if t.dtype not in _SAFETENSORS_DTYPES), None)
    if odd is not None:
        raise FlowgeomError(f"tensor {odd} has dtype {tensors[odd].dtype}, which flowgeom does not write; cast it first")
    order = sorted(tensors, key=lambda k: (_DTYPE_RANK[tensors[k].dtype], k))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    fh.write(struct.pack("<Q", len(text)) + text)
    for name in order:
        t = tensors[name].detach().to("cpu").contiguous()
        if t.numel():
            fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # the tensor's own bytes, no copy


def write_model_files(folder: Path, tensors: dict, config_json: dict, *, tokenizer=None, report: dict | None = None,
                      extra: dict[str, dict] | None = None, weights: str = "model.safetensors") -> None:
    """``weights`` (the tensors; a factored folder names its own, :data:`flowgeom.compress.folder.WEIGHTS_NAME`),
    ``config.json``, ``extra`` JSON files, ``tokenizer.json`` and ``flowgeom_share.json`` (the compression report)
    in ``folder``, each through :func:`flowgeom.runs.atomic_write`."""
    from flowgeom.runs import atomic_write, atomic_write_bytes, atomic_write_json

    atomic_write(folder / weights, lambda fh: stream_safetensors(fh, tensors, {"format": "pt"}), root=folder)
    jsons = {"config.json": config_json, **(extra or {}), **({} if report is None else {"flowgeom_share.json": report})}
    for name, obj in jsons.items():
        atomic_write_json(folder / name, obj, root=folder)
    if tokenizer is not None:
        atomic_write_bytes(folder / "tokenizer.json", tokenizer.to_str(pretty=True).encode(), root=folder)


def save_llama_folder(folder: Path, config_json: dict, state: dict, *, tokenizer=None,
                      report: dict | None = None) -> None:
    """A plain HF folder of any family in ``folder``: ``model.safetensors`` (float32, contiguous), ``config.json``,
    ``tokenizer.json`` and ``flowgeom_share.json`` (the compression report) when given.

    With tied embeddings ``lm_head.weight`` is not written (HF convention).
    """
    tensors = {k: v.float().contiguous() for k, v in state.items()
               if not (k == "lm_head.weight" and config_json.get("tie_word_embeddings"))}
    write_model_files(folder, tensors, config_json, tokenizer=tokenizer, report=report)
