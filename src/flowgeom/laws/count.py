"""Count the conservation laws of any ``nn.Module`` numerically.

Theory (Marcotte, Gribonval & Peyré 2023, "Abide by the law and follow the
flow"). For a model f(x; θ), θ ∈ R^D, let W be the span of the fields
X_{x,c}(θ) = ∇_θ⟨c, f(x; θ)⟩ over all inputs x and output weights c, and
Lie(W) the Lie algebra they generate (closed under [X, Y] = J_Y X − J_X Y).
If dim Lie(W)(θ) is constant on a neighbourhood of θ (the constant-rank
condition of Frobenius' theorem), the number of functionally independent
conservation laws of gradient flow — for every data set — near θ is

    laws = D − dim Lie(W)(θ).

Numerics. At a random point θ (float64 by default) the engine draws blocks of
random fields (depth 0) and random left-nested brackets of depth 1, 2, …
(``fields.FieldModel``), each block one ``vmap`` call. Vectors are normalised
and their span is grown by blocks: the block is projected on the orthogonal
complement of the current basis, and the singular values σ of the projected
block above a relative tolerance are new directions. A depth stops once a
block has at least ``patience`` more vectors than new directions (for
generic draws a block that does not fill up has saturated the level); the
bracket depths stop at the first depth that adds nothing or when the span is
all of R^D. Depth 0 keeps an orthonormal basis (the O(D³) step); from depth 1
on the engine tracks the small complement N (D × laws) instead, so a bracket
block costs O(D · laws).

The report keeps the kept and dropped σ closest to the tolerance: a law broken
only weakly (e.g. by LayerNorm's eps) shows up as a kept σ many orders of
magnitude below 1 yet far above the tolerance.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from flowgeom.errors import FlowgeomError, InputError, positive_int
from flowgeom.laws.fields import FieldModel, Sampler, draw_inputs, generator, module_sampler, shape_sampler
from flowgeom.laws.precision import assess, eager_attention, gap_notes, tolerance_for
from flowgeom.memory import require as require_memory

DEFAULT_TOL = {torch.float64: 1e-9, torch.float32: 1e-4}


def input_sampler(module: nn.Module, sample_input: Sampler | None, input_shape) -> Sampler:
    """The sampler of one run: ``sample_input`` or ``input_shape`` when given (not both), else ``module.sample_input``.

    ``input_shape`` is the shape of *one* input, without the batch dimension: ``(4, 8)`` for a
    module that takes ``(batch, 4, 8)``.
    """
    if input_shape is not None:
        if sample_input is not None:
            raise FlowgeomError("pass either sample_input or input_shape, not both")
        from flowgeom.laws.target import parse_shape

        try:
            shape = parse_shape(input_shape)
        except FlowgeomError as exc:
            raise FlowgeomError(str(exc).replace("--input-shape", "input_shape").replace(" like 4,8", " like (4, 8)")
                                .replace("comma-separated ", "")) from None
        return shape_sampler(shape)
    if sample_input is not None:
        return sample_input
    if not callable(getattr(module, "sample_input", None)):
        raise InputError(f"{type(module).__name__} has no sample_input(batch, generator) to draw inputs from",
                         python_fix="pass input_shape=(4, 8), the shape of one input without the batch dimension, "
                                    "or give the module a sample_input(batch, generator) method",
                         cli_fix="pass --input-shape 4,8, the shape of one input without the batch dimension, "
                                 "or give the module a sample_input(batch, generator) method")
    return module_sampler(module)


DEGENERATE = ("the block is degenerate: its output is constant in the weights (rank 0, every field is zero at this "
              "point: a dead module, or a config such as num_experts_per_tok=0 that routes no token to any expert), "
              "so it has no conservation laws to count; fix the module or its config")


@dataclass
class CountResult:
    """What :func:`count` measured. ``laws = parameters − rank``."""

    parameters: int
    rank: int
    laws: int
    ranks_by_depth: list[int]
    expected: int | None
    seconds: float
    seed: int
    tolerance: float
    gap: dict
    dtype: str
    device: str
    draws: int
    vectorised: bool = True
    notes: list[str] = field(default_factory=list)
    precision: dict | None = None  # precision.Precision: the noise floor of the fields and what it means

    def to_dict(self) -> dict:
        return asdict(self)


class SpanTracker:
    """Span of normalised vectors, grown by blocks, with the σ of every decision.

    Phase 1 keeps an orthonormal basis B (r × D); :meth:`to_complement` swaps
    it for an orthonormal basis N (D × (D − r)) of its complement, after which
    :meth:`add` costs O(D · (D − r)) per vector.
    """

    def __init__(self, dim: int, *, tol: float, dtype=torch.float64, device="cpu"):
        self.dim, self.tol = dim, tol
        self._buf = torch.empty(0, dim, dtype=dtype, device=device)  # (D, D) once used; rows [:r] = basis
        self._r = 0
        self.complement: torch.Tensor | None = None  # (D, D - r) once switched
        self.kept: list[float] = []
        self.dropped: list[float] = []

    @property
    def basis(self) -> torch.Tensor:
        return self._buf[: self._r]  # (r, D) orthonormal rows

    @property
    def rank(self) -> int:
        return self.dim - self.complement.shape[1] if self.complement is not None else self.basis.shape[0]

    def add(self, vectors: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        """Add a block (b, D); return the number of new directions.

        Rows are divided by ``scales`` (b,) — the magnitude their rounding error
        is relative to; default their own norm — so σ is a relative measure.
        """
        scales = vectors.norm(dim=1) if scales is None else torch.maximum(scales, vectors.norm(dim=1))
        ok = scales > 0
        self.dropped.extend([0.0] * int((~ok).sum()))
        v = vectors[ok] / scales[ok, None]  # (b, D) rows of norm <= 1
        if v.shape[0] == 0 or self.rank == self.dim:
            self.dropped.extend([0.0] * v.shape[0])
            return 0
        if self.complement is not None:
            return self._add_complement(v)
        return self._add_basis(v)

    def _record(self, sigma: torch.Tensor) -> torch.Tensor:
        keep = sigma > self.tol
        self.kept.extend(sigma[keep].tolist())
        self.dropped.extend(sigma[~keep].tolist())
        return keep

    def _project(self, v: torch.Tensor) -> torch.Tensor:
        b = self.basis
        return v - (v @ b.T) @ b if b.shape[0] else v  # (n, D)

    def _add_basis(self, v: torch.Tensor) -> int:
        resid = self._project(v)  # (b, D)
        q, r = torch.linalg.qr(resid.T)  # (D, m), (m, b), m = min(D, b)
        sigma = torch.linalg.svdvals(r)  # accurate σ, descending
        keep = self._record(sigma)
        a = int(keep.sum())
        if a == 0:
            return 0
        if sigma[a - 1] < 1e-6:  # a weak direction kept: full SVD for its singular vector
            u = torch.linalg.svd(r)[0][:, :a]
        else:
            # Right singular vectors from eigh(rᵀr) (fast), left ones as r·w: errors of w along
            # near-null directions are multiplied by their tiny σ, so span(r·w) is accurate.
            w = torch.linalg.eigh(r.T @ r)[1][:, -a:]  # (b, a)
            u = torch.linalg.qr(r @ w)[0]  # (m, a)
        new = (q @ u).T  # (a, D) orthonormal, ⊥ basis up to rounding
        if sigma[a - 1] < 1e-4:  # small σ: rounding (~eps·√r/σ) is amplified, re-orthogonalise
            new = torch.linalg.qr(self._project(new).T)[0].T
        if self._buf.shape[0] == 0:
            self._buf = self._buf.new_empty(self.dim, self.dim)  # preallocated: no O(D²) copy per block
        self._buf[self._r : self._r + a] = new
        self._r += a
        return a

    def _add_complement(self, v: torch.Tensor) -> int:
        s = v @ self.complement  # (b, k) coordinates in the complement
        _, sigma, vh = torch.linalg.svd(s, full_matrices=True)  # vh (k, k)
        keep = self._record(sigma)
        a = int(keep.sum())
        self.complement = self.complement @ vh[a:].T  # (D, k - a)
        return a

    def to_complement(self, generator: torch.Generator) -> None:
        """Switch to tracking the orthogonal complement (D, D − r)."""
        k = self.dim - self.basis.shape[0]
        g = torch.randn(self.dim, k, generator=generator, dtype=torch.float64).to(self.basis)
        for _ in range(2):  # project twice for orthogonality at rounding level
            g = g - self.basis.T @ (self.basis @ g)
        self.complement = torch.linalg.qr(g)[0] if k else g  # (D, k)
        self._buf, self._r = self._buf[:0], 0

    def gap(self, n: int = 5) -> dict:
        kept = sorted(self.kept)[:n]
        dropped = sorted(self.dropped, reverse=True)[:n]
        ratio = kept[0] / dropped[0] if kept and dropped and dropped[0] > 0 else None
        return {"tolerance": self.tol, "smallest_kept": kept, "largest_dropped": dropped, "ratio": ratio}


def random_point(module: nn.Module, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """θ_p = rms(p) · N(0, 1) per tensor (rms 1 for all-zero tensors): generic yet on the module's scale."""
    out = {}
    for name, p in module.named_parameters():
        rms = float(p.detach().double().pow(2).mean().sqrt()) if p.numel() else 1.0
        noise = torch.randn(p.shape, generator=generator, dtype=torch.float64)
        out[name] = (noise * (rms if rms > 0 else 1.0)).to(p)
    return out


