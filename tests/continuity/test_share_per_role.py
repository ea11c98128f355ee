"""Per-role sharing (one role at a time at a budget of that role), the random layer-drop baseline's seeds,
the verdict per role, the `continuity share` progress bar, and the re-exported compression API.

The model is a real ``transformers`` Llama from :func:`flowgeom.hf.tiny.tiny_model` whose q_proj is
planted: each group of two adjacent layers shares an exact rank-r *input* basis, with r the rank the
budget allows. Sharing q in input space must then be exact; in output space it must not be.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import pytest
import torch

from flowgeom.cli import main
from flowgeom.continuity import compress
from flowgeom.experiments import sharing

pytest.importorskip("transformers")

L, GROUP, BUDGET = 6, 2, 0.25


def _orthonormal(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(rows, cols, generator=gen, dtype=torch.float64))[0]  # (rows, cols)


@pytest.fixture(scope="module")
def planted():
    """(HF Llama config dict, state) with q exactly shared in input space at the BUDGET's rank."""
    from flowgeom.hf.tiny import tiny_model

    hf = tiny_model("llama", seed=0, dtype=torch.float32, num_hidden_layers=L, hidden_size=32,
                    intermediate_size=48)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    for key, w in state.items():  # HF's std-0.02 init predicts near-uniformly: give every projection unit gain
        if w.ndim == 2 and "embed" not in key:
            state[key] = w / (w.std() * math.sqrt(w.shape[1])) * (6.0 if key == "lm_head.weight" else 1.0)
    m, n = state["model.layers.0.self_attn.q_proj.weight"].shape  # (32, 32)
    groups = compress.layer_groups(L, GROUP)
    r = compress.share_rank_for_budget(m, n, [len(g) for g in groups], BUDGET, "input")
    assert 1 < r < min(m, n)  # a real reduction, not the clamp
    gen = torch.Generator().manual_seed(3)
    for idx in groups:
        basis = _orthonormal(n, r, gen)  # (n, r), shared by the group
        for layer in idx:
            coeff = torch.randn(m, r, generator=gen, dtype=torch.float64)
            state[f"model.layers.{layer}.self_attn.q_proj.weight"] = (2 * coeff @ basis.T / math.sqrt(n)).float()
    return hf.config.to_dict(), state, r


def _config(strategy, role="q", budget=BUDGET, seed=0):
    return {"strategy": strategy, "role": role, "budget": budget, "seed": seed, "group": GROUP}


# ---------------------------------------------------------------- per-role compression at a budget

def test_planted_input_basis_is_exact_in_input_space_and_not_in_output_space(planted):
    _, state, r = planted
    m, n = state["model.layers.0.self_attn.q_proj.weight"].shape
    before = {k: v.clone() for k, v in state.items()}
    new_in, layers, facts_in = sharing.compress_for(state, L, _config("role-input"))
    new_out, _, facts_out = sharing.compress_for(state, L, _config("role-output"))
    assert layers == L and all(torch.equal(before[k], state[k]) for k in state)  # the input is not modified
    q_in, q_out = facts_in["roles"]["q"], facts_out["roles"]["q"]
    assert list(facts_in["roles"]) == ["q"] and q_in["space"] == "input" and q_in["rank"] == r
    assert q_in["rel_error"] < 1e-5
    assert q_out["space"] == "output" and q_out["rel_error"] > 0.05
    for layer in range(L):
        key = f"model.layers.{layer}.self_attn.q_proj.weight"
        assert torch.allclose(new_in[key], state[key], atol=1e-5)
        for other in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):  # one role at a time
            assert new_in[f"model.layers.{layer}.{other}.weight"] is state[f"model.layers.{layer}.{other}.weight"]
    # honest count, computed here independently: one (n x r) basis per group + one (m x r) block per layer
    G = math.ceil(L / GROUP)
    assert facts_in["scope_params"] == L * m * n
    assert facts_in["saved_params"] == L * m * n - (G * n * r + L * m * r)
    assert facts_in["saved_params"] >= BUDGET * L * m * n  # the rank is the largest that fits the budget
    stored_r1 = G * n * (r + 1) + L * m * (r + 1)
    assert stored_r1 > (1 - BUDGET) * L * m * n
    r_out = q_out["rank"]
    assert facts_out["saved_params"] == L * m * n - (G * m * r_out + L * r_out * n)


