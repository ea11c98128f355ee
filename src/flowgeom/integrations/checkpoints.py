"""The laws' drift over saved checkpoints, without touching training code (``flowgeom conserve drift``).

Each checkpoint is a Hugging Face folder (a Trainer's ``checkpoint-N``, a
``save_pretrained`` folder: ``config.json`` plus ``model.safetensors`` or a
sharded index) or a bare ``.safetensors`` file (with ``config=`` a
``config.json``, or one next to it). The laws are located in the first
checkpoint (:func:`flowgeom.laws.locate.locate_blocks`) and every checkpoint's
weights are copied into the same model and measured, with the verdicts of
:mod:`flowgeom.laws.verdict` and the figure of :mod:`flowgeom.integrations.figure`.

**One reference.** ε is measured from θ_0 when the run left its law values:
the ``flowgeom_theta0.safetensors`` a
:class:`~flowgeom.integrations.ConservationCallback` writes into the Trainer's
``output_dir``, found in the folder that holds the checkpoints (or given as
``reference=``). The callback measured from the same θ_0, so both give the same
numbers; and where a checkpoint holds the callback's state, its exact
plain-SGD prediction (:class:`flowgeom.laws.predict.SGDPrediction`) is
replayed, so both give the same verdict. Without that file the first checkpoint
is the reference, and the verdict line says so ("from checkpoint-20; θ_0
unknown"); the prediction is then the part of the callback's between the
first checkpoint and each later one (ĥ_j − ĥ_first = Σ τ²·h(g) over the steps
between), when both hold its state. A θ_0 file saved for another model (other
laws or shapes) is not used, and the line says that too.

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
from flowgeom.laws.verdict import HELD_THRESHOLD, KINDS, OptimizerInfo, info_of_kind

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


def trainer_checkpoints(folder: Path) -> list[Path]:
    """The ``checkpoint-N`` folders a Trainer wrote into its ``output_dir`` ``folder``, by step."""
    found = [p for p in folder.glob("checkpoint-*") if p.is_dir() and re.fullmatch(r"checkpoint-\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def _output_dir_error(folder: Path, found: list[Path]) -> FlowgeomError:
    """A Trainer's ``output_dir`` given where its checkpoints belong: name them and the command that measures them."""
    names = ", ".join(p.name for p in found[:4]) + (f", … ({len(found)} in all)" if len(found) > 4 else "")
    return FlowgeomError(f"{shown(folder)} is a Trainer output folder; pass the checkpoint folders it holds "
                         f"({names}), e.g. flowgeom conserve drift {shown(folder / 'checkpoint-*')}")


