"""Held-out perplexity of one model and the models compared with it, as the user judges a compression.

:func:`compare_models` loads each model from disk in turn (a dense folder, a
factored folder written by ``compress run``, a GGUF or ``builtin:`` name),
scores it on the same token ids with :func:`flowgeom.compress.perplexity.perplexity`
and reports its parameters and bytes on disk next to its perplexity ratio to
the first model. The CLI (``flowgeom compress evaluate``) only parses and prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flowgeom.compress.perplexity import EvalConfig, perplexity, windows
from flowgeom.errors import FlowgeomError

Progress = Callable[[str, int, int], None]  # (model, windows done, windows in all)


def bytes_on_disk(path: Path) -> int:
    """Bytes of a model file, or of the files directly inside a model folder."""
    return sum(f.stat().st_size for f in (path.iterdir() if path.is_dir() else [path]) if f.is_file())


def weight_bytes(path: Path) -> int:
    """Bytes of the weight files (``.safetensors``, ``.gguf``) of a model file or folder."""
    files = path.iterdir() if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files if f.is_file() and f.suffix in (".safetensors", ".gguf"))


def stored_dtype(path: Path) -> str:
    """How a model's weights are stored: ``gguf`` (quantised), or the float dtype a compressed folder names."""
    if path.suffix == ".gguf" or (path.is_dir() and any(path.glob("*.gguf"))):
        return "gguf"
    share = path / "flowgeom_share.json" if path.is_dir() else None
    if share is not None and share.is_file():
        from flowgeom.runs import read_json_object

        return str(read_json_object(share, fix="re-run compress run").get("dtype") or "float32")
    return "float32"


def _saved_params(path: Path) -> int | None:
    """The parameters a ``compress run`` folder says it saved (None for other models)."""
    share = path / "flowgeom_share.json" if path.is_dir() else None
    if share is None or not share.is_file():
        return None
    from flowgeom.runs import read_json_object

    return read_json_object(share, fix="re-run compress run").get("saved_params")


def compare_models(specs: Sequence[str], *, text: str = "kjv", config: EvalConfig, device: str | torch.device = "cpu",
                   out: str | Path | None = None, progress: Progress | None = None) -> dict:
    """Perplexity of ``specs[0]`` and of every other model against it, on ``text``'s held-out split.

    Every path, the output file (never one of the models, nor inside one) and the
    text's length are checked before any model is loaded. The tokenizer is the
    first model's; a model with fewer token embeddings than it has tokens is refused.
    """
    from flowgeom.compress.folder import load_model
    from flowgeom.compress.run import source_path
    from flowgeom.data.text import is_named, load_text
    from flowgeom.data.tokens import load_tokenizer, token_ids
    from flowgeom.runs import atomic_write_json, check_out_file

    paths = [source_path(s) for s in specs]
    if out is not None:
        check_out_file(out, inputs=paths)
    tokenizer = load_tokenizer(paths[0])
    corpus = load_text(text, split="test")
    ids = token_ids(corpus, tokenizer)
    n = len(ids) if config.max_tokens is None else min(len(ids), config.max_tokens)
    windows(n, config.context, config.stride or config.context)  # text too short: refused before any model loads
    rows = []
    for spec, path in zip(specs, paths):
        t0 = time.perf_counter()
        model = load_model(path).to(device)
        load_seconds = time.perf_counter() - t0
        if model.config.vocab_size < tokenizer.get_vocab_size():
            raise FlowgeomError(f"{spec} has {model.config.vocab_size} token embeddings but the tokenizer of "
                                f"{specs[0]} has {tokenizer.get_vocab_size()} tokens; compare models that share it")
        tick = None if progress is None else (lambda done, total, spec=spec: progress(spec, done, total))
        res = perplexity(model, ids.to(device), config, progress=tick)
        eval_seconds = res.pop("seconds")
        row = {"model": spec, **res, "params": sum(p.numel() for p in model.parameters()),
               "bytes_on_disk": bytes_on_disk(path), "load_seconds": load_seconds, "eval_seconds": eval_seconds,
               "seconds": time.perf_counter() - t0}
        saved = _saved_params(path)
        if saved is not None:
            row["saved_params"] = saved
        row["weight_bytes"], row["stored"] = weight_bytes(path), stored_dtype(path)
        rows.append(row)
        del model
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2}
    for row in rows:
        row["ppl_ratio"] = row["ppl"] / rows[0]["ppl"]
        # the reference's parameters stored densely in this model's dtype: what the compression is judged against
        dense = rows[0]["params"] * sizes.get(row["stored"], 4)
        row["dense_bytes_same_dtype"] = dense
        row["bytes_ratio"] = row["weight_bytes"] / dense
    split = {"kjv": "test (last 5% of verses)", "fortunes": "whole text"}.get(
        text, "test (last 5%)" if is_named(text) else "whole file")
    result = {"text": text, "split": split,
              "tokens_in_split": len(ids),
              "config": {"context": config.context, "stride": config.stride or config.context,
                         "max_tokens": config.max_tokens},
              "models": rows}
    if out is not None:
        atomic_write_json(Path(out), result, inputs=paths)
    return result
