"""Perplexity of a causal LM (any family ``compress run`` reads) on held-out text, its yardstick.

**Text.** The held-out split is ``flowgeom.data.text.load_text("kjv", split="test")``:
the last 5% of the King James verses (1,556 verses, Colossians 4:5 to
Revelation 22:21, joined by newlines), which flowgeom's own LM training
(split ``train``) never reads; SmolLM2's pre-training data very likely held
the Bible, so the numbers compare compressions of one model, they do not
measure generalisation. Tokenised with the model's own tokenizer (SmolLM2:
47,870 tokens), cached on disk (:mod:`flowgeom.data.tokens`). ``quick`` scores the first
:data:`QUICK_TOKENS` tokens, ``full`` all of them.

**Windows.** Tokens ``t_0 .. t_{N-1}``, context c, stride s <= c (default
s = c: non-overlapping windows). Window k reads ``t[ks : ks + c]``; it scores
the targets ``t_j`` with ``j`` from ``max(ks + 1, end of the previous window)``
to its own end, each predicted from the tokens before it in the window. With
s = c every window scores c - 1 targets (its first token has no context); with
s < c each target gets at least c - s tokens of context and every target
``t_1 .. t_{N-1}`` is scored exactly once (the same recipe as HF's strided
perplexity). ``ppl = exp(sum NLL / n_targets)`` (natural log).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flowgeom.errors import FlowgeomError

QUICK_TOKENS = 4096


@dataclass(frozen=True)
class EvalConfig:
    context: int = 512  # tokens per window
    stride: int | None = None  # window step; None = context (non-overlapping)
    max_tokens: int | None = QUICK_TOKENS  # score the first N tokens of the split (None = all: --full)
    batch: int = 1  # windows per forward call

    def __post_init__(self):
        for name, low in (("context", 2), ("batch", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise FlowgeomError(f"--{name} must be an integer >= {low}, got {value!r}")
        if self.stride is not None and not (isinstance(self.stride, int) and 1 <= self.stride <= self.context):
            raise FlowgeomError(f"--stride must be in 1..--context ({self.context}), got {self.stride!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 2):
            raise FlowgeomError(f"--tokens must be an integer >= 2, got {self.max_tokens!r}")


def windows(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_target)`` per window; targets ``first_target..end-1`` are scored (see module doc)."""
    if n_tokens < context:
        raise FlowgeomError(f"the text has {n_tokens} tokens, fewer than --context {context}: not one full window; "
                            "use a shorter --context (or --full, or a longer text)")
    out, scored_to = [], 1
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + context, n_tokens)
        first = max(begin + 1, scored_to)
        if first < end:
            out.append((begin, end, first))
            scored_to = end
        if end == n_tokens:
            break
    return out


def _vocab_rows(model: torch.nn.Module) -> int | None:
    """Rows of the model's token embedding (``config.vocab_size``, else the first ``nn.Embedding``), if known."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return None if embedding is None else embedding.num_embeddings


@torch.inference_mode()
def perplexity(model: torch.nn.Module, ids: torch.Tensor, config: EvalConfig = EvalConfig(), *,
               progress: Callable[[int, int], None] | None = None) -> dict:
    """``{"ppl", "nll", "targets", "windows", "seconds"}`` of ``model`` (ids (B, T) -> logits) on ``ids`` (N,)."""
    from flowgeom.compress.arch import logits as logits_of

    ids = ids.long()
    if config.max_tokens is not None:
        ids = ids[: config.max_tokens]
    rows = _vocab_rows(model)
    if rows is not None and len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < rows):
        raise FlowgeomError(f"token ids run from {int(ids.min())} to {int(ids.max())} but the model has {rows} token "
                            f"embeddings (ids 0..{rows - 1}): the ids are not from this model's tokenizer, or the "
                            "token cache is damaged (delete ~/.cache/flowgeom/tokens or $FLOWGEOM_CACHE/tokens)")
    spans = windows(len(ids), config.context, config.stride or config.context)
    t0, total, count = time.perf_counter(), 0.0, 0
    for start in range(0, len(spans), config.batch):
        chunk = spans[start:start + config.batch]
        width = max(e - b for b, e, _ in chunk)
        if all(e - b == width for b, e, _ in chunk):
            x = torch.stack([ids[b:e] for b, e, _ in chunk])  # (B, T)
            logits = logits_of(model, x)  # (B, T, vocab)
            rows = [logits[i] for i in range(len(chunk))]
        else:  # a short last window: its own call
            rows = [logits_of(model, ids[b:e][None])[0] for b, e, _ in chunk]
        for row, (b, e, first) in zip(rows, chunk):
            pred = row[first - 1 - b:e - 1 - b]  # (targets, vocab): position j-1 predicts t_j
            total += float(F.cross_entropy(pred, ids[first:e], reduction="sum"))
            count += e - first
        if progress:
            progress(min(start + config.batch, len(spans)), len(spans))
    nll = total / count
    if math.isnan(nll):
        raise FlowgeomError("the model's logits are NaN, so no perplexity exists; its weights hold NaN or overflow: "
                            "check the checkpoint")
    ppl = math.exp(nll) if nll < 709.0 else math.inf  # exp overflows a float beyond ~709.78: report inf, not crash
    return {"ppl": ppl, "nll": nll, "targets": count, "windows": len(spans), "tokens": len(ids),
            "context": config.context, "stride": config.stride or config.context,
            "seconds": time.perf_counter() - t0}
