"""The laws' drift over saved checkpoints, without touching training code (``flowgeom conserve drift``).

Each checkpoint is a Hugging Face folder (a Trainer's ``checkpoint-N``, a
``save_pretrained`` folder: ``config.json`` plus ``model.safetensors`` or a
sharded index) or a bare ``.safetensors`` file (with ``config=`` a
``config.json``, or one next to it). The first checkpoint is θ_0: its laws are
located (:func:`flowgeom.laws.locate.locate_blocks`) and every later
checkpoint's weights are copied into the same model and measured against it,
with the verdicts of :mod:`flowgeom.laws.verdict` and the figure of
:mod:`flowgeom.integrations.figure`.

A series must be one model: every checkpoint has the first one's family
(``model_type``) and exactly its parameter names and shapes, else one error
names the first checkpoint that differs. Weights are read from safetensors
(no pickle; ``optimizer.pt`` and ``training_args.bin`` are never opened), one
tensor at a time; of the later checkpoints only the tensors the laws read are
loaded (every other shape is checked from the file headers). The
steps come from ``trainer_state.json`` (``global_step``), else from the
``checkpoint-N`` name, else the order given; the series is sorted by step.
The optimiser, for the expected behaviour, is read from the monitor state a
:class:`~flowgeom.integrations.ConservationCallback` saved next to the
weights, else from ``optimizer_kind``.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, shown
from flowgeom.files import read_json_object
from flowgeom.laws.verdict import HELD_THRESHOLD, KINDS, info_of_kind

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


@dataclass(frozen=True)
class Checkpoint:
    path: Path           # the folder or .safetensors file given
    config: Path         # its config.json
    step: int | None     # global_step, from trainer_state.json or the checkpoint-N name


def _config_of(path: Path, config: Path | None) -> Path:
    if config is not None:
        return config
    cand = (path if path.is_dir() else path.parent) / "config.json"
    if not cand.is_file():
        where = "folder" if path.is_dir() else "file's folder"
        raise FlowgeomError(f"{shown(path)}: no config.json in the {where}; pass --config CONFIG.json (the model's "
                            "Hugging Face config)")
    return cand


def _step_of(path: Path) -> int | None:
    folder = path if path.is_dir() else path.parent
    state = folder / "trainer_state.json"
    if state.is_file():
        try:
            step = read_json_object(state, fix="re-save the checkpoint").get("global_step")
            if isinstance(step, int):
                return step
        except FlowgeomError:
            pass  # a damaged (or non-regular) trainer_state.json: fall back to the folder's name
    m = re.fullmatch(r"checkpoint-(\d+)", path.name if path.is_dir() else path.parent.name)
    return int(m.group(1)) if m else None


def resolve(paths: Sequence[str | os.PathLike], config: str | os.PathLike | None = None) -> list[Checkpoint]:
    """Check every path and order the series by step (validate first: nothing is loaded yet)."""
    if len(paths) < 2:
        raise FlowgeomError(f"drift needs at least 2 checkpoints (the first is θ_0), got {len(paths)}; "
                            "e.g. flowgeom conserve drift out/checkpoint-*")
    cfg = Path(config) if config is not None else None
    if cfg is not None and not cfg.is_file():
        raise FlowgeomError(f"--config {shown(cfg)} is not a file; pass the model's config.json")
    out = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise FlowgeomError(f"checkpoint {shown(p)} does not exist")
        if p.is_dir():
            if not any((p / w).is_file() for w in WEIGHTS):
                if (p / "adapter_config.json").is_file():
                    raise FlowgeomError(f"{shown(p)} holds a PEFT adapter only; merge it into its base model "
                                        "(merge_and_unload + save_pretrained) and measure the merged folders")
                raise FlowgeomError(f"{shown(p)} has no model.safetensors (or sharded index); save checkpoints with "
                                    "safetensors (the Trainer's default) — pickled .bin weights are not read")
        elif p.suffix != ".safetensors":
            raise FlowgeomError(f"{shown(p)} is neither a checkpoint folder nor a .safetensors file")
        out.append(Checkpoint(p, _config_of(p, cfg), _step_of(p)))
    if all(c.step is not None for c in out):
        steps = [c.step for c in out]
        if len(set(steps)) != len(steps):
            raise FlowgeomError(f"two checkpoints share step {max(steps, key=steps.count)}; pass each step once")
        out.sort(key=lambda c: c.step)
    else:
        out = [Checkpoint(c.path, c.config, i) for i, c in enumerate(out)]
    return out


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise FlowgeomError("conserve drift needs transformers; install the extra: pip install 'flowgeom[hf]'") from exc
    return transformers


def _load_config(ck: Checkpoint):
    transformers = _transformers()
    try:
        return transformers.AutoConfig.from_pretrained(str(ck.config.parent) if ck.config.name == "config.json"
                                                       else str(ck.config), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a malformed or foreign config.json: one line with its cause
        raise FlowgeomError(f"{shown(ck.config)} is not a readable Hugging Face config ({type(exc).__name__}: "
                            f"{' '.join(str(exc).split())[:200]}); pass the model's config.json with --config") from exc


def _model_of(config) -> nn.Module:
    transformers = _transformers()
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if cls is not None:
            return cls._from_config(config)
        return transformers.AutoModelForCausalLM.from_config(config)


def _files(ck: Checkpoint) -> list[Path]:
    """The safetensors files of a checkpoint (single file, folder, or the shards of an index)."""
    if ck.path.is_file():
        return [ck.path]
    if (ck.path / "model.safetensors").is_file():
        return [ck.path / "model.safetensors"]
    index = ck.path / "model.safetensors.index.json"
    weight_map = read_json_object(index, fix="re-save the checkpoint").get("weight_map")  # never a FIFO
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise FlowgeomError(f"{shown(index)} is not a shard index (no weight_map of file names); re-save the "
                            "checkpoint")
    files = [ck.path / f for f in sorted(set(weight_map.values()))]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise FlowgeomError(f"{shown(index)} names {shown(missing[0].name)}, which is missing; copy every shard")
    return files


def _read(ck: Checkpoint, names: set[str] | None) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.Tensor]]:
    """Every tensor's shape (from the headers) and the tensors in ``names`` (all when None), one at a time."""
    from safetensors import safe_open

    shapes, tensors = {}, {}
    for f in _files(ck):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    shapes[key] = tuple(fh.get_slice(key).get_shape())
                    if names is None or key in names:
                        tensors[key] = fh.get_tensor(key)
        except Exception as exc:  # noqa: BLE001 - truncated / not safetensors
            raise FlowgeomError(f"{shown(f)} is not a readable safetensors file ({type(exc).__name__}: "
                                f"{' '.join(str(exc).split())[:160]}); re-save the checkpoint") from exc
    return shapes, tensors


