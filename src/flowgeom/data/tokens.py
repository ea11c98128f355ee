"""Real sub-word tokens for language-model evaluation: the GGUF's own BPE tokenizer, and a disk cache of ids.

A llama.cpp GGUF carries its tokenizer as metadata: ``tokenizer.ggml.tokens``
(id -> byte-level string), ``tokenizer.ggml.merges`` (``"a b"`` pairs, best
first) and ``tokenizer.ggml.token_type`` (3 = control). For
``tokenizer.ggml.model == "gpt2"`` (SmolLM2) this is GPT-2 byte-level BPE;
:func:`gguf_tokenizer` builds it with the ``tokenizers`` library the same way
``transformers`` does (``GPT2Tokenizer``: BPE with no continuing prefix, a
ByteLevel pre-tokenizer without prefix space, ByteLevel decoder; control
tokens added as special tokens), in ~1 s instead of transformers' 40 s. The
slow test checks that both give the same ids on the KJV held-out split.
No BOS is prepended (SmolLM2's ``add_bos_token`` is false).

``cached_ids(text, tokenizer)`` stores the ids as ``.npy`` (int32, loaded with
``allow_pickle=False``) under ``$FLOWGEOM_CACHE`` (default
``~/.cache/flowgeom``) ``/tokens/<sha256(text)[:16]>-<sha256(tokenizer)[:16]>.npy``,
written atomically; a cache file that does not parse is recomputed.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np

from flowgeom.errors import FlowgeomError, require
from flowgeom.files import read_npy, read_text
from flowgeom.limits import file_int

MAX_TOKENIZER = 2**28  # bytes of tokenizer.json (the largest real ones are ~35 MB)
CONTROL = 3  # llama.cpp token type of control tokens (<|endoftext|>, <|im_start|> ...)


def gguf_tokenizer(metadata: dict):
    """A ``tokenizers.Tokenizer`` from a GGUF's metadata (byte-level BPE, ``tokenizer.ggml.model == gpt2``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise FlowgeomError(f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2', "
                            "as in SmolLM2, Llama 3, Qwen2)")
    tokens, merges = metadata.get("tokenizer.ggml.tokens"), metadata.get("tokenizer.ggml.merges")
    if not tokens or not merges:
        raise FlowgeomError("the GGUF holds no tokenizer.ggml.tokens / merges; it carries no tokenizer")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in ("default", "gpt2", "smollm", "starcoder"):
        raise FlowgeomError(f"GGUF pre-tokenizer {pre!r} is not supported (its split regex differs from GPT-2's); "
                            "supported: default, gpt2, smollm, starcoder")
    fix = "the GGUF's tokenizer metadata is corrupt or forged: re-download or re-convert it"
    kinds = metadata.get("tokenizer.ggml.token_type") or ()
    for key, value, item in (("tokens", tokens, str), ("merges", merges, str), ("token_type", kinds, int)):
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, item) and not isinstance(v, bool)
                                                           for v in value):
            raise FlowgeomError(f"GGUF metadata tokenizer.ggml.{key} must be a list of {item.__name__}, got "
                                f"{type(value).__name__}; {fix}")
    file_int(len(tokens), "vocab_size", where="GGUF metadata tokenizer.ggml.tokens (count)", fix=fix)
    bad = next((m for m in merges if len(m.split(" ")) != 2), None)
    if bad is not None:
        raise FlowgeomError(f"GGUF merge {bad[:40]!r} is not two tokens separated by one space; {fix}")
    try:
        tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges],
                            dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own Exception type
        raise FlowgeomError(f"the GGUF tokenizer cannot be built ({' '.join(str(exc).split())[:200]}); {fix}") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, kinds) if k == CONTROL]
    if control:
        tok.add_special_tokens(control)
    return tok


