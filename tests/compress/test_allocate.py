"""Loss-aware rank allocation and mixed plans: the estimates against autograd and against measured loss changes,
the selection against brute force, the chosen allocation against exhaustive search on a tiny trained Llama, and
the CLI (--allocate, --method mixed, bad input)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
import torch.nn.functional as F
from test_compression import tiny_folder
from test_share_evaluate import _run

from flowgeom.compress import allocate as A
from flowgeom.compress import plan as C
from flowgeom.compress.calibrate import calibrate, sensitivity
from flowgeom.compress.mixed import calibration_loss
from flowgeom.errors import FlowgeomError
from flowgeom.nn.llama import LlamaConfig, LlamaForCausalLM, llama_from_state

VOCAB = 48


def _markov(n_seq: int, T: int, seed: int) -> torch.Tensor:
    """Sequences of a fixed sparse Markov chain (3 successors per token, probabilities .7/.2/.1)."""
    nxt = torch.randint(0, VOCAB, (VOCAB, 3), generator=torch.Generator().manual_seed(123))
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(n_seq, T, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (n_seq,), generator=gen)
    for t in range(1, T):
        pick = torch.multinomial(torch.tensor([0.7, 0.2, 0.1]), n_seq, replacement=True, generator=gen)
        ids[:, t] = nxt[ids[:, t - 1], pick]
    return ids


@pytest.fixture(scope="module")
def trained():
    """A 3-block Llama trained to loss ~1 on the chain (from ~3.9): compression costs it real loss."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = _markov(16 * 120, 33, 1)
    for step in range(120):
        x = data[16 * step:16 * (step + 1)]
        loss = F.cross_entropy(model(x)[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().requires_grad_(False)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = _markov(16, 33, 7)
    return cfg, model, state, ids, calibrate(model, ids)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A tiny HF Llama folder (512 positions: the calibration sequences are 512 tokens) with a byte tokenizer."""
    return tiny_folder(tmp_path, monkeypatch, max_position_embeddings=512)


def _share(capsys, tiny, out, *argv):
    return _run(capsys, "compress", "run", str(tiny), "--out", str(out), "--calib", str(tiny.parent / "calib.txt"),
                "--calib-tokens", "512", *argv)


def _loss(cfg, state, ids) -> float:
    return calibration_loss(llama_from_state(cfg, state), ids, batch=16)


# ---------------------------------------------------------------- the estimates

def test_first_order_estimate_is_the_weight_gradient_along_each_component(trained):
    cfg, model, state, ids, calib = trained
    p = C.plan("whiten", state, n_layers=3, ratio=0.3)
    factors = C.full_factors(p, state, calib)
    sens, loss = sensitivity(model, ids, C.probes(p.units, factors))
    assert loss == pytest.approx(_loss(cfg, state, ids), rel=1e-5)
    for u, f in list(zip(p.units, factors))[::5]:
        w = model.get_parameter(C.weight_key(u.layers[0], u.role))
        w.requires_grad_(True)
        logits = model(ids)
        grad, = torch.autograd.grad(F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)), w)
        w.requires_grad_(False)
        P, Q = (f.coeffs[0], f.basis) if f.space == "input" else (f.basis, f.coeffs[0])
        want = -torch.einsum("mn,mi,in->i", grad.double(), P.double(), Q.double())  # -<∇W L, P_i Q_i>
        got = sens[(u.layers[0], u.role)][0]
        assert (got - want).abs().max() <= 1e-4 * want.abs().max() + 1e-9, u


def _whole_model_sensitivity(model, ids, probes, batch=2):
    """The estimates of :func:`sensitivity` by one backward through the whole model per batch (every block's
    activations held at once): the independent reference for its block-by-block backward."""
    from flowgeom.compress.arch import runner
    from flowgeom.compress.calibrate import logits_of

    run = runner(model)
    n_targets = ids.shape[0] * (ids.shape[1] - 1)
    first = {k: torch.zeros(P.shape[1], dtype=torch.float64) for k, (P, _) in probes.items()}
    fisher = {k: torch.zeros(P.shape[1], dtype=torch.float64) for k, (P, _) in probes.items()}

    def watch(key):
        P, Q = (t.float() for t in probes[key])
        rows = run.arch.slots[key[1]].rows  # a role inside a fused projection

        def hook(_m, args, out):
            x = args[0].detach()

            def on_grad(g):
                g = g if rows is None else g[..., list(rows)]
                ab = (g.reshape(-1, g.shape[-1]) @ P) * (x.reshape(-1, x.shape[-1]) @ Q.T)  # (B T, r)
                first[key].sub_(ab.sum(0).double())
                fisher[key].add_(ab.double().square().sum(0) * (n_targets / 2))
            out.register_hook(on_grad)
        return hook

    for size in {min(batch, len(ids) - i) for i in range(0, len(ids), batch)}:
        run.prepare(size, ids.shape[1], torch.float32)  # a transformers model's block arguments, before the hooks
    handles = [run.layers[l].get_submodule(run.arch.slots[r].path).register_forward_hook(watch((l, r)))
               for l, r in probes]
    model.requires_grad_(False)
    total = 0.0
    for i in range(0, len(ids), batch):
        x = ids[i:i + batch]
        logits = logits_of(model, x, root=True)  # (B, T, vocab)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1),
                               reduction="sum") / n_targets
        loss.backward()
        total += float(loss.detach())
    for handle in handles:
        handle.remove()
    return {k: (first[k], fisher[k]) for k in probes}, total


@pytest.mark.parametrize("method", ["whiten", "basis-sharing"])
def test_block_by_block_sensitivity_is_the_whole_model_backward(trained, method):
    """The gradients of the checkpointed backward (the head run one sequence at a time) are the whole-model
    backward's, bit for bit, from probes in memory or read from disk one unit at a time; the loss, summed in
    another order, to rounding."""
    from flowgeom.compress.store import FactorFiles, TensorFiles

    cfg, model, state, ids, calib = trained
    p = C.plan(method, state, n_layers=3, ratio=0.3, group=2)
    factors = C.full_factors(p, state, calib)
    want, want_loss = _whole_model_sensitivity(model, ids, C.probes(p.units, factors))
    on_disk = C.full_factors(p, state, calib, out=FactorFiles(TensorFiles.temporary()))
    for probes in (C.probes(p.units, factors), C.probes(p.units, on_disk)):
        got, loss = sensitivity(model, ids, probes)
        assert loss == pytest.approx(want_loss, rel=1e-6) and list(got) == list(want)  # summed per sequence
        for key in want:
            assert torch.equal(got[key][0], want[key][0]) and torch.equal(got[key][1], want[key][1]), key
    for f, g in zip(factors, on_disk):
        assert f.space == g.space and f.shift == g.shift and torch.equal(f.basis, g.basis)
        assert torch.equal(f.sigma, g.sigma) and all(torch.equal(a, b) for a, b in zip(f.coeffs, g.coeffs))


@pytest.mark.parametrize("model_type", ["phi3", "gpt2"])
def test_block_by_block_sensitivity_is_the_whole_model_backward_of_a_transformers_family(model_type):
    """The same through a transformers model's own blocks (their captured arguments), fused q|k|v rows
    (Phi-3) and GPT-2's transposed Conv1D included."""
    pytest.importorskip("transformers")
    from flowgeom.compress.arch import arch_of, role_state
    from flowgeom.hf.tiny import tiny_model

    def fresh():  # calibration's inference mode would leave its captured block arguments on a model it ran
        return tiny_model(model_type, seed=0, dtype=torch.float32, vocab_size=VOCAB).eval()

    model = fresh()
    L = model.config.num_hidden_layers
    state = role_state(arch_of(model.config), dict(model.state_dict()), L)
    ids = _markov(6, 24, 3)
    p = C.plan("whiten", state, n_layers=L, ratio=0.3, roles=arch_of(model.config).roles)
    factors = C.full_factors(p, state, calibrate(fresh(), ids))
    want, want_loss = _whole_model_sensitivity(model, ids, C.probes(p.units, factors))
    got, loss = sensitivity(model, ids, C.probes(p.units, factors))
    assert loss == pytest.approx(want_loss, rel=1e-6) and list(got) == list(want)  # summed per sequence
    assert all(torch.equal(got[k][0], want[k][0]) and torch.equal(got[k][1], want[k][1]) for k in want)


def test_compress_run_writes_the_factors_of_the_in_memory_pipeline(tiny, tmp_path, capsys):
    """``compress run`` (Grams and full-rank factors waiting on disk, the model's weights not copied, gradients
    block by block) writes exactly the tensors of the pipeline held in memory: calibrate, full-rank factors,
    a whole-model backward, the allocation, the truncated factors. With the cache cold, warm, and off."""
    from safetensors.torch import load_file

    from flowgeom.compress.calibrate import GRAD_TOKENS
    from flowgeom.compress.folder import factored_tensors
    from flowgeom.compress.calibrate import calibration_ids
    from flowgeom.compress.source import view_model
    from flowgeom.compress.store import cache_root
    from flowgeom.data.tokens import load_tokenizer
    from flowgeom.nn.llama import llama_state_dict

    cfg, state = llama_state_dict(tiny)
    ids = calibration_ids(tiny, str(tiny.parent / "calib.txt"), 512, 512, load_tokenizer(tiny))
    calib = calibrate(llama_from_state(cfg, state), ids)
    L = cfg.num_hidden_layers
    p = C.plan("whiten", state, n_layers=L, ratio=0.2, calib=calib)
    units = p.units + p.dense
    factors = C.full_factors(p, state, calib)
    sens, _ = _whole_model_sensitivity(llama_from_state(cfg, state), ids[: max(1, GRAD_TOKENS // 512)],
                                       C.probes(units, factors))
    ranks = A.allocate(C.candidates(units, sens), math.ceil(0.2 * sum(u.dense_params for u in units)))
    new = C.with_ranks(p, units, ranks, "")
    full = {(u.role, u.space, u.layers): f for u, f in zip(units, factors)}
    want, _ = factored_tensors(C.compress(new, state, calib, full=full), state, tie=cfg.tie_word_embeddings)
    for name, argv in (("cold", []), ("warm", []), ("off", ["--no-cache"])):
        out = tmp_path / name
        code, _, err = _share(capsys, tiny, out, *argv)
        assert code == 0, err
        [weights] = out.glob("*.safetensors")
        got = load_file(str(weights))
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), name
    assert not any((cache_root() / "scratch").iterdir())  # the scratch folders went with the run
    model = view_model(cfg, state)  # what calibration and the gradients run: the weights themselves
    assert all(model.get_parameter(k).data_ptr() == t.data_ptr() for k, t in state.items())


def test_second_order_estimate_predicts_the_loss_of_removing_one_component(trained):
    """Taylor (first + Fisher) against the measured loss change of removing single components; first order
    alone misses the curvature of the large ones."""
    cfg, model, state, ids, calib = trained
    p = C.plan("whiten", state, n_layers=3, ratio=0.3, roles=("down", "q"))
    factors = C.full_factors(p, state, calib)
    sens, base = sensitivity(model, ids, C.probes(p.units, factors))
    taylor, first, actual = [], [], []
    for u, f in zip(p.units, factors):
        key = C.weight_key(u.layers[0], u.role)
        P, Q = (f.coeffs[0], f.basis) if f.space == "input" else (f.basis, f.coeffs[0])
        for i in range(0, P.shape[1], 4):
            changed = dict(state)
            changed[key] = state[key] - P[:, i:i + 1] @ Q[i:i + 1]
            actual.append(_loss(cfg, changed, ids) - base)
            d1, d2 = sens[(u.layers[0], u.role)]
            taylor.append(float(d1[i] + d2[i]))
            first.append(float(d1[i]))
    actual, taylor, first = map(torch.tensor, (actual, taylor, first))
    err_taylor = (taylor - actual).abs().sum() / actual.abs().sum()
    err_first = (first - actual).abs().sum() / actual.abs().sum()
    assert err_taylor < 0.35
    assert err_taylor < err_first
    assert torch.corrcoef(torch.stack([taylor, actual]))[0, 1] > 0.9


# ---------------------------------------------------------------- the selection

def _brute(cands, target):
    """The minimum predicted cost over every prefix allocation (rank 1..max or dense) saving >= target."""
    best = (math.inf, None)
    options = [[None, *range(1, c.max_rank + 1)] for c in cands]
    for ks in itertools.product(*options):
        if sum(c.savings(k) for c, k in zip(cands, ks)) >= target:
            best = min(best, (A.predicted(cands, ks), ks), key=lambda t: t[0])
    return best


@pytest.mark.parametrize("seed", range(6))
def test_lagrangian_selection_is_near_the_brute_force_optimum_and_meets_the_budget(seed):
    gen = torch.Generator().manual_seed(seed)
    cands = []
    for m, n in [(6, 10), (8, 8), (4, 12), (10, 6)]:
        sigma2 = torch.rand(min(m, n), generator=gen).sort(descending=True).values ** 2 * torch.rand(1, generator=gen) * 3
        noise = 0.1 * torch.randn(min(m, n), generator=gen) * sigma2
        cands.append(A.Candidate((sigma2 + noise).double(), m + n, m * n))
    target = int(0.35 * sum(c.dense for c in cands))
    ks = A.select(cands, target)
    saved = sum(c.savings(k) for c, k in zip(cands, ks))
    assert target <= saved < target + max(c.per_rank for c in cands)
    best, _ = _brute(cands, target)
    assert A.predicted(cands, ks) <= best * 1.05 + 1e-12
    zs = A.zero_sum(cands, target)
    assert sum(c.savings(k) for c, k in zip(cands, zs)) >= target


def test_a_unit_whose_factoring_saves_nothing_stays_dense():
    costly = A.Candidate(torch.linspace(10, 1, 8).double(), 16, 64)  # 8x8: rank >= 4 saves nothing
    cheap = A.Candidate(torch.full((8,), 1e-3).double(), 16, 64)
    ks = A.select([costly, cheap], 48)  # 48 of 128: all from the cheap one (rank 1 saves 48)
    assert ks == [None, 1]
    assert costly.max_rank == 3 and costly.savings(None) == 0
    with pytest.raises(FlowgeomError, match="smaller budget"):
        A.select([costly, cheap], 97)


def test_zero_sum_keeps_the_running_sum_of_first_order_estimates_near_zero():
    gen = torch.Generator().manual_seed(3)
    cands = [A.Candidate(torch.randn(12, generator=gen).double(), 20, 100) for _ in range(5)]
    ks = A.zero_sum(cands, 200)
    removed = A.predicted(cands, ks)
    largest = max(float(c.cost.abs().max()) for c in cands)
    assert abs(removed) <= largest  # the rule alternates signs: the sum never runs away
    assert abs(removed) < abs(sum(float(c.cost[k:].sum()) for c, k in zip(cands, [k or 12 for k in ks]))) + largest


# ---------------------------------------------------------------- against exhaustive search

def test_loss_allocation_is_within_5_percent_of_the_exhaustive_best(trained):
    """Every prefix allocation (rank, or dense) of the three down projections at the same budget, each measured;
    the allocator's choice (the estimates, no search) is within 5% of the best measured calibration loss."""
    cfg, model, state, ids, calib = trained
    p = C.plan("whiten", state, n_layers=3, ratio=0.5, roles=("down",))
    factors = C.full_factors(p, state, calib)
    sens, dense_loss = sensitivity(model, ids, C.probes(p.units, factors))
    cands = C.candidates(p.units, sens)
    target = math.ceil(0.5 * p.dense_params)

    def measured(ks) -> float:
        changed = dict(state)
        for u, f, k in zip(p.units, factors, ks):
            if k is not None:
                changed[C.weight_key(u.layers[0], u.role)] = C.truncate(f, k).dense()[0]
        return _loss(cfg, changed, ids)

    losses = {}
    options = [[None, *range(1, c.max_rank + 1)] for c in cands]
    for first in itertools.product(*options[:-1]):  # the last unit takes the largest rank that meets the budget
        rest = target - sum(c.savings(k) for c, k in zip(cands, first))
        last = cands[-1]
        k = None if rest <= 0 else (last.dense - rest) // last.per_rank
        if k is not None and k < 1:
            continue
        losses[(*first, k)] = measured((*first, k))
    best = min(losses.values())
    worst = max(losses.values())
    chosen = A.allocate(cands, target)
    got = measured(chosen)
    even = measured([u.rank for u in p.units])
    assert worst > 1.05 * best  # the 5% criterion separates allocations here
    assert got <= 1.05 * best, (chosen, got, best, min(losses, key=losses.get))
    assert got - dense_loss <= 1.5 * (best - dense_loss)  # and in the loss the compression adds
    assert got <= even + 1e-6


# ---------------------------------------------------------------- plans, CLI

def test_a_plan_with_dense_units_counts_them_in_the_scope(trained):
    cfg, model, state, ids, calib = trained
    p = C.plan("whiten", state, n_layers=3, ratio=0.3, roles=("q", "down"))
    new = C.with_ranks(p, p.units, [None, *[u.rank for u in p.units[1:]]], "test")
    assert new.dense_params == p.dense_params
    assert new.stored_params == p.stored_params - p.units[0].stored_params + p.units[0].dense_params
    roles = new.by_role()
    assert roles["q"]["dense_layers"] == [0] and len(roles["q"]["rel_error"]) == 1
    out = C.Compressed(new, [C.truncate(f, u.rank) for u, f in zip(new.units, C.full_factors(new, state, calib))])
    assert torch.equal(out.dense_state(state)[C.weight_key(0, "q")], state[C.weight_key(0, "q")])


def test_loss_allocation_through_the_cli_meets_the_budget_and_loads(tiny, tmp_path, capsys):
    from flowgeom.compress.folder import factored_llama

    out = tmp_path / "loss"
    code, stdout, err = _share(capsys, tiny, out, "--budget", "0.3", "--allocate", "loss", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["allocate"] == "loss" and "calib_loss" in report["allocation"]
    assert 0.3 <= report["scope_saved_fraction"] < 0.3 + 0.01
    ranks = [k for r in report["roles"].values() for k in r["ranks"]]
    assert len(set(ranks)) > 1  # not the even split
    with torch.no_grad():
        assert math.isfinite(float(factored_llama(out)(torch.zeros(1, 8, dtype=torch.long)).sum()))


@pytest.mark.parametrize("seed", range(4))
def test_a_rank_cap_is_respected_and_the_capped_optimum_is_found(seed):
    """With caps, every rank stays within its cap (or the unit stays dense), the budget is met, and the
    selection is near the brute-force optimum over the capped choices."""
    gen = torch.Generator().manual_seed(seed)
    cands = []
    for m, n in [(6, 10), (8, 8), (4, 12), (10, 6)]:
        cost = (torch.rand(min(m, n), generator=gen).sort(descending=True).values ** 2).double()
        cands.append(A.Candidate(cost, m + n, m * n, C.speed_cap((m, n), 0.6)))
    assert all(c.max_rank * c.per_rank <= 0.6 * c.dense for c in cands)
    target = int(0.4 * sum(c.dense for c in cands))
    ks = A.select(cands, target)
    assert all(k is None or k <= c.cap for c, k in zip(cands, ks))
    assert sum(c.savings(k) for c, k in zip(cands, ks)) >= target
    best, _ = _brute(cands, target)
    assert A.predicted(cands, ks) <= best * 1.05 + 1e-12


def test_speed_cap_is_the_flop_fraction_of_the_two_products():
    for (m, n), f in [((576, 576), 0.7), ((1536, 576), 0.5), ((192, 576), 1.0)]:
        k = C.speed_cap((m, n), f)
        assert k * (m + n) <= f * m * n < (k + 1) * (m + n)


def test_max_flops_keeps_slow_projections_dense_through_the_cli(tiny, tmp_path, capsys):
    out = tmp_path / "capped"
    code, stdout, err = _share(capsys, tiny, out, "--budget", "0.3", "--max-flops", "0.6", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    assert report["max_flops"] == 0.6 and 0.3 <= report["scope_saved_fraction"]
    from flowgeom.compress.folder import read_factored

    _, units, _ = read_factored(out)
    assert units and all(u.rank * sum(u.shape) <= 0.6 * u.shape[0] * u.shape[1] for u in units)
    code, _, err = _share(capsys, tiny, tmp_path / "y", "--allocate", "even", "--max-flops", "0.6")
    assert code == 2 and "--max-flops caps the ranks the loss allocation chooses" in err
    assert not (tmp_path / "y").exists()


def test_allocate_loss_without_calibration_is_one_line_exit_2(tiny, tmp_path, capsys):
    code, _, err = _share(capsys, tiny, tmp_path / "x", "--method", "svd", "--allocate", "loss")
    assert code == 2 and "--allocate loss needs calibration" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
    code, _, err = _share(capsys, tiny, tmp_path / "x", "--rank", "4", "--allocate", "loss")
    assert code == 2 and "--rank fixes every rank" in err


def test_mixed_writes_a_folder_evaluate_reads_and_keeps_the_best_measured_split(tiny, tmp_path, capsys):
    out = tmp_path / "mixed"
    code, stdout, err = _share(capsys, tiny, out, "--method", "mixed", "--budget", "0.3", "--calib-tokens", "1024",
                               "--allocate", "loss", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    tried = report["mixed_tried"]
    assert [t["n"] for t in tried] == list(range(len(tried))) and len(tried) >= 2
    best = min(tried, key=lambda t: t["loss"])
    assert report["dropped"] == best["dropped"] and report["layers"] == 4 - best["n"]
    assert all(t["scope_saved_fraction"] >= 0.3 for t in tried)
    assert report["scope_saved_fraction"] == pytest.approx(best["scope_saved_fraction"])
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 4 - best["n"]
    code, stdout, err = _run(capsys, "compress", "evaluate", str(tiny), "--compare", str(out), "--text",
                             str(tiny.parent / "text.txt"), "--context", "64", "--json")
    assert code == 0, err
    assert math.isfinite(json.loads(stdout)["models"][1]["ppl"])