def resolve(paths: Sequence[str | os.PathLike], config: str | os.PathLike | None = None, *,
            minimum: int = 2) -> list[Checkpoint]:
    """Check every path and order the series by step (validate first: nothing is loaded yet)."""
    if len(paths) < minimum:
        found = trainer_checkpoints(Path(paths[0])) if len(paths) == 1 and Path(paths[0]).is_dir() else []
        if found:
            raise _output_dir_error(Path(paths[0]), found)
        raise FlowgeomError(f"drift needs at least 2 checkpoints (the first is the reference), or one beside the "
                            f"run's flowgeom_theta0.safetensors, got {len(paths)}; "
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
                if found := trainer_checkpoints(p):
                    raise _output_dir_error(p, found)
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


def _saved_state(ck: Checkpoint) -> dict[str, Any] | None:
    """The monitor state a ConservationCallback saved next to the weights, if any."""
    from flowgeom.integrations.session import STATE_FILE, read_state
    from flowgeom.runs import decode_checkpoint

    f = (ck.path if ck.path.is_dir() else ck.path.parent) / STATE_FILE
    if not f.is_file():
        return None
    return decode_checkpoint(read_state(f), source=str(f))


def _saved_optimizer(state: dict[str, Any] | None) -> OptimizerInfo | None:
    """The optimiser (class, kind, hyper-parameters) a saved monitor state describes, if it does."""
    saved = (state or {}).get("optimizer")
    if not isinstance(saved, dict) or saved.get("kind") not in KINDS:
        return None
    try:
        return OptimizerInfo(**{k: saved[k] for k in OptimizerInfo.__dataclass_fields__ if k in saved})
    except (TypeError, ValueError, FlowgeomError):
        return info_of_kind(saved["kind"])


def _prediction_state(state: dict[str, Any] | None, monitor) -> dict[str, Any] | None:
    """The monitor part of a saved callback state, when it is this model's and holds the plain-SGD prediction."""
    saved = (state or {}).get("monitor")
    if (state is None or state.get("fingerprint") != monitor.fingerprint() or not isinstance(saved, dict)
            or not all(isinstance(saved.get(k), torch.Tensor) for k in ("h0", "sgd_h", "sgd_roundoff", "sgd_steps"))):
        return None
    return saved


def _prediction_between(first: dict[str, Any] | None, later: dict[str, Any] | None,
                        base: dict[str, Any]) -> dict[str, Any]:
    """``base`` (θ_0 := the first checkpoint) with the prediction of the steps between two saved states of one run.

    ĥ_later − ĥ_first = Σ h(Δ_k) over the steps between them, whatever θ_0 was; round-off adds in quadrature.
    Without both states (or from two runs): ``base`` alone, no prediction.
    """
    if first is None or later is None or not torch.equal(first["h0"], later["h0"]):
        return base
    steps = int(later["sgd_steps"]) - int(first["sgd_steps"])
    if steps < 0:
        return base
    return {**base, "sgd_h": base["h0"] + (later["sgd_h"] - first["sgd_h"]),
            "sgd_roundoff": (later["sgd_roundoff"] - first["sgd_roundoff"]).clamp_min(0.0),
            "sgd_steps": torch.tensor(steps, dtype=torch.int64)}


def find_reference(series: Sequence[Checkpoint]) -> Path | None:
    """The ``flowgeom_theta0.safetensors`` of the run: in the one folder that holds every checkpoint folder."""
    from flowgeom.integrations.session import REFERENCE_FILE

    parents = {(c.path.parent if c.path.is_dir() else c.path.parent.parent).resolve() for c in series}
    if len(parents) != 1:
        return None
    path = parents.pop() / REFERENCE_FILE
    return path if path.exists() else None


def _use_reference(monitor, path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """Load θ_0 from ``path`` into ``monitor``: (its state, None), or (None, why it was not used)."""
    from flowgeom.integrations.session import read_reference

    ref = read_reference(path)
    if ref["fingerprint"] != monitor.fingerprint():
        return None, f"{path.name} was saved for another model"
    monitor.load_state_dict(ref["monitor"])
    return ref, None


def checkpoint_drift(paths: Sequence[str | os.PathLike], *, config: str | os.PathLike | None = None,
                     optimizer_kind: str | None = None, threshold: float = HELD_THRESHOLD,
                     figure: str | os.PathLike | None = None, heads: int | None = None,
                     positions: str | None = None, device: str = "cpu", reference: str | os.PathLike | None = None,
                     progress=lambda msg: None) -> dict[str, Any]:
    """ε of every law family at each checkpoint against θ_0 (else the first checkpoint), with verdicts (and the figure).

    ``reference``: a ``flowgeom_theta0.safetensors`` (default: the one beside the checkpoint folders, if any).
    """
    from flowgeom.laws.monitor import ConservationMonitor

    if optimizer_kind is not None and optimizer_kind not in KINDS:
        raise FlowgeomError(f"unknown optimiser kind {optimizer_kind!r}; choose one of: {', '.join(KINDS)}")
    inputs = [*paths, *([config] if config is not None else [])]
    if figure is not None:
        from flowgeom.report.figures import check_figure_path
        from flowgeom.runs import check_out_file

        check_figure_path(figure)
        check_out_file(figure, "--figure", inputs=inputs)  # never into a checkpoint folder it reads
    if reference is not None and not Path(reference).is_file():
        raise FlowgeomError(f"--reference {shown(reference)} is not a file; pass the flowgeom_theta0.safetensors a "
                            "ConservationCallback wrote into the Trainer's output_dir")
    series = resolve(paths, config, minimum=1)
    ref_path = Path(reference) if reference is not None else find_reference(series)
    if len(series) < 2 and ref_path is None:
        resolve(paths, config)  # the error: one checkpoint and no θ_0 to measure it from
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
    ref, unused = _use_reference(monitor, ref_path) if ref_path is not None else (None, None)
    if ref is None and len(series) < 2:
        raise FlowgeomError(f"one checkpoint and no θ_0 to measure it from ({unused}); pass at least 2 checkpoints")
    if ref is not None:
        source = {"kind": "theta0", "path": str(ref_path), "step": ref["step"]}
        named = None if ref["step"] == 0 else f"from θ_0 = step {ref['step']} (a rebased resume)"
        against = "θ_0" if ref["step"] == 0 else f"θ_0 (step {ref['step']})"
    else:
        source = {"kind": "checkpoint", "path": str(first.path), "step": first.step}
        named = f"from {first.path.name}; θ_0 unknown" + (f" ({unused})" if unused else "")
        against = first.path.name
    read = set(monitor.param_names)  # later checkpoints: only what the laws read is loaded (the rest: headers)
    records, states = [], []
    for i, ck in enumerate(series):
        if i:
            progress(f"{i + 1}/{len(series)} {ck.path}")
            _load_into(model, ck, first, read)
        state = _saved_state(ck)
        states.append(state)
        if ref is not None:  # the callback's prediction at this checkpoint, when it measured from the same θ_0
            saved = _prediction_state(state, monitor)
            same = saved is not None and torch.equal(saved["h0"], ref["monitor"]["h0"])
            monitor.load_state_dict(saved if same else ref["monitor"])
        elif i == 0:
            base = monitor.state_dict()  # θ_0 := this checkpoint, as measured
        else:  # the prediction between the first checkpoint and this one, when the callback saved both
            monitor.load_state_dict(_prediction_between(_prediction_state(states[0], monitor),
                                                        _prediction_state(state, monitor), base))
        rec = monitor.step(ck.step if ck.step is not None else i)
        rec = {"checkpoint": str(ck.path), **rec}
        for v in monitor.verdicts(rec, threshold=threshold):
            rec[f"ratio/{v.family}"] = v.ratio
        records.append(rec)
    info = info_of_kind(optimizer_kind) if optimizer_kind is not None else _saved_optimizer(states[-1])
    monitor.optimizer_info = info
    summary = monitor.summary(record=records[-1], threshold=threshold, reference=named)
    out = {"checkpoints": [str(c.path) for c in series], "steps": [r["step"] for r in records],
           "model_type": getattr(cfg0, "model_type", None), "reference": source, "against": against,
           "records": records, "summary": summary, "uncovered": monitor.uncovered_list()}
    if figure is not None:
        from flowgeom.integrations.figure import plot_drift

        history = [{k: v for k, v in r.items() if k == "step" or ("@" not in k and isinstance(v, float))}
                   for r in records]
        plot_drift(history, figure, title=f"{out['model_type']}: drift from {against}", inputs=inputs)
        out["figure"] = str(figure)
    return out
