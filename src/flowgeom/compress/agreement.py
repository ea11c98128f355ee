"""Does a compressed model still behave like its source? Teacher-forced agreement and greedy generation health.

Perplexity can read 1.3x while every greedy continuation loops, so a
compression is also judged by what a user gets from it, against the dense
source ("reference") on the same text and prompts:

**Teacher-forced agreement** (on the evaluation text, the windows of
:func:`flowgeom.compress.perplexity.windows`; both models read the same true
tokens): at every scored position ``j``,

* top-1 agreement: ``argmax p_ref(. | t_<j) == argmax p_model(. | t_<j)``, averaged over positions;
* ``KL(p_ref || p_model) = sum_v p_ref(v) (log p_ref(v) - log p_model(v))`` (nats), averaged over positions.

**Generation health** (``N`` prompts from a held-out text, :func:`prompts_from`;
each continued greedily by exactly ``new_tokens`` tokens, end-of-text tokens
included: every model writes the same number of tokens):

* a continuation *loops* when some token 3-gram occurs at least 3 times in it
  (:func:`loops`); the **loop fraction** is the fraction of prompts whose
  continuation loops. Three occurrences of a 3-gram within 48 tokens is the
  phrase "I am a slave, I am a slave, I am a slave": ordinary prose repeats a
  3-gram twice at most in so short a span;
* **distinct-2** (Li et al. 2016) of one continuation is its distinct token
  2-grams over its 2-grams; the reported value is the mean over prompts;
* **prefix agreement**: the number of leading new tokens a model's greedy
  continuation shares with the reference's, averaged over prompts (48 = the
  same text, 0 = it parts at once).

The reference scored against itself gets top-1 1, KL 0 and prefix agreement
``new_tokens`` (tested).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flowgeom.errors import FlowgeomError, positive_int

LOOP_N, LOOP_REPEATS = 3, 3  # a continuation loops when a 3-gram occurs >= 3 times
DISTINCT_N = 2


@dataclass(frozen=True)
class GenerationConfig:
    prompts: int = 24  # held-out prompts
    prompt_words: int = 8  # words of each prompt (the opening of a paragraph of the text)
    new_tokens: int = 48  # greedy tokens per prompt
    text: str = "fortunes"  # where the prompts come from (out of domain: never calibrated or healed on)

    def __post_init__(self):
        positive_int(self.prompts, "--prompts")
        positive_int(self.prompt_words, "prompt words")
        positive_int(self.new_tokens, "--new-tokens")


# ---------------------------------------------------------------- pure metrics of token lists

def loops(tokens: Sequence[int], *, n: int = LOOP_N, repeats: int = LOOP_REPEATS) -> bool:
    """Whether some n-gram of ``tokens`` occurs at least ``repeats`` times (overlapping occurrences count)."""
    grams = Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))
    return bool(grams) and max(grams.values()) >= repeats


def distinct(tokens: Sequence[int], *, n: int = DISTINCT_N) -> float:
    """Distinct n-grams over n-grams of one sequence (1.0 for a sequence shorter than n + 1 tokens)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if len(grams) > 1 else 1.0


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def generation_health(continuations: Sequence[Sequence[int]],
                      reference: Sequence[Sequence[int]] | None = None) -> dict[str, float]:
    """``loop_fraction``, ``distinct2`` and (given the reference's continuations of the same prompts)
    ``prefix_agreement`` of a model's continuations (module docstring)."""
    if not continuations:
        raise FlowgeomError("no continuations to score; pass at least one prompt")
    out = {"loop_fraction": sum(loops(c) for c in continuations) / len(continuations),
           "distinct2": sum(distinct(c) for c in continuations) / len(continuations)}
    if reference is not None:
        if len(reference) != len(continuations):
            raise FlowgeomError(f"{len(continuations)} continuations against {len(reference)} reference ones")
        out["prefix_agreement"] = sum(shared_prefix(c, r) for c, r in zip(continuations, reference)) / len(reference)
    return out


