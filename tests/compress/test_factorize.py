"""Activation-aware factorisations against independent computations (float64, planted ground truths)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowgeom.compress import factorize as fz
from flowgeom.errors import FlowgeomError


def _grams(g, n, tokens, gen, scale=None):
    """Gram of ``tokens`` anisotropic inputs per layer, (g, n, n)."""
    scale = torch.logspace(0, -2, n, dtype=torch.float64) if scale is None else scale
    X = torch.randn(g, tokens, n, generator=gen, dtype=torch.float64) * scale
    return X.transpose(1, 2) @ X, X


@settings(max_examples=25, deadline=None)
@given(m=st.integers(2, 9), n=st.integers(2, 9), seed=st.integers(0, 10_000), data=st.data())
def test_whitened_loss_is_the_discarded_spectrum(m, n, seed, data):
    gen = torch.Generator().manual_seed(seed)
    k = data.draw(st.integers(1, min(m, n)))
    W = torch.randn(1, m, n, generator=gen, dtype=torch.float64)
    G, X = _grams(1, n, 3 * n, gen)
    f = fz.share_input(W, G, k)
    approx = f.dense()
    loss = float(torch.linalg.matrix_norm((W[0] - approx[0]) @ X[0].T) ** 2)  # ||(W - W') X^T||_F^2, X rows tokens
    assert loss == pytest.approx(float((f.sigma[k:] ** 2).sum()), rel=1e-8, abs=1e-10)
    assert float(fz.whitened_loss(W, approx, G)[0]) == pytest.approx(loss, rel=1e-8, abs=1e-10)


def test_whitening_beats_plain_svd_on_the_data_loss():
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(1, 12, 10, generator=gen, dtype=torch.float64)
    G, _ = _grams(1, 10, 40, gen)
    whitened = fz.whitened_loss(W, fz.share_input(W, G, 4).dense(), G)
    plain = fz.whitened_loss(W, fz.share_input(W, None, 4).dense(), G)
    assert float(whitened) < float(plain)
    # the data-free case is Eckart-Young: same error as torch's own truncated SVD
    U, S, Vh = torch.linalg.svd(W[0])
    assert torch.allclose(fz.share_input(W, None, 4).dense()[0], (U[:, :4] * S[:4]) @ Vh[:4], atol=1e-12)


@pytest.mark.parametrize("space", ["input", "output"])
def test_planted_shared_basis_is_recovered_exactly(space):
    gen = torch.Generator().manual_seed(1)
    g, m, n, r = 3, 8, 7, 3
    if space == "input":
        B = torch.randn(r, n, generator=gen, dtype=torch.float64)
        W = torch.stack([torch.randn(m, r, generator=gen, dtype=torch.float64) @ B for _ in range(g)])
    else:
        B = torch.randn(m, r, generator=gen, dtype=torch.float64)
        W = torch.stack([B @ torch.randn(r, n, generator=gen, dtype=torch.float64) for _ in range(g)])
    G, _ = _grams(g, n, 30, gen)
    f = fz.factorize(W, G, r, space)
    assert torch.allclose(f.dense(), W, atol=1e-9)
    assert f.stored() == r * fz.stored_per_rank(m, n, g, space)
    assert float(f.sigma[r:].abs().max()) < 1e-6 * float(f.sigma[0])


def test_group_basis_equals_brute_force_svd_of_the_stacked_whitened_matrices():
    gen = torch.Generator().manual_seed(2)
    g, m, n, k = 2, 6, 5, 3
    W = torch.randn(g, m, n, generator=gen, dtype=torch.float64)
    G, _ = _grams(g, n, 25, gen)
    f = fz.share_input(W, G, k)
    # independent: eigenvectors of S^T (sum_l W_l^T W_l) S with S from an eigendecomposition square root
    Gs = G.sum(0)
    S = torch.linalg.cholesky(Gs)
    M = S.T @ torch.einsum("gmi,gmj->ij", W, W) @ S
    _, vecs = torch.linalg.eigh(M)
    V = vecs[:, -k:]
    P_brute = V @ V.T  # projector onto the top-k right singular space of [W_1; W_2] S
    # the basis rows span S^{-T} V: map back and compare projectors
    Vk = (f.basis @ S).T  # (n, k) = V_k (orthonormal)
    assert torch.allclose(Vk.T @ Vk, torch.eye(k, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(Vk @ Vk.T, P_brute, atol=1e-9)


def test_output_basis_minimises_the_whitened_loss_over_random_bases():
    gen = torch.Generator().manual_seed(3)
    g, m, n, k = 2, 6, 5, 2
    W = torch.randn(g, m, n, generator=gen, dtype=torch.float64)
    G, _ = _grams(g, n, 25, gen)
    best = float(fz.whitened_loss(W, fz.share_output(W, G, k).dense(), G).sum())
    for _ in range(50):
        U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen, dtype=torch.float64))
        assert best <= float(fz.whitened_loss(W, U @ U.T @ W, G).sum()) + 1e-9
    # and equals the discarded eigenvalues of sum_l W_l G_l W_l^T
    sig = fz.share_output(W, G, k).sigma
    assert best == pytest.approx(float((sig[k:] ** 2).sum()), rel=1e-8)


def test_refit_is_the_per_layer_least_squares_solution_and_never_worse():
    gen = torch.Generator().manual_seed(4)
    g, m, n, k = 2, 6, 8, 3
    W = torch.randn(g, m, n, generator=gen, dtype=torch.float64)
    G, X = _grams(g, n, 40, gen)
    D = torch.diag(torch.logspace(1, -1, n, dtype=torch.float64))
    G[1] = D @ G[1] @ D  # layers see different inputs
    f = fz.share_input(W, G, k)
    r = fz.refit(f, W, G)
    before = fz.whitened_loss(W, f.dense(), G)
    after = fz.whitened_loss(W, r.dense(), G)
    assert (after <= before + 1e-9).all()
    for l in range(g):  # lstsq: min_C ||W_l X_l^T - C B X_l^T||
        Z = (f.basis @ G[l] @ f.basis.T)
        C = torch.linalg.solve(Z, (W[l] @ G[l] @ f.basis.T).T).T
        assert torch.allclose(r.coeffs[l], C, atol=1e-5, rtol=1e-5)


def test_whitener_shifts_a_singular_gram_like_svd_llm():
    gen = torch.Generator().manual_seed(5)
    X = torch.randn(3, 6, generator=gen, dtype=torch.float64)  # 3 tokens for 6 inputs: rank 3
    S, shift = fz.whitener(X.T @ X)
    assert shift > 0
    lam = torch.linalg.eigvalsh(X.T @ X)[0]
    assert shift == pytest.approx(float(-lam) + fz.JITTER)
    assert torch.allclose(S @ S.T, X.T @ X + shift * torch.eye(6, dtype=torch.float64), atol=1e-10)
    S, shift = fz.whitener(torch.eye(4, dtype=torch.float64))
    assert shift == 0.0


@pytest.mark.parametrize("m,n,g,c", [(576, 576, 2, 0.2), (192, 576, 2, 0.2), (1536, 576, 3, 0.3), (576, 1536, 1, 0.1)])
def test_rank_rule_is_basis_sharings_formula_and_never_over_budget(m, n, g, c):
    k = fz.rank_for_ratio(m, n, g, c, "input")
    assert k == min(math.floor((1 - c) * n * m * g / (n + m * g)), min(m, n))
    assert k * (n + g * m) <= (1 - c) * g * m * n
    assert (k + 1) * (n + g * m) > (1 - c) * g * m * n or k == min(m, n)
    with pytest.raises(FlowgeomError, match="fraction"):
        fz.rank_for_ratio(m, n, g, 1.0)


# ---------------------------------------------------------------- data-free (grams None): plain SVD of the stack

def _orthonormal(k, r, gen):
    return torch.linalg.qr(torch.randn(k, r, generator=gen, dtype=torch.float64))[0]  # (k, r)


@settings(max_examples=25, deadline=None)
@given(g=st.integers(1, 4), m=st.integers(3, 9), n=st.integers(3, 9), data=st.data())
def test_data_free_sharing_reproduces_a_planted_basis_exactly(g, m, n, data):
    r = data.draw(st.integers(1, min(m, n)))
    gen = torch.Generator().manual_seed(g * 100 + m * 10 + n)
    V, U = _orthonormal(n, r, gen), _orthonormal(m, r, gen)
    w_in = torch.randn(g, m, r, generator=gen, dtype=torch.float64) @ V.T  # (g, m, n), rows in span V
    w_out = U @ torch.randn(g, r, n, generator=gen, dtype=torch.float64)  # (g, m, n), columns in span U
    assert torch.allclose(fz.share_input(w_in, None, r).dense(), w_in, atol=1e-10)
    assert torch.allclose(fz.share_output(w_out, None, r).dense(), w_out, atol=1e-10)
    if g >= 2 and r < m:  # the wrong space needs rank min(m, g r) > r: it loses information (the test can fail)
        assert not torch.allclose(fz.factorize(w_in, None, r, "output").dense(), w_in, atol=1e-6)


def test_data_free_basis_spans_the_top_singular_space_of_the_stack():
    gen = torch.Generator().manual_seed(5)
    mats = torch.randn(3, 7, 5, generator=gen, dtype=torch.float64)
    r = 2
    vertical, horizontal = mats.reshape(21, 5), torch.cat(list(mats), dim=1)  # (g m, n), (m, g n)
    _, s_in, Vh = torch.linalg.svd(vertical)
    P_ref = Vh[:r].T @ Vh[:r]
    f = fz.share_input(mats, None, r)
    assert torch.allclose(f.basis @ f.basis.T, torch.eye(r, dtype=torch.float64), atol=1e-12)  # (k, n) orthonormal
    assert torch.allclose(f.basis.T @ f.basis, P_ref, atol=1e-10)
    assert torch.allclose(f.sigma, s_in, atol=1e-10)
    U_ref, s_out, _ = torch.linalg.svd(horizontal)
    out = fz.share_output(mats, None, r)
    assert torch.allclose(out.basis @ out.basis.T, U_ref[:, :r] @ U_ref[:, :r].T, atol=1e-10)
    assert torch.allclose(out.sigma, s_out, atol=1e-10)
    # coefficients + basis rebuild the projection
    assert torch.stack(f.coeffs).shape == (3, 7, 2) and torch.allclose(f.dense(), mats @ P_ref, atol=1e-10)


def test_parameter_counts_and_rank_rule_by_hand():
    # 3 layers of (m, n) = (6, 4) at rank 2: one basis plus every layer's coefficients
    assert 2 * fz.stored_per_rank(6, 4, 3, "input") == 4 * 2 + 3 * 6 * 2 == 44
    assert 2 * fz.stored_per_rank(6, 4, 3, "output") == 6 * 2 + 3 * 2 * 4 == 36
    assert 2 * fz.stored_per_rank(6, 4, 1, "input") == 2 * (6 + 4) == 20  # per-layer SVD, (U S) V^T
    mats = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert fz.share_input(mats, None, 2).stored() == 44 and fz.share_output(mats, None, 2).stored() == 36
    # the largest k with k * stored_per_rank <= (1 - c) g m n, at most min(m, n); 0 when rank 1 does not fit
    assert fz.rank_for_ratio(6, 4, 1, 0.5) == 1  # 0.5 * 24 / 10 = 1.2
    assert fz.rank_for_ratio(6, 4, 3, 0.5, "output") == 2  # 0.5 * 72 / 18 = 2 exactly: fits
    assert fz.rank_for_ratio(6, 4, 3, 0.5, "input") == 1  # 0.5 * 72 / 22 = 1.6
    assert fz.rank_for_ratio(6, 4, 10, 0.0, "output") == 4  # 240 / 46 = 5.2, clamped to min(m, n)
    assert fz.rank_for_ratio(6, 4, 1, 0.9) == 0  # 0.1 * 24 / 10 = 0.24
    with pytest.raises(FlowgeomError, match="unknown space 'diagonal'; choose one of: input, output"):
        fz.stored_per_rank(6, 4, 3, "diagonal")


# ---------------------------------------------------------------- balanced factors

def _column_norms(f: fz.Factors) -> tuple[torch.Tensor, torch.Tensor]:
    """Per rank: (basis norm, stacked-coefficient norm)."""
    stack = torch.stack(f.coeffs)
    if f.space == "input":
        return f.basis.norm(dim=1), stack.pow(2).sum(dim=(0, 1)).sqrt()
    return f.basis.norm(dim=0), stack.pow(2).sum(dim=(0, 2)).sqrt()


@settings(max_examples=30, deadline=None)
@given(g=st.integers(1, 3), m=st.integers(2, 8), n=st.integers(2, 8), space=st.sampled_from(fz.SPACES),
       seed=st.integers(0, 10_000), data=st.data())
def test_balance_keeps_every_product_and_equalises_each_rank(g, m, n, space, seed, data):
    gen = torch.Generator().manual_seed(seed)
    k = data.draw(st.integers(1, min(m, n)))
    W = torch.randn(g, m, n, generator=gen, dtype=torch.float64)
    G, _ = _grams(g, n, 3 * n, gen, scale=torch.logspace(1.5, -1, n, dtype=torch.float64))
    f = fz.factorize(W, G, k, space)
    b = fz.balance(f)
    assert torch.allclose(b.dense(), f.dense(), rtol=1e-10, atol=1e-12)
    basis_norm, coeff_norm = _column_norms(b)
    assert torch.allclose(basis_norm, coeff_norm, rtol=1e-10)
    # the unbalanced whitened factors really are lopsided here (inputs of scale up to 30): the test can fail
    if space == "input":
        before_b, before_c = _column_norms(f)
        assert float((before_c / before_b).max()) > 10


def test_balance_leaves_a_zero_rank_alone():
    basis = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)  # rank 1 of the basis is zero
    coeff = torch.tensor([[4.0, 1.0], [0.0, 2.0]], dtype=torch.float64)
    b = fz.balance(fz.Factors("input", basis, (coeff,), torch.ones(2)))
    assert torch.equal(b.basis[1], basis[1]) and torch.equal(b.coeffs[0][:, 1], coeff[:, 1])
    assert float(b.basis[0].norm()) == pytest.approx(2.0) and float(b.coeffs[0][:, 0].norm()) == pytest.approx(2.0)


def _adam_step_ratio(f: fz.Factors, X: torch.Tensor, Y: torch.Tensor, lr: float) -> float:
    """Loss after / before one Adam step on both factors of ``y = C B x`` (float64, MSE to the planted Y)."""
    B = f.basis.clone().requires_grad_(True)
    C = f.coeffs[0].clone().requires_grad_(True)
    opt = torch.optim.Adam([B, C], lr=lr)

    def loss() -> torch.Tensor:
        return ((X @ B.T @ C.T - Y) ** 2).mean()

    before = loss()
    before.backward()
    opt.step()
    with torch.no_grad():
        return float(loss() / before)


def test_one_adam_step_is_smooth_on_balanced_factors_and_blows_up_on_the_raw_split():
    """A planted low-rank map whose inputs are large (as a transformer's residual stream is): the whitened
    truncation's basis carries S^{-1} (tiny) and its coefficients Σ (large); one Adam step of lr 1e-3 moves
    every entry by ~1e-3, which is ~100% of a basis entry. Balanced, the same step barely moves the loss."""
    gen = torch.Generator().manual_seed(0)
    n, m, r, tokens = 24, 20, 6, 400
    X = torch.randn(tokens, n, generator=gen, dtype=torch.float64) * 30.0
    W = torch.randn(m, r, generator=gen, dtype=torch.float64) @ torch.randn(r, n, generator=gen, dtype=torch.float64)
    Y = X @ W.T + 0.5 * torch.randn(tokens, m, generator=gen, dtype=torch.float64)
    f = fz.share_input(W[None], (X.T @ X)[None], r - 2)  # truncated: the loss is not zero, so gradients are real
    raw, balanced = _adam_step_ratio(f, X, Y, 1e-3), _adam_step_ratio(fz.balance(f), X, Y, 1e-3)
    assert raw > 10, raw  # what the folders held before: one step blows the loss up
    assert balanced < 1.5, balanced
