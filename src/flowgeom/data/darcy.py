"""2-D Darcy flow: the small set shipped in ``neuraloperator==0.3.0`` and our own generator.

The PDE (Li et al. 2021, FNO paper, §5.2)::

    −∇·(a(x) ∇u(x)) = 1   on (0, 1)²,     u = 0 on the boundary,
    a = ψ(μ),  μ ~ N(0, (−Δ + τ² I)^{−α}),  ψ = 12 on μ ≥ 0, 3 on μ < 0   (α = 2, τ = 3)

**Shipped set.** ``neuralop/datasets/data/darcy_{train,test}_16.pt`` and
``darcy_test_32.pt`` inside the installed wheel (found with
``importlib.metadata.files``; the package itself is never imported). Each
file is a ``dict`` with ``x`` (N res res) ``bool`` (True where a = 12; checked:
more True cells ⇒ smaller u) and ``y`` (N res res) ``float32``. Measured on
the files: train 1000, test 50 at 16², 50 at 32²; ``y`` is zero on the first
row/column and *not* on the last (a sub-sample ``[0 : res·k : k]`` of a fine
grid), and it is ≈ 100× the physical ``u`` (``max y ≈ 1``, while
``max u ≈ 0.01`` for a ∈ {3, 12}), so we report our generator's statistics
scale-free and quote the fitted scale.

**Generator.** The FNO recipe: μ from the cosine (DCT-II) expansion with
coefficients ``τ^{α−1} (π² |k|² + τ²)^{−α/2}`` (zero mean mode), thresholded;
five-point finite differences on the fine grid of ``res·k + 1`` nodes with
face conductivities the arithmetic mean of the two nodes, solved with
``scipy.sparse.linalg.spsolve``; then the same sub-sample as the shipped set.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.fft
import scipy.sparse
import scipy.sparse.linalg
import torch

from flowgeom.errors import FlowgeomError, choice_error, positive_int
from flowgeom.files import regular_file

A_HIGH, A_LOW = 12.0, 3.0
SHIPPED = {("train", 16): "darcy_train_16.pt", ("test", 16): "darcy_test_16.pt", ("test", 32): "darcy_test_32.pt"}


@dataclass(frozen=True)
class DarcySet:
    """Coefficients ``a`` (N res res) in {3, 12} and solutions ``u`` (N res res), float32."""

    a: torch.Tensor
    u: torch.Tensor
    source: str

    def __post_init__(self) -> None:
        if self.a.shape != self.u.shape or self.a.ndim != 3:
            raise FlowgeomError(f"Darcy a and u must both be (N res res), got {tuple(self.a.shape)} and {tuple(self.u.shape)}")

    def __len__(self) -> int:
        return self.a.shape[0]

    @property
    def resolution(self) -> int:
        return self.a.shape[-1]


def shipped_path(split: str, resolution: int) -> Path:
    """Path of a shipped file inside the installed ``neuraloperator`` wheel."""
    if (split, resolution) not in SHIPPED:
        raise choice_error("Darcy split/resolution", (split, resolution), SHIPPED)
    name = SHIPPED[(split, resolution)]
    try:
        files = importlib.metadata.files("neuraloperator") or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise FlowgeomError("the Darcy data come from the neuraloperator==0.3.0 wheel; install it with "
                            "`pip install --no-deps neuraloperator==0.3.0` (make env does)") from exc
    for f in files:
        if str(f).endswith(f"datasets/data/{name}"):
            return Path(f.locate())
    raise FlowgeomError(f"{name} not found in the installed neuraloperator wheel; reinstall neuraloperator==0.3.0")


def load_shipped(split: str = "train", resolution: int = 16, *, path: str | Path | None = None) -> DarcySet:
    """Read one shipped file (or a file of the same format at ``path``)."""
    path = Path(path) if path is not None else shipped_path(split, resolution)
    regular_file(path, "Darcy file", fix="pass the .pt file itself")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt files
        raise FlowgeomError(f"cannot read Darcy file {path}: {exc}; expected a torch dict with 'x' and 'y'") from exc
    if not isinstance(raw, dict) or not {"x", "y"} <= set(raw):
        raise FlowgeomError(f"Darcy file {path} must hold a dict with keys 'x' (coefficients) and 'y' (solutions)")
    x, y = raw["x"], raw["y"]
    a = torch.where(x.bool(), A_HIGH, A_LOW).float() if x.dtype == torch.bool else x.float()
    return DarcySet(a, y.float(), f"neuraloperator:{path.name}")


def gaussian_random_field(n: int, *, rng: np.random.Generator, alpha: float = 2.0, tau: float = 3.0) -> np.ndarray:
    """μ (n n) on the nodes of [0, 1]², covariance ``(−Δ + τ² I)^{−α}`` with Neumann modes (FNO ``GRF.m``)."""
    k1, k2 = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    coef = tau ** (alpha - 1) * (np.pi**2 * (k1**2 + k2**2) + tau**2) ** (-alpha / 2)  # (n, n)
    modes = n * coef * rng.standard_normal((n, n))
    modes[0, 0] = 0.0
    return scipy.fft.idctn(modes, type=2, norm="ortho")


def solve(a: np.ndarray) -> np.ndarray:
    """Finite-difference solution of ``−∇·(a ∇u) = 1``, u = 0 on the boundary; ``a`` (n n) on all nodes.

    Node spacing ``h = 1/(n−1)``; the flux between neighbours uses the
    arithmetic mean of their ``a``; returns ``u`` (n n) with zero boundary.
    """
    n = a.shape[0]
    h = 1.0 / (n - 1)
    m = n - 2  # interior nodes per side
    idx = np.arange(m * m).reshape(m, m)
    rows, cols, vals = [], [], []
    diag = np.zeros((m, m))
    inner = a[1:-1, 1:-1]
    for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        neigh = a[1 + di : n - 1 + di, 1 + dj : n - 1 + dj]  # (m, m)
        face = (inner + neigh) / 2
        diag += face
        ii, jj = np.meshgrid(np.arange(m), np.arange(m), indexing="ij")
        ti, tj = ii + di, jj + dj
        ok = (ti >= 0) & (ti < m) & (tj >= 0) & (tj < m)  # neighbours on the boundary contribute u = 0
        rows.append(idx[ok])
        cols.append(idx[ti[ok], tj[ok]])
        vals.append(-face[ok])
    rows.append(idx.ravel())
    cols.append(idx.ravel())
    vals.append(diag.ravel())
    matrix = scipy.sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(m * m, m * m))
    interior = scipy.sparse.linalg.spsolve(matrix, np.full(m * m, h * h))
    u = np.zeros((n, n))
    u[1:-1, 1:-1] = interior.reshape(m, m)
    return u


def generate(n: int, *, resolution: int = 16, seed: int = 0, oversample: int = 4, alpha: float = 2.0,
             tau: float = 3.0) -> DarcySet:
    """``n`` samples at ``resolution`` (fine grid ``resolution·oversample + 1`` nodes, sub-sampled like the shipped set)."""
    positive_int(n, "n")
    positive_int(oversample, "oversample")
    if resolution < 4:
        raise FlowgeomError(f"need resolution >= 4, got {resolution}")
    rng = np.random.default_rng(seed)
    fine = resolution * oversample + 1
    a_all, u_all = [], []
    for _ in range(n):
        a = np.where(gaussian_random_field(fine, rng=rng, alpha=alpha, tau=tau) >= 0, A_HIGH, A_LOW)
        u = solve(a)
        a_all.append(a[: resolution * oversample : oversample, : resolution * oversample : oversample])
        u_all.append(u[: resolution * oversample : oversample, : resolution * oversample : oversample])
    return DarcySet(torch.tensor(np.stack(a_all), dtype=torch.float32), torch.tensor(np.stack(u_all), dtype=torch.float32),
                    f"generated:res={resolution},k={oversample},seed={seed}")


def statistics(data: DarcySet) -> dict[str, float]:
    """Scale-free summary used to compare the generator with the shipped set."""
    u, a = data.u.double(), data.a.double()
    frac = (a == A_HIGH).double().mean(dim=(1, 2))  # (N,)
    mean_u = u.mean(dim=(1, 2))  # (N,)
    corr = torch.corrcoef(torch.stack([frac, mean_u]))[0, 1]
    return {
        "n": len(data),
        "frac_high": float(frac.mean()),
        "u_mean": float(u.mean()),
        "u_cv": float(u.std() / u.mean()),
        "u_max_over_mean": float(u.amax(dim=(1, 2)).mean() / u.mean()),
        "first_row_over_mean": float(u[:, 0, :].abs().mean() / u.mean()),
        "last_row_over_mean": float(u[:, -1, :].mean() / u.mean()),
        "corr_frac_high_mean_u": float(corr),
    }