MAX_DEPTH = 16  # bracket depth k costs 3**k Jacobian-vector products per draw; deeper is never reached in practice


def check_tolerance(tol: float | None, dtype: torch.dtype) -> None:
    """FlowgeomError unless ``tol`` is None or a relative tolerance in (10·eps(dtype), 1)."""
    if tol is None:
        return
    eps = torch.finfo(dtype).eps
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 10 * eps < tol < 1:
        raise FlowgeomError(f"tolerance must be a relative singular-value threshold in ({10 * eps:.0e}, 1) for "
                            f"{str(dtype).replace('torch.', '')}, got {tol!r}; the default is {DEFAULT_TOL.get(dtype, 1e-6):.0e}")


def io_estimate(sampler: Sampler, out_shape: torch.Size, samples: int, *, bytes_per: int = 8) -> int:
    """Bytes of ``samples`` module inputs and output weights (one draw sized with a throwaway generator)."""
    x = draw_inputs(sampler, 1, 1, 1, torch.Generator().manual_seed(0), dtype=None, device="cpu")  # (1, 1, 1, *sample)
    return 2 * bytes_per * samples * (x[0, 0, 0].numel() + math.prod(out_shape))


def memory_estimate(parameters: int, block: int, *, bytes_per: int = 8) -> int:
    """Bytes the count needs: the D × D basis, the complement swap and a few (block, D) buffers."""
    return bytes_per * (2 * parameters * parameters + 6 * block * parameters)


