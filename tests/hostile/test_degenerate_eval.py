"""``compress evaluate`` on degenerate input says what is degenerate instead of reporting a confident number.

* Weights scaled by 1e18: RMSNorm's mean square overflows float32, the norm
  returns 0 and every logit row is uniform, so the perplexity came out as the
  vocabulary size (ppl 256.0002). Now the forward refuses, naming the peak.
* Token ids beyond the embedding: ``IndexError`` from the embedding. Now one
  line naming the id range and the embedding rows; and a planted token cache
  entry (which produced such ids, or other ids) no longer matches its stored
  digest, so it is recomputed instead of trusted.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgeom.compress.write import save_llama_folder
from flowgeom.compress.perplexity import EvalConfig, perplexity
from flowgeom.errors import FlowgeomError
from flowgeom.nn.llama import LlamaConfig, LlamaForCausalLM
from tree_digest import snapshot  # noqa: E402  (tests/hostile is on sys.path)

TINY = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=4, max_position_embeddings=64)


def _model(scale: float = 1.0) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model.eval()


@pytest.fixture
def make_folder(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(31)} | {"[UNK]": 31}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "text.txt").write_text(" ".join(f"w{(7 * i) % 31}" for i in range(200)))

    def make(name: str, scale: float = 1.0) -> Path:
        path = tmp_path / name
        path.mkdir()
        save_llama_folder(path, TINY.to_hf(), _model(scale).state_dict(), tokenizer=tok)
        return path

    return make


def _evaluate(cli, folder: Path, tmp_path: Path, *extra):
    return cli(["compress", "evaluate", folder, "--text", tmp_path / "text.txt", "--context", "8", *extra])


def test_scaled_weights_are_refused_not_scored_as_the_vocabulary_size(make_folder, tmp_path, cli, strict_json):
    good = make_folder("good")
    rc, out, _ = _evaluate(cli, good, tmp_path, "--json")
    assert rc == 0 and strict_json(out)  # the same folder unscaled is scored
    bad = make_folder("scaled", 1e18)
    before = snapshot(tmp_path / "scaled")
    rc, out, err = _evaluate(cli, bad, tmp_path, "--out", tmp_path / "o.json")
    limit = math.sqrt(torch.finfo(torch.float32).max / TINY.hidden_size)
    assert rc == 2 and not out
    assert re.fullmatch(r"flowgeom: error: the forward overflowed float32: hidden states reach \|h\| = \S+, beyond "
                        rf"the {re.escape(f'{limit:.3g}')} RMSNorm can square, so the logits would be meaningless; "
                        r"the weights are broken or wildly scaled: check the checkpoint", err.strip()), err
    assert not (tmp_path / "o.json").exists() and snapshot(tmp_path / "scaled") == before


def test_the_overflow_is_what_the_old_answer_hid():
    """Without the check, the 1e18 model's logits carry nothing: NaN, or rows so flat the ppl is the vocabulary size."""
    model = _model(1e18)
    ids = torch.arange(16) % TINY.vocab_size
    h = model.model.embed_tokens(ids[None])
    for layer in model.model.layers:
        h = layer(h, *__import__("flowgeom.nn.llama", fromlist=["rope_tables"]).rope_tables(TINY, 16, dtype=h.dtype))
    logits = model.lm_head(model.model.norm(h))[0]  # (T, vocab)
    assert not bool(torch.isfinite(logits).all()) or bool((logits == logits[:, :1]).all())
    with pytest.raises(FlowgeomError, match="the forward overflowed float32"):
        perplexity(model, ids, EvalConfig(context=8))
    assert math.isfinite(perplexity(_model(), ids, EvalConfig(context=8))["ppl"])  # the unscaled model is scored


@pytest.mark.parametrize("scale", [1e2, 1e3])
def test_large_but_representable_weights_are_still_scored(scale):
    ids = torch.arange(16) % TINY.vocab_size
    assert math.isfinite(perplexity(_model(scale), ids, EvalConfig(context=8))["nll"])


def test_ids_beyond_the_embedding_are_one_error():
    ids = torch.tensor([1, 2, 3, 40, 5, 6, 7, 8, 9])
    with pytest.raises(FlowgeomError) as info:
        perplexity(_model(), ids, EvalConfig(context=8))
    assert str(info.value).startswith("token ids run from 1 to 40 but the model has 32 token embeddings (ids 0..31)")
    with pytest.raises(FlowgeomError, match="token ids run from -1 to 9"):
        perplexity(_model(), torch.tensor([-1, 2, 3, 4, 5, 6, 7, 8, 9]), EvalConfig(context=8))


@pytest.mark.parametrize("plant", ["out of range", "in range"])
def test_a_planted_token_cache_is_not_trusted(make_folder, tmp_path, cli, strict_json, plant):
    """An edited cache entry (ids beyond the vocabulary, or other valid ids) is ignored and recomputed."""
    folder = make_folder("m")
    rc, out, _ = _evaluate(cli, folder, tmp_path, "--json")
    assert rc == 0
    clean = strict_json(out)
    entries = sorted((tmp_path / "cache" / "tokens").glob("*.npy"))
    assert len(entries) == 1
    ids = np.load(entries[0])
    planted = ids.copy()
    planted[3:] = 10**6 if plant == "out of range" else 0  # ids no embedding has / a different text's ids
    np.save(entries[0], planted.astype(np.int32))
    rc, out, err = _evaluate(cli, folder, tmp_path, "--json")
    assert rc == 0, err
    assert json_ppl(strict_json(out)) == json_ppl(clean)  # the same perplexity: the planted ids were not used
    assert np.array_equal(np.load(entries[0]), ids)  # rewritten with the real ids


def json_ppl(report: dict) -> list[float]:
    """Every ``ppl`` number in an evaluate --json report."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            found.extend(v for k, v in node.items() if k == "ppl")
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(report)
    assert found
    return found
