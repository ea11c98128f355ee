"""Calibration: the input Gram of every projection of a causal LM, and the hidden-state statistics of pruning.

**What is measured.** Calibration text is cut into ``seq_len``-token sequences
(:func:`calibration_ids`) and run through the model block by block. In block l
four inputs are seen (:data:`~flowgeom.compress.arch.INPUT_GROUPS`): the
attention input (after its norm; read by q, k, v), the input of o, the MLP
input (read by gate and up) and the input of down. Each one's Gram ``X^T X`` accumulates in
float64, chunk by chunk (:data:`GRAM_KEYS`): a chunk's product is formed in the
activations' own precision (at most a few thousand rows each, as SVD-LLM
forms its Grams; a float64 product of the 1536-wide down_proj input was half
of SmolLM2's calibration time) and summed in float64, so rounding does not
grow with the number of calibration tokens.

**Streamed, one block at a time.** The hidden states of all sequences
(N x d floats) move from block to block, so memory holds one block's
activations, never the whole model's. In the *sequential* variant (SVD-LLM and
Basis Sharing at high ratios) ``on_group(layers, grams)`` may replace the
weights of a group of blocks after their Grams are measured; the group's input
is then propagated again through the compressed blocks, so every later Gram
is measured on the activations the compressed model really produces.

**Pruning statistics** come from the same pass, on the first
:data:`PRUNE_TOKENS` tokens: the cosine of every token's hidden state before
and after each block (ShortGPT's Block Influence ``BI_l = 1 - mean cos``) and
the angular distance ``arccos(cos)/π`` between the inputs of blocks l and l+n
for every n (Gromov et al.'s criterion for dropping n consecutive blocks).

**On disk, one block at a time.** Every block's Grams are complete once
the block has run, and nothing later needs them all at once, so with a
``store`` (:class:`~flowgeom.compress.store.GramFiles`) each block's Grams go
to disk as soon as they are complete and are read back when a plan uses them:
SmolLM2's 0.8 GB of float64 Grams never sit in memory together.

**Cache.** :func:`cached_calibration` keeps the non-sequential result in
``$FLOWGEOM_CACHE/grams/<key>/`` (one ``<block>.safetensors`` per block and
``calibration.json`` with the pruning statistics; measured into a scratch
folder that is renamed into place when complete), keyed by the sha256 of the
model's weights, of the token ids and of ``seq_len``; the stored key is
checked on read, and a folder that is incomplete, does not parse or does not
match is measured again.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flowgeom.compress.arch import HF_NAMES, INPUT_GROUPS, ROLE_GRAM, weight_key
from flowgeom.compress.arch import runner as runner_of
from flowgeom.compress.store import GramFiles, TensorFiles, cache_root
from flowgeom.errors import FlowgeomError
from flowgeom.memory import trim_heap

# Gram name -> (Llama's module whose input it is, the roles that read it)
GRAM_KEYS = {key: (HF_NAMES[roles[0]], roles) for key, roles in INPUT_GROUPS.items()}
PRUNE_TOKENS = 2048  # tokens whose hidden states feed BI and the angular distances
DEFAULT_TOKENS = 16384  # > 10x the widest projection input of SmolLM2 (1,536): Grams full rank and well conditioned
FORMAT = "flowgeom-calibration-2"


@dataclass
class Calibration:
    """``grams[l][key]`` (float64, (n, n)) per block and :data:`GRAM_KEYS` key (a list in memory, or
    :class:`~flowgeom.compress.store.GramFiles` read block by block); ``tokens`` seen; ``block_influence[l]``;
    ``angular[n][l]`` = angular distance between the inputs of blocks l and l+n."""

    grams: Sequence[dict[str, torch.Tensor]]
    tokens: int
    seq_len: int
    block_influence: list[float]
    angular: dict[int, list[float]]

    def role_grams(self, role: str, layers: Sequence[int]) -> torch.Tensor:
        """The Grams role ``role`` sees in ``layers``, stacked (g, n, n)."""
        return torch.stack([self.grams[l][ROLE_GRAM[role]] for l in layers])


def calibration_ids(source: Path, calib: str, tokens: int, seq_len: int, tokenizer) -> torch.Tensor:
    """(S, seq_len) calibration ids from ``calib``: the train split of a shipped text (``kjv``, ``kjv+pydoc``
    ...), or a UTF-8 file; only the prefix that holds them is tokenised (:func:`flowgeom.data.tokens.leading_ids`)."""
    from flowgeom.data.text import check_text, load_text
    from flowgeom.data.tokens import leading_ids

    if tokenizer is None:
        raise FlowgeomError(f"{source} has no tokenizer, so calibration text cannot be tokenised; copy the original "
                            "model's tokenizer.json into it, or use --method svd (data-free)")
    check_text(calib, "--calib")
    text = load_text(calib, split="train")
    if not text.strip():
        raise FlowgeomError(f"--calib {calib} holds no text; pass a UTF-8 text of at least --calib-tokens tokens")
    ids = leading_ids(text, tokenizer, tokens if isinstance(tokens, int) and tokens > 0 else len(text))
    return sequences(ids, tokens, seq_len)


def sequences(ids: torch.Tensor, n_tokens: int, seq_len: int) -> torch.Tensor:
    """The first ``n_tokens`` ids cut into (S, seq_len) rows; refused with the numbers when the text is short."""
    if not isinstance(n_tokens, int) or n_tokens < seq_len:
        raise FlowgeomError(f"--calib-tokens {n_tokens!r} is below one sequence of {seq_len} tokens; pass more")
    if len(ids) < n_tokens:
        raise FlowgeomError(f"the calibration text has {len(ids):,} tokens, fewer than --calib-tokens "
                            f"{n_tokens:,}; pass a longer --calib text or a smaller --calib-tokens")
    S = n_tokens // seq_len
    return ids[: S * seq_len].long().reshape(S, seq_len)


def input_widths(state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Gram key -> width of that input in block 0 (the widest decides how many calibration tokens are needed)."""
    out = {}
    for key, roles in INPUT_GROUPS.items():
        found = [state[weight_key(0, r)] for r in roles if weight_key(0, r) in state]
        if found:
            out[key] = int(found[0].shape[1])
    return out