@pytest.mark.parametrize("role", sharing.ROLES7)
def test_every_role_saves_at_least_its_budget_with_each_strategy(planted, role):
    _, state, _ = planted
    m, n = state[f"model.layers.0.{compress.HF_NAMES[role]}.weight"].shape
    for strategy in sharing.ROLE_STRATEGIES:
        _, _, facts = sharing.compress_for(state, L, _config(strategy, role=role))
        [(got_role, f)] = facts["roles"].items()
        assert got_role == role and facts["scope_params"] == L * m * n
        clamped = f["rank"] == min(m, n)
        assert facts["saved_params"] >= BUDGET * L * m * n or clamped, (strategy, role, f)
        if strategy == "role-svd":
            assert facts["saved_params"] == L * m * n - L * f["rank"] * (m + n)


def test_a_per_role_run_needs_a_known_role(planted):
    from flowgeom.errors import FlowgeomError

    _, state, _ = planted
    with pytest.raises(FlowgeomError, match="role.*'qq'.*gate"):
        sharing.compress_for(state, L, _config("role-input", role="qq"))
    with pytest.raises(FlowgeomError, match="budget 1.0"):
        compress.share_rank_for_budget(32, 32, [2, 2], 1.0, "input")


def test_grids_hold_the_per_role_sweep_and_five_random_orders():
    quick, cpu, full = (sharing.sharing_grid(p) for p in ("quick", "cpu", "full"))
    assert all("role" not in c for c in quick)  # the quick grid keeps its run ids
    assert sorted(c["seed"] for c in quick if c["strategy"] == "drop-random") == [0, 1, 2, 3, 4]
    per_role = [c for c in cpu if "role" in c]
    assert {(c["role"], c["strategy"]) for c in per_role} == {(r, s) for r in sharing.ROLES7
                                                               for s in sharing.ROLE_STRATEGIES}
    assert len({c["budget"] for c in per_role}) >= 1 and all(c["tokens"] == 2048 for c in cpu)
    assert {c["seed"] for c in cpu if c["strategy"] == "drop-random"} == {0, 1, 2, 3, 4}
    assert any("role" in c for c in full)
    from flowgeom.reproduce.claims_continuity import claims

    [claim] = [c for c in claims() if c.id == "continuity.sharing"]
    assert claim.grid("cpu") == cpu and claim.command("cpu").endswith("--cpu --only continuity.sharing")


# ---------------------------------------------------------------- the random layer-drop baseline

def test_random_drop_orders_differ_between_seeds_and_repeat_for_a_seed():
    orders = [compress.random_drop_order(12, seed=s, protect=(0, 11)) for s in range(5)]
    assert all(sorted(o) == list(range(1, 11)) for o in orders)
    assert len({tuple(o) for o in orders}) == 5
    assert orders == [compress.random_drop_order(12, seed=s, protect=(0, 11)) for s in range(5)]
    torch.manual_seed(0)  # the global generator plays no part
    assert compress.random_drop_order(12, seed=2, protect=(0, 11)) == orders[2]


def test_drop_random_runs_drop_reproducible_seed_dependent_blocks(planted):
    _, state, _ = planted
    dropped = []
    for seed in range(5):
        cfg = {"strategy": "drop-random", "budget": 0.3, "seed": seed, "group": GROUP}
        _, layers, facts = sharing.compress_for(state, L, cfg)
        assert facts["dropped"] == sharing.compress_for(state, L, cfg)[2]["dropped"]
        assert 0 not in facts["dropped"] and L - 1 not in facts["dropped"] and layers == L - len(facts["dropped"])
        dropped.append(tuple(facts["dropped"]))
    assert len(set(dropped)) > 1


# ---------------------------------------------------------------- the verdict per role

def _row(strategy, ppl, role=None, budget=0.2, seed=0, saved=0.2):
    row = {"strategy": strategy, "budget": budget, "seed": seed, "ppl": ppl, "nll": math.log(ppl),
           "saved_fraction": saved, "saved_params": int(saved * 1e6), "layers": 30}
    return row | ({"role": role} if role else {})


def _role_rows(ppl):
    """ppl: role -> (input, output, svd)."""
    return [_row(f"role-{s}", p, role=role) for role, ps in ppl.items() for s, p in zip(("input", "output", "svd"), ps)]


SEED_WINS = {"q": (35, 40, 50), "k": (36, 45, 50), "gate": (34, 60, 50), "up": (34, 38, 50),
             "o": (70, 40, 50), "down": (80, 45, 50), "v": (900, 1000, 950)}