def _load_into(model: nn.Module, ck: Checkpoint, first: Checkpoint, names: set[str] | None = None) -> None:
    """Copy ``ck``'s weights (only ``names``, e.g. those the laws read) into ``model``; refuse names or shapes
    that differ from the series' first. Shapes come from the file headers, so the rest is never loaded."""
    state = model.state_dict()
    shapes, tensors = _read(ck, names)
    # tied weights (lm_head = embed_tokens) are saved once: only the model's own names must all be present
    missing = sorted(set(state) - set(shapes) - _tied(model))
    unexpected = sorted(set(shapes) - set(state))
    if missing or unexpected:
        what = (f"missing {', '.join(missing[:3])}" if missing else "") + ("; " if missing and unexpected else "") + \
               (f"unexpected {', '.join(unexpected[:3])}" if unexpected else "")
        raise FlowgeomError(f"checkpoint {shown(ck.path)} does not hold the parameters of {shown(first.path)} "
                            f"({what}): a series must be one model")
    bad = [(n, shape, tuple(state[n].shape)) for n, shape in shapes.items() if shape != tuple(state[n].shape)]
    if bad:
        n, got, want = bad[0]
        raise FlowgeomError(f"checkpoint {shown(ck.path)}: {n} has shape {got}, {shown(first.path)} has {want}: a "
                            f"series must be one model ({len(bad)} tensor(s) differ)")
    with torch.no_grad():
        for n, t in tensors.items():
            state[n].copy_(t)


