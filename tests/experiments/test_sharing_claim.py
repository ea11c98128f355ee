"""continuity.sharing: equal-budget ranks, the claim end to end on a tiny planted Llama, the verdict on
hand-made summaries.

The tiny model is planted so the answer is known: each group of two adjacent layers of q, k, gate, up
shares an exact rank-r input basis (o, down: output basis), with r the seed-space rank the budget allows.
Sharing in the seed's space is then exact (perplexity unchanged) and sharing in the opposite space is
lossy. The text is sampled from the model itself, so any change of the function raises the expected NLL
(cross-entropy = entropy + KL): (a) must beat (b).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowgeom.continuity import compress
from flowgeom.continuity.checkpoint_out import save_llama_folder
from flowgeom.errors import FlowgeomError
from flowgeom.experiments import sharing
from flowgeom.nn.llama import LlamaConfig, LlamaForCausalLM, llama_state_dict
from flowgeom.reproduce import pipeline
from flowgeom.reproduce.claims_continuity import run_sharing, sharing_verdict
from flowgeom.reproduce.registry import Claim

TINY = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=6,
                   num_key_value_heads=2, head_dim=8, rope_theta=1000.0, max_position_embeddings=128,
                   tie_word_embeddings=False)
BUDGET, CONTEXT, TOKENS = 0.3, 32, 1024


def _word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def _orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(rows, cols, generator=gen))[0]  # (rows, cols)


def planted_state(cfg: LlamaConfig, budget: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random Llama weights; each role of SIX exactly shared in its seed space at the budget's rank."""
    gen = torch.Generator().manual_seed(seed)
    L, g = cfg.num_hidden_layers, 2
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    state = {k: (torch.ones(s) if k.endswith("norm.weight") else torch.randn(*s, generator=gen) / math.sqrt(s[-1]))
             for k, s in shapes.items()}
    state["lm_head.weight"] *= 6.0  # sharp next-token distributions: a changed function shows in the NLL
    groups = compress.layer_groups(L, g)
    for role in sharing.SIX:
        name = compress.HF_NAMES[role]
        m, n = shapes[f"model.layers.0.{name}.weight"]
        space = compress.SEED_SPACE[role]
        r = sharing.share_rank_for_budget(m, n, [len(x) for x in groups], budget, space)
        for idx in groups:
            basis = _orthonormal(n if space == "input" else m, r, gen)
            for l in idx:
                c = torch.randn(m if space == "input" else r, r if space == "input" else n, generator=gen)
                w = c @ basis.T if space == "input" else basis @ c  # (m, n), rank r
                state[f"model.layers.{l}.{name}.weight"] = w / w.norm() * math.sqrt(m)
    return state


