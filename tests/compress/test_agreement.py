"""Agreement with the source and generation health (flowgeom.compress.agreement): hand-computed values on toy
inputs, the KV-cached decoding against a full recompute, the reference against itself, and evaluate's refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.compress.agreement import (
    GenerationConfig, continue_tokens, distinct, generation_health, greedy_continuations, loops, prompts_from,
    shared_prefix, teacher_forced_agreement,
)
from flowgeom.compress.perplexity import EvalConfig
from flowgeom.errors import FlowgeomError
from flowgeom.nn.llama import LlamaConfig, LlamaForCausalLM

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=96, tie_word_embeddings=False)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


class Bigram(torch.nn.Module):
    """logits[b, t] = table[ids[b, t]]: a model whose every prediction is known by hand."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(torch.as_tensor(table, dtype=torch.float64))

    def forward(self, ids):
        return self.table[ids]


# ---------------------------------------------------------------- pure metrics

def test_loops_distinct_prefix_by_hand():
    slave = [1, 2, 3, 4] * 3  # "I am a slave" x 3: the 3-gram (1,2,3) occurs 3 times
    assert loops(slave)
    assert not loops([1, 2, 3, 4, 1, 2, 3, 5])  # (1,2,3) twice only
    assert loops([7, 7, 7, 7, 7])  # (7,7,7) at 0, 1, 2: overlapping occurrences count
    assert not loops([7, 7, 7, 7])
    assert distinct([1, 2, 1, 2, 1]) == pytest.approx(2 / 4)  # bigrams 12 21 12 21
    assert distinct([1, 2, 3]) == 1.0 and distinct([5]) == 1.0
    assert shared_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and shared_prefix([1], [2]) == 0
    health = generation_health([slave, [1, 2, 3, 4, 5, 6]], reference=[[1, 2, 3, 9], [1, 2, 3, 4, 5, 6]])
    assert health["loop_fraction"] == 0.5
    assert health["distinct2"] == pytest.approx((4 / 11 + 1.0) / 2)
    assert health["prefix_agreement"] == pytest.approx((3 + 6) / 2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=30))
def test_loops_matches_a_brute_force_count(tokens):
    brute = any(sum(tokens[j:j + 3] == tokens[i:i + 3] for j in range(len(tokens) - 2)) >= 3
                for i in range(len(tokens) - 2))
    assert loops(tokens) == brute
    assert 0 < distinct(tokens) <= 1


def test_prompts_are_paragraph_openings_spread_over_the_text():
    text = "\n\n".join(f"p{i} " + " ".join(f"w{j}" for j in range(12)) for i in range(10))
    prompts = prompts_from(text, 5, 3)
    assert prompts == [f"p{i} w0 w1" for i in (0, 2, 4, 6, 8)]
    with pytest.raises(FlowgeomError, match="fewer than --prompts 11"):
        prompts_from(text, 11, 3)
    with pytest.raises(FlowgeomError, match="--prompts"):
        GenerationConfig(prompts=0)


# ---------------------------------------------------------------- models

def test_teacher_forced_agreement_by_hand():
    # vocabulary of 2; the reference predicts token 0 with p=0.8 after either token, the model predicts
    # token 1 with p=0.6 after a 1 and agrees (token 0, p=0.8) after a 0
    ref = Bigram([[math.log(0.8), math.log(0.2)], [math.log(0.8), math.log(0.2)]])
    model = Bigram([[math.log(0.8), math.log(0.2)], [math.log(0.4), math.log(0.6)]])
    ids = torch.tensor([0, 1, 0, 1, 1])  # positions read 0, 1, 0, 1 (the last token only a target)
    res = teacher_forced_agreement(model, ref, ids, EvalConfig(context=5, max_tokens=None))
    kl_after_1 = 0.8 * math.log(0.8 / 0.4) + 0.2 * math.log(0.2 / 0.6)
    assert res["positions"] == 4
    assert res["top1"] == pytest.approx(0.5)
    assert res["kl"] == pytest.approx(kl_after_1 / 2)
    self = teacher_forced_agreement(ref, ref, ids, EvalConfig(context=3, max_tokens=None))
    # windows [0, 3) and [3, 5): t_3 opens the second window without context (perplexity.windows), so 3
    assert self["top1"] == 1.0 and self["kl"] == pytest.approx(0.0, abs=1e-12) and self["positions"] == 3


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_cached_decoding_equals_a_full_recompute(temperature):
    model = tiny_llama()
    prompt = torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    fast = continue_tokens(model, prompt, 20, temperature=temperature, generator=torch.Generator().manual_seed(2))
    ids, gen = prompt, torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _ in range(20):
            logits = model(ids)[:, -1]  # no cache: every position recomputed
            if temperature > 0:
                token = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen)
            else:
                token = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
    assert torch.equal(fast, ids[:, 7:])