def trainable_only(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose frozen parameters (``requires_grad=False``) are buffers.

    The numeric engine counts laws over ``named_parameters()``; gradient flow never moves a frozen
    parameter, so it is a constant of the flow, not a coordinate. On a LoRA layer this leaves only
    the adapters, i.e. the laws *of the fine-tuning*.
    """
    work = copy.deepcopy(module)
    for sub in work.modules():
        for name in [n for n, p in sub._parameters.items() if p is not None and not p.requires_grad]:
            p = sub._parameters.pop(name)
            sub.register_buffer(name, p.detach())
    return work


def frozen_note(frozen: list[str]) -> list[str]:
    """The note a count or discovery carries when frozen parameters were held fixed (empty when none were)."""
    if not frozen:
        return []
    shown = ", ".join(frozen[:4]) + (f", … ({len(frozen) - 4} more)" if len(frozen) > 4 else "")
    return [f"{len(frozen)} frozen parameter tensor(s) (requires_grad=False: {shown}) are constants of the flow, "
            "not coordinates: D counts the trained parameters only"]


def prepare(module: nn.Module, sample_input: Sampler | None, *, dtype, device,
            input_shape=None) -> tuple[nn.Module, Sampler, list[str]]:
    """A float copy of ``module`` on ``device`` (frozen parameters as constants), its input sampler and the
    frozen parameters' names; FlowgeomError if unusable."""
    if not isinstance(module, nn.Module):
        raise FlowgeomError(f"expected an nn.Module, got {type(module).__name__}")
    if sum(p.numel() for p in module.parameters()) == 0:
        raise FlowgeomError(f"{type(module).__name__} has no parameters: there is nothing to conserve; pass a module with weights")
    check_parameters(module)
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if len(frozen) == len(list(module.parameters())):
        raise FlowgeomError(f"every parameter of {type(module).__name__} is frozen (requires_grad=False): gradient flow "
                            "moves nothing, so every function of θ is trivially conserved; unfreeze the parameters "
                            "you train (module.requires_grad_(True))")
    sample_input = input_sampler(module, sample_input, input_shape)
    work = trainable_only(module).to(device=device, dtype=dtype)  # a deep copy; frozen tensors as buffers
    return work, sample_input, frozen


def check_parameters(module: nn.Module) -> None:
    """FlowgeomError for parameters the engine cannot differentiate: on the meta device, not real floats, NaN/Inf."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.is_meta:
            raise FlowgeomError(f"{name!r} is on the meta device (no values); materialise the module first "
                                "(module.to_empty(device='cpu') and initialise or load its weights)")
    for name, p in module.named_parameters():
        if not p.is_floating_point():
            raise FlowgeomError(f"parameter {name!r} has dtype {str(p.dtype).replace('torch.', '')}; gradient flow needs "
                                "real floating-point parameters; register it as a buffer (register_buffer) instead")
        if not bool(torch.isfinite(p).all()):
            raise FlowgeomError(f"parameter {name!r} contains NaN or Inf; fix or re-initialise the weights")


def require_finite(values: torch.Tensor, what: str) -> None:
    """FlowgeomError when ``values`` hold NaN or Inf: a rank of non-finite vectors means nothing."""
    if not bool(torch.isfinite(values).all()):
        raise FlowgeomError(f"{what} contain NaN or Inf at the sampled points; the module must be finite and "
                            "differentiable there (look for log/sqrt/division at 0, overflow, or NaN weights)")


def probe_output(model: FieldModel, theta: torch.Tensor, sampler: Sampler, generator: torch.Generator, *, dtype, device) -> torch.Size:
    """Run the module once on a sampled input; its output shape, or a FlowgeomError saying why it failed."""
    x = draw_inputs(sampler, 1, 1, 1, generator, dtype=dtype, device=device)[0, 0, 0]
    try:
        with torch.no_grad():
            y = model.output(theta, x)
    except FlowgeomError:
        raise
    except Exception as exc:  # the module rejected the input: say so in one line
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"the module rejected an input of shape {tuple(x.shape)} (forward gets one input at a time, "
                         f"without the batch dimension): {msg}",
                         python_fix="pass an input_shape it accepts (one input, without the batch dimension)",
                         cli_fix="pass an --input-shape it accepts (one input, without the batch dimension)") from None
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        got = type(y).__name__ if not isinstance(y, torch.Tensor) else f"a {str(y.dtype).replace('torch.', '')} tensor"
        raise FlowgeomError(f"the module must return one floating-point tensor, got {got}; wrap it to return a float tensor")
    require_finite(y, "the module's outputs")
    return y.shape


@dataclass(frozen=True)
class Draws:
    """How the fields were drawn so far: how many, and whether every block ran vmapped."""

    count: int = 0
    vectorised: bool = True

    def then(self, n: int, vectorised: bool) -> Draws:
        return Draws(self.count + n, self.vectorised and vectorised)


class FieldSource:
    """Random draws of depth-k brackets at θ, in blocks, vmapped (loop fallback). Holds no state but the generator's."""

    def __init__(self, model: FieldModel, theta, sampler, out_shape, generator, *, per_field, dtype, device):
        self.model, self.theta, self.sampler, self.out_shape = model, theta, sampler, out_shape
        self.per_field = per_field
        self.generator, self.dtype, self.device = generator, dtype, device

    def block(self, depth: int, n: int, *, vectorise: bool = True) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(fields, scales, vmapped): ``vectorise=False`` skips a vmap already seen failing on this module."""
        p = self.per_field if depth == 0 else max(1, self.per_field // 8)  # brackets mix generators already
        xs = draw_inputs(self.sampler, n, depth + 1, p, self.generator, dtype=self.dtype, device=self.device)
        cs = torch.randn(n, depth + 1, p, *self.out_shape, generator=self.generator, dtype=torch.float64)
        cs = cs.to(device=self.device, dtype=self.dtype)
        d = self.theta.numel()
        chunk = max(1, int(2**27 // (8 * p * d * 3 ** depth)))
        out = None
        if vectorise:
            try:
                out = self.model.draw(self.theta, depth, xs, cs, chunk=chunk)
            except FlowgeomError:
                raise
            except Exception:  # some op has no vmap rule: fall back to a loop over draws
                pass
        vmapped = out is not None
        if out is None:
            fn = self.model.nested(depth)
            try:
                pairs = [fn(self.theta, xs[i], cs[i]) for i in range(n)]
            except FlowgeomError:
                raise
            except Exception as exc:  # it ran once in probe_output: the module is not a pure function of (θ, x)
                msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise FlowgeomError(f"the module failed while drawing depth-{depth} fields, after a first call that worked: "
                                    f"{type(exc).__name__}: {msg}; its forward must be a pure function of its "
                                    "parameters and input (no call counters or state changed by forward)") from None
            out = torch.stack([v for v, _ in pairs]), torch.stack([s for _, s in pairs])
        require_finite(out[0], f"the depth-{depth} fields (gradients{' and brackets' if depth else ''})")
        require_finite(out[1], f"the depth-{depth} field scales")
        return out[0], out[1], vmapped


Progress = Callable[[str, int, int], None]  # (stage, done, total): e.g. ("depth 1", rank so far, D)


def _grow_level(span: SpanTracker, source: FieldSource, depth: int, draws: Draws, *, block: int, patience: int,
                max_blocks: int, progress: Progress | None = None) -> Draws:
    """Draw blocks of depth-``depth`` brackets until ``patience`` consecutive draws add nothing.

    A block that does not fill up (``n − added ≥ patience``) is followed by a
    confirmation block of ``patience`` draws; the level ends when that adds
    nothing (else the search goes on).
    """
    saturated = False
    for _ in range(max_blocks):
        if span.rank == span.dim:
            return draws
        n = patience if saturated else min(block, span.dim - span.rank + patience)
        fields, scales, vmapped = source.block(depth, n, vectorise=draws.vectorised)
        draws = draws.then(n, vmapped)
        added = span.add(fields, scales)
        if progress is not None:
            progress(f"rank of Lie(W), depth {depth}", span.rank, span.dim)
        if saturated and added == 0:
            return draws
        saturated = n - added >= patience
    return draws


def lie_span(span: SpanTracker, source: FieldSource, generator: torch.Generator, *, max_depth: int, patience: int,
             block: int, progress: Progress | None = None) -> tuple[list[int], Draws]:
    """Grow ``span`` to Lie(W)(θ): depth 0 in basis form, then brackets in complement form; ranks by depth."""
    d = span.dim
    draws = _grow_level(span, source, 0, Draws(), block=block, patience=patience, max_blocks=math.ceil(d / block) + 8,
                        progress=progress)
    ranks = [span.rank]
    span.to_complement(generator)
    for depth in range(1, max_depth + 1):
        if span.rank == d:
            break
        before = span.rank
        draws = _grow_level(span, source, depth, draws, block=min(block, 256), patience=patience,
                            max_blocks=math.ceil(d / 256) + 8, progress=progress)
        ranks.append(span.rank)
        if span.rank == before:
            break
    return ranks, draws


def count(
    module: nn.Module,
    sample_input: Sampler | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    tol: float | None = None,
    max_depth: int = 6,
    patience: int = 8,
    block: int = 512,
    at: str = "random",
    per_field: int = 16,
    max_memory: int | None = None,
    check_precision: bool = True,
    input_shape: Sequence[int] | None = None,
    progress: Progress | None = None,
    expected: int | None = None,
) -> CountResult:
    """Number of independent conservation laws of ``module`` at a random θ.

    Inputs: ``input_shape`` (one input, without the batch dimension: ``(4, 8)`` for a
    module called on ``(batch, 4, 8)``; standard normal), or ``sample_input(n, generator)``
    returning ``n`` valid module inputs stacked on dim 0, or by default the module's own
    ``sample_input(batch, generator)`` method. Each drawn field sums the
    generators of ``per_field`` inputs with random output weights. ``at`` is
    ``"random"`` (a generic point on the module's scale) or ``"module"`` (its
    current weights). Raises FlowgeomError for a module without parameters, an
    input it rejects, or a D whose memory estimate exceeds ``max_memory``
    (default: :func:`flowgeom.memory.budget`, 80% of what ``device`` has free). ``check_precision`` first measures
    the fields' rounding noise (:mod:`flowgeom.laws.precision`): a module computing
    below ``dtype`` inside is reported, and without ``tol`` the tolerance follows
    the measured noise. ``progress(stage, done, total)`` is called after every block of
    fields (the CLI's progress bar): the rank found so far out of D.
    """
    start = time.perf_counter()
    device = torch.device(device)
    if at not in ("random", "module"):
        raise FlowgeomError(f"unknown point {at!r}; choose random or module")
    for value, name in ((patience, "patience"), (block, "block"), (per_field, "per_field")):
        positive_int(value, name)
    if not 0 <= max_depth <= MAX_DEPTH:
        raise FlowgeomError(f"max_depth must be between 0 and {MAX_DEPTH}, got {max_depth}")
    check_tolerance(tol, dtype)
    generator(seed)  # a bad seed is refused before any work
    work, sampler, frozen = prepare(module, sample_input, dtype=dtype, device=device, input_shape=input_shape)
    switched = eager_attention(work)  # sdpa/flash have no forward-mode AD; eager is the same function
    model = FieldModel(work)
    d = model.layout.size
    need = memory_estimate(d, block, bytes_per=torch.empty(0, dtype=dtype).element_size())
    require_memory(need, f"D = {d:,} parameters", device=device, limit=max_memory,
                   fix="that is the rank computation's working set: count a smaller instance or pass device='cuda'",
                   cli_fix="that is the rank computation's working set: count a smaller instance or use --device cuda")
    gen = torch.Generator().manual_seed(seed)
    params = random_point(work, gen) if at == "random" else dict(work.named_parameters())
    theta = model.layout.flatten({k: v.detach() for k, v in params.items()}).to(device=device, dtype=dtype)
    out_shape = probe_output(model, theta, sampler, gen, dtype=dtype, device=device)
    io = io_estimate(sampler, out_shape, block * per_field, bytes_per=torch.empty(0, dtype=dtype).element_size())
    require_memory(io, f"one block of {block * per_field:,} inputs and output weights", device=device, limit=max_memory,
                   fix="use a smaller input_shape or module output", cli_fix="use a smaller --input-shape or module output")
    source = FieldSource(model, theta, sampler, out_shape, gen, per_field=per_field, dtype=dtype, device=device)
    prec = assess(model, theta, sampler, out_shape, seed=seed, dtype=dtype, device=device, per_field=per_field) if check_precision else None
    default_tol = DEFAULT_TOL.get(dtype, 1e-6)
    tol_used = tol if tol is not None else tolerance_for(prec, default_tol) if prec is not None and prec.reduced else default_tol
    span = SpanTracker(d, tol=tol_used, dtype=dtype, device=device)
    ranks, draws = lie_span(span, source, gen, max_depth=max_depth, patience=patience, block=block, progress=progress)
    if span.rank == 0 and d > 0:  # D "laws" of a constant function would say nothing about the architecture
        raise FlowgeomError(DEGENERATE)
    notes = switched + frozen_note(frozen) + gap_notes(span.gap(), prec, default_tol=default_tol,
                                                       tol_given=tol is not None)
    if max_depth == 0 and span.rank < d:
        notes.append("max_depth 0: no Lie brackets were taken, so this is D − dim W(θ), an upper bound on the laws")
    elif len(ranks) == max_depth + 1 and ranks[-1] != ranks[-2] and span.rank < d:
        notes.append(f"depth {max_depth} still added directions; raise max_depth for a sure count")
    if not draws.vectorised:
        notes.append("torch.func.vmap failed on this module; fields were drawn one by one (slow path)")
    return CountResult(
        parameters=d, rank=span.rank, laws=d - span.rank, ranks_by_depth=ranks, expected=expected_laws(module, expected),
        seconds=time.perf_counter() - start, seed=seed, tolerance=span.tol, gap=span.gap(), dtype=str(dtype).replace("torch.", ""),
        device=str(device), draws=draws.count, vectorised=draws.vectorised, notes=notes,
        precision=prec.to_dict() if prec is not None else None,
    )


def expected_laws(module: nn.Module, given: int | None = None) -> int | None:
    """``given`` (a target's own expectation, e.g. an ``hf:`` closed form), else the catalogue's count
    when ``module`` is one zoo block, else None."""
    if given is not None or not type(module).__module__.startswith("flowgeom.nn."):
        return given
    from flowgeom.laws.catalogue import expected_count

    return expected_count(module)