def sampled_text(cfg: LlamaConfig, state: dict, n_tokens: int, context: int, seed: int = 1) -> str:
    """Words sampled from the model itself, one independent window of ``context`` tokens at a time."""
    from flowgeom.nn.llama import llama_from_state

    model = llama_from_state(cfg, state)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(cfg.vocab_size, (n_tokens // context, 1), generator=gen)  # (W, 1)
    with torch.no_grad():
        while ids.shape[1] < context:
            probs = torch.softmax(model(ids)[:, -1], dim=-1)  # (W, vocab)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return " ".join(f"w{i}" for i in ids.flatten().tolist())


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharing")
    state = planted_state(TINY, BUDGET)
    folder = root / "tiny"
    folder.mkdir()
    save_llama_folder(folder, TINY.to_hf(), state, tokenizer=_word_tokenizer(TINY.vocab_size))
    text = root / "text.txt"
    text.write_text(sampled_text(TINY, state, TOKENS, CONTEXT))
    return folder, text


def _grid(folder, text):
    return sharing.sharing_grid("quick", source=str(folder), text=str(text), tokens=TOKENS, context=CONTEXT,
                                budgets=(BUDGET,), drop_budgets=(BUDGET,), v_budgets=(BUDGET,), random_seeds=(0, 1))


def test_the_claim_end_to_end_on_a_planted_tiny_llama(planted, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    folder, text = planted
    claim = Claim("continuity", "continuity.sharing", "001", "test", quick=_grid(folder, text), run=run_sharing,
                  verdict=sharing_verdict)
    out = tmp_path / "sweep"
    report = pipeline.run("continuity", out=out, claims=[claim], show_progress=False)
    assert report["sweep"]["failed"] == 0
    [row] = report["claims"]
    assert row["finished"] == row["runs"] == 10
    rows = {(s["strategy"], s["seed"]): s for s in
            (json.loads(p.read_text()) for p in (out / "runs" / "continuity.sharing").glob("*/summary.json"))}
    ref, a, b = rows["none", 0], rows["seed-space", 0], rows["opposite-space", 0]
    assert a["ppl"] == pytest.approx(ref["ppl"], rel=1e-4)  # planted: the seed's space is exact
    assert max(r["rel_error"] for r in a["roles"].values()) < 1e-4
    assert min(r["rel_error"] for r in b["roles"].values()) > 0.05  # the opposite space is lossy for every role
    assert b["ppl"] > 1.05 * ref["ppl"]
    assert row["verdict"]["verdict"] == "reproduced", row["verdict"]
    cfg, state = llama_state_dict(folder)
    # equal budgets: ranks are rounded down, so each role saves at least 30% unless its rank is clamped
    for s in ("seed-space", "opposite-space", "svd"):
        assert BUDGET - 0.02 < rows[s, 0]["saved_fraction"] < BUDGET + 0.05, (s, rows[s, 0]["saved_fraction"])
        for role, r in rows[s, 0]["roles"].items():
            dense = 4 * math.prod(state[f"model.layers.0.{compress.HF_NAMES[role]}.weight"].shape)
            assert r["saved_params"] >= BUDGET * dense or (role == "k" and r["rank"] == 16), (s, role, r)
    drop = rows["drop-continuity", 0]
    k = sharing.drop_count(BUDGET, drop["scope_params"], compress.block_params(state, 0), 4)
    assert drop["layers"] == 4 - k and drop["saved_params"] == k * compress.block_params(state, 0)
    assert 0 not in drop["dropped"] and 3 not in drop["dropped"]
    # the figure shows what the runs wrote
    [fig] = row["verdict"]["figures"]
    assert (out / fig).is_file() and (out / fig).read_bytes()[:4] == b"\x89PNG"
    # resumable: a second sweep keeps every finished run
    again = pipeline.run("continuity", out=out, claims=[claim], show_progress=False, resume=True)
    assert {r["status"] for r in again["sweep"]["runs"]} == {"skipped"} and again["sweep"]["skipped"] == 10
    assert again["claims"][0]["verdict"]["measured"] == row["verdict"]["measured"]


def test_share_rank_fits_the_budget_and_is_the_largest_that_does():
    groups = [2] * 15
    for m, n, space in [(576, 576, "input"), (192, 576, "output"), (1536, 576, "input"), (576, 1536, "output")]:
        for b in (0.05, 0.1, 0.2, 0.3):
            r = sharing.share_rank_for_budget(m, n, groups, b, space)
            stored = sum(compress.shared_params(m, n, g, r, space) for g in groups)
            assert stored <= (1 - b) * 30 * m * n
            if r < min(m, n):
                assert sum(compress.shared_params(m, n, g, r + 1, space) for g in groups) > (1 - b) * 30 * m * n
    assert sharing.share_rank_for_budget(192, 576, groups, 0.1, "input") == 192  # K: clamped to its rank bound


def test_bad_strategy_and_budget_are_one_error():
    state = planted_state(TINY, BUDGET)
    with pytest.raises(FlowgeomError, match="strategy.*seed-space"):
        sharing.compress_for(state, 4, {"strategy": "shared", "budget": 0.1, "group": 2, "seed": 0})
    with pytest.raises(FlowgeomError, match="budget 1.5"):
        sharing.compress_for(state, 4, {"strategy": "svd", "budget": 1.5, "group": 2, "seed": 0})
    with pytest.raises(FlowgeomError, match="unknown sharing preset keys"):
        sharing.sharing_grid("quick", budget=(0.1,))


def test_quick_grid_is_small_and_covers_every_strategy():
    grid = sharing.sharing_grid("quick")
    assert len(grid) <= 13 and {c["strategy"] for c in grid} == set(sharing.STRATEGIES)
    assert len(sharing.sharing_grid("full")) > len(grid)
    assert all(c["tokens"] is None for c in sharing.sharing_grid("full"))


# ---------------------------------------------------------------- the verdict on hand-made summaries

def _row(strategy, budget, ppl, seed=0, saved=0.1):
    return {"strategy": strategy, "budget": budget, "seed": seed, "ppl": ppl, "nll": math.log(ppl),
            "saved_fraction": saved, "saved_params": int(saved * 1e8), "layers": 30}


def _rows(a, b, c=(40.0, 60.0)):
    rows = [_row("none", 0.0, 28.9)]
    for x, pa, pb, pc in zip((0.1, 0.2), a, b, c):
        rows += [_row("seed-space", x, pa), _row("opposite-space", x, pb), _row("svd", x, pc)]
    return rows


@pytest.mark.parametrize("a,b,verdict", [((30.0, 35.0), (50.0, 90.0), "reproduced"),
                                         ((50.0, 90.0), (30.0, 35.0), "not reproduced"),
                                         ((30.0, 95.0), (50.0, 90.0), "differs")])
def test_verdict_follows_seed_space_against_opposite_space(a, b, verdict):
    out = sharing.judge(_rows(a, b))
    assert out["verdict"] == verdict
    wins = sum(x < y for x, y in zip(a, b))
    assert f"beats the opposite space at {wins} of 2 budgets" in out["how"]
    beats = sum(x < y for x, y in zip(a, (40.0, 60.0)))
    assert f"beats per-layer SVD at {beats} of 2 budgets" in out["how"]
    assert "reference ppl 28.90" in out["measured"]
    assert "broken" not in out["how"]  # 30 < 10 x 28.9


def test_verdict_says_when_every_compressed_model_is_broken():
    out = sharing.judge(_rows((300.0, 3e4), (1e3, 2e4), c=(2e3, 7e5)))
    assert out["verdict"] == "differs" and "every shared or SVD model is broken (ppl >= 300" in out["how"]
    assert "broken" not in sharing.judge(_rows((280.0, 3e4), (1e3, 2e4), c=(2e3, 7e5)))["how"]


def test_verdict_on_dropping_and_v():
    rows = _rows((30.0, 35.0), (50.0, 90.0))
    rows += [_row("drop-continuity", 0.1, 45.0), _row("drop-random", 0.1, 80.0, seed=0),
             _row("drop-random", 0.1, 40.0, seed=1)]
    rows += [_row("v-input", 0.2, 31.0), _row("v-output", 0.2, 33.0), _row("v-svd", 0.2, 30.0)]
    how = sharing.judge(rows)["how"]
    # random mean: exp(mean(log 80, log 40)) = 56.6 > 45: continuity-ranked is better, beating 1 of 2 seeds
    assert "continuity-ranked dropping at 10% is better than random (beats 1 of 2" in how
    assert "sharing in neither space beats V's own per-layer SVD" in how
    rows[-1] = _row("v-svd", 0.2, 32.0)
    assert "sharing V beats its per-layer SVD" in sharing.judge(rows)["how"]


def test_verdict_without_a_comparable_pair_is_not_run():
    out = sharing.judge([_row("none", 0.0, 28.9), _row("seed-space", 0.1, 30.0), _row("opposite-space", 0.2, 40.0)])
    assert out["verdict"] == "not run" and "both seed-space and opposite-space" in out["how"]


def test_the_claim_is_registered_with_the_presets():
    from flowgeom.reproduce.claims_continuity import claims

    [claim] = [c for c in claims() if c.id == "continuity.sharing"]
    assert not claim.unavailable
    assert claim.quick == sharing.sharing_grid("quick") and claim.full == sharing.sharing_grid("full")
    assert claim.command("quick") == "flowgeom reproduce continuity --quick --only continuity.sharing"
