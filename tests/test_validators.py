"""One validator, one parser: the positive-int check and the KEY=VALUE / boolean reading, library and CLI alike."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgeom.cli import _common
from flowgeom.errors import FlowgeomError, positive_int
from flowgeom.options import FALSE_WORDS, TRUE_WORDS, boolean, key_values

SRC = Path(__file__).resolve().parents[1] / "src" / "flowgeom"


@pytest.mark.parametrize("value", [1, 7, np.int64(3), torch.tensor(4)])
def test_positive_int_accepts_integers(value):
    assert positive_int(value, "n") == int(value) and type(positive_int(value, "n")) is int


@pytest.mark.parametrize("value,got", [
    (0, "got 0"), (-3, "got -3"), (True, "got bool True"), (2.0, "got float 2.0"), ("3", "got str '3'"),
    (None, "got NoneType None"), (torch.tensor(2.0), "got Tensor tensor(2.)"),
])
def test_positive_int_refuses_by_name(value, got):
    with pytest.raises(FlowgeomError) as err:
        positive_int(value, "--workers", fix="pass 1 or more")
    assert str(err.value) == f"--workers must be a whole number >= 1, {got}; pass 1 or more"


def test_positive_int_maximum_and_no_name():
    assert positive_int(5, "n", maximum=5) == 5
    with pytest.raises(FlowgeomError, match=r"^n must be a whole number between 1 and 5, got 6$"):
        positive_int(6, "n", maximum=5)
    with pytest.raises(FlowgeomError, match=r"^must be a whole number >= 1, got 0$"):
        positive_int(0, "")


def test_cli_type_uses_the_same_check_and_wording():
    capped = _common.positive_int(maximum=10)
    assert _common.positive_int("3") == 3 and capped(" 10 ") == 10
    for parse, text, why in ((_common.positive_int, "0", "must be a whole number >= 1, got 0"),
                             (capped, "11", "must be a whole number between 1 and 10, got 11"),
                             (_common.positive_int, "1.5", "expected a whole number, got '1.5'")):
        with pytest.raises(argparse.ArgumentTypeError) as err:
            parse(text)
        assert str(err.value) == why


def test_library_configs_word_it_the_same_way():
    from flowgeom.continuity.analyze import AnalyzeConfig
    from flowgeom.nn.llama import LlamaConfig
    from flowgeom.nn.resmlp import ResMLPConfig

    for build, message in ((lambda: AnalyzeConfig(workers=0), "--workers must be a whole number >= 1, got 0"),
                           (lambda: LlamaConfig(num_hidden_layers=0),
                            "Llama config num_hidden_layers must be a whole number >= 1, got 0"),
                           (lambda: ResMLPConfig(depth=0), "depth must be a whole number >= 1, got 0")):
        with pytest.raises(FlowgeomError) as err:
            build()
        assert str(err.value) == message


def test_the_old_wordings_are_gone():
    """No hand-written positive-int message is left beside the validator."""
    old = re.compile(r"must be (a positive integer|>= 1|≥ 1), got|must be >= 1 and")
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and old.search(node.value):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == []


# ---------------------------------------------------------------- booleans and KEY=VALUE

@pytest.mark.parametrize("word", [*TRUE_WORDS, "ON", " Yes "])
def test_boolean_true_words(word):
    assert boolean(word) is True


@pytest.mark.parametrize("word", [*FALSE_WORDS, "OFF", " No "])
def test_boolean_false_words(word):
    assert boolean(word) is False


def test_on_and_off_mean_the_same_everywhere():
    assert set(TRUE_WORDS) == {"true", "yes", "on", "1"} and set(FALSE_WORDS) == {"false", "no", "off", "0"}
    with pytest.raises(FlowgeomError, match=r"^--set residual: expected true or false \(also yes/no, on/off, 1/0\), "
                                            r"got 'maybe'$"):
        boolean("maybe", "--set residual")
    assert _common.boolean("on") is True and _common.boolean("off") is False  # the argparse type reads the same words
    with pytest.raises(argparse.ArgumentTypeError, match="on/off"):
        _common.boolean("enabled")


def test_key_values_splits_strips_and_refuses():
    assert key_values(["a=1", " train-limit = 5 ", "x=y=z", "e="], flag="--set", example="--set a=1") == \
        {"a": "1", "train_limit": "5", "x": "y=z", "e": ""}
    assert key_values(None, flag="--set", example="") == {}
    cases = [(["width"], "--set expects KEY=VALUE, got 'width' (e.g. --set width=64)"),
             (["=3"], "--set expects KEY=VALUE, got '=3' (e.g. --set width=64)"),
             (["width=3", "width=4"], "--set width given twice; give each key once"),
             (["widht=3"], "--set widht: unknown MLP run option 'widht'; valid: width, depth")]
    for items, message in cases:
        with pytest.raises(FlowgeomError) as err:
            key_values(items, flag="--set", example="--set width=64", known=["width", "depth"], what="MLP run option")
        assert str(err.value) == message


def test_set_reads_booleans_with_the_one_vocabulary():
    from flowgeom.cli.continuity_train import _parse_sets
    from flowgeom.experiments.continuity_mlp import MLPRunConfig

    assert _parse_sets(["residual=off", "width=8"], MLPRunConfig) == {"residual": False, "width": 8}
    assert _parse_sets(["residual=on"], MLPRunConfig) == {"residual": True}