def prompts_from(text: str, count: int, words: int) -> list[str]:
    """``count`` prompts, each the first ``words`` words of a paragraph (blank-line separated) of ``text`` with at
    least ``words + 4`` words, taken evenly over the text's paragraphs (deterministic: no seed)."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if len(p.split()) >= words + 4]
    if len(paragraphs) < count:
        raise FlowgeomError(f"the prompt text has {len(paragraphs)} paragraphs of {words + 4}+ words, fewer than "
                            f"--prompts {count}; ask for fewer prompts")
    step = len(paragraphs) / count
    return [" ".join(paragraphs[int(i * step)].split()[:words]) for i in range(count)]


# ---------------------------------------------------------------- models

def _next_logits(model, ids: torch.Tensor, state):
    """Logits (B, vocab) of the last position and the decoding state after reading ``ids`` (B, T): flowgeom's
    Llama through its :class:`~flowgeom.nn.llama.KVCache`, a transformers model through ``past_key_values``."""
    from flowgeom.nn.llama import KVCache, LlamaForCausalLM

    if isinstance(model, LlamaForCausalLM):
        cache = KVCache() if state is None else state
        return model(ids, cache=cache)[:, -1], cache
    out = model(input_ids=ids, past_key_values=state, use_cache=True)
    return out.logits[:, -1], out.past_key_values


@torch.inference_mode()
def continue_tokens(model, prompt: torch.Tensor, new_tokens: int, *, temperature: float = 0.0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """``new_tokens`` tokens (B, new_tokens) after ``prompt`` (B, T0), with a KV cache: greedy at
    ``temperature`` 0, else sampled from ``softmax(logits / temperature)`` with ``generator``."""
    logits, state = _next_logits(model, prompt, None)
    out = []
    for i in range(new_tokens):
        if temperature > 0:
            probs = F.softmax(logits.float() / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
        else:
            token = logits.argmax(-1, keepdim=True)  # (B, 1)
        out.append(token)
        if i + 1 < new_tokens:
            logits, state = _next_logits(model, token, state)
    return torch.cat(out, dim=1)


def greedy_continuations(model, prompts: Sequence[Sequence[int]], new_tokens: int, *,
                         progress: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """Each prompt's greedy continuation; prompts of equal length run as one batch (decoding is bound by reading
    the weights, so a batch costs about what one row costs). A prompt longer than the model's positions allow
    beside ``new_tokens`` keeps its last tokens."""
    positions = getattr(model.config, "max_position_embeddings", None)
    room = new_tokens if positions is None else positions - new_tokens  # prompt tokens that fit beside the new ones
    if room < 1:
        raise FlowgeomError(f"{new_tokens} new tokens leave no room for a prompt in the model's {positions} "
                            "positions; ask for fewer --new-tokens")
    device = next(model.parameters()).device
    cut = [list(p)[-room:] if positions is not None else list(p) for p in prompts]  # a long prompt keeps its end
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(cut):
        by_length.setdefault(len(p), []).append(i)
    out: list[list[int]] = [[] for _ in cut]
    done = 0
    for rows in by_length.values():  # prompts of one length decode together: one weight read per step for all
        tokens = continue_tokens(model, torch.tensor([cut[i] for i in rows], device=device), new_tokens)
        for i, row in zip(rows, tokens.tolist()):
            out[i] = row
        done += len(rows)
        if progress:
            progress(done, len(prompts))
    return out


@torch.inference_mode()
def teacher_forced_agreement(model, reference, ids: torch.Tensor, config) -> dict[str, float]:
    """``{"top1", "kl", "positions"}`` of ``model`` against ``reference`` on ``ids`` (N,), in the windows of
    ``config`` (an :class:`~flowgeom.compress.perplexity.EvalConfig`), every scored position once."""
    from flowgeom.compress.arch import logits as logits_of
    from flowgeom.compress.perplexity import windows

    ids = ids.long()
    if config.max_tokens is not None:
        ids = ids[: config.max_tokens]
    agree, kl, count = 0, 0.0, 0
    for b, e, first in windows(len(ids), config.context, config.stride or config.context):
        x = ids[b:e][None]  # (1, T)
        rows = slice(first - 1 - b, e - 1 - b)  # positions predicting t_first .. t_{e-1}
        log_r = F.log_softmax(logits_of(reference, x)[0, rows].float(), dim=-1)  # (targets, vocab)
        log_m = F.log_softmax(logits_of(model, x)[0, rows].float(), dim=-1)  # (targets, vocab)
        agree += int((log_r.argmax(-1) == log_m.argmax(-1)).sum())
        kl += float((log_r.exp() * (log_r - log_m)).sum())
        count += e - first
    return {"top1": agree / count, "kl": kl / count, "positions": count}


# ---------------------------------------------------------------- targets: what a compression must keep

LOOP_POINTS = 0.10  # loop fraction at most the reference's + 10 points
DISTINCT_RATIO = 0.9  # distinct-2 at least 0.9 x the reference's
TOP1 = 0.80  # teacher-forced top-1 agreement on the out-of-domain text


def meets_targets(agreement: dict, health: dict, reference_health: dict) -> dict[str, bool]:
    """Which generation targets a model meets against its reference (the bar a recommended budget must pass)."""
    checks = {"loops": health["loop_fraction"] <= reference_health["loop_fraction"] + LOOP_POINTS + 1e-12,
              "distinct2": health["distinct2"] >= DISTINCT_RATIO * reference_health["distinct2"] - 1e-12,
              "top1": agreement["top1"] >= TOP1}
    return {**checks, "all": all(checks.values())}


class Judge:
    """The reference's side of every comparison, computed once: the token ids scored teacher-forced, the prompts
    and the reference's greedy continuations; ``judge(model)`` returns the model's agreement, generation health
    and the targets it meets."""

    def __init__(self, reference, ids: torch.Tensor, prompts: Sequence[Sequence[int]], config,
                 generation: GenerationConfig = GenerationConfig()):
        self.reference, self.ids, self.prompts, self.config = reference, ids, [list(p) for p in prompts], config
        self.generation = generation
        self.continuations = greedy_continuations(reference, self.prompts, generation.new_tokens)
        self.health = generation_health(self.continuations)

    def __call__(self, model) -> dict:
        agreement = teacher_forced_agreement(model, self.reference, self.ids, self.config)
        health = generation_health(greedy_continuations(model, self.prompts, self.generation.new_tokens),
                                   self.continuations)
        return {"agreement": agreement, "generation": health,
                "targets": meets_targets(agreement, health, self.health)}
