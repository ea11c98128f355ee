"""Training-time continuity metrics: checked against a direct full SVD and planted cases."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.continuity.dynamics import ContinuityTracker, relative_update, series, stack_continuity
from flowgeom.errors import FlowgeomError


def planted_stack(L, m, n, *, seed, gap=4.0, noise=0.05):
    """Matrices with a clear top singular pair (σ1 ≈ gap · σ2), independent directions per layer."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(L, m, 2, generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(L, n, 2, generator=g, dtype=torch.float64))[0]
    A = gap * u[..., :1] @ v[..., :1].mT + u[..., 1:] @ v[..., 1:].mT
    return A + noise * torch.randn(L, m, n, generator=g, dtype=torch.float64)


def direct(stack):
    U, S, Vh = torch.linalg.svd(stack.double(), full_matrices=False)
    v1 = (Vh[:-1, 0] * Vh[1:, 0]).sum(-1).abs()
    u1 = (U[:-1, :, 0] * U[1:, :, 0]).sum(-1).abs()
    A, B = stack[:-1].double(), stack[1:].double()
    gin = torch.stack([((a.T @ a) * (b.T @ b)).sum() / ((a.T @ a).norm() * (b.T @ b).norm()) for a, b in zip(A, B)])
    gout = torch.stack([((a @ a.T) * (b @ b.T)).sum() / ((a @ a.T).norm() * (b @ b.T).norm()) for a, b in zip(A, B)])
    return v1, u1, gin, gout


@pytest.mark.parametrize("shape", [(4, 12, 9), (3, 7, 16)])
def test_matches_full_svd(shape):
    stack = planted_stack(*shape, seed=1).float()
    got = stack_continuity(stack, k=2, seed=0)
    v1, u1, gin, gout = direct(stack)
    assert got["v1_pairs"] == pytest.approx(v1.tolist(), abs=1e-4)
    assert got["u1_pairs"] == pytest.approx(u1.tolist(), abs=1e-4)
    assert got["v1"] == pytest.approx(float(v1.mean()), abs=1e-4)
    assert got["gram_in"] == pytest.approx(float(gin.mean()), rel=1e-5)
    assert got["gram_out"] == pytest.approx(float(gout.mean()), rel=1e-5)
    _, _, Vh = torch.linalg.svd(stack.double(), full_matrices=False)
    sub = ((Vh[:-1, :2] @ Vh[1:, :2].mT) ** 2).sum((-2, -1)) / 2  # mean cos² of principal angles, top-2
    assert got["subspace_in"] == pytest.approx(float(sub.mean()), abs=1e-4)


def test_planted_shared_direction_is_continuous():
    """Layers sharing v1 (own u1) are input-continuous only."""
    g = torch.Generator().manual_seed(3)
    v = torch.nn.functional.normalize(torch.randn(10, generator=g), dim=0)
    u = torch.nn.functional.normalize(torch.randn(5, 8, generator=g), dim=1)
    stack = 5 * u[:, :, None] * v[None, None, :] + 0.01 * torch.randn(5, 8, 10, generator=g)
    got = stack_continuity(stack, k=1)
    assert got["v1"] > 0.999
    assert got["u1"] < 0.9


def model_and_params(L=4, m=6, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(m, n, generator=g)) for _ in range(L)]


def test_identical_gradients_give_gradient_continuity_one():
    params = model_and_params()
    tracker = ContinuityTracker({"w": params}, k=2)
    g = torch.randn(6, 5, generator=torch.Generator().manual_seed(9))
    for p in params:
        p.grad = g.clone()
    rec = tracker.measure()["w"]
    assert rec["v1_baseline"] == pytest.approx(math.gamma(2.5) / (math.sqrt(math.pi) * math.gamma(3)))  # d = 5
    assert {"u1_baseline", "gram_in_baseline", "subspace_in_baseline"} <= set(rec)
    for key in ("v1", "u1", "gram_in", "gram_out", "subspace_in", "index_in"):
        assert rec["grad"][key] == pytest.approx(1.0, abs=1e-5)
    assert rec["weight"]["v1"] < 0.99  # independent random weights