def _tied(model: nn.Module) -> set[str]:
    seen: dict[int, str] = {}
    tied = set()
    for n, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            tied.add(n)
        seen.setdefault(id(t), n)
    return tied


def _saved_optimizer(ck: Checkpoint) -> str | None:
    """The optimiser kind a ConservationCallback saved next to the weights, if any."""
    from flowgeom.integrations.session import STATE_FILE, read_state
    from flowgeom.runs import decode_checkpoint

    f = (ck.path if ck.path.is_dir() else ck.path.parent) / STATE_FILE
    if not f.is_file():
        return None
    state = decode_checkpoint(read_state(f), source=str(f))
    kind = (state.get("optimizer") or {}).get("kind")
    return kind if kind in KINDS else None


def checkpoint_drift(paths: Sequence[str | os.PathLike], *, config: str | os.PathLike | None = None,
                     optimizer_kind: str | None = None, threshold: float = HELD_THRESHOLD,
                     figure: str | os.PathLike | None = None, heads: int | None = None,
                     positions: str | None = None, device: str = "cpu", progress=lambda msg: None) -> dict[str, Any]:
    """ε of every law family at each checkpoint against the first, with verdicts (and the figure)."""
    from flowgeom.laws.monitor import ConservationMonitor

    if optimizer_kind is not None and optimizer_kind not in KINDS:
        raise FlowgeomError(f"unknown optimiser kind {optimizer_kind!r}; choose one of: {', '.join(KINDS)}")
    inputs = [*paths, *([config] if config is not None else [])]
    if figure is not None:
        from flowgeom.report.figures import check_figure_path
        from flowgeom.runs import check_out_file

        check_figure_path(figure)
        check_out_file(figure, "--figure", inputs=inputs)  # never into a checkpoint folder it reads
    series = resolve(paths, config)
    first = series[0]
    cfg0 = _load_config(first)
    for ck in series[1:]:
        cfg = _load_config(ck) if ck.config != first.config else cfg0
        if getattr(cfg, "model_type", None) != getattr(cfg0, "model_type", None):
            raise FlowgeomError(f"checkpoint {shown(ck.path)} is a {cfg.model_type!r} model, {shown(first.path)} a "
                                f"{cfg0.model_type!r} one: a series must be one model family")
    model = _model_of(cfg0)
    progress(f"θ_0 {first.path}")
    _load_into(model, first, first)  # all of θ_0: a zero-baseline law's scale may read its whole block
    model.to(device)
    monitor = ConservationMonitor(model, warn=False, heads=heads, positions=positions)
    read = set(monitor.param_names)  # later checkpoints: only what the laws read is loaded (the rest: headers)
    records = []
    for i, ck in enumerate(series):
        if i:
            progress(f"{i + 1}/{len(series)} {ck.path}")
            _load_into(model, ck, first, read)
        rec = monitor.step(ck.step if ck.step is not None else i)
        rec = {"checkpoint": str(ck.path), **rec}
        for v in monitor.verdicts(rec, threshold=threshold):
            rec[f"ratio/{v.family}"] = v.ratio
        records.append(rec)
    kind = optimizer_kind or _saved_optimizer(series[-1])
    if kind is not None:
        monitor.optimizer_info = info_of_kind(kind)
    summary = monitor.summary(record=records[-1], threshold=threshold)
    out = {"checkpoints": [str(c.path) for c in series], "steps": [r["step"] for r in records],
           "model_type": getattr(cfg0, "model_type", None), "records": records, "summary": summary,
           "uncovered": monitor.uncovered_list()}
    if figure is not None:
        from flowgeom.integrations.figure import plot_drift

        history = [{k: v for k, v in r.items() if k == "step" or ("@" not in k and isinstance(v, float))}
                   for r in records]
        plot_drift(history, figure, title=f"{out['model_type']}: drift from {first.path.name}", inputs=inputs)
        out["figure"] = str(figure)
    return out
