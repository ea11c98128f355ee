"""continuity.sharing: the claim end to end on a tiny planted Llama, pruning orders, and the verdict on
hand-made summaries.

The tiny model is planted so the answer is known: each group of two adjacent layers of q, k, gate, up
shares an exact input basis and of o, down an exact output basis (V: exactly low rank per layer), each at
the rank the budget allows. Whitened sharing in the seed's space is then exact (perplexity unchanged) and
sharing in the opposite space is lossy. The text is sampled from the model itself, so any change of the
function raises the expected NLL (cross-entropy = entropy + KL): (a) must beat (b).
"""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch

from flowgeom.cli import main
from flowgeom.compress import factorize as fz
from flowgeom.compress.arch import weight_key
from flowgeom.compress.plan import SEED_SPACE, layer_groups
from flowgeom.compress.write import save_llama_folder
from flowgeom.errors import FlowgeomError
from flowgeom.experiments import sharing
from flowgeom.nn.llama import LlamaConfig, LlamaForCausalLM, llama_from_state
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


def planted_state(cfg: LlamaConfig, budget: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random Llama weights; each seed role exactly shared in its seed space, V exactly low rank, at the
    ranks the budget allows (Basis Sharing's rank rule)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    state = {k: (torch.ones(s) if k.endswith("norm.weight") else torch.randn(*s, generator=gen) / math.sqrt(s[-1]))
             for k, s in shapes.items()}
    state["lm_head.weight"] *= 6.0  # sharp next-token distributions: a changed function shows in the NLL
    for role in list(SEED_SPACE) + ["v"]:
        m, n = shapes[weight_key(0, role)]
        space, g = SEED_SPACE.get(role, "input"), 2 if role in SEED_SPACE else 1
        r = fz.rank_for_ratio(m, n, g, budget, space)
        for idx in layer_groups(cfg.num_hidden_layers, g):
            basis = torch.linalg.qr(torch.randn(n if space == "input" else m, r, generator=gen))[0]
            for l in idx:
                c = torch.randn(m if space == "input" else r, r if space == "input" else n, generator=gen)
                w = c @ basis.T if space == "input" else basis @ c  # (m, n), rank r
                state[weight_key(l, role)] = w / w.norm() * math.sqrt(m)
    return state


def sampled_text(cfg: LlamaConfig, state: dict, n_tokens: int, context: int, seed: int = 1) -> str:
    """Words sampled from the model itself, one independent window of ``context`` tokens at a time."""
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
    calib = root / "calib.txt"
    calib.write_text(sampled_text(TINY, state, TOKENS, CONTEXT, seed=2))
    return folder, text, calib


def _grid(folder, text, calib, **over):
    return sharing.sharing_grid("quick", source=str(folder), text=str(text), tokens=TOKENS, context=CONTEXT,
                                calib=str(calib), calib_tokens=512, budgets=(BUDGET,), prune_budgets=(BUDGET,),
                                random_seeds=(0, 1), **over)


def test_the_claim_end_to_end_on_a_planted_tiny_llama(planted, tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    folder, text, calib = planted
    grid = _grid(folder, text, calib, role_budgets=(BUDGET,))
    claim = Claim("continuity", "continuity.sharing", "001", "test", quick=grid, run=run_sharing,
                  verdict=sharing_verdict)
    out = tmp_path / "sweep"
    report = pipeline.run("continuity", out=out, claims=[claim], show_progress=False)
    assert report["sweep"]["failed"] == 0
    [row] = report["claims"]
    assert row["finished"] == row["runs"] == len(grid) == 1 + 6 + 14 + 5
    rows = {(s["strategy"], s.get("role"), s["seed"]): s for s in
            (json.loads(p.read_text()) for p in (out / "runs" / "continuity.sharing").glob("*/summary.json"))}
    ref, a, b = rows["none", None, 0], rows["seed-space", None, 0], rows["opposite-space", None, 0]
    assert a["ppl"] == pytest.approx(ref["ppl"], rel=1e-4)  # planted: the seed's space is exact
    assert max(r["rel_error"] for r in a["roles"].values()) < 1e-4
    assert b["ppl"] > 1.05 * ref["ppl"]
    for role in SEED_SPACE:  # one role at a time, the seed space is exact, the other one is not
        seed, other = ("input", "output") if SEED_SPACE[role] == "input" else ("output", "input")
        assert rows[f"role-{seed}", role, 0]["ppl"] == pytest.approx(ref["ppl"], rel=1e-4)
        assert rows[f"role-{other}", role, 0]["ppl"] > rows[f"role-{seed}", role, 0]["ppl"], role
    assert row["verdict"]["verdict"] == "reproduced", row["verdict"]
    for s in sharing.METHODS:  # equal budgets: floors store at most (1 - b) of the projections
        assert rows[s, None, 0]["saved_fraction"] >= BUDGET - 0.01, s
    for s in ("prune-bi", "prune-angular", "prune-continuity"):
        drop = rows[s, None, 0]
        assert drop["layers"] == 4 - len(drop["dropped"]) and drop["saved_params"] > 0
    [fig] = row["verdict"]["figures"]
    assert (out / fig).read_bytes()[:4] == b"\x89PNG"
    again = pipeline.run("continuity", out=out, claims=[claim], show_progress=False, resume=True)
    assert again["sweep"]["skipped"] == len(grid)
    assert again["claims"][0]["verdict"]["measured"] == row["verdict"]["measured"]


def test_pruning_orders_follow_their_papers():
    bi = [0.5, 0.1, 0.3, 0.05, 0.9]
    assert sharing.bi_drop(bi, 2) == [1, 3]  # ShortGPT: the lowest Block Influence
    angular = {2: [0.4, 0.2, 0.1, 0.3]}  # inputs of blocks l and l+2
    assert sharing.angular_drop(angular, 2) == [2, 3]  # Gromov et al.: the most similar span
    assert len({tuple(sharing.random_drop(10, 3, seed=s)) for s in range(10)}) > 1  # seeds give different orders
    assert sharing.random_drop(6, 2, seed=3) == sharing.random_drop(6, 2, seed=3)
    assert all(0 < l < 5 for l in sharing.random_drop(6, 3, seed=1))
    assert sharing.drop_count(0.1, 1000, 40, 30) == 2 and sharing.drop_count(0.9, 1000, 40, 4) == 2


def test_bad_strategy_budget_and_preset_keys_are_one_error(planted):
    folder, text, calib = planted
    with pytest.raises(FlowgeomError, match="strategy"):
        run_sharing({"strategy": "shared", "budget": 0.1, "source": str(folder)}, None, False)
    with pytest.raises(FlowgeomError, match="budget 1.5"):
        run_sharing({"strategy": "svd", "budget": 1.5, "source": str(folder)}, None, False)
    with pytest.raises(FlowgeomError, match="unknown sharing preset keys"):
        sharing.sharing_grid("quick", budget=(0.1,))


def test_grids_cover_every_strategy_and_scale_up():
    quick = sharing.sharing_grid("quick")
    assert {c["strategy"] for c in quick} == set(sharing.STRATEGIES) and len(quick) == 12
    cpu, full = sharing.sharing_grid("cpu"), sharing.sharing_grid("full")
    assert len(cpu) == len(full) > len(quick)
    assert {c["role"] for c in cpu if "role" in c} == set(sharing.ROLES)
    assert all(c["tokens"] is None for c in full) and {c["budget"] for c in full if c["strategy"] == "whiten"} \
        == {0.1, 0.2, 0.3}


# ---------------------------------------------------------------- the verdict on hand-made summaries

def _row(strategy, budget, ppl, seed=0, saved=None, role=None):
    row = {"strategy": strategy, "budget": budget, "seed": seed, "ppl": ppl, "nll": math.log(ppl),
           "saved_fraction": budget if saved is None else saved, "saved_params": 1, "layers": 30}
    return row | ({"role": role} if role else {})


def _rows(a, b, cont=(33.0, 40.0), bs=(35.0, 41.0)):
    rows = [_row("none", 0.0, 28.9)]
    for x, pa, pb, pc, pbs in zip((0.1, 0.2), a, b, cont, bs):
        rows += [_row("seed-space", x, pa), _row("opposite-space", x, pb), _row("continuity", x, pc),
                 _row("basis-sharing", x, pbs), _row("svd", x, 1e4)]
    return rows


@pytest.mark.parametrize("a,b,verdict", [((30.0, 35.0), (50.0, 90.0), "reproduced"),
                                         ((50.0, 90.0), (30.0, 35.0), "not reproduced"),
                                         ((30.0, 95.0), (50.0, 90.0), "differs")])
def test_verdict_follows_seed_space_against_opposite_space(a, b, verdict):
    out = sharing.judge(_rows(a, b))
    assert out["verdict"] == verdict
    wins = sum(x < y for x, y in zip(a, b))
    assert f"the seed's space beats the opposite space at {wins} of 2 budgets" in out["how"]
    assert "reference ppl 28.90" in out["measured"]
    assert "continuity-guided beats Basis Sharing at 10% (33 vs 35)" in out["how"]


def test_verdict_names_the_best_method_and_its_ratio_and_when_continuity_loses():
    how = sharing.judge(_rows((30.0, 35.0), (50.0, 90.0), cont=(36.0, 40.0)))["how"]
    assert "best at 10%: seed-space (30, 1.04x the reference)" in how
    assert "continuity-guided loses to Basis Sharing at 10% (36 vs 35)" in how


def test_verdict_per_role_and_pruning():
    rows = _rows((30.0, 35.0), (50.0, 90.0))
    for role, (pi, po) in {"q": (31, 33), "o": (35, 40), "v": (50, 45)}.items():
        rows += [_row("role-input", 0.2, pi, role=role), _row("role-output", 0.2, po, role=role)]
    rows += [_row("prune-continuity", 0.1, 45.0), _row("prune-random", 0.1, 80.0, seed=0),
             _row("prune-random", 0.1, 40.0, seed=1), _row("prune-bi", 0.1, 50.0)]
    out = sharing.judge(rows)
    assert out["verdict"] == "differs"  # q wins, o loses
    assert "per role, whitened, the seed's space beats the opposite space for 1 of 2 roles" in out["how"]
    assert "V: the output space is better" in out["how"]
    assert "continuity-ranked dropping at 10% beats 1 of 2 random orders" in out["how"]
    assert "drop 10%: bi 50, continuity 45, random mean 56.57" in out["measured"]


def test_verdict_without_a_comparable_pair_is_not_run():
    out = sharing.judge([_row("none", 0.0, 28.9), _row("seed-space", 0.1, 30.0), _row("opposite-space", 0.2, 40.0)])
    assert out["verdict"] == "not run"


def test_the_claim_is_registered_with_the_presets():
    from flowgeom.reproduce.claims_continuity import claims

    [claim] = [c for c in claims() if c.id == "continuity.sharing"]
    assert not claim.unavailable
    assert claim.quick == sharing.sharing_grid("quick") and claim.full == sharing.sharing_grid("full")
    assert claim.cpu == sharing.sharing_grid("cpu")


def test_figure_has_a_per_role_panel(tmp_path):
    from PIL import Image

    rows = _rows((30.0, 35.0), (50.0, 90.0)) + [_row("role-input", 0.2, 31, role="q"),
                                                _row("role-output", 0.2, 33, role="q")]
    with Image.open(sharing.sharing_figure(rows, tmp_path / "two.png")) as img:
        wide = img.size[0]
    with Image.open(sharing.sharing_figure(rows[:6], tmp_path / "one.png")) as img:
        assert wide > 1.5 * img.size[0]


# ---------------------------------------------------------------- the CLI progress bar

class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("as_json", [True, False])
def test_share_progress_bar_only_on_a_terminal_without_json(planted, tmp_path, monkeypatch, capsys, as_json):
    folder, _, calib = planted
    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setenv("TERM", "xterm")
    argv = ["compress", "run", str(folder), "--out", str(tmp_path / "out"), "--method", "whiten", "--budget",
            "0.3", "--calib", str(calib), "--calib-tokens", "512"] + (["--json"] if as_json else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    if as_json:
        assert term.getvalue() == "" and json.loads(out)["method"] == "whiten"
    else:
        assert "calibrate" in term.getvalue() and "factorise" in term.getvalue()
    assert "Traceback" not in term.getvalue()
