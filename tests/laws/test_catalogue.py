"""The catalogue's laws hold (check at round-off), are independent, and the controls fail."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad

from flowgeom.laws import catalogue, check, expected_count, flow_rate
from flowgeom.laws.catalogue import VARIANTS
from flowgeom.laws.check import law_gradients
from flowgeom.nn import build

TOL = 1e-10


def _verify(model, seed=0):
    entry = catalogue(model)
    report = check(model, entry.laws + entry.controls, n_fields=24, n_points=2, seed=seed)
    assert report.passed, report.as_dict()
    assert report.max_violation <= TOL
    controls = [v for v in report.verdicts if v.status == "control"]
    assert controls and min(v.max_violation for v in controls) > 1e-4
    return entry


def _independent(model, entry):
    """The law components are functionally independent: their gradients have full rank."""
    if not entry.laws:
        return
    params = {n: p.detach().double() for n, p in model.named_parameters()}
    G = torch.cat(law_gradients(entry.laws, params))
    assert torch.linalg.matrix_rank(G).item() == entry.count


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.label for v in VARIANTS])
def test_every_catalogue_row_holds_and_controls_fail(variant):
    model = build(variant.arch, seed=1, **variant.options)
    entry = _verify(model)
    _independent(model, entry)


@settings(max_examples=12, deadline=None)
@given(d=st.integers(2, 6), m=st.integers(1, 6), out=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_swiglu_laws_any_size(d, m, out, seed):
    model = build("swiglu", seed=seed, d_model=d, d_hidden=m, d_out=out)
    entry = _verify(model, seed)
    assert entry.count == m


@settings(max_examples=12, deadline=None)
@given(H=st.integers(1, 3), dk=st.integers(1, 3), dv=st.integers(1, 3), pos=st.sampled_from(["none", "sinusoidal", "rope"]),
       seed=st.integers(0, 10_000))
def test_mha_laws_any_size(H, dk, dv, pos, seed):
    if pos == "rope":
        dk *= 2
    model = build("mha", seed=seed, d_model=7, heads=H, d_k=dk, d_v=dv, positions=pos, seq_len=3)
    entry = _verify(model, seed)
    qk = dk // 2 if pos == "rope" else dk * (dk + 1) // 2
    assert entry.count == H * (qk + dv * (dv + 1) // 2)
    _independent(model, entry)


@settings(max_examples=10, deadline=None)
@given(E=st.integers(2, 4), m=st.integers(1, 3), d=st.integers(2, 4), k=st.one_of(st.none(), st.integers(1, 4)),
       bias=st.booleans(), seed=st.integers(0, 10_000))
def test_softmax_moe_laws_any_size(E, m, d, k, bias, seed):
    k = None if k is None else min(k, E)
    model = build("moe", seed=seed, experts=E, d_hidden=m, d_model=d, top_k=k, router_bias=bias)
    entry = _verify(model, seed)
    router = E * (d + bias) if k == 1 else d + bias  # top-1: gate ≡ 1, the router is frozen
    assert entry.count == E * m + router


@settings(max_examples=10, deadline=None)
@given(act=st.sampled_from(["relu", "identity", "gelu", "silu", "tanh"]), bias=st.booleans(), r=st.integers(1, 3),
       seed=st.integers(0, 10_000))
def test_two_layer_laws_any_size(act, bias, r, seed):
    model = build("ffn", seed=seed, d_model=4, d_hidden=r, d_out=5, activation=act, bias=bias)
    entry = _verify(model, seed)
    assert entry.count == {"relu": r, "identity": r * (r + 1) // 2}.get(act, 0)


@pytest.mark.parametrize("widths", ["3,2,4", "4,3,3,5", "5,2,2,2,3"])
def test_deep_linear_chain_laws(widths):
    model = build("chain", seed=0, widths=widths)
    entry = _verify(model)
    inner = [int(w) for w in widths.split(",")[1:-1]]
    assert entry.count == sum(w * (w + 1) // 2 for w in inner)


def test_top1_router_is_frozen():
    model = build("moe", seed=0, top_k=1, experts=3, d_model=4)
    entry = _verify(model)
    assert "moe.router_frozen" in {l.family for l in entry.laws}
    assert entry.count == 3 * model.d_hidden + 3 * 4


@pytest.mark.parametrize("top_k", [None, 2])
def test_sigmoid_gate_router_sum_is_not_conserved_but_softmax_is(top_k):
    """The seed's claim for the normalised sigmoid gate, measured false; softmax's law pinned at zero."""
    sig = build("moe", seed=3, gate="sigmoid", top_k=top_k)
    soft = build("moe", seed=3, gate="softmax", top_k=top_k)
    (claim,) = catalogue(sig).refuted
    law = next(l for l in catalogue(soft).laws if l.family == "moe.router_sum")
    assert flow_rate(sig, claim, seed=1).max() > 1e-3
    assert flow_rate(soft, law, seed=1).max() < 1e-12
    report = check(sig, [claim], n_fields=16, n_points=1)
    assert report.verdicts[0].max_violation > 1e-3
    assert "router_sum" not in {l.family for l in catalogue(sig).laws}


def test_laws_are_conserved_by_small_step_gradient_descent():
    """An end-to-end check independent of the orthogonality argument: GD drift is O(τ²)."""
    model = build("swiglu", seed=0).double()
    x = model.sample_input(16, torch.Generator().manual_seed(0)).double()
    y = torch.randn(16, model.d_out, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    entry = catalogue(model)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    def loss(p):
        return ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean()

    def drift(tau, steps=50):
        p = dict(params)
        h0 = entry.laws[0].evaluate(p)
        for _ in range(steps):
            g = grad(loss)(p)
            p = {n: p[n] - tau * g[n] for n in p}
        return (entry.laws[0].evaluate(p) - h0).abs().max().item()

    ratio = drift(1e-2) / drift(5e-3)
    assert 3.0 < ratio < 5.0  # halving τ over τ·k fixed steps... k fixed: error ∝ τ², ratio ≈ 4


def test_expected_count_only_for_zoo_blocks():
    assert expected_count(build("swiglu", seed=0, d_hidden=5)) == 5
    assert expected_count(torch.nn.Linear(2, 2)) is None


def test_laws_located_inside_a_bigger_model():
    net = torch.nn.Sequential(build("swiglu", seed=0), build("swiglu", seed=1))
    entry = catalogue(net)
    assert {l.params[0] for l in entry.laws} == {"0.up_proj.weight", "1.up_proj.weight"}
    params = dict(net.named_parameters())
    assert entry.laws[1].evaluate(params).shape == (8,)