def check_rank(widths: dict[str, int], tokens: int) -> None:
    """A Gram of n-dimensional inputs from fewer than n tokens cannot be whitened: refuse with the count."""
    widest = max(widths.values())
    if tokens < widest:
        key = max(widths, key=widths.get)
        raise FlowgeomError(f"{tokens:,} calibration tokens cannot give a full-rank Gram for the {widest}-wide "
                            f"input of {GRAM_KEYS[key][0]}: at least {widest:,} are needed (the default "
                            f"{DEFAULT_TOKENS:,} is safe); pass --calib-tokens {max(widest, 4 * widest):,} or more")


GRAM_ROWS = 512  # rows of a Gram added to the float64 sum at a time: a 23 MB temporary at width 5,632


def gram_hooks(layer: torch.nn.Module, paths: dict[str, str], acc: dict[str, torch.Tensor]) -> list:
    """Pre-hooks on ``layer``'s modules at ``paths`` (Gram key -> module path) adding each input's Gram
    ``X^T X`` to ``acc`` (float64): each batch's product in the activations' precision, added in place
    :data:`GRAM_ROWS` rows at a time (``acc + part`` would hold three float64 Grams at once, 0.76 GB for a
    5,632-wide input). The same sum, bit for bit, in memory (:func:`calibrate`) and streamed."""
    handles = []
    for key, path in paths.items():
        def hook(_m, args, key=key):
            x = args[0].reshape(-1, args[0].shape[-1])  # (B T, n)
            part = x.T @ x  # (n, n)
            if key not in acc:
                acc[key] = part.double()
                return
            for i in range(0, len(part), GRAM_ROWS):
                acc[key][i:i + GRAM_ROWS] += part[i:i + GRAM_ROWS].double()
        handles.append(layer.get_submodule(path).register_forward_pre_hook(hook))
    return handles


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(a.double(), b.double(), dim=-1).clamp(-1, 1)