def test_per_role_verdict_counts_roles_where_the_seed_space_wins():
    rows = [_row("none", 32.3)] + _role_rows(SEED_WINS)
    out = sharing.judge(rows)
    assert out["verdict"] == "reproduced", out
    assert "per role, the seed's space beats the opposite space for 6 of 6 roles" in out["how"]
    assert "q: the seed's input space wins (1 of 1 budgets)" in out["how"]
    # v: svd/best = 950/900 = 1.06, the lowest of the roles (q: 50/35 = 1.43, ...): special, as the seed says
    assert "V is special, as the seed says" in out["how"] and "input space wins (900 vs 1000)" in out["how"]
    assert "q (seed: input) 20%: input 35, output 40, svd 50" in out["measured"]
    flipped = dict(SEED_WINS, o=(40, 70, 50), down=(45, 80, 50), v=(30, 31, 90))
    out = sharing.judge([_row("none", 32.3)] + _role_rows(flipped))
    assert out["verdict"] == "differs" and "for 4 of 6 roles" in out["how"]
    assert "o: the seed's output space loses (0 of 1 budgets)" in out["how"]
    assert "V is not special" in out["how"]  # 90/30 = 3 is the largest gain
    reversed_ = {r: (p[1], p[0], p[2]) for r, p in SEED_WINS.items()}
    assert sharing.judge(_role_rows(reversed_))["verdict"] == "not reproduced"


def test_per_role_rows_do_not_leak_into_the_all_roles_comparison():
    rows = [_row("seed-space", 3e4, budget=0.1), _row("opposite-space", 1e4, budget=0.1)] + _role_rows(SEED_WINS)
    out = sharing.judge(rows)
    assert "10% saved: seed space 3e+04, opposite 1e+04" in out["measured"]
    assert "all six roles at once: the seed's space beats the opposite space at 0 of 1 budgets" in out["how"]
    assert out["verdict"] == "reproduced"  # decided per role when per-role runs exist
    assert {r["role"] for r in out["table"]} == set(SEED_WINS) | {"-"}


def test_unequal_measured_savings_are_flagged():
    rows = _role_rows({"k": (36, 45, 50)})
    rows[0]["saved_fraction"] = 0.167  # K's input-space rank clamped at its bound
    assert "savings differ: 16.7%/20.0%/20.0%" in sharing.judge(rows)["measured"]


def test_drop_verdict_reports_the_random_distribution():
    rows = [_row("seed-space", 40.0, budget=0.1), _row("opposite-space", 50.0, budget=0.1),
            _row("drop-continuity", 46.0, budget=0.1)]
    rows += [_row("drop-random", p, budget=0.1, seed=s) for s, p in enumerate((52.3, 98.6, 60.0, 45.0, 70.0))]
    out = sharing.judge(rows)
    mean = math.exp(sum(math.log(p) for p in (52.3, 98.6, 60.0, 45.0, 70.0)) / 5)
    assert f"continuity-ranked 46 vs random mean {mean:.4g} (min 45, max 98.6, 5 seeds)" in out["measured"]
    assert "is better than random (beats 4 of 5 random rankings" in out["how"]


def test_figure_has_a_per_role_panel(tmp_path):
    rows = [_row("none", 32.3), _row("seed-space", 3e4, budget=0.1)] + _role_rows(SEED_WINS)
    path = sharing.sharing_figure(rows, tmp_path / "sharing.png")
    from PIL import Image

    with Image.open(path) as img:
        wide = img.size
    alone = sharing.sharing_figure(rows[:2], tmp_path / "alone.png")
    with Image.open(alone) as img:
        assert wide[0] > 1.5 * img.size[0]  # two panels


# ---------------------------------------------------------------- the CLI progress bar