def test_delta_tracks_accumulated_update_and_ratio():
    params = model_and_params(L=3)
    tracker = ContinuityTracker({"w": params})
    w0 = [p.detach().clone() for p in params]
    rec0 = tracker.measure()["w"]
    assert math.isnan(rec0["delta"]["v1"]) and rec0["dw_ratio"] == 0.0
    assert math.isnan(rec0["grad"]["v1"])  # no gradient yet
    d = torch.outer(torch.arange(1.0, 7.0), torch.ones(5))  # rank one, same for every layer
    with torch.no_grad():
        for i, p in enumerate(params):
            p.add_((i + 1) * d)
    rec = tracker.measure()["w"]
    assert rec["delta"]["v1"] == pytest.approx(1.0, abs=1e-5)
    assert rec["delta"]["u1"] == pytest.approx(1.0, abs=1e-5)
    want = [float((i + 1) * d.norm() / w.norm()) for i, w in enumerate(w0)]
    assert rec["dw_ratio_layers"] == pytest.approx(want, rel=1e-5)
    assert rec["dw_ratio"] == pytest.approx(sum(want) / 3, rel=1e-5)


def test_relative_update_closed_form():
    w0 = torch.ones(2, 3, 3)
    w = w0 * torch.tensor([2.0, 0.5])[:, None, None]
    assert relative_update(w, w0).tolist() == pytest.approx([1.0, 0.5])


def test_tracker_state_roundtrip_and_series():
    params = model_and_params()
    tracker = ContinuityTracker({"w": params})
    state = tracker.state_dict()
    with torch.no_grad():
        params[0].mul_(3.0)
    other = ContinuityTracker({"w": params})
    other.load_state_dict(state)
    assert torch.equal(other.w0["w"], tracker.w0["w"])
    records = [{"step": 0, "loss": 1.0}, {"step": 5, "continuity": tracker.measure()}]
    steps, values = series(records, "w", None, "dw_ratio")
    assert steps == [5] and values[0] > 0
    assert series(records, "w", "weight", "v1")[0] == [5]


def test_bad_roles_are_clear_errors():
    with pytest.raises(FlowgeomError, match="needs >= 2"):
        ContinuityTracker({"w": model_and_params(L=1)})
    with pytest.raises(FlowgeomError, match="one shape"):
        ContinuityTracker({"w": [torch.zeros(3, 3), torch.zeros(3, 4)]})
    with pytest.raises(FlowgeomError, match="at least one role"):
        ContinuityTracker({})
    with pytest.raises(FlowgeomError, match="unknown kinds"):
        ContinuityTracker({"w": model_and_params()}, kinds=("weights",))
    with pytest.raises(FlowgeomError, match="L >= 2"):
        stack_continuity(torch.zeros(1, 3, 3))


@settings(max_examples=8, deadline=None)
@given(L=st.integers(2, 4), m=st.integers(2, 9), n=st.integers(2, 9), seed=st.integers(0, 99))
def test_ranges_and_lengths(L, m, n, seed):
    stack = torch.randn(L, m, n, generator=torch.Generator().manual_seed(seed))
    got = stack_continuity(stack, k=4, seed=seed)
    k = min(4, m, n)
    assert len(got["v1_pairs"]) == L - 1 and len(got["v_idx"]) == k and len(got["u_idx"]) == k
    for key in ("v1", "u1", "gram_in", "gram_out", "index_in", "index_out", "subspace_in", "subspace_out"):
        assert -1e-6 <= got[key] <= 1 + 1e-6


def test_low_rank_gradient_stacks_stay_in_range():
    """Rank-deficient stacks (gradients at init): cosines stay in [0, 1] and v1 matches the full SVD."""
    g = torch.Generator().manual_seed(5)
    stack = torch.randn(4, 20, 2, generator=g) @ torch.randn(4, 2, 20, generator=g)
    stack[1] *= 1e-3
    got = stack_continuity(stack, k=4)
    v1, u1, _, _ = direct(stack)
    assert got["v1_pairs"] == pytest.approx(v1.tolist(), abs=1e-4)
    assert all(0 <= c <= 1 + 1e-9 for c in got["v_idx"] + got["u_idx"])