@torch.inference_mode()
def calibrate(model, ids: torch.Tensor, *, groups: Sequence[Sequence[int]] | None = None, batch: int = 4,
              on_group: Callable[[list[int], list[dict[str, torch.Tensor]]], None] | None = None,
              progress: Callable[[int, int], None] | None = None, store: GramFiles | None = None) -> Calibration:
    """Grams and pruning statistics of a causal LM (flowgeom's Llama or any family of
    :mod:`flowgeom.compress.arch`) on ``ids`` (S, T) sequences, block by block (module docstring). ``groups``:
    consecutive blocks compressed together (default: one group per block); ``on_group(layers, their grams)``
    (sequential variant) may change those blocks' weights before their output is propagated. ``store``
    (:class:`~flowgeom.compress.store.GramFiles`): each group's Grams go there once the group is done, and the
    result reads them from it; default: all in memory."""
    runner = runner_of(model)
    paths = runner.arch.input_paths()
    L = len(runner)
    groups = [[l] for l in range(L)] if groups is None else [list(g) for g in groups]
    if [l for g in groups for l in g] != list(range(L)):
        raise FlowgeomError(f"calibration groups {groups} do not cover the {L} blocks in order")
    S, T = ids.shape
    param = next(model.parameters())
    h = runner.embed(ids.to(param.device))  # (S, T, d)
    for size in {min(batch, S - i) for i in range(0, S, batch)}:
        runner.prepare(size, T, h.dtype, h.device)  # before any Gram hook exists
    keep = max(1, min(S, math.ceil(PRUNE_TOKENS / T)))  # sequences whose states feed the pruning statistics
    grams: list[dict[str, torch.Tensor]] = [dict() for _ in range(L)]
    inputs = [h[:keep].reshape(-1, h.shape[-1]).clone()]  # the state entering each block, then the last output

    def run(l: int, x: torch.Tensor, acc: dict | None) -> torch.Tensor:
        handles = [] if acc is None else gram_hooks(runner.layers[l], paths, acc)
        try:
            return torch.cat([runner.block(l, x[i:i + batch]) for i in range(0, S, batch)])
        finally:
            for handle in handles:
                handle.remove()

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x[:keep].reshape(-1, x.shape[-1]).clone()

    done = 0
    for group in groups:
        start, states = h, []
        for l in group:
            h = run(l, h, grams[l])
            states.append(flat(h))
            trim_heap()  # one block's activations freed: the next block's come from returned pages
            done += 1
            if progress:
                progress(done, L)
        if on_group is not None:
            on_group(group, [grams[l] for l in group])
            h, states = start, []
            for l in group:  # the compressed blocks' own outputs feed what follows
                h = run(l, h, None)
                states.append(flat(h))
        inputs.extend(states)
        if store is not None:
            for l in group:
                store.put(l, grams[l])
                grams[l] = {}
    bi = [1.0 - float(_cos(inputs[l], inputs[l + 1]).mean()) for l in range(L)]
    angular = {n: [float((torch.arccos(_cos(inputs[l], inputs[l + n])) / math.pi).mean()) for l in range(L - n + 1)]
               for n in range(1, L)}
    return Calibration(grams if store is None else store, S * T, T, bi, angular)


# ---------------------------------------------------------------- disk cache

def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the names, shapes, dtypes and bytes of a state dict (sorted by name)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        digest.update(f"{name}|{list(t.shape)}|{t.dtype}|".encode())
        digest.update(t.view(torch.uint8).numpy() if t.numel() else b"")  # the tensor's own bytes, no copy
    return digest.hexdigest()


