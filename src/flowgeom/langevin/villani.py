"""A numeric probe of the Villani condition (seed ``004_…``; Villani 2009, Shi–Su–Jordan 2023).

With the SDE ``dθ = −∇V dt + √s dB`` (Gibbs density ``∝ exp(−2V/s)``), ``V``
is a *Villani function* when, as ``‖θ‖ → ∞``,

1. ``V(θ) → +∞`` (confinement), so ``∫ exp(−2V/s) < ∞`` can hold, and
2. ``Q(θ) = ‖∇V(θ)‖² / s − ΔV(θ) → +∞``.

Then the Gibbs measure satisfies a Poincaré inequality and the SDE converges
exponentially (``O(log 1/ε)`` time to ε-suboptimality).

The probe evaluates ``V``, ``‖∇V‖²`` and ``ΔV`` (exact Hessian trace via
the Hessian's diagonal (plain autograd) for ``D ≤ exact_max_dim``; otherwise Hutchinson,
``ΔV ≈ mean_j z_jᵀ H z_j`` with Rademacher ``z_j``, error bar = standard
error of the mean) along

* random rays ``θ_0 + r u`` (``u`` uniform on the sphere, ``r`` on a
  geometric grid up to ``r_max``), and
* the symmetry orbit ``M_t θ_0`` (``M_t = diag(e^t, e^{-t}, 1…)``, ``t`` up
  to ``log r_max``, so ``‖M_t θ_0‖ ≈ e^t``), where an unregularised
  attention/LoRA loss is constant.

**Verdict rule.** On each path compare the mid point (``m``, first point of
the far half) with the end point (``e``):

* not confining (``V_e − V_m ≤ 1 + |V_m|``) → *fails* (V bounded);
* ``Q`` grows (``Q_e > 0``, ``Q_e > 4|Q_m|``, ``|Q_e| > 3σ_e`` with
  Hutchinson) → *holds*;
* ``Q_e ≥ 0`` but not growing (``‖x‖``: ``Q → 1/s``) → *fails*;
* ``Q_e < 0``: the regulariser has not yet overtaken the loss's own
  curvature (along the LoRA orbit ``ΔV₀ ∼ r²``). The path is probed again
  from ``r_max`` to ``r_ext`` (1e30, float64 is fine there) and judged by
  the same rule; if ``Q`` is still negative, it *fails* when ``Q/r²`` has
  stopped rising (``Q ≈ −c r²``: quadratic confinement, e.g. weight decay, too
  weak for this ``s``) and is *inconclusive* when ``Q/r²`` still rises (a
  super-quadratic term, e.g. ``λ n log n`` with tiny λ, may win further out).

The overall verdict is ``fails`` if any path fails, ``holds`` if all hold,
else ``inconclusive``. On ``‖x‖²`` (``Q = 4r²/s − 2D``) it holds; on ``‖x‖``
(``Q → 1/s``) it fails; on unregularised attention/LoRA it fails because ``V``
is constant on the orbit.

**Partition function along the orbit.** ``I(T) = ∫_0^T exp(−2(V(M_t θ_0) −
V(θ_0))/s) dt`` (trapezoid rule): it grows linearly in ``T`` when ``V`` is
constant on the orbit (the Gibbs measure cannot be normalised) and
saturates with a confining regulariser.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from flowgeom.errors import FlowgeomError, finite_number, positive_int
from flowgeom.langevin.objective import Objective

VERDICTS = ("holds", "fails", "inconclusive")


@dataclass(frozen=True)
class Derivatives:
    value: float
    grad_sq: float
    laplacian: float
    laplacian_err: float  # 0 for the exact trace

    def villani(self, temperature: float) -> float:
        return self.grad_sq / temperature - self.laplacian


# Reverse mode through plain torch.autograd, not torch.func: the first torch.func.grad call
# imports all of torch._dynamo (1–4 s per process), longer than a whole tiny probe.


def _value_and_grad(fn, theta: torch.Tensor, *, create_graph: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(θ with grad, V(θ), ∇V(θ))``; with ``create_graph`` the gradient can be differentiated again."""
    th = theta.detach().requires_grad_(True)
    with torch.enable_grad():
        value = fn(th)
        (g,) = torch.autograd.grad(value, th, create_graph=create_graph)
    return th, value.detach(), g


