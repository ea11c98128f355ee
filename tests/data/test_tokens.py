"""Token ids of a text's start from a prefix of it: the whole text's ids, for the BPE tokenizer calibration uses."""

from __future__ import annotations

import pytest

from flowgeom.data.text import load_text
from flowgeom.data.tokens import leading_ids, load_tokenizer, token_ids


@pytest.fixture(scope="module")
def smollm2():
    from flowgeom.io.builtin import builtin_path

    return load_tokenizer(builtin_path("builtin:smollm2"))


@pytest.mark.parametrize("name", ["kjv+pydoc", "fortunes"])
def test_leading_ids_are_the_start_of_the_whole_texts_ids(smollm2, name, tmp_path):
    text = load_text(name, split="train")
    whole = token_ids(text, smollm2, cache=tmp_path)  # the whole text encoded (1.8 M tokens for kjv+pydoc)
    for n in (1, 1000, 16384, 40000):
        assert leading_ids(text, smollm2, n).tolist() == whole[:n].tolist(), n


def test_leading_ids_of_a_short_text_are_all_its_ids_and_cuts_inside_runs_of_spaces_agree(smollm2):
    text = "In the beginning God created the heaven and the earth.\n\n\n   And the earth was without form;\n" * 200
    whole = smollm2.encode(text, add_special_tokens=False).ids
    assert leading_ids(text, smollm2, 10 ** 6).tolist() == whole
    for n in (7, 300, 1500):
        assert leading_ids(text, smollm2, n).tolist() == whole[:n], n