def test_cached_decoding_matches_transformers_generate():
    transformers = pytest.importorskip("transformers")
    model = tiny_llama()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY.to_hf(), attn_implementation="eager")).eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    hf.lm_head.weight.data.copy_(model.lm_head.weight)
    prompt = [[5, 9, 33, 2]]
    ours = greedy_continuations(model, prompt, 16)
    theirs = greedy_continuations(hf, prompt, 16)  # the transformers path: past_key_values
    with torch.no_grad():
        generated = hf.generate(torch.tensor(prompt), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert ours == theirs == [generated[0, 4:].tolist()]


def test_a_long_prompt_keeps_its_end_and_no_room_is_refused():
    model = tiny_llama()
    long = [list(range(60)) * 2]  # 120 tokens, 96 positions
    out = greedy_continuations(model, long, 10)
    assert out == greedy_continuations(model, [long[0][-86:]], 10)
    with pytest.raises(FlowgeomError, match="fewer --new-tokens"):
        greedy_continuations(model, long, 96)


# ---------------------------------------------------------------- evaluate on a tiny folder

@pytest.fixture
def folder_pair(tmp_path, monkeypatch):
    """A tiny dense Llama folder with a byte tokenizer, a second copy of it, and a perturbed copy."""
    from test_share_evaluate import _byte_tokenizer, hf_tiny

    from flowgeom.compress.write import save_llama_folder

    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    hf = hf_tiny()
    cfg = LlamaConfig.from_hf(hf.config.to_dict())
    folders = {}
    for name, noise in (("dense", 0.0), ("copy", 0.0), ("noisy", 0.05)):
        state = {k: v + noise * torch.randn_like(v) if k.endswith("proj.weight") else v
                 for k, v in hf.state_dict().items()}
        folders[name] = tmp_path / name
        folders[name].mkdir()
        save_llama_folder(folders[name], cfg.to_hf(), state, tokenizer=_byte_tokenizer())
    text = "\n\n".join(f"Paragraph {i} of the held out text has a dozen plain words in it." for i in range(40))
    (tmp_path / "text.txt").write_text(text)
    return folders, tmp_path / "text.txt"


def _run(capsys, *argv):
    from flowgeom.cli import main

    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_evaluate_scores_the_reference_against_itself_as_perfect(folder_pair, capsys):
    folders, text = folder_pair
    code, out, err = _run(capsys, "compress", "evaluate", str(folders["dense"]), "--compare", str(folders["copy"]),
                          str(folders["noisy"]), "--text", str(text), "--context", "64", "--prompt-text", str(text),
                          "--prompts", "6", "--new-tokens", "12", "--generate", "In the beginning", "--json")
    assert code == 0, err
    result = json.loads(out)
    dense, copy, noisy = result["models"]
    assert "agreement" not in dense and "prefix_agreement" not in dense["generation"]
    assert copy["agreement"]["top1"] == 1.0 and copy["agreement"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert copy["generation"]["prefix_agreement"] == 12.0
    assert copy["generation"]["loop_fraction"] == dense["generation"]["loop_fraction"]
    assert noisy["agreement"]["top1"] < 1.0 and noisy["agreement"]["kl"] > 1e-4
    assert copy["generate"] == dense["generate"] and len(dense["generate"]) == 1
    assert result["generation"]["prompts"] == 6 and result["generate_prompts"] == ["In the beginning"]
    # the human table shows the agreement and the continuations
    code, out, err = _run(capsys, "compress", "evaluate", str(folders["dense"]), "--compare", str(folders["copy"]),
                          "--text", str(text), "--context", "64", "--prompt-text", str(text), "--prompts", "2",
                          "--new-tokens", "4", "--generate", "In the")
    assert code == 0, err
    assert "top-1 agree" in out and "100.0%" in out and "greedy continuations of 'In the'" in out


@pytest.mark.parametrize("argv,message", [
    (("--generate", " "), "empty prompt"),
    (("--prompts", "0"), "--prompts"),
])
def test_evaluate_bad_generation_input_is_one_line_exit_2(folder_pair, capsys, argv, message):
    folders, text = folder_pair
    code, _, err = _run(capsys, "compress", "evaluate", str(folders["dense"]), "--text", str(text), "--context", "64",
                        *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_evaluate_refuses_models_with_different_tokenizers(folder_pair, tmp_path, capsys):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folders, text = folder_pair
    other = Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    other.save(str(folders["noisy"] / "tokenizer.json"))
    out = tmp_path / "result.json"
    code, _, err = _run(capsys, "compress", "evaluate", str(folders["dense"]), "--compare", str(folders["noisy"]),
                        "--text", str(text), "--context", "64", "--out", str(out))
    assert code == 2 and "another tokenizer" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_the_reference_judged_against_itself_meets_every_target_and_a_broken_model_does_not():
    from flowgeom.compress.agreement import Judge, meets_targets

    reference = tiny_llama()
    ids = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(0))
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9, 8]]
    judge = Judge(reference, ids, prompts, EvalConfig(context=50, max_tokens=None), GenerationConfig(new_tokens=12))
    same = judge(reference)
    assert same["agreement"]["top1"] == 1.0 and same["generation"]["prefix_agreement"] == 12.0
    assert same["targets"] == {"loops": True, "distinct2": True, "top1": True, "all": True}
    other = judge(tiny_llama(seed=5))
    assert other["agreement"]["top1"] < 0.8 and not other["targets"]["all"]
    # the bar itself, by hand: 10 loop points and 0.9x distinct-2 are allowed, not more
    ref = {"loop_fraction": 0.3, "distinct2": 0.8}
    assert meets_targets({"top1": 0.8}, {"loop_fraction": 0.4, "distinct2": 0.72}, ref)["all"]
    assert not meets_targets({"top1": 0.8}, {"loop_fraction": 0.41, "distinct2": 0.72}, ref)["loops"]
    assert not meets_targets({"top1": 0.8}, {"loop_fraction": 0.4, "distinct2": 0.71}, ref)["distinct2"]
    assert not meets_targets({"top1": 0.79}, {"loop_fraction": 0.4, "distinct2": 0.72}, ref)["top1"]


def test_prompts_batched_by_length_continue_as_they_would_alone():
    model = tiny_llama()
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9, 8, 7], [3, 3, 3, 3], [11]]
    together = greedy_continuations(model, prompts, 10)
    assert together == [greedy_continuations(model, [p], 10)[0] for p in prompts]
