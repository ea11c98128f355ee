"""The precision a module really computes in, and how to make it compute in the count's dtype.

Why it matters. The law engine decides ranks from singular values: a
direction is new when its relative σ exceeds ``tol`` (1e-9 in float64). That
assumes the fields ∇_θ⟨c, f(x; θ)⟩ carry float64 rounding (~1e-16). A module
that casts an inner op down — transformers' eager attention computes
``softmax(..., dtype=torch.float32)``, its RMSNorms upcast to float32, MoE
routers call ``.float()`` — produces fields with float32 rounding (~1e-7
relative); rounding noise then projects onto the law directions with σ of
order 1e-9 … 1e-8, above the tolerance, and the count comes out too small
(a 2-head RoPE Llama attention: 20 laws instead of 24).

Measuring it (:func:`measure`). Take a field g(θ) = ∇_θ Σ_i⟨c_i, f(x_i; θ)⟩
at the count's point θ, a random direction u (each coordinate scaled by
|θ_k|), ε = 1e-7 and the second differences s_h = g(θ + hu) + g(θ − hu) − 2g(θ)
at h = ε and 2ε. In exact arithmetic s_h = h²·∂²g[u, u] + O(h⁴), so
s_2ε − 4 s_ε = O(ε⁴) ≈ 0: the curvature cancels (a single second difference
would read a curvature of 1e3 as "noise" 1e-11). What is left is rounding,
which is not smooth in θ: a relative step of 1e-7 flips the roundings of a
float32 intermediate (spacing ~6e-8) but not of a float64 one. Hence

    η = ‖s_2ε − 4 s_ε‖ / (√70 ‖g(θ)‖)

(√70: the five evaluations' independent errors, weights 1, 1, 6, 4, 4)
estimates the relative rounding of one field: ~1e-16 … 1e-15 for a float64
module, ~1e-8 … 1e-7 when a float32 op sits on the path, ~1e-3 for bfloat16.
The largest η of a few draws is reported with the precision it corresponds to.

Running casts in the module dtype (:func:`keep_dtype`). A
``TorchFunctionMode`` that turns down-casts of float64 tensors
(``.to(float32)``, ``.float()``, ``.half()``, ``.type(...)``, ``softmax(...,
dtype=float32)``) into no-ops. This is legitimate for counting laws: a cast is
the identity in exact arithmetic, so the function f(x; θ) — hence its
symmetries, its fields' span and its conservation laws — is the same; only
the rounding changes. ``hf:`` targets run their forward inside it by default.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

LOW = (torch.float32, torch.float16, torch.bfloat16)
EPS = 1e-7  # relative step of the second difference
# noise floor η -> precision the module effectively computes in (upper bounds, in order)
LEVELS = ((1e-11, "float64"), (1e-5, "float32"), (math.inf, "float16/bfloat16"))
NATIVE = {torch.float64: "float64", torch.float32: "float32"}


@dataclass
class Precision:
    """What :func:`measure` found: the noise floor η of the fields and the precision it means."""

    dtype: str          # the count's arithmetic
    effective: str      # precision the fields really carry: float64, float32, float16/bfloat16
    noise: float        # η, the largest relative second difference of the draws
    reduced: bool       # effective precision below the count's dtype

    def to_dict(self) -> dict:
        return asdict(self)


def level(noise: float) -> str:
    return next(name for bound, name in LEVELS if noise <= bound)


def measure(field, theta: torch.Tensor, draws: list[tuple[torch.Tensor, torch.Tensor]], generator: torch.Generator,
            *, dtype: torch.dtype) -> Precision:
    """η of ``field(θ, xs, cs)`` over ``draws`` [(xs, cs)], each along a fresh direction (curvature cancelled).

    ``field`` is :meth:`flowgeom.laws.fields.FieldModel.field`; θ (D,).
    """
    noise = 0.0
    for xs, cs in draws:
        u = torch.randn(theta.shape, generator=generator, dtype=torch.float64).to(theta) * theta.abs()  # (D,)
        g0 = field(theta, xs, cs)
        norm = float(torch.linalg.vector_norm(g0))
        if not math.isfinite(norm) or norm == 0.0:
            continue
        s1 = field(theta + EPS * u, xs, cs) + field(theta - EPS * u, xs, cs) - 2 * g0  # ε²·curvature + noise
        s2 = field(theta + 2 * EPS * u, xs, cs) + field(theta - 2 * EPS * u, xs, cs) - 2 * g0  # 4ε²·curvature + noise
        eta = float(torch.linalg.vector_norm(s2 - 4 * s1)) / (math.sqrt(70.0) * norm)
        noise = max(noise, eta if math.isfinite(eta) else math.inf)
    effective = level(noise)
    native = NATIVE.get(dtype, "float32")
    order = [name for _, name in LEVELS]
    reduced = order.index(effective) > order.index(native) if native in order else False
    return Precision(dtype=native, effective=effective, noise=noise, reduced=reduced)


def tolerance_for(precision: Precision, default: float) -> float:
    """Tolerance matched to the measured noise floor: 10·η, never below ``default``, at most 1e-3.

    Rounding noise projected on a law direction has σ ≲ η (measured: ~1e-9
    against η ≈ 1e-7 for float32 softmax in a float64 attention), while real
    directions of small blocks have σ ≳ 1e-3; 10·η separates the two when the
    gap allows it, and the gap report says when it does not.
    """
    return min(1e-3, max(default, 10.0 * precision.noise))


class keep_dtype(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch.no_grad
    """Inside ``with keep_dtype():`` down-casts of float64 tensors are no-ops (see the module docstring)."""

    _TO = (torch.Tensor.to, torch.Tensor.type)
    _UP = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)
    _SOFTMAX = (torch.nn.functional.softmax, torch.nn.functional.log_softmax, torch.softmax, torch.log_softmax,
                torch.Tensor.softmax, torch.Tensor.log_softmax)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            if func in self._UP and len(args) == 1 and not kwargs:
                return x
            if func in self._TO:
                rest = tuple(a for a in args[1:] if not (isinstance(a, torch.dtype) and a in LOW))
                dropped = len(rest) < len(args) - 1
                if kwargs.get("dtype") in LOW:
                    kwargs.pop("dtype")
                    dropped = True
                if func is torch.Tensor.type and rest and isinstance(rest[0], str) and rest[0] in ("torch.FloatTensor", "torch.HalfTensor"):
                    return x
                if dropped:
                    return func(x, *rest, **kwargs) if rest or kwargs else x
            if func in self._SOFTMAX and kwargs.get("dtype") in LOW:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def eager_attention(module: nn.Module) -> list[str]:
    """Switch Hugging Face modules in ``module`` that use sdpa/flash/flex attention to eager; notes of what changed.

    sdpa and flash kernels have no forward-mode AD on CPU (the bracket step
    needs ``jvp``); eager attention is the same function. Acts on the configs
    of ``module`` (a copy the count owns), in place.
    """
    notes, seen = [], set()
    for sub in module.modules():
        config = getattr(sub, "config", None)
        impl = getattr(config, "_attn_implementation", None)
        if config is None or id(config) in seen or not isinstance(impl, str) or impl == "eager":
            continue
        seen.add(id(config))
        try:
            config._attn_implementation = "eager"
        except Exception:  # noqa: BLE001 - a config that refuses the switch keeps its kernel; the count then says why it failed
            continue
        notes.append(f"attention implementation {impl!r} switched to 'eager' for the count (same function; "
                     f"{impl} kernels have no forward-mode AD)")
    return notes


def assess(model, theta: torch.Tensor, sampler, out_shape, *, seed: int, dtype: torch.dtype, device, per_field: int,
           draws: int = 3) -> Precision | None:
    """:func:`measure` on ``draws`` fields of ``model`` (a FieldModel) at θ, with its own generator.

    The generator is derived from ``seed`` but separate from the count's, so
    the count draws exactly what it drew before this probe existed.
    """
    from flowgeom.laws.fields import draw_inputs

    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    pairs = []
    for _ in range(draws):
        xs = draw_inputs(sampler, 1, 1, per_field, gen, dtype=dtype, device=device)[0, 0]  # (p, *sample)
        cs = torch.randn(per_field, *out_shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
        pairs.append((xs, cs))
    try:
        return measure(model.field, theta, pairs, gen, dtype=dtype)
    except Exception:  # noqa: BLE001 - the probe is advisory: a module it cannot differentiate fails later with its own message
        return None


UNCLEAR_RATIO = 1e3  # smallest kept σ / largest dropped σ below this: the rank is not clearly separated


def gap_notes(gap: dict, precision: Precision | None, *, default_tol: float, tol_given: bool) -> list[str]:
    """Notes on a reduced precision and on an unclear rank gap (``gap`` from ``SpanTracker.gap``)."""
    notes = []
    if precision is not None and precision.reduced:
        how = (f"tolerance raised from {default_tol:.0e} to {gap['tolerance']:.0e} (10 × the noise)" if not tol_given
               else f"the tolerance {gap['tolerance']:.0e} was given, not adapted")
        notes.append(f"reduced precision: the fields carry {precision.effective} rounding (noise {precision.noise:.1e} "
                     f"relative) in a {precision.dtype} count — an op casts down inside the module (e.g. "
                     f"softmax(dtype=float32) in eager attention, an RMSNorm or router upcast to float32); {how}. "
                     "Fix: run those ops in the module dtype (hf: targets do; for your own module wrap its forward in "
                     "flowgeom.laws.precision.keep_dtype()), then recount")
    kept, dropped = gap["smallest_kept"], gap["largest_dropped"]
    if precision is not None and kept and kept[0] < 10 * precision.noise:
        below = sum(1 for s in kept if s < 10 * precision.noise)
        notes.append(f"unclear rank gap: {below}{'+' if below == len(kept) else ''} kept σ (smallest {kept[0]:.1e}) lie "
                     f"within 10 × the fields' rounding noise {precision.noise:.1e}: they may be noise, not directions, "
                     "and the count too small; leave --tol at its default (it follows the noise) or run the module "
                     "in full precision")
        return notes
    if kept and dropped and dropped[0] > 0 and kept[0] / dropped[0] < UNCLEAR_RATIO:
        notes.append(f"unclear rank gap: smallest kept σ {kept[0]:.1e} vs largest dropped σ {dropped[0]:.1e} "
                     f"(ratio {kept[0] / dropped[0]:.1e} < {UNCLEAR_RATIO:.0e}); the count depends on the tolerance "
                     "and is not reliable — look for an op computing in lower precision, or pass --tol between "
                     "the two groups of σ")
    return notes
