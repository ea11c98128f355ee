"""The numeric law counter agrees with closed forms, planted laws and a dense baseline."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.laws.catalogue import expected_count
from flowgeom.laws.count import SpanTracker, count
from flowgeom.laws.fields import FieldModel, shape_sampler
from flowgeom.nn import build



def _laws(name, seed=0, **opts):
    res = count(build(name, seed=seed, **opts), seed=seed)
    assert res.parameters == res.rank + res.laws
    return res


# --- closed forms, three sizes per architecture --------------------------------------------

@pytest.mark.parametrize("activation", ["gelu", "silu", "tanh"])
@pytest.mark.parametrize("d_model,d_hidden", [(3, 4), (4, 6), (5, 3)])
def test_smooth_ffn_has_no_laws(activation, d_model, d_hidden):
    res = _laws("ffn", activation=activation, d_model=d_model, d_hidden=d_hidden)
    assert res.laws == 0 and res.ranks_by_depth == [res.parameters]
    assert res.gap["largest_dropped"] == []  # full rank: nothing was dropped


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("d_in,width,d_out", [(4, 3, 5), (3, 6, 2), (5, 4, 4)])
def test_relu2_one_law_per_neuron(d_in, width, d_out, bias):
    assert _laws("relu2", d_in=d_in, width=width, d_out=d_out, bias=bias).laws == width


@pytest.mark.parametrize("d_in,width,d_out", [(4, 3, 5), (3, 2, 4), (5, 4, 4)])
def test_linear2_symmetric_matrix_law(d_in, width, d_out):
    res = _laws("linear2", d_in=d_in, width=width, d_out=d_out)
    assert res.laws == width * (width + 1) // 2
    assert res.ranks_by_depth[1] > res.ranks_by_depth[0]  # brackets are needed (rotations of the inner space)


@pytest.mark.parametrize("d_model,d_hidden,d_out", [(3, 2, 3), (4, 5, 2), (6, 8, 6)])
def test_swiglu_one_law_per_hidden_unit(d_model, d_hidden, d_out):
    assert _laws("swiglu", d_model=d_model, d_hidden=d_hidden, d_out=d_out).laws == d_hidden


@pytest.mark.parametrize("positions", ["none", "sinusoidal"])
@pytest.mark.parametrize("d_model,heads,d_k,d_v", [(6, 2, 2, 3), (5, 1, 2, 2), (8, 3, 1, 2)])
def test_mha_head_gram_laws(positions, d_model, heads, d_k, d_v):
    res = _laws("mha", d_model=d_model, heads=heads, d_k=d_k, d_v=d_v, positions=positions)
    assert res.laws == heads * (d_k * (d_k + 1) // 2 + d_v * (d_v + 1) // 2)


@pytest.mark.parametrize("d_model,heads,d_k,d_v", [(6, 2, 4, 2), (5, 1, 2, 3), (6, 1, 6, 1)])
def test_mha_rope_block_laws(d_model, heads, d_k, d_v):
    res = _laws("mha", d_model=d_model, heads=heads, d_k=d_k, d_v=d_v, positions="rope")
    assert res.laws == heads * (d_k // 2 + d_v * (d_v + 1) // 2)


@pytest.mark.parametrize("opts", [{}, {"top_k": 2}, {"router_bias": True}, {"experts": 4, "top_k": 3, "d_hidden": 2}])
def test_moe_softmax_keeps_the_router_law(opts):
    model = build("moe", seed=0, **opts)
    res = count(model)
    e, m, d = model.n_experts, model.d_hidden, model.d_model
    assert res.laws == e * m + d + (1 if opts.get("router_bias") else 0)
    assert res.expected == expected_count(model) == res.laws


@pytest.mark.parametrize("opts", [{}, {"top_k": 2}, {"router_bias": True, "experts": 4}])
def test_moe_normalised_sigmoid_loses_the_router_law(opts):
    """The seed claims E·m + d; the count says E·m (the audit's finding)."""
    model = build("moe", seed=0, gate="sigmoid", **opts)
    res = count(model)
    assert res.laws == model.n_experts * model.d_hidden
    soft = count(build("moe", seed=0, gate="softmax", **opts))
    assert soft.laws - res.laws == model.d_model + (1 if opts.get("router_bias") else 0)


def test_moe_top1_router_is_frozen():
    model = build("moe", seed=0, top_k=1)
    assert count(model).laws == expected_count(model) == 3 * 3 + 3 * 4


@pytest.mark.parametrize("widths", ["4,3,3,5", "3,2,2,2,4", "2,3,3"])
def test_deep_linear_chain_one_gram_law_per_pair(widths):
    ws = [int(w) for w in widths.split(",")]
    res = _laws("chain", widths=widths)
    assert res.laws == sum(w * (w + 1) // 2 for w in ws[1:-1])


@settings(max_examples=3, deadline=None)
@given(st.integers(2, 5), st.integers(1, 4), st.integers(2, 5), st.integers(0, 10**6))
def test_linear2_sweep_with_rank_condition(d_in, width, d_out, seed):
    res = _laws("linear2", seed=seed, d_in=d_in, width=width, d_out=d_out)
    if width <= min(d_in, d_out):
        assert res.laws == width * (width + 1) // 2
    else:  # UV has rank min(d_in, d_out): D − dim of the rank-bounded matrices, still counted exactly
        assert res.laws >= width * (width + 1) // 2


# --- planted laws and the dense baseline ----------------------------------------------------

class Unused(nn.Module):
    """f(x) = tanh(A x); B is never used: each of its 6 entries is conserved."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Parameter(torch.randn(2, 3))

    def forward(self, x):
        return torch.tanh(self.a(x))


class Product(nn.Module):
    """f(x) = u·v·x with scalar u, v: exactly one law, u² − v²."""

    def __init__(self):
        super().__init__()
        self.u = nn.Parameter(torch.tensor(0.7))
        self.v = nn.Parameter(torch.tensor(-1.3))

    def forward(self, x):
        return self.u * self.v * x


def test_planted_laws():
    assert count(Unused(), shape_sampler((3,))).laws == 6
    res = count(Product(), shape_sampler((2,)))
    assert (res.parameters, res.laws) == (2, 1)


def test_depth0_rank_matches_dense_jacobian_svd():
    """Baseline: the full Jacobian over many inputs, dense SVD; the engine's depth-0 rank must agree."""
    model = build("mha", seed=3, d_model=4, heads=2, d_k=2, d_v=2).double()
    res = count(model, seed=3, at="module")
    fm = FieldModel(model)
    theta = fm.layout.flatten(dict(model.named_parameters())).detach()
    x = model.sample_input(64, torch.Generator().manual_seed(1))
    jac = torch.func.jacrev(lambda t: fm.output(t, x))(theta).reshape(-1, theta.numel())  # (outputs, D)
    s = torch.linalg.svdvals(jac)
    assert int((s > 1e-9 * s[0]).sum()) == res.ranks_by_depth[0]


def test_span_tracker_planted_rank():
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(7, 20, generator=g, dtype=torch.float64)
    span = SpanTracker(20, tol=1e-9)
    assert span.add(torch.randn(5, 7, generator=g, dtype=torch.float64) @ basis) == 5
    assert span.add(torch.randn(9, 7, generator=g, dtype=torch.float64) @ basis) == 2
    assert span.rank == 7 and max(span.dropped) < 1e-12
    span.to_complement(g)
    assert span.add(basis) == 0 and span.rank == 7
    assert span.add(torch.randn(3, 20, generator=g, dtype=torch.float64)) == 3 and span.rank == 10
    assert torch.allclose(span.complement.T @ span.complement, torch.eye(10, dtype=torch.float64), atol=1e-12)


def test_same_seed_same_numbers():
    a, b = (count(build("swiglu", seed=0), seed=5) for _ in range(2))
    assert a.ranks_by_depth == b.ranks_by_depth and a.gap == b.gap


# --- normalisation, residuals, near-laws ------------------------------------------------------

class NormBlock(nn.Module):
    def __init__(self, norm: str, eps: float):
        super().__init__()
        self.up = nn.Linear(6, 5, bias=False)
        self.norm = (nn.LayerNorm if norm == "layer" else nn.RMSNorm)(5, eps=eps, elementwise_affine=False)
        self.down = nn.Linear(5, 4)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norm_eps_near_law_is_visible(norm):
    """Scale invariance of `up` gives the law ‖up‖² at eps = 0; eps breaks it only weakly."""
    exact = count(NormBlock(norm, 0.0), shape_sampler((6,)))
    broken = count(NormBlock(norm, 1e-5), shape_sampler((6,)))
    assert exact.laws == broken.laws + 1
    weakest = broken.gap["smallest_kept"]
    assert 1e-8 < weakest[0] < 1e-3 < weakest[1]  # one direction far below the others, far above round-off
    assert exact.gap["smallest_kept"][0] > 1e-3


class ResidualBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(6)
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)
        self.rms = nn.RMSNorm(6)

    def forward(self, x):  # (T, 6) -> (T, 6)
        return self.rms(x + self.down(torch.relu(self.up(self.ln(x)))))


@pytest.mark.slow
def test_layernorm_rmsnorm_residual_module_runs_cleanly():
    res = count(ResidualBlock(), shape_sampler((3, 6)))
    assert res.parameters == 128 and 0 < res.laws < res.parameters
    assert res.gap["ratio"] > 1e6 and res.vectorised and not res.notes


# --- errors -------------------------------------------------------------------------------------

def test_module_without_parameters():
    with pytest.raises(FlowgeomError, match="no parameters"):
        count(nn.ReLU(), shape_sampler((3,)))


def test_input_the_module_rejects():
    with pytest.raises(FlowgeomError, match=r"rejected an input of shape \(5,\)"):
        count(nn.Linear(3, 2), shape_sampler((5,)))


def test_missing_input_names_the_python_fix():
    with pytest.raises(FlowgeomError, match=r"pass input_shape=\(4, 8\)") as info:
        count(nn.Linear(3, 2))
    assert "--input-shape" not in str(info.value)  # a Python user has no flag to pass


def test_input_shape_keyword_counts_a_plain_module():
    chain = nn.Sequential(nn.Linear(3, 4, bias=False), nn.ReLU(), nn.Linear(4, 2, bias=False))
    res = count(chain, input_shape=(3,))
    assert (res.parameters, res.laws) == (20, 4)  # one rescaling law per hidden ReLU unit
    with pytest.raises(FlowgeomError, match=r"rejected an input of shape \(5,\).*input_shape it accepts"):
        count(chain, input_shape=[5])
    with pytest.raises(FlowgeomError, match="either sample_input or input_shape"):
        count(chain, shape_sampler((3,)), input_shape=(3,))
    with pytest.raises(FlowgeomError, match=r"input_shape must be .* like \(4, 8\)"):
        count(chain, input_shape=(0, 3))


def test_too_large_refused_with_estimate():
    with pytest.raises(FlowgeomError, match=r"D = 144 parameters needs about .* GiB"):
        count(build("swiglu"), max_memory=1000)


# --- frozen parameters are constants of the flow --------------------------------------------

class _Deep(nn.Module):
    """Linear -> Linear -> Linear: each hidden layer of width w gives the w(w+1)/2 laws W_{i+1}ᵀW_{i+1} − W_i W_iᵀ."""

    def __init__(self, frozen: tuple[str, ...] = ()):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 2, bias=False), nn.Linear(2, 2, bias=False), nn.Linear(2, 3, bias=False)
        for name in frozen:
            getattr(self, name).requires_grad_(False)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_frozen_parameters_are_held_fixed_not_counted():
    sampler = shape_sampler((3,))
    free = count(_Deep(), sampler)
    assert (free.parameters, free.laws) == (16, 6)  # two hidden layers of width 2: 3 + 3
    part = count(_Deep(frozen=("a",)), sampler)
    # a fixed: only cᵀc − b bᵀ is left (3 laws); the flow moves b and c (4 + 6 = 10 coordinates)
    assert (part.parameters, part.laws) == (10, 3)
    assert any("1 frozen parameter tensor(s)" in n and "a.weight" in n for n in part.notes)
    # the same count as the module with a as a buffer by hand (an independent construction)
    by_hand = _Deep()
    weight = by_hand.a._parameters.pop("weight")
    by_hand.a.register_buffer("weight", weight.detach())
    assert count(by_hand, sampler).laws == part.laws and not any("frozen" in n for n in free.notes)
    with pytest.raises(FlowgeomError, match="every parameter of _Deep is frozen"):
        count(_Deep(frozen=("a", "b", "c")), sampler)


def test_progress_reports_the_rank_growing_to_the_count():
    calls = []
    res = count(build("relu2", seed=0), progress=lambda stage, done, total: calls.append((stage, done, total)))
    assert calls and all(total == res.parameters for _, _, total in calls)
    assert calls[0][0].endswith("depth 0") and calls[-1][1] == res.rank
    assert [done for _, done, _ in calls] == sorted(done for _, done, _ in calls)  # the rank only grows
