"""Shipped texts by name: ``pydoc`` (the Python reference's prose) and ``A+B`` mixes (data/text.py)."""

from __future__ import annotations

import re

import pytest

from flowgeom.data.text import CHUNK, check_text, is_named, load_text
from flowgeom.errors import FlowgeomError


def _shingles(text: str, n: int = 10) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_pydoc_splits_are_disjoint_english_prose():
    parts = {s: load_text("pydoc", split=s) for s in ("train", "valid", "test")}
    assert len(parts["train"]) > 300_000 and all(len(t) > 1000 for t in parts.values())
    # no topic in two splits (topics quote one another, so a shared phrase is allowed; a shared topic is not)
    assert parts["test"][:2000] not in parts["train"] and parts["valid"][:2000] not in parts["train"]
    assert parts["train"].count(" the ") > 2000  # prose, not a table of code


def test_a_mix_alternates_chunks_in_equal_shares_the_shorter_repeating():
    kjv, pydoc = load_text("kjv", split="test"), load_text("pydoc", split="test")
    mix = load_text("kjv+pydoc", split="test")
    assert mix.startswith(kjv[:CHUNK]) and pydoc[:CHUNK] in mix[: 3 * CHUNK]
    # kjv's test split is longer: all of it is there once, chunk for chunk with pydoc's, which cycles (2 chunks)
    assert mix.count(kjv[-200:]) == 1 and mix.count(kjv[CHUNK * 10: CHUNK * 10 + 200]) == 1
    kjv_chunks = len(kjv) // CHUNK
    assert abs(mix.count(pydoc[:200]) - kjv_chunks / 2) <= 2
    assert load_text("kjv+pydoc", split="test") == mix  # deterministic


def test_the_out_of_domain_text_shares_no_10_word_shingle_with_the_calibration_mix():
    fortunes = _shingles(load_text("fortunes"))
    assert not fortunes & _shingles(load_text("pydoc", split="train"))


def test_names_and_paths(tmp_path):
    assert is_named("kjv") and is_named("kjv+pydoc") and not is_named("kjv+novel")
    (tmp_path / "t.txt").write_text("hello")
    check_text(str(tmp_path / "t.txt"), "--calib")
    with pytest.raises(FlowgeomError, match=r"--calib kjv\+novel is neither a shipped text .*kjv, fortunes, pydoc"):
        check_text("kjv+novel", "--calib")
