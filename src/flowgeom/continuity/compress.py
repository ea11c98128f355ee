"""Compression that uses (or ignores) cross-layer continuity: shared bases, per-layer SVD, layer dropping.

Seed 001's design implication: adjacent layers share singular directions, so
a group of g adjacent layers can share one rank-r basis in the space where the
role is continuous (Q, K, Gate, Up: input space; O, Down: output space).

**Shared basis, input space.** For the group's matrices ``W_l`` (m x n) stack
them vertically, ``S = [W_1; ...; W_g]`` (g m x n); ``V`` (n x r) holds the top-r
right singular vectors of S, i.e. the top-r eigenvectors of
``S^T S = sum_l W_l^T W_l``. Each layer keeps ``C_l = W_l V`` (m x r) and is
rebuilt as ``W_l ~ C_l V^T = W_l V V^T``. Among all rank-r subspaces shared by
the group, V minimises ``sum_l ||W_l - W_l P||_F^2`` (Eckart-Young on S).

**Shared basis, output space.** Stack horizontally, ``S = [W_1, ..., W_g]``
(m x g n); ``U`` (m x r) = top-r left singular vectors (eigenvectors of
``sum_l W_l W_l^T``); ``C_l = U^T W_l`` (r x n); ``W_l ~ U U^T W_l``.

**Parameters, counted honestly.** A group of g layers stores the basis plus
every layer's coefficients: input ``n r + g m r``, output ``m r + g r n``,
against ``g m n`` dense. Per-layer truncated SVD (no sharing) stores
``r (m + n)`` per layer (singular values folded into one factor). Dropping a
layer saves every parameter of the block (its seven projections and two norms).

Every function here is a pure tensor function (stacks ``(g, m, n)`` in,
tensors out) or works on an HF-named state dict without touching the input;
the CLI (``flowgeom continuity share``) is a thin layer over
:func:`share_state_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from flowgeom.errors import FlowgeomError, choice_error

SPACES = ("input", "output")
# Where seed 001 says each role is continuous (V: no clear opportunity, so no entry).
SEED_SPACE = {"q": "input", "k": "input", "gate": "input", "up": "input", "o": "output", "down": "output"}
HF_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
            "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
ROLES = tuple(HF_NAMES)


def opposite(space: str) -> str:
    """``input`` <-> ``output`` (strategy (b) of the sharing experiment)."""
    if space not in SPACES:
        raise choice_error("space", space, SPACES)
    return SPACES[1 - SPACES.index(space)]


def _check_stack(mats: torch.Tensor, rank: int, space: str) -> None:
    if space not in SPACES:
        raise choice_error("space", space, SPACES)
    if mats.ndim != 3:
        raise FlowgeomError(f"expected a stack (g, m, n) of matrices, got shape {list(mats.shape)}")
    bound = min(mats.shape[1:])
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= bound:
        raise FlowgeomError(f"rank {rank!r} is outside 1..{bound}, the rank bound of {mats.shape[1]}x{mats.shape[2]} "
                            "matrices; pass a smaller --rank")


def shared_basis(mats: torch.Tensor, rank: int, space: str) -> torch.Tensor:
    """One orthonormal basis for the group ``mats`` (g, m, n): input (n, r) = top-r right singular vectors
    of the vertical stack; output (m, r) = top-r left singular vectors of the horizontal stack.

    Computed as the top-r eigenvectors of the summed Gram in float64 (``sum_l W_l^T W_l`` or
    ``sum_l W_l W_l^T``), returned in the dtype of ``mats``.
    """
    _check_stack(mats, rank, space)
    w = mats.double()
    gram = torch.einsum("gmi,gmj->ij", w, w) if space == "input" else torch.einsum("gim,gjm->ij", w, w)  # (n,n)/(m,m)
    _, vecs = torch.linalg.eigh(gram)  # ascending eigenvalues
    return vecs[:, -rank:].flip(-1).to(mats.dtype)  # (n, r) or (m, r), largest first


def coefficients(mats: torch.Tensor, basis: torch.Tensor, space: str) -> torch.Tensor:
    """Per-layer coefficients: input ``W_l V`` (g, m, r); output ``U^T W_l`` (g, r, n)."""
    return mats @ basis if space == "input" else basis.T @ mats


def reconstruct(coeffs: torch.Tensor, basis: torch.Tensor, space: str) -> torch.Tensor:
    """Dense matrices (g, m, n) from coefficients and basis: ``C_l V^T`` or ``U C_l``."""
    return coeffs @ basis.T if space == "input" else basis @ coeffs


def share_stack(mats: torch.Tensor, rank: int, space: str) -> torch.Tensor:
    """``W_l V V^T`` (input) or ``U U^T W_l`` (output) for every layer of the group, shape (g, m, n)."""
    basis = shared_basis(mats, rank, space)
    return reconstruct(coefficients(mats, basis, space), basis, space)


def truncated_svd(mats: torch.Tensor, rank: int) -> torch.Tensor:
    """Best rank-r approximation of each matrix on its own (no sharing), shape (g, m, n)."""
    _check_stack(mats, rank, "input")
    U, S, Vh = torch.linalg.svd(mats.double(), full_matrices=False)  # (g,m,k) (g,k) (g,k,n)
    return ((U[..., :rank] * S[:, None, :rank]) @ Vh[:, :rank]).to(mats.dtype)


def layer_groups(n_layers: int, group: int) -> list[list[int]]:
    """``[[0..g-1], [g..2g-1], ...]``; the last group holds the remainder (a single layer shares nothing)."""
    if not 1 <= group <= n_layers:
        raise FlowgeomError(f"--group {group} is outside 1..{n_layers}, the number of layers of the model; "
                            "pass a smaller --group")
    return [list(range(s, min(s + group, n_layers))) for s in range(0, n_layers, group)]


def shared_params(m: int, n: int, g: int, rank: int, space: str) -> int:
    """Stored numbers for g layers of (m, n) sharing one rank-r basis: basis + per-layer coefficients."""
    if space not in SPACES:
        raise choice_error("space", space, SPACES)
    return (n * rank + g * m * rank) if space == "input" else (m * rank + g * rank * n)


def svd_params(m: int, n: int, rank: int) -> int:
    """Stored numbers for one (m, n) matrix as a rank-r factorisation ``(U S) V^T``: r (m + n)."""
    return rank * (m + n)


def svd_rank_for_budget(m: int, n: int, params: float) -> int:
    """Largest per-layer rank whose factorisation stores at most ``params`` numbers (>= 1)."""
    return max(1, min(min(m, n), math.floor(params / (m + n))))


def share_rank_for_budget(m: int, n: int, group_sizes: Sequence[int], budget: float, space: str) -> int:
    """Largest shared rank whose storage fits ``(1 - budget) L m n`` for one role, clamped to 1..min(m, n).

    Input space stores ``r (G n + L m)``, output ``r (G m + L n)`` (G groups of sizes ``group_sizes``, L layers
    in all): one basis per group plus one coefficient block per layer. At the clamp ``min(m, n)`` the role saves
    *more* than ``budget`` (or less, even a negative amount, when the bases outweigh the saving); callers report
    what :func:`share_state_dict` measured, not the budget.
    """
    if space not in SPACES:
        raise choice_error("space", space, SPACES)
    if not 0.0 <= budget < 1.0:
        raise FlowgeomError(f"budget {budget!r} must be a fraction in [0, 1); e.g. 0.1 saves 10% of the role")
    L, G = sum(group_sizes), len(group_sizes)
    per_rank = G * n + L * m if space == "input" else G * m + L * n
    return max(1, min(min(m, n), math.floor((1 - budget) * L * m * n / per_rank)))


def _role_stack(state: Mapping[str, torch.Tensor], role: str, layers: Sequence[int]) -> torch.Tensor:
    return torch.stack([state[f"model.layers.{l}.{HF_NAMES[role]}.weight"] for l in layers])  # (g, m, n)


def _check_roles(state: Mapping[str, torch.Tensor], roles: Sequence[str], n_layers: int) -> None:
    for role in roles:
        if role not in HF_NAMES:
            raise choice_error("role", role, ROLES)
        missing = [l for l in range(n_layers) if f"model.layers.{l}.{HF_NAMES[role]}.weight" not in state]
        if missing:
            raise FlowgeomError(f"role {role} ({HF_NAMES[role]}) not found in layer(s) {missing[:5]} of the model; "
                                f"pass roles among those it has ({', '.join(ROLES)} for Llama)")


def check_share(state: Mapping[str, torch.Tensor], roles: Sequence[str], *, n_layers: int, group: int,
                rank: int | None) -> None:
    """Every check :func:`share_state_dict` makes, without any SVD: roles present, group and rank in range
    (``rank`` None: ranks come from a budget, :func:`share_rank_for_budget`, which clamps them)."""
    _check_roles(state, roles, n_layers)
    layer_groups(n_layers, group)
    for role in () if rank is None else roles:
        m, n = state[f"model.layers.0.{HF_NAMES[role]}.weight"].shape
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= min(m, n):
            raise FlowgeomError(f"--rank {rank} is above the rank bound {min(m, n)} of role {role} ({m}x{n}); pass "
                                f"--rank <= {min(m, n)} or leave {role} out of --roles")


@dataclass(frozen=True)
class RoleResult:
    role: str
    space: str  # input | output | none (per-layer SVD)
    shape: tuple[int, int]  # (m, n)
    groups: list[list[int]]
    rank: int
    dense_params: int  # L m n
    stored_params: int  # bases + coefficients (or factorisations)
    rel_error: list[float]  # ||W_l - W_l'||_F / ||W_l||_F per layer

    @property
    def saved(self) -> int:
        return self.dense_params - self.stored_params


def share_state_dict(state: Mapping[str, torch.Tensor], spaces: Mapping[str, str], *, n_layers: int, group: int,
                     rank: int | Mapping[str, int],
                     progress: Callable[[int, int], None] | None = None
                     ) -> tuple[dict[str, torch.Tensor], list[RoleResult]]:
    """A new state dict whose role matrices are rebuilt from shared bases, and what each role stores.

    ``spaces`` maps role -> ``input``/``output``; ``rank`` is one rank for every role or a rank per role
    (e.g. from :func:`share_rank_for_budget`). ``state`` is not modified. ``progress(done, total)`` is
    called after each (role, group), ``total = len(spaces) * number of groups``.
    """
    _check_roles(state, list(spaces), n_layers)
    groups = layer_groups(n_layers, group)
    ranks = {role: rank[role] if isinstance(rank, Mapping) else rank for role in spaces}
    out, results = dict(state), []
    total, done = len(spaces) * len(groups), 0
    for role, space in spaces.items():
        stack = _role_stack(state, role, range(n_layers))  # (L, m, n)
        _, m, n = stack.shape
        _check_stack(stack, ranks[role], space)
        new, stored = torch.empty_like(stack), 0
        for idx in groups:
            new[idx] = share_stack(stack[idx], ranks[role], space)
            stored += shared_params(m, n, len(idx), ranks[role], space)
            done += 1
            if progress:
                progress(done, total)
        results.append(_result(role, space, stack, new, groups, ranks[role], stored))
        for l in range(n_layers):
            out[f"model.layers.{l}.{HF_NAMES[role]}.weight"] = new[l].contiguous()
    return out, results


def svd_state_dict(state: Mapping[str, torch.Tensor], roles: Sequence[str], *, n_layers: int,
                   rank: int) -> tuple[dict[str, torch.Tensor], list[RoleResult]]:
    """A new state dict with each role matrix replaced by its own best rank-r approximation (no sharing)."""
    _check_roles(state, roles, n_layers)
    out, results = dict(state), []
    for role in roles:
        stack = _role_stack(state, role, range(n_layers))  # (L, m, n)
        _, m, n = stack.shape
        new = truncated_svd(stack, rank)
        results.append(_result(role, "none", stack, new, [[l] for l in range(n_layers)], rank,
                               n_layers * svd_params(m, n, rank)))
        for l in range(n_layers):
            out[f"model.layers.{l}.{HF_NAMES[role]}.weight"] = new[l].contiguous()
    return out, results


def _result(role, space, old, new, groups, rank, stored) -> RoleResult:
    L, m, n = old.shape
    err = (torch.linalg.matrix_norm((old - new).double()) / torch.linalg.matrix_norm(old.double())).tolist()
    return RoleResult(role, space, (m, n), groups, rank, L * m * n, stored, err)


# ---------------------------------------------------------------- layer dropping

def block_params(state: Mapping[str, torch.Tensor], layer: int) -> int:
    """Numbers stored by decoder block ``layer`` (all its tensors)."""
    prefix = f"model.layers.{layer}."
    return sum(t.numel() for k, t in state.items() if k.startswith(prefix))


def drop_layers(state: Mapping[str, torch.Tensor], drop: Sequence[int], *, n_layers: int) -> dict[str, torch.Tensor]:
    """A state dict without blocks ``drop``; the kept blocks renumbered 0..L-len(drop)-1 in order."""
    bad = sorted({l for l in drop if not 0 <= l < n_layers})
    if bad or len(set(drop)) != len(drop) or len(drop) >= n_layers:
        raise FlowgeomError(f"cannot drop layers {list(drop)} of a {n_layers}-layer model: indices must be distinct, "
                            f"in 0..{n_layers - 1}, and leave at least one layer")
    keep = [l for l in range(n_layers) if l not in set(drop)]
    new_index = {old: new for new, old in enumerate(keep)}
    out = {}
    for key, t in state.items():
        if key.startswith("model.layers."):
            layer = int(key.split(".")[2])
            if layer in new_index:
                out[key.replace(f"model.layers.{layer}.", f"model.layers.{new_index[layer]}.", 1)] = t
        else:
            out[key] = t
    return out


def continuity_scores(report: Mapping, *, spaces: Mapping[str, str] | None = None) -> dict[int, float]:
    """Redundancy score per layer from an :func:`flowgeom.continuity.analyze` report.

    For each role, the adjacent-pair subspace alignment in the role's space
    (``subspace_in`` for input, ``subspace_out`` for output; default spaces:
    :data:`SEED_SPACE`, roles without one use the larger of the two); a layer's
    score is the mean over roles of the mean over the pairs (l-1, l) and
    (l, l+1) it belongs to. High score = the layer's weights continue their
    neighbours' directions = first candidate to drop.
    """
    spaces = dict(SEED_SPACE if spaces is None else spaces)
    per_layer: dict[int, list[float]] = {}
    for role, r in report["roles"].items():
        key = {"input": "subspace_in", "output": "subspace_out"}.get(spaces.get(role, ""))
        for p in r["pairs"]:
            if p["distance"] != 1:
                continue
            value = p[key] if key else max(p["subspace_in"], p["subspace_out"])
            for layer in (p["a"], p["b"]):
                per_layer.setdefault(layer, []).append(value)
    return {l: sum(v) / len(v) for l, v in sorted(per_layer.items())}


def drop_order(scores: Mapping[int, float], *, protect: Sequence[int] = ()) -> list[int]:
    """Layers by descending score (ties: lower index first), ``protect`` left out."""
    return [l for l, _ in sorted(scores.items(), key=lambda kv: (-kv[1], kv[0])) if l not in set(protect)]


def random_drop_order(n_layers: int, *, seed: int, protect: Sequence[int] = ()) -> list[int]:
    """A random ranking (the control for :func:`drop_order`), from its own generator."""
    gen = torch.Generator().manual_seed(seed)
    return [l for l in torch.randperm(n_layers, generator=gen).tolist() if l not in set(protect)]


def drop_count(budget: float, scope: int, block: int, n_layers: int) -> int:
    """Blocks to drop so that ``n block`` is nearest ``budget scope`` (at least 1, at most L - 2)."""
    return max(1, min(n_layers - 2, round(budget * scope / block)))


def bi_drop(block_influence: Sequence[float], n: int) -> list[int]:
    """ShortGPT (Men et al. 2024): the n blocks of lowest Block Influence ``1 - mean cos(input, output)``."""
    return sorted(sorted(range(len(block_influence)), key=lambda l: (block_influence[l], l))[:n])


def angular_drop(angular: Mapping[int, Sequence[float]], n: int) -> list[int]:
    """Gromov et al. 2024: blocks l..l+n-1 for the l whose input and the output of block l+n-1 differ least
    (angular distance ``arccos(cos)/π`` between the inputs of blocks l and l+n)."""
    row = angular[n]
    start = min(range(len(row)), key=lambda l: (row[l], l))
    return list(range(start, start + n))