class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def tiny_folder(planted, tmp_path_factory):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    from flowgeom.continuity.checkpoint_out import save_llama_folder
    from flowgeom.nn.llama import LlamaConfig

    hf_cfg, state, _ = planted
    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(hf_cfg["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path_factory.mktemp("share") / "tiny"
    folder.mkdir()
    save_llama_folder(folder, LlamaConfig.from_hf(hf_cfg).to_hf(), state, tokenizer=tok)
    return folder


@pytest.mark.parametrize("as_json", [True, False])
def test_share_progress_bar_only_on_a_terminal_without_json(tiny_folder, tmp_path, monkeypatch, capsys, as_json):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setenv("TERM", "xterm")
    argv = ["continuity", "share", str(tiny_folder), "--out", str(tmp_path / "out"), "--roles", "q,up",
            "--space", "input", "--rank", "4"] + (["--json"] if as_json else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    if as_json:
        assert term.getvalue() == ""
        report = json.loads(out)
        assert report["roles"]["q"]["space"] == "input" and report["roles"]["q"]["rel_error_mean"] < 1
    else:
        assert "share q,up: 2 roles x 3 groups" in term.getvalue()
    assert "Traceback" not in term.getvalue()


def test_share_progress_counts_roles_times_groups(planted):
    _, state, _ = planted
    calls = []
    compress.share_state_dict(state, {"q": "input", "o": "output"}, n_layers=L, group=4, rank={"q": 3, "o": 5},
                              progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 4) for i in range(1, 5)]  # 2 roles x 2 groups (4 + the remainder 2)


# ---------------------------------------------------------------- re-exports

def test_compression_api_is_reexported_and_the_package_import_stays_light():
    import flowgeom.continuity as cont
    from flowgeom.continuity import lm_eval
    from flowgeom.nn import llama

    for name in cont.__all__:
        assert getattr(cont, name) is not None, name
    assert cont.share_state_dict is compress.share_state_dict and cont.perplexity is lm_eval.perplexity
    assert cont.load_llama is llama.load_llama and cont.llama_state_dict is llama.llama_state_dict
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cont.nope  # noqa: B018
    code = ("import sys, flowgeom.continuity as c; heavy = [m for m in ('flowgeom.nn.llama', 'flowgeom.data.tokens', "
            "'flowgeom.continuity.checkpoint_out', 'safetensors', 'tokenizers', 'transformers', 'matplotlib') "
            "if m in sys.modules]; print(heavy); c.load_tokenizer; print('flowgeom.data.tokens' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "True"


# ---------------------------------------------------------------- the per-role grid end to end

def _sampled_words(hf_cfg, state, n_windows: int, context: int) -> str:
    """Words sampled from the model itself: any change of its function raises the expected NLL."""
    from flowgeom.nn.llama import LlamaConfig, llama_from_state

    model = llama_from_state(LlamaConfig.from_hf(hf_cfg), state)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(hf_cfg["vocab_size"], (n_windows, 1), generator=gen)
    with torch.no_grad():
        while ids.shape[1] < context:
            probs = torch.softmax(model(ids)[:, -1], dim=-1)  # (W, vocab)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return " ".join(f"w{i}" for i in ids.flatten().tolist())


def test_per_role_grid_runs_through_the_sweep(planted, tiny_folder, tmp_path, monkeypatch):
    from flowgeom.reproduce import pipeline
    from flowgeom.reproduce.claims_continuity import run_sharing, sharing_verdict
    from flowgeom.reproduce.registry import Claim

    monkeypatch.setenv("FLOWGEOM_CACHE", str(tmp_path / "cache"))
    hf_cfg, state, _ = planted
    text = tmp_path / "text.txt"
    text.write_text(_sampled_words(hf_cfg, state, 16, 32))
    grid = sharing.sharing_grid("cpu", source=str(tiny_folder), text=str(text), tokens=None, context=32,
                                role_budgets=(BUDGET,), drop_budgets=(), random_seeds=())
    claim = Claim("continuity", "continuity.sharing", "001", "test", cpu=grid, quick=grid, run=run_sharing,
                  verdict=sharing_verdict)
    out = tmp_path / "sweep"
    report = pipeline.run("continuity", scale="cpu", out=out, claims=[claim], show_progress=False)
    assert report["sweep"]["failed"] == 0 and report["claims"][0]["finished"] == 1 + 21
    rows = [json.loads(p.read_text()) for p in (out / "runs" / "continuity.sharing").glob("*/summary.json")]
    by = {(r["strategy"], r.get("role")): r for r in rows}
    ref = by["none", None]["ppl"]
    assert by["role-input", "q"]["ppl"] == pytest.approx(ref, rel=1e-4)  # planted: exact
    assert by["role-output", "q"]["ppl"] > by["role-input", "q"]["ppl"] * 1.001
    how = report["claims"][0]["verdict"]["how"]
    assert "q: the seed's input space wins (1 of 1 budgets)" in how and "V " in how
    assert report["claims"][0]["verdict"]["verdict"] in ("reproduced", "differs", "not reproduced")


def test_per_role_verdict_flags_broken_pairs_and_cheaper_winners():
    rows = [_row("none", 30.0)] + _role_rows({"up": (500, 320, 800), "q": (31, 33, 32), "v": (2000, 1000, 9000)})
    rows[1]["saved_fraction"] = 0.05  # up, input space: 5% saved against 12.5% in the output space
    rows[2]["saved_fraction"] = 0.125
    how = sharing.judge(rows)["how"]
    assert "up: the seed's input space loses (0 of 1 budgets) [1 of 1 budgets: both broken (ppl over 10x the " \
           "reference)]" in how  # the output space won while saving more: no cheaper-winner flag
    assert "q: the seed's input space wins (1 of 1 budgets);" in how  # 31 and 33 are fine models
    assert "(all 3 broken: ppl over 10x the reference)" in how  # V: 2000, 1000, 9000 against 30
    rows[1]["ppl"], rows[1]["nll"] = 250.0, math.log(250.0)  # now the input space wins, having saved less
    how = sharing.judge(rows)["how"]
    assert "up: the seed's input space wins (1 of 1 budgets) [1 of 1 budgets: the winner saved less]" in how
