"""The paper's two losses (seed ``004_…``, Defs. 2.4–2.7), as pure functions of their trainable weights.

Layout: every weight is ``(out, in)`` like ``nn.Linear`` (``q_proj.weight``).

**Single-head attention regression** (only ``W_Q``, ``W_K`` trainable).
Data ``X_i`` (T d), targets ``Y_i`` (T d_v), a fixed value map ``W_V``
(d_v d); ``W_Q``, ``W_K`` are (d_k d)::

    A_i  = RowSoftmax(X_i W_Qᵀ W_K X_iᵀ / √d_k)                      (T T)
    V(W_Q, W_K) = (1/N) Σ_i ‖A_i X_i W_Vᵀ − Y_i‖²_F

It depends on ``W_Qᵀ W_K`` only, so it is constant on the orbits
``W_Q → M W_Q``, ``W_K → M^{-T} W_K`` (M ∈ GL(d_k)); in the paper's (in, out)
layout this reads ``W_Q → W_Q M``, ``W_K → W_K M^{-T}``.

**Depth-2 LoRA network** (only ``U``, ``V`` trainable).
Inputs ``x_i`` (d), targets ``y_i`` (d_out), frozen ``W_pre`` (h d) and head
``W_out`` (d_out h), ``U`` (h r) = PEFT ``lora_B``, ``V`` (r d) = ``lora_A``::

    W = W_pre + α U V
    L(U, V) = (1/N) Σ_i ‖W_out tanh(W x_i) − y_i‖²

constant on ``U → U M``, ``V → M⁻¹ V`` (M ∈ GL(r)).

Regularised versions add ``R(W_Q) + R(W_K)`` or ``R(U) + R(V)`` with a
:class:`~flowgeom.langevin.regularizers.Regularizer`.

Each is an :class:`~flowgeom.langevin.objective.Objective` (the loss with its
parameter shapes, a flat-vector view and its symmetry orbit); the textbook
potentials ``‖x‖²`` and ``‖x‖`` are objectives too (no orbit).
"""

from __future__ import annotations

import math

import torch

from flowgeom.errors import choice_error
from flowgeom.langevin.objective import Objective, Params
from flowgeom.langevin.user_loss import load_objective


def attention_loss(w_q: torch.Tensor, w_k: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                   w_v: torch.Tensor) -> torch.Tensor:
    """Attention regression loss; ``x`` (N T d), ``y`` (N T d_v), ``w_q``/``w_k`` (d_k d), ``w_v`` (d_v d)."""
    d_k = w_q.shape[0]
    q = x @ w_q.T  # (N, T, d_k)
    k = x @ w_k.T  # (N, T, d_k)
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d_k), dim=-1)  # (N, T, T)
    out = att @ (x @ w_v.T)  # (N, T, d_v)
    return (out - y).pow(2).sum(dim=(-1, -2)).mean()


def lora_loss(u: torch.Tensor, v: torch.Tensor, x: torch.Tensor, y: torch.Tensor, w_pre: torch.Tensor,
              w_out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Depth-2 LoRA loss; ``x`` (N d), ``y`` (N d_out), ``u`` (h r), ``v`` (r d), ``w_pre`` (h d), ``w_out`` (d_out h)."""
    w = w_pre + alpha * (u @ v)  # (h, d)
    hidden = torch.tanh(x @ w.T)  # (N, h)
    return (hidden @ w_out.T - y).pow(2).sum(dim=-1).mean()


def attention_orbit(w_q: torch.Tensor, w_k: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M W_Q, M^{-T} W_K)`` for ``M`` (d_k d_k) invertible."""
    return m @ w_q, torch.linalg.inv(m).T @ w_k


def lora_orbit(u: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(U M, M⁻¹ V)`` for ``M`` (r r) invertible."""
    return u @ m, torch.linalg.solve(m, v)


def attention_objective(*, n: int = 8, tokens: int = 4, d: int = 4, d_k: int = 2, d_v: int = 2, seed: int = 0,
                        dtype: torch.dtype = torch.float64) -> Objective:
    """A random attention-regression task (targets from a planted ``W_Q*, W_K*`` plus noise)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, tokens, d, generator=g, dtype=dtype)
    w_v = torch.randn(d_v, d, generator=g, dtype=dtype) / math.sqrt(d)
    w_q0 = torch.randn(d_k, d, generator=g, dtype=dtype)
    w_k0 = torch.randn(d_k, d, generator=g, dtype=dtype)
    with torch.no_grad():
        att = torch.softmax(x @ w_q0.T @ w_k0 @ x.transpose(-1, -2) / math.sqrt(d_k), dim=-1)  # (N, T, T)
        y = att @ x @ w_v.T + 0.1 * torch.randn(n, tokens, d_v, generator=g, dtype=dtype)  # (N, T, d_v)

    def loss(p: Params) -> torch.Tensor:
        return attention_loss(p["q_proj.weight"], p["k_proj.weight"], x, y, w_v)

    def orbit(p: Params, m: torch.Tensor) -> Params:
        q, k = attention_orbit(p["q_proj.weight"], p["k_proj.weight"], m)
        return {"q_proj.weight": q, "k_proj.weight": k}

    return Objective("attention", {"q_proj.weight": (d_k, d), "k_proj.weight": (d_k, d)}, loss, orbit, d_k)


def lora_objective(*, n: int = 16, d: int = 4, hidden: int = 4, rank: int = 2, d_out: int = 2, alpha: float = 1.0,
                   seed: int = 0, dtype: torch.dtype = torch.float64) -> Objective:
    """A random depth-2 LoRA regression task (PEFT names ``lora_B`` = U, ``lora_A`` = V)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    w_pre = torch.randn(hidden, d, generator=g, dtype=dtype) / math.sqrt(d)
    w_out = torch.randn(d_out, hidden, generator=g, dtype=dtype) / math.sqrt(hidden)
    y = torch.randn(n, d_out, generator=g, dtype=dtype)

    def loss(p: Params) -> torch.Tensor:
        return lora_loss(p["lora_B.weight"], p["lora_A.weight"], x, y, w_pre, w_out, alpha)

    def orbit(p: Params, m: torch.Tensor) -> Params:
        u, v = lora_orbit(p["lora_B.weight"], p["lora_A.weight"], m)
        return {"lora_B.weight": u, "lora_A.weight": v}

    return Objective("lora", {"lora_B.weight": (hidden, rank), "lora_A.weight": (rank, d)}, loss, orbit, rank)


def norm_objective(power: int, *, dim: int = 4) -> Objective:
    """Textbook potentials: ``‖x‖²`` (``power=2``, Villani) and ``‖x‖`` (``power=1``, not Villani)."""
    if power == 2:
        return Objective("norm2", {"x": (dim,)}, lambda p: p["x"].pow(2).sum())
    if power == 1:
        return Objective("norm1", {"x": (dim,)}, lambda p: p["x"].pow(2).sum().sqrt())
    raise choice_error("norm power", power, (1, 2))


LOSSES = ("attention", "lora", "norm2", "norm1")


def objective(name: str, *, seed: int = 0) -> Objective:
    """One of :data:`LOSSES` at its default (small) size, or a user's ``FILE.py:NAME`` (:mod:`flowgeom.langevin.user_loss`)."""
    if name not in LOSSES and ":" in name:
        return load_objective(name, seed=seed)
    if name == "attention":
        return attention_objective(seed=seed)
    if name == "lora":
        return lora_objective(seed=seed)
    if name == "norm2":
        return norm_objective(2)
    if name == "norm1":
        return norm_objective(1)
    raise choice_error("loss", name, (*LOSSES, "path/to/file.py:NAME"))
