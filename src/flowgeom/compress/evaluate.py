"""Several models compared with the first (the dense source), as the user judges a compression.

:func:`compare_models` loads each model from disk in turn (a dense folder, a
factored folder written by ``compress run``, a GGUF or ``builtin:`` name),
scores it on the same token ids with :func:`flowgeom.compress.perplexity.perplexity`
and reports its parameters and bytes on disk next to its perplexity ratio to
the first model; with the first model kept in memory, it also scores how each
model agrees with it, teacher-forced and in greedy generation
(:mod:`flowgeom.compress.agreement`). The CLI (``flowgeom compress evaluate``)
only parses and prints.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from flowgeom.compress.agreement import LOOP_N, LOOP_REPEATS, GenerationConfig
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


def _same_tokenizers(specs: Sequence[str], paths: Sequence[Path], tokenizer) -> None:
    """Refuse a model that carries a tokenizer other than the first model's (token ids would mean other text)."""
    from flowgeom.data.tokens import load_tokenizer, tokenizer_fingerprint

    mine = tokenizer_fingerprint(tokenizer)
    for spec, path in zip(specs[1:], paths[1:]):
        try:
            theirs = load_tokenizer(path)
        except FlowgeomError:
            continue  # no tokenizer of its own (a bare folder): it is read with the first model's
        if tokenizer_fingerprint(theirs) != mine:
            raise FlowgeomError(f"{spec} has another tokenizer than {specs[0]} ({theirs.get_vocab_size()} vs "
                                f"{tokenizer.get_vocab_size()} tokens, or other merges): compare models that share "
                                "one tokenizer (a compressed model and the source it came from)")


def compare_models(specs: Sequence[str], *, text: str = "kjv", config: EvalConfig, device: str | torch.device = "cpu",
                   out: str | Path | None = None, progress: Progress | None = None,
                   generation: GenerationConfig | None = GenerationConfig(), agreement: bool = True,
                   generate: Sequence[str] = ()) -> dict:
    """Perplexity of ``specs[0]`` and of every other model against it, on ``text``'s held-out split; with
    ``agreement``, each later model's teacher-forced top-1 agreement and KL against the first on the same
    windows; with ``generation``, the health of greedy continuations of held-out prompts (and prefix agreement
    with the first model's); ``generate``: prompts whose greedy continuations are returned per model.

    Every path, the output file (never one of the models, nor inside one), the tokenizers (one for all) and
    the text's length are checked before any model is loaded. The tokenizer is the first model's; a model
    with fewer token embeddings than it has tokens is refused.
    """
    from flowgeom.compress.agreement import generation_health, greedy_continuations, prompts_from
    from flowgeom.compress.agreement import teacher_forced_agreement
    from flowgeom.compress.folder import is_factored, load_model, read_factored
    from flowgeom.compress.source import source_path
    from flowgeom.data.text import is_named, load_text
    from flowgeom.data.tokens import load_tokenizer, token_ids
    from flowgeom.runs import atomic_write_json, check_out_file

    paths = [source_path(s) for s in specs]
    if out is not None:
        check_out_file(out, inputs=paths)
    if any(not p.strip() for p in generate):
        raise FlowgeomError("--generate got an empty prompt; pass the text to continue, e.g. --generate 'Once upon'")
    for path in paths:  # a damaged factored folder is refused before any model runs
        if is_factored(path):
            read_factored(path)
    tokenizer = load_tokenizer(paths[0])
    _same_tokenizers(specs, paths, tokenizer)
    corpus = load_text(text, split="test")
    ids = token_ids(corpus, tokenizer)
    n = len(ids) if config.max_tokens is None else min(len(ids), config.max_tokens)
    windows(n, config.context, config.stride or config.context)  # text too short: refused before any model loads
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False).ids  # noqa: E731
    prompts = [] if generation is None else [
        encode(p) for p in prompts_from(load_text(generation.text, split="test"), generation.prompts,
                                        generation.prompt_words)]
    rows, reference, reference_continuations = [], None, None
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
               "bytes_on_disk": bytes_on_disk(path), "load_seconds": load_seconds, "eval_seconds": eval_seconds}
        if agreement and reference is not None:
            row["agreement"] = teacher_forced_agreement(model, reference, ids.to(device), config)
        if prompts:
            tick = None if progress is None else (lambda done, total, spec=spec: progress(f"{spec} generate", done,
                                                                                              total))
            continuations = greedy_continuations(model, prompts, generation.new_tokens, progress=tick)
            row["generation"] = generation_health(continuations, reference_continuations)
            reference_continuations = reference_continuations or continuations
        if generate:
            row["generate"] = [tokenizer.decode(c) for c in greedy_continuations(
                model, [encode(p) for p in generate], (generation or GenerationConfig()).new_tokens)]
        row["seconds"] = time.perf_counter() - t0
        saved = _saved_params(path)
        if saved is not None:
            row["saved_params"] = saved
        row["weight_bytes"], row["stored"] = weight_bytes(path), stored_dtype(path)
        rows.append(row)
        if reference is None and agreement and len(specs) > 1:
            reference = model  # kept: every later model is scored against it, window by window
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
              "generation": None if generation is None else {**asdict(generation), "loop_ngram": LOOP_N,
                                                             "loop_repeats": LOOP_REPEATS},
              "generate_prompts": list(generate),
              "models": rows}
    if out is not None:
        atomic_write_json(Path(out), result, inputs=paths)
    return result