def laplacian_exact(fn, theta: torch.Tensor) -> torch.Tensor:
    """``tr ∇²V(θ)`` from the Hessian's diagonal, one reverse pass per coordinate (D ≤ exact_max_dim)."""
    th, _, g = _value_and_grad(fn, theta, create_graph=True)
    d = theta.numel()
    with torch.enable_grad():
        diag = [torch.autograd.grad(g[i], th, retain_graph=i < d - 1)[0][i] for i in range(d)]  # ∂²V/∂θ_i²
    return torch.stack(diag).sum()


def laplacian_hutchinson(fn, theta: torch.Tensor, *, probes: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Hutchinson's ``(mean zᵀHz, standard error)`` with ``probes`` Rademacher vectors."""
    if probes < 2:
        raise FlowgeomError(f"Hutchinson needs at least 2 probes for an error bar, got {probes}")
    z = torch.randint(0, 2, (probes, theta.numel()), generator=generator).to(theta.dtype) * 2 - 1  # (m, D)
    th, _, g = _value_and_grad(fn, theta, create_graph=True)
    with torch.enable_grad():  # vᵀ H v with H v = ∇(∇V·v), one Hessian-vector product per probe
        samples = torch.stack([(torch.autograd.grad(g, th, v, retain_graph=j < probes - 1)[0] * v).sum()
                               for j, v in enumerate(z)])  # (m,)
    return samples.mean(), samples.std() / math.sqrt(probes)


def derivatives(fn, theta: torch.Tensor, *, exact: bool, probes: int = 64,
                generator: torch.Generator | None = None) -> Derivatives:
    """``V``, ``‖∇V‖²`` and ``ΔV`` at ``θ`` (D,)."""
    _, value, g = _value_and_grad(fn, theta, create_graph=False)
    if exact:
        lap, err = laplacian_exact(fn, theta), torch.zeros(())
    else:
        lap, err = laplacian_hutchinson(fn, theta, probes=probes, generator=generator or torch.Generator().manual_seed(0))
    return Derivatives(float(value), float(g.pow(2).sum()), float(lap), float(err))


@dataclass(frozen=True)
class PathResult:
    kind: str  # "ray" or "orbit"
    radius: list[float]
    value: list[float]
    villani: list[float]
    villani_err: list[float]
    confining: bool
    q_grows: bool
    q_bounded: bool
    verdict: str
    reason: str = ""
    extended: bool = False  # re-probed out to ``r_ext`` because Q < 0 at r_max


def judge(kind: str, radius: list[float], value: list[float], q: list[float], q_err: list[float], *,
          extended: bool = False) -> PathResult:
    """Apply the module's verdict rule to one path (``extended``: the second, far pass)."""
    mid, end = len(q) // 2, len(q) - 1
    confining = value[end] - value[mid] > 1 + abs(value[mid])
    q_grows = q[end] > 0 and q[end] > 4 * abs(q[mid]) and abs(q[end]) > 3 * q_err[end]
    q_bounded = 0 <= q[end] <= 1.5 * abs(q[mid]) + 3 * q_err[end]
    if not confining:
        verdict, reason = "fails", "V stays bounded: not confining"
    elif q_grows:
        verdict, reason = "holds", "V and Q grow"
    elif q_bounded or (q[end] >= 0 and not q_grows):
        verdict, reason = "fails", "Q tends to a finite limit"
    elif not extended:
        verdict, reason = "inconclusive", "Q < 0 at the largest radius"
    else:
        # Q ≈ κ(r) r² with κ < 0: a super-quadratic term makes κ rise (log: ∝ log² r), a quadratic one does not
        k_mid, k_end = q[mid] / radius[mid] ** 2, q[end] / radius[end] ** 2
        noise = 3 * q_err[end] / radius[end] ** 2
        if k_end - k_mid > 1e-3 * abs(k_mid) + noise:
            verdict, reason = "inconclusive", f"Q < 0 out to r={radius[end]:.1e} but Q/r² still rising"
        else:
            verdict, reason = "fails", f"Q ≈ {k_end:.3g}·r² out to r={radius[end]:.1e}: the confinement loses to the curvature"
    return PathResult(kind, radius, value, q, q_err, confining, q_grows, q_bounded, verdict, reason, extended)


@dataclass(frozen=True)
class VillaniReport:
    objective: str
    regularizer: str
    temperature: float
    dim: int
    exact: bool
    verdict: str
    paths: list[PathResult]
    orbit_integral: dict[str, list[float] | str] | None = field(default=None)


def orbit_integral(obj: Objective, theta0: torch.Tensor, *, temperature: float, t_max: float,
                   points: int = 200) -> dict[str, list[float] | str]:
    """Partial integrals ``I(T)`` of ``exp(−2(V(M_t θ_0) − V(θ_0))/s)`` over ``t ∈ [0, T]``.

    Verdict ``diverges`` when the integrand at ``T`` is still ≥ half its value
    at 0 (``I`` grows linearly), ``converges`` when it has fallen below 1e-8
    (``I`` has saturated), else ``inconclusive``.
    """
    ts = torch.linspace(0, t_max, points, dtype=torch.float64)
    with torch.no_grad():
        v = torch.stack([obj.flat(obj.orbit(theta0, float(t))) for t in ts])
    w = torch.exp(-2 * (v - v[0]) / temperature)  # (points,)
    partial = torch.cat([torch.zeros(1, dtype=w.dtype), torch.cumsum((w[1:] + w[:-1]) / 2 * (ts[1:] - ts[:-1]), 0)])
    step = max(1, points // 10)
    undefined = _undefined_integral(v, w, partial, temperature)
    if undefined:
        return {"T": ts[::step].tolist(), "I": partial[::step].tolist(), "verdict": "undefined", "reason": undefined}
    if w[-1] >= 0.5 * w[0]:
        verdict = "diverges"
    elif w[-1] < 1e-8:
        verdict = "converges"
    else:
        verdict = "inconclusive"
    return {"T": ts[::step].tolist(), "I": partial[::step].tolist(), "verdict": verdict}


def _undefined_integral(v: torch.Tensor, w: torch.Tensor, partial: torch.Tensor, temperature: float) -> str:
    """Why ``I(T)`` has no trustworthy value at this ``s`` ('' when it has one).

    Two failures give a verdict from noise: ``exp(−2ΔV/s)`` overflows float64
    (``ΔV < −354 s``), or ``V`` at ``T`` equals ``V(θ_0)`` to round-off while
    the round-off ``δ`` of ``V`` is not small against ``s`` (then
    ``exp(−2ΔV/s)`` at ``T`` is 0, 1 or ∞ at the whim of the last bit).
    """
    if not (bool(torch.isfinite(w).all()) and bool(torch.isfinite(partial).all())):
        return (f"exp(−2ΔV/s) overflows float64 at s={temperature:g} (ΔV down to {float((v - v[0]).min()):.3g}); "
                "raise the temperature")
    roundoff = 16 * torch.finfo(v.dtype).eps * float(v.abs().max())
    if abs(float(v[-1] - v[0])) <= roundoff and 2 * roundoff / temperature > 1e-3:
        return (f"V(M_T θ_0) = V(θ_0) to round-off ({roundoff:.1e}), which is not small against s={temperature:g}: "
                "the integrand is float noise; raise the temperature")
    return ""


def probe_memory(dim: int, *, rays: int, points: int, exact: bool, probes: int) -> int:
    """Bytes a :func:`probe` holds at its peak (an over-estimate, checked before it starts).

    Each path keeps four float lists over up to ``2·points`` radii (Python
    floats, ~32 bytes each, counted 4× for the report's dict and JSON copies)
    plus ~2 KB of bookkeeping; the Laplacian needs the graph of ``∇V`` (its
    diagonal is taken one coordinate at a time; counted as a ``D × D`` Hessian
    and a few copies, an over-estimate) or ``probes × D`` Rademacher vectors and
    their Hessian-vector products.
    """
    per_path = 2 * points * 4 * 32 * 4 + 2048
    laplacian = 8 * (4 * dim * dim if exact else 8 * probes * dim)
    return (rays + 1) * per_path + laplacian + 8 * 200 * dim


def probe(obj: Objective, *, temperature: float = 1.0, rays: int = 3, r_max: float = 1e3, points: int = 12,
          exact_max_dim: int = 200, probes: int = 64, seed: int = 0, r_ext: float = 1e30) -> VillaniReport:
    """Run the Villani probe on ``obj`` (see the module docstring for the rule).

    Rays start at ``obj.theta0`` when the objective has one (a user's model,
    :func:`~flowgeom.langevin.user_loss.loss_objective`), else at a random point.
    """
    finite_number(temperature, "temperature s", positive=True, fix="the Villani quantity needs s > 0")
    if not finite_number(r_max, "r_max", fix="probe out to a finite r_max > 10") > 10:
        raise FlowgeomError(f"r_max must be > 10 to probe behaviour at infinity, got {r_max!r}")
    if not finite_number(r_ext, "r_ext", fix="extrapolate out to a finite r_ext > r_max, e.g. 1e30") > r_max:
        raise FlowgeomError(f"r_ext must exceed r_max, got r_ext={r_ext!r}, r_max={r_max!r}")
    positive_int(rays, "rays")
    if points < 4:
        raise FlowgeomError(f"need points >= 4 along each ray, got points={points}")
    g = torch.Generator().manual_seed(seed)
    exact = obj.dim <= exact_max_dim
    theta0 = torch.randn(obj.dim, generator=g, dtype=torch.float64)
    if obj.theta0 is not None:  # a user's model: its own weights (the draw above keeps the rays' stream the same)
        theta0 = obj.flatten(obj.theta0).to(torch.float64)

    def measure(thetas: list[torch.Tensor]) -> tuple[list[float], ...]:
        ds = [derivatives(obj.flat, th, exact=exact, probes=probes, generator=g) for th in thetas]
        rows = [(float(th.norm()), d.value, d.villani(temperature), d.laplacian_err) for th, d in zip(thetas, ds)]
        rows = [r for r in rows if all(math.isfinite(x) for x in r)]  # float64 overflow far out (large ε)
        return tuple(list(col) for col in zip(*rows)) if rows else ([], [], [], [])

    def path(kind: str, at) -> PathResult:
        """``at(x)`` is the point at log-radius ``x``; probe [0, log r_max], then out to log r_ext if Q < 0."""
        near = measure([at(float(x)) for x in torch.linspace(0, math.log(r_max), points, dtype=torch.float64)])
        if len(near[0]) < 4:
            raise FlowgeomError(
                f"V or Q = ‖∇V‖²/s − ΔV is not finite in float64 at {points - len(near[0])} of {points} points of a "
                f"{kind} up to r={r_max:g} (s={temperature:g}): too few left for a verdict; raise the temperature "
                "or lower --r-max")
        result = judge(kind, *near)
        if result.verdict != "inconclusive":
            return result
        far = measure([at(float(x)) for x in torch.linspace(math.log(r_max), math.log(r_ext), points, dtype=torch.float64)])
        if len(far[0]) < 4:
            return result
        second = judge(kind, *far, extended=True)
        return dataclasses.replace(second, radius=near[0] + far[0], value=near[1] + far[1],
                                   villani=near[2] + far[2], villani_err=near[3] + far[3])

    paths = []
    for _ in range(rays):
        u = torch.randn(obj.dim, generator=g, dtype=torch.float64)
        u = u / u.norm()
        paths.append(path("ray", lambda x, u=u: theta0 + math.exp(x) * u))
    integral = None
    if obj.orbit_fn is not None:
        paths.append(path("orbit", lambda x: obj.orbit(theta0, x)))
        integral = orbit_integral(obj, theta0, temperature=temperature, t_max=math.log(r_max))
    verdicts = [p.verdict for p in paths]
    overall = "fails" if "fails" in verdicts else "holds" if all(v == "holds" for v in verdicts) else "inconclusive"
    return VillaniReport(obj.name, obj.regularizer.kind, temperature, obj.dim, exact, overall, paths, integral)


def plot(report: VillaniReport, path) -> None:
    """Save ``V`` and ``Q`` against the radius for every probed path (matplotlib, Agg; atomic)."""
    from matplotlib.figure import Figure  # object API: no pyplot, no global backend switch

    from flowgeom.runs import atomic_write_figure

    fig = Figure(figsize=(10, 4))
    ax_v, ax_q = fig.subplots(1, 2)
    for i, p in enumerate(report.paths):
        label = f"{p.kind} {i}: {p.verdict}"
        ax_v.plot(p.radius, p.value, marker=".", label=label)
        ax_q.errorbar(p.radius, p.villani, yerr=[3 * e for e in p.villani_err], marker=".", label=label)
    for ax, name in ((ax_v, "V"), (ax_q, "Q = |∇V|²/s − ΔV")):
        ax.set_xscale("log")
        ax.set_yscale("symlog")
        ax.set_xlabel("‖θ‖")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    fig.suptitle(f"Villani probe: {report.objective} + {report.regularizer} (s={report.temperature:g}) → {report.verdict}")
    fig.tight_layout()
    atomic_write_figure(path, fig, dpi=100)