def load_tokenizer(spec: str | Path):
    """The tokenizer of a model: a GGUF's metadata, or ``tokenizer.json`` in an HF folder."""
    from tokenizers import Tokenizer

    from flowgeom.io import is_gguf, local_path, open_gguf

    path = local_path(spec)
    if path.is_dir() and os.path.lexists(path / "tokenizer.json"):  # a FIFO or device is refused, not skipped
        text = read_text(path / "tokenizer.json", "tokenizer.json", limit=MAX_TOKENIZER,
                         fix="copy the original model's tokenizer.json there")
        try:
            return Tokenizer.from_str(text)
        except Exception as exc:  # the tokenizers library raises its own Exception type
            raise FlowgeomError(f"{path / 'tokenizer.json'} is not a readable tokenizer ({exc}); "
                                "re-export it") from None
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise FlowgeomError(f"folder {path} holds no tokenizer.json and not exactly one .gguf; the model's "
                                "tokenizer is needed to evaluate it: copy the original model's tokenizer.json "
                                "there, or pass the folder with --compare after a reference model that has one")
        path = ggufs[0]
    if not is_gguf(path):
        raise FlowgeomError(f"no tokenizer found for {spec}; pass a .gguf or a folder with tokenizer.json")
    with open_gguf(path) as gguf:
        return gguf_tokenizer(gguf.metadata)  # decodes the tokenizer entries while the file is open


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON: two tokenizers with the same hash give the same ids."""
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("FLOWGEOM_CACHE") or Path.home() / ".cache" / "flowgeom") / "tokens"


def _digest(key: str, ids: np.ndarray) -> str:
    """sha256 (16 hex) of a cache entry's key and ids: binds the ids to the text and tokenizer they came from."""
    return hashlib.sha256(key.encode() + np.ascontiguousarray(ids, dtype="<i4").tobytes()).hexdigest()[:16]


def cached_ids(text: str, tokenizer, *, cache: Path | None = None) -> np.ndarray:
    """Token ids (int32, no special tokens added) of ``text``, from the disk cache or computed and stored.

    An entry is ``KEY-DIGEST.npy``: KEY hashes the text and the tokenizer, DIGEST hashes KEY and the ids. An
    entry whose ids do not hash to its DIGEST (damaged, truncated, or edited by hand) is ignored and rewritten.
    """
    from flowgeom.runs import atomic_write_bytes

    key = f"{hashlib.sha256(text.encode()).hexdigest()[:16]}-{tokenizer_fingerprint(tokenizer)[:16]}"
    folder = cache or cache_dir()
    most = len(text.encode())  # byte-level tokenizers give at most one id per byte: a larger entry is forged
    for path in sorted(folder.glob(f"{key}-*.npy")) if folder.is_dir() else []:
        if not path.is_file():
            continue
        try:
            ids = read_npy(path, "token cache entry", fix="it is recomputed", limit=4 * most + 4096,
                           check=lambda shape: require(len(shape) == 1 and shape[0] <= most, "not a list of ids"))
        except (OSError, ValueError):  # FlowgeomError included
            continue  # damaged or forged cache file: recompute and overwrite
        if ids.dtype == np.int32 and ids.ndim == 1 and path.stem == f"{key}-{_digest(key, ids)}":
            return ids
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    try:
        atomic_write_bytes(folder / f"{key}-{_digest(key, ids)}.npy", buf.getvalue())
    except (OSError, FlowgeomError):
        pass  # a read-only cache only costs time
    return ids


LEADING_MARGIN = 256  # ids a prefix must hold past the ones asked for: the cut's own pre-token stays clear of them


def leading_ids(text: str, tokenizer, n: int):
    """The first ``n`` token ids of ``text`` as a torch int64 tensor (all of them when it has fewer), from a
    prefix of it: the ids the whole text's encoding starts with.

    A tokenizer cuts text into pre-tokens (words, runs of spaces, punctuation, added tokens) and encodes each
    on its own, so a prefix gives the whole text's ids except in the pre-token it cuts. The prefix, ending at a
    line break, doubles from ``8 n`` characters until it holds ``n +`` :data:`LEADING_MARGIN` ids and a longer
    prefix, cut mid-line, agrees with it on the first ``n``. Encoding only that much matters: the calibration
    mix kjv+pydoc is 1.8 M tokens, whose encoding takes 6 s and 0.75 GB (a ``tokenizers`` Encoding keeps a string
    and offsets per token) to give the 16,384 ids calibration uses.
    """
    import torch

    def encode(part: str) -> list[int]:
        return tokenizer.encode(part, add_special_tokens=False).ids

    size = max(4096, 8 * n)
    while 2 * size < len(text):
        cut = text.rfind("\n", 0, size) + 1 or size
        first = encode(text[:cut])
        if len(first) >= n + LEADING_MARGIN and encode(text[:2 * size])[:n] == first[:n]:
            return torch.tensor(first[:n], dtype=torch.int64)
        size *= 2
    return torch.tensor(encode(text)[:n], dtype=torch.int64)


def token_ids(text: str, tokenizer, *, cache: Path | None = None):
    """:func:`cached_ids` as a torch int64 tensor (N,), what the perplexity evaluation takes."""
    import torch

    return torch.from_numpy(cached_ids(text, tokenizer, cache=cache).astype("int64"))