def calibration_key(state: dict[str, torch.Tensor], ids: torch.Tensor) -> str:
    """The cache key of a calibration: sha256 of the weights, the (S, T) token ids and the format."""
    digest = hashlib.sha256(f"{FORMAT}|{weights_digest(state)}|{list(ids.shape)}|".encode())
    digest.update(ids.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def cache_dir() -> Path:
    return cache_root() / "grams"


META = "calibration.json"  # a cache entry's key, token count and pruning statistics, beside its blocks' Grams


def save_meta(folder: Path, calib: Calibration, key: str) -> None:
    """``calibration.json`` of a calibration whose Grams are already in ``folder``."""
    from flowgeom.runs import atomic_write_json

    meta = {"key": key, "format": FORMAT, "tokens": calib.tokens, "seq_len": calib.seq_len,
            "layers": len(calib.grams), "block_influence": calib.block_influence,
            "angular": {str(n): v for n, v in calib.angular.items()}}
    atomic_write_json(folder / META, meta, root=folder)


def load_calibration(folder: Path, key: str, n_layers: int) -> Calibration | None:
    """The calibration cached in ``folder`` when it is complete and was stored for ``key``, else None; its
    Grams are checked here (finite float64, every key, every block) and read again when used."""
    from flowgeom.files import read_json_object

    try:
        meta = read_json_object(folder / META, fix="it is measured again")
        if meta.get("key") != key or meta.get("format") != FORMAT or meta.get("layers") != n_layers:
            return None
        angular = {int(n): [float(x) for x in v] for n, v in meta["angular"].items()}
        grams = GramFiles(TensorFiles(folder), n_layers, key)
        calib = Calibration(grams, int(meta["tokens"]), int(meta["seq_len"]),
                            [float(x) for x in meta["block_influence"]], angular)
    except Exception:  # any damage (truncated, foreign, hand-edited) means: measure again
        return None
    return calib if grams.check(tuple(GRAM_KEYS)) else None


def cached_calibration(model, state: dict[str, torch.Tensor], ids: torch.Tensor, *, cache: Path | None = None,
                       progress: Callable[[int, int], None] | None = None) -> tuple[Calibration, bool]:
    """``(calibration, from_cache)`` of the non-sequential pass; when not cached, measured into a scratch folder
    that then becomes the cache entry."""
    key = calibration_key(state, ids)
    folder = (cache or cache_dir()) / key[:32]
    L = len(runner_of(model))
    found = load_calibration(folder, key, L) if (folder / META).is_file() else None
    if found is not None:
        return found, True
    files = TensorFiles.temporary(durable=True)
    calib = calibrate(model, ids, progress=progress, store=GramFiles(files, L, key))
    try:
        save_meta(files.folder, calib, key)
        files.move(folder)  # the entry appears whole, or not at all
    except (OSError, FlowgeomError):
        pass  # a read-only cache only costs time: the Grams stay in scratch for this run
    return calib, False


# ---------------------------------------------------------------- calibration gradients

def logits_of(model, ids: torch.Tensor, *, root: bool = False, runner=None) -> torch.Tensor:
    """The model's logits (B, T, vocab) block by block, as :func:`calibrate` runs it. ``root``: the
    embeddings start an autograd graph, so every projection's output gets a gradient while no weight needs one."""
    runner = runner or runner_of(model)
    h = runner.embed(ids)  # (B, T, d)
    if root:
        h = h.detach().requires_grad_()
    for l in range(len(runner)):
        h = runner.block(l, h)
    return runner.head(h)


GRAD_TOKENS = 4096  # calibration tokens whose gradients score the components (8 sequences of 512)


def sensitivity(model, ids: torch.Tensor, probes: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], *,
                batch: int = 2, progress: Callable[[int, int], None] | None = None
                ) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], float]:
    """First- and second-order loss estimates of removing rank-one pieces of the projections
    (:mod:`flowgeom.compress.allocate` has the maths), and the model's calibration loss.

    ``probes[(layer, role)] = (P (m, r), Q (r, n))``: removing piece i changes that projection's weight by
    ``-P[:, i] Q[i, :]``. L is the mean next-token NLL over all of ``ids`` (S, T), float32; per token t of
    the projection's input ``x_t`` and output gradient ``g_t = ∂L/∂y_t``, with ``a = g P`` and ``b = x Q^T``:
    ``first = -sum_t a_t * b_t`` and ``fisher = (N/2) sum_t (a_t * b_t)^2`` (N targets), each (r,).

    **Block by block** (gradient checkpointing at block boundaries): a forward pass keeps only each block's
    input; the loss is backpropagated to the last block's output, then each block, last first, is run again
    from its kept input and backpropagated alone, with the probes of that block read (``probes`` may be a lazy
    mapping, :class:`flowgeom.compress.plan.Probes`). The recomputed block runs the same operations on the
    same input in the same grad mode as the first pass, so every gradient is the one a whole-model backward
    gives; the head and the loss run one sequence at a time (each row's gradient does not depend on the others,
    the loss is summed in another order: equal to rounding). Memory: the blocks' inputs, one block's activations
    and one sequence's logits (no gradient for the weights, no logits for the last position, which predicts
    nothing), where a whole-model backward held every block's activations (~0.8 GB a sequence of 512 tokens
    on SmolLM2) and the logits of the batch (0.8 GB with their gradients at 2 x 512 tokens).
    """
    runner = runner_of(model)
    S, T = ids.shape
    n_targets = S * (T - 1)
    by_layer: dict[int, list[str]] = {}
    for layer, role in probes:
        by_layer.setdefault(layer, []).append(role)
    first: dict[tuple[int, str], torch.Tensor] = {}
    fisher: dict[tuple[int, str], torch.Tensor] = {}
    live: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # the probes of the block being backpropagated
    handles = []

    def watch(layer: int, role: str):
        rows = runner.arch.slots[role].rows  # the role's outputs inside a fused projection

        def forward_hook(_m, args, out):
            if role not in live:  # the first, graph-free pass
                return
            x = args[0].detach()

            def on_grad(g):
                with torch.no_grad():
                    P, Q = live[role]
                    g = g if rows is None else g[..., list(rows)]
                    ab = (g.reshape(-1, g.shape[-1]) @ P) * (x.reshape(-1, x.shape[-1]) @ Q.T)  # (B T, r)
                    key = (layer, role)
                    if key not in first:
                        first[key] = torch.zeros(P.shape[1], dtype=torch.float64)
                        fisher[key] = torch.zeros(P.shape[1], dtype=torch.float64)
                    first[key].sub_(ab.sum(0).double())
                    fisher[key].add_(ab.double().square().sum(0) * (n_targets / 2))
            out.register_hook(on_grad)
        return forward_hook

    for size in {min(batch, S - i) for i in range(0, S, batch)}:
        runner.prepare(size, T, next(model.parameters()).dtype)  # before the probes' hooks exist
    for layer, roles in by_layer.items():
        for role in roles:
            module = runner.layers[layer].get_submodule(runner.arch.slots[role].path)
            handles.append(module.register_forward_hook(watch(layer, role)))
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    total = 0.0
    try:
        for i in range(0, S, batch):
            x = ids[i:i + batch]
            inputs = [runner.embed(x).detach()]  # (B, T, d) entering each block, then the last block's output
            for l in range(len(runner)):  # as logits_of(root=True) runs it, the graph dropped block by block
                inputs.append(runner.block(l, inputs[-1].requires_grad_()).detach())
            h = inputs.pop().requires_grad_()
            for b in range(len(x)):  # one sequence's logits at a time, (T-1, vocab): the last position predicts nothing
                loss = F.cross_entropy(runner.head(h[b, :-1]).float(), x[b, 1:], reduction="sum") / n_targets
                loss.backward()
                total += float(loss.detach())
            grad = h.grad
            del loss, h
            trim_heap()
            for l in reversed(range(len(runner))):
                live.update({role: tuple(t.float() for t in probes[(l, role)]) for role in by_layer.get(l, ())})
                h = inputs.pop().requires_grad_()
                runner.block(l, h).backward(grad)
                grad = h.grad
                live.clear()
                del h
                trim_heap()
            if progress:
                progress(min(i + batch, S), S)
    finally:
        live.clear()
        for handle in handles:
            handle.remove()
        for p, flag in zip(model.parameters(), flags):
            p.requires_grad_(flag)
    out = {}
    for key in probes:
        if key not in first:  # no gradient reached it: nothing removed there changes the loss
            r = probes[key][0].shape[1]
            first[key], fisher[key] = torch.zeros(r, dtype=torch.float64), torch.zeros(r, dtype=torch.float64)
        out[key] = (first[key], fisher[key])
    return out, total
