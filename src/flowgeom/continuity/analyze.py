"""The checkpoint continuity analyzer: every role, every layer pair, streamed.

For each role (q k v o gate up down, or ``--role`` patterns) the layers are
read one at a time (``batch`` at a time when asked) in layer order. Per
layer we keep only small things — the top-k singular pairs and the
small-side Gram — plus the raw matrices of the last ``max(distances)``
layers, which the cross products of the Gram similarity need. Peak memory is
therefore about ``batch + max(distances)`` matrices of one role (two for the
defaults), never the model, per worker.

**Roles in parallel.** With ``workers > 1`` (CPU), roles run in that many
threads, largest first, each with one BLAS thread: the heavy kernels release
the GIL (:mod:`flowgeom.continuity._blas`), and every role is computed by
the same calls in the same order as serially, so the report is bit-identical
for any ``workers``. Peak memory is then ``workers`` times the above.

Verdict rule (per role, on the adjacent pairs = the first distance):
``r_in = mean v1 / baseline_v1``, ``r_out = mean u1 / baseline_u1``;
``input-continuous`` if ``r_in >= threshold`` and ``r_out < threshold``,
``output-continuous`` in the mirror case, ``input+output-continuous`` if both,
``neither`` otherwise. The default threshold 3 is far outside chance: the
mean over L-1 random pairs of |cos| has relative spread ~0.75/sqrt(L-1).

**The sigma^2-Gram similarity, exact or sketched** (``gram_method``, issue 41).
``exact`` forms the small-side Gram and one cross product per pair (``3 D d^2``
flops); ``sketch`` estimates it by Hutch++ with shared Rademacher probes and
carries a 95% interval (:mod:`flowgeom.continuity.sketch`); ``auto`` (default)
sketches the roles whose exact pair would take more than a second or two
(:func:`flowgeom.continuity.sketch.choose`) and says which in ``roles[R].gram``.
A sketched role keeps its matrices in the compute dtype in the window (the
pair products need them) and forms no Gram unless the dense eigensolver or
``--spectra`` needs one. The verdict reads v1/u1, which are never sketched; a
sketched metric whose ratio interval straddles the threshold is flagged
(``metrics[M].straddles_threshold``).
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch

from flowgeom.continuity import _blas
from flowgeom.continuity import sketch as _sketch
from flowgeom.continuity.baselines import METRICS, analytic_baselines, monte_carlo_baselines
from flowgeom.continuity.metrics import gram_fro, gram_numerator, pair_metrics
from flowgeom.continuity.layouts import NamingHints, check_config_shapes, hints_for
from flowgeom.continuity.naming import MatrixRef, resolve_roles
from flowgeom.continuity.spectra import (DENSE_MAX_DIM, SOLVERS, GramOperator, bf16_gram, pairs_and_spectrum_from_gram,
                                         pairs_from_gram, small_gram, unit_scale, unscale_pairs, unscale_values)
from flowgeom.errors import FlowgeomError, finite_number, positive_int, require_choices
from flowgeom.io import TensorSource, open_source
from flowgeom.memory import USABLE_FRACTION, budget

DTYPES = {"float64": torch.float64, "float32": torch.float32}
BASELINES = ("analytic", "montecarlo")
GRAM_METHODS = ("auto", "exact", "sketch")


@dataclass(frozen=True)
class AnalyzeConfig:
    k: int = 8  # top-k singular pairs: subspace and index-matched metrics (v1/u1 use the first)
    distances: tuple[int, ...] = (1,)  # layer distances Δ; the first one drives table and verdict
    roles: tuple[str, ...] | None = None  # subset of roles (default: all found)
    max_layers: int | None = None  # analyse only the first N layers of each role
    device: str = "cpu"
    dtype: str = "float64"  # compute dtype of the Grams and cross products
    baseline: str = "analytic"  # or "montecarlo" (Gaussian draws of the same shapes)
    draws: int = 8  # Monte-Carlo draws
    seed: int = 0
    batch: int = 1  # layers stacked per batched call (memory ~ batch + max distance matrices)
    threshold: float = 3.0  # verdict: ratio to baseline counted as continuous
    tol: float = 1e-10  # Krylov residual tolerance (relative to sigma_1^2)
    solver: str = "auto"  # top-k eigenpairs of the Gram: auto | krylov | dense (see spectra.py)
    gram: bool = True  # sigma^2-Gram similarity at all (False: --no-gram)
    gram_method: str = "auto"  # exact | sketch | auto (sketch where an exact pair would take > ~1.5 s; sketch.py)
    probes: int | None = None  # sketch: Rademacher probes per matrix and space (default: the rule from rel_error)
    rel_error: float | None = None  # sketch: target 95% half-width relative to the value (default 0.02)
    heads: int | None = None  # query heads for splitting fused q|k|v (default: from the model config)
    kv_heads: int | None = None  # key/value heads for splitting fused q|k|v (default: from the model config)
    merge_lora: bool = False  # analyse W + s·B A for PEFT LoRA-adapted projections instead of the base W
    lora_adapter: str | None = None  # which adapter to merge when the checkpoint holds several
    spectra: bool = False  # per-matrix stable rank, spectral entropy, power-law alpha of the ESD (powerlaw.py)
    workers: int = 1  # roles analysed in parallel threads on CPU (same report for any value; memory x workers)

    def __post_init__(self):
        for name in ("k", "batch", "draws", "workers"):
            positive_int(getattr(self, name), f"--{name}")
        if not self.distances:
            raise FlowgeomError("--distance needs at least one layer distance, e.g. --distance 1")
        for d in self.distances:
            positive_int(d, "each --distance")
        for name in ("heads", "kv_heads"):
            if getattr(self, name) is not None:
                positive_int(getattr(self, name), f"--{name.replace('_', '-')}")
        if self.max_layers is not None and self.max_layers < 2:
            raise FlowgeomError(f"--max-layers must be >= 2 (pairs need two layers), got {self.max_layers}")
        require_choices(self, dtype=DTYPES, solver=SOLVERS, baseline=BASELINES)
        if finite_number(self.threshold, "--threshold", fix="a ratio to chance > 1, e.g. 3") <= 1:
            raise FlowgeomError(f"--threshold must be > 1 (a ratio to chance), got {self.threshold}")
        finite_number(self.tol, "--tol", positive=True, fix="a small relative residual, e.g. 1e-10")
        try:
            if isinstance(self.seed, bool):
                raise TypeError
            seed_ok = 0 <= operator.index(self.seed) < 2**63
        except TypeError:
            seed_ok = False
        if not seed_ok:
            raise FlowgeomError(f"--seed must be a whole number in [0, 2**63), got {type(self.seed).__name__} "
                                f"{self.seed!r}")
        require_choices(self, gram_method=GRAM_METHODS)
        if not self.gram and self.gram_method == "sketch":
            raise FlowgeomError("--gram sketch asks for the sigma^2-Gram similarity and --no-gram skips it; "
                                "drop one of them")
        if self.probes is not None:
            positive_int(self.probes, "--probes", fix="e.g. --probes 32 (or leave it out: --rel-error sets it)")
            if self.rel_error is not None:
                raise FlowgeomError(f"--probes {self.probes} fixes the probe count and --rel-error {self.rel_error} "
                                    "asks the rule to choose it; give one of them")
        if self.rel_error is not None:
            e = finite_number(self.rel_error, "--rel-error", fix="a fraction, e.g. 0.02 for 2%")
            if not 0 < e < 1:
                raise FlowgeomError(f"--rel-error must be between 0 and 1 (a fraction: 0.02 = 2%), got {e!r}")

    @property
    def target_error(self) -> float:
        """The relative 95% half-width the probe rule aims at (sketch.DEFAULT_REL_ERROR unless set)."""
        return _sketch.DEFAULT_REL_ERROR if self.rel_error is None else float(self.rel_error)


def verdict(r_in: float | None, r_out: float | None, threshold: float) -> str:
    """Verdict from the v1 and u1 ratios to baseline (see module docstring)."""
    inp = r_in is not None and r_in >= threshold
    out = r_out is not None and r_out >= threshold
    return {(True, True): "input+output-continuous", (True, False): "input-continuous",
            (False, True): "output-continuous", (False, False): "neither"}[(inp, out)]


@dataclass
class _LayerState:
    layer: int
    matrix: torch.Tensor | None  # (m, n) compute dtype, or bf16 as stored (see _layer_states); None with gram=False
    gram: torch.Tensor | None  # small-side Gram (None with gram=False)
    fro: torch.Tensor  # ||A^T A||_F
    pairs: object  # SingularPairs of this matrix
    spectrum: dict | None = None  # layer spectra (config.spectra): powerlaw.layer_spectrum + eigenvalue source
    side: str = "in"  # which side the Gram is on ("in": A^T A, "out": A A^T)
    sketches: dict | None = None  # {space: sketch.LayerSketch} of a sketched role (extended as the probe rule grows)


@dataclass
class _RoleRun:
    refs: list[MatrixRef]
    pairs: list[dict] = field(default_factory=list)
    spectra: list[dict] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the role (with workers > 1: while sharing the CPU with other roles)
    sketchers: dict | None = None  # {space: sketch.SpaceSketcher} of a sketched role


def _stats(values: Sequence[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    std = float(t.std()) if len(values) > 1 else 0.0
    return {"mean": float(t.mean()), "std": std, "min": float(t.min()), "max": float(t.max())}


class Analyzer:
    """Streams one role at a time; see module docstring. Use :func:`analyze`."""

    def __init__(self, source: TensorSource, config: AnalyzeConfig, custom: Mapping[str, str] | None = None,
                 hints: NamingHints | None = None):
        self.source, self.config = source, config
        hints = hints or NamingHints(heads=config.heads, kv_heads=config.kv_heads, merge_lora=config.merge_lora,
                                     lora_adapter=config.lora_adapter)
        self.layout = resolve_roles(source.shapes, custom=custom, only=config.roles,
                                    hints=hints).limited(config.max_layers, source.shapes)
        check_config_shapes(self.layout.roles, hints)  # a tensor the config does not describe: refused, not analysed
        self.k_of: dict[str, int] = {}  # top-k per role: a router may have fewer rows (experts) than --k
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.metrics = METRICS if config.gram else tuple(m for m in METRICS if not m.startswith("gram_"))
        self.gram_of: dict[str, tuple[str, str]] = {}  # role: (exact | sketch, why)
        for role, refs in self.layout.roles.items():
            m, n = refs[0].shape
            if config.gram:
                self.gram_of[role] = _sketch.choose((m, n), config.gram_method, device=config.device)
            if self.gram_of.get(role, ("",))[0] == "sketch" and config.probes is not None and config.probes > min(m, n):
                raise FlowgeomError(f"--probes {config.probes} is beyond the side {min(m, n)} of role {role} "
                                    f"{[m, n]}: more probes than the matrix's rank bound estimate nothing more; "
                                    f"use --probes {min(m, n)} or fewer, or --gram exact")
            self.k_of[role] = config.k
            if config.k > min(m, n) and (role == "router" or role.endswith(".router")):
                self.k_of[role] = min(m, n)  # one row per expert (a shared-expert gate has one row)
            elif config.k > min(m, n):
                raise FlowgeomError(f"--k {config.k} exceeds the rank bound {min(m, n)} of role {role} {[m, n]}; lower --k")
            too_far = [d for d in config.distances if d >= len(refs)]
            if too_far:  # every distance must give at least one pair: its mean is reported
                raise FlowgeomError(f"--distance {too_far[0]} leaves no pair among the {len(refs)} layers "
                                    f"of role {role}; use distances below {len(refs)}")

    def role_memory(self, role: str) -> int:
        """Peak bytes of analysing ``role`` (:func:`role_memory` with this checkpoint's dtypes and settings)."""
        refs = self.layout.roles[role]
        compute = torch.empty((), dtype=self.dtype).element_size()
        stored = max(getattr(self.source, "itemsizes", {}).get(r.tensor, compute) for r in refs)
        sketch = self.sketched(role)
        bf16 = (self.config.gram and not sketch and self.dtype == torch.float32 and self.device.type == "cpu"
                and stored == 2)
        return role_memory(refs[0].shape, stored=stored, compute=compute, batch=self.config.batch,
                           keep=max(self.config.distances), gram=self.config.gram, bf16_window=bf16, sketch=sketch)

    def sketched(self, role: str) -> bool:
        """Whether ``role``'s sigma^2-Gram similarity is sketched (``gram_method`` and the role's shape)."""
        return self.gram_of.get(role, ("",))[0] == "sketch"

    def sketchers(self, role: str) -> dict[str, _sketch.SpaceSketcher] | None:
        """Fresh probe state for one pass over ``role`` (None when it is not sketched)."""
        if not self.sketched(role):
            return None
        m, n = self.layout.roles[role][0].shape
        cap = _sketch.cap_for((m, n), self.config.gram_method)
        return {space: _sketch.SpaceSketcher(role, space, n if space == "in" else m, seed=self.config.seed,
                                             probes=self.config.probes, rel_error=self.config.target_error, cap=cap)
                for space in ("in", "out")}

    def _load(self, ref: MatrixRef) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(A 2^-e, e, A as stored)``: the first in the compute dtype, extreme weights (1e25, 1e-30) rescaled
        exactly (spectra.unit_scale)."""
        t = ref.load(self.source)  # one tensor (or one expert of a stack), fused rows selected, LoRA merged
        if not t.is_floating_point():
            raise FlowgeomError(f"{ref.tensor} (role {ref.role}) has dtype {str(t.dtype).replace('torch.', '')}: the "
                                "integer codes of a quantised checkpoint (without their scales) or not weights at "
                                "all; dequantise the checkpoint to float first, or leave the role out with --roles")
        t = t.to(device=self.device)
        return (*unit_scale(t, self.dtype), t)  # (m, n), (), (m, n)

    def _layer_states(self, refs: list[MatrixRef], sketchers: dict | None = None) -> list[_LayerState]:
        loaded = [self._load(r) for r in refs]
        exps = torch.stack([e for _, e, _ in loaded])  # (B,) power-of-two scale of each matrix
        if sketchers is not None:
            return self._sketched_states(refs, loaded, exps, sketchers)
        keep = self.config.gram and self.dtype == torch.float32 and self.device.type == "cpu"
        stored = [t if keep and t.dtype == torch.bfloat16 and not e.any() else None for _, e, t in loaded]
        loaded = [m for m, _, _ in loaded]
        mats = loaded[0].unsqueeze(0) if len(loaded) == 1 else torch.stack(loaded)  # (B, m, n), no copy for B = 1
        del loaded
        k = self.k_of[refs[0].role]
        spectra = [None] * len(refs)
        d = min(mats.shape[-2:])
        krylov = self.config.solver == "krylov" or (self.config.solver == "auto" and d > DENSE_MAX_DIM)
        if krylov and not self.config.spectra and all(t is not None for t in stored):
            # bf16 checkpoint: the float32 Gram is never formed. The similarity's Gram comes from a bf16 GEMM
            # (exact products, float32 sums, entries rounded to bf16: spectra.bf16_gram), the eigenpairs from
            # Krylov on the float32 matrix itself (spectra.GramOperator). For a 14336x4096 gate matrix the bf16
            # GEMM took 1.6-2.2 s of CPU against 3.0 s for ?syrk; end to end (2 layers of q and gate, load ~15)
            # the difference from the ?syrk path was within the noise.
            grams = torch.stack([bf16_gram(t)[0] for t in stored])  # (B, d, d) float32
            side = "in" if mats.shape[-1] <= mats.shape[-2] else "out"  # the small side, as small_gram chooses
            pairs = pairs_from_gram(mats, GramOperator(mats, side), side, k, solver="krylov", tol=self.config.tol,
                                    seed=self.config.seed)
        elif self.config.spectra:
            grams, side = small_gram(mats)  # the whole ESD: from the dense solver's own reduction, or a separate eigvalsh
            pairs, values, how = pairs_and_spectrum_from_gram(mats, grams, side, k, solver=self.config.solver,
                                                             tol=self.config.tol, seed=self.config.seed)
            spectra = self._spectra(refs, unscale_values(values, exps), how, grams.dtype)
        else:
            grams, side = small_gram(mats)
            pairs = pairs_from_gram(mats, grams, side, k, solver=self.config.solver, tol=self.config.tol,
                                    seed=self.config.seed)
        pairs = unscale_pairs(pairs, exps)  # true singular values (vectors and ratios are scale-free)
        fros = gram_fro(mats, grams)
        for ref, fro in zip(refs, fros.tolist()):
            if fro == 0:
                raise FlowgeomError(f"{ref.tensor} (role {ref.role}, layer {ref.layer}) is all zeros: its singular "
                                    "vectors are undefined; leave the role out with --roles, or analyse a checkpoint "
                                    "where it has been trained")
        if not self.config.gram:  # pairs only need the factors: drop the matrix and Gram right away
            return [_LayerState(r.layer, None, None, fros[i], pairs[i], spectra[i], side) for i, r in enumerate(refs)]
        # a bf16 matrix stays in the window as stored: half the memory, and its cross products run as bf16
        # GEMMs with float32 accumulation (metrics.cross_sq; float32 compute on CPU only, unscaled matrices)
        return [_LayerState(r.layer, mats[i] if stored[i] is None else stored[i], grams[i], fros[i], pairs[i],
                            spectra[i], side) for i, r in enumerate(refs)]

    def _sketched_states(self, refs: list[MatrixRef], loaded: list, exps: torch.Tensor,
                         sketchers: dict) -> list[_LayerState]:
        """Layer states of a sketched role: top-k pairs as usual, no Gram unless the solver or --spectra needs
        one, and each layer's probe products (sketch.SpaceSketcher.sketch) in place of its Gram norm."""
        loaded = [m for m, _, _ in loaded]  # A 2^-e in the compute dtype: the similarity is scale-free
        mats = loaded[0].unsqueeze(0) if len(loaded) == 1 else torch.stack(loaded)  # (B, m, n), no copy for B = 1
        del loaded
        for ref, norm in zip(refs, torch.linalg.vector_norm(mats, dim=(-2, -1)).tolist()):
            if norm == 0:
                raise FlowgeomError(f"{ref.tensor} (role {ref.role}, layer {ref.layer}) is all zeros: its singular "
                                    "vectors are undefined; leave the role out with --roles, or analyse a checkpoint "
                                    "where it has been trained")
        k = self.k_of[refs[0].role]
        side = "in" if mats.shape[-1] <= mats.shape[-2] else "out"
        spectra = [None] * len(refs)
        dense = self.config.solver == "dense" or (self.config.solver == "auto" and self.device.type == "cpu"
                                                  and min(mats.shape[-2:]) <= DENSE_MAX_DIM)
        opts = dict(solver=self.config.solver, tol=self.config.tol, seed=self.config.seed)
        if self.config.spectra:
            grams, side = small_gram(mats)
            pairs, values, how = pairs_and_spectrum_from_gram(mats, grams, side, k, **opts)
            spectra = self._spectra(refs, unscale_values(values, exps), how, grams.dtype)
        elif dense:
            pairs = pairs_from_gram(mats, small_gram(mats)[0], side, k, **opts)
        else:  # Krylov on x -> A^T (A x): the m d^2 Gram is never formed
            pairs = pairs_from_gram(mats, GramOperator(mats, side), side, k, **opts)
        pairs = unscale_pairs(pairs, exps)
        return [_LayerState(r.layer, mats[i], None, torch.zeros((), dtype=torch.float64), pairs[i], spectra[i], side,
                            sketches={space: sk.sketch(mats[i]) for space, sk in sketchers.items()})
                for i, r in enumerate(refs)]

    def _spectra(self, refs: list[MatrixRef], values: torch.Tensor, how: str, dtype: torch.dtype) -> list[dict]:
        """Layer spectra of each matrix from its ESD ``values`` (B d), computed in ``dtype`` (powerlaw.layer_spectrum)."""
        from flowgeom.continuity.powerlaw import layer_spectrum

        eps = torch.finfo(dtype).eps
        return [dict(layer_spectrum(v, ref.shape, eps), eigenvalues=how) for ref, v in zip(refs, values.cpu())]

    def _pair(self, a: _LayerState, b: _LayerState, d: int, sketchers: dict | None = None) -> dict:
        rec = {"a": a.layer, "b": b.layer, "distance": d}
        vals = pair_metrics(a.pairs, b.pairs)
        extra = {}
        for space in ("in", "out") if self.config.gram else ():
            if sketchers is not None:
                est, a.sketches[space], b.sketches[space] = sketchers[space].pair(
                    a.matrix, a.sketches[space], b.matrix, b.sketches[space])
                vals[f"gram_{space}"] = torch.tensor(est.value)
                extra |= {f"gram_{space}_ci": est.interval, f"gram_{space}_probes": est.probes}
                continue
            num = gram_numerator(a.matrix, b.matrix, space, gram_a=a.gram, gram_b=b.gram, side=a.side)
            vals[f"gram_{space}"] = num / (a.fro * b.fro)
        rec.update({key: float(vals[key]) for key in self.metrics})
        rec.update(extra)
        gap_a, gap_b = float(a.pairs.gap), float(b.pairs.gap)
        rec.update(gap_a=gap_a, gap_b=gap_b)
        return rec

    def run_role(self, role: str, progress: Callable[[int], None] | None = None) -> _RoleRun:
        refs = self.layout.roles[role]
        run, window = _RoleRun(refs, sketchers=self.sketchers(role)), []
        t0 = time.perf_counter()
        keep = max(self.config.distances)
        for start in range(0, len(refs), self.config.batch):
            for st in self._layer_states(refs[start:start + self.config.batch], run.sketchers):
                for d in self.config.distances:
                    partner = next((w for w in window if w.layer == st.layer - d), None)
                    if partner is not None:
                        run.pairs.append(self._pair(partner, st, d, run.sketchers))
                run.spectra.append({"layer": st.layer, "sigma": st.pairs.S.tolist(), "gap": float(st.pairs.gap),
                                    "residual": float(st.pairs.residual), "krylov_depth": st.pairs.iters,
                                    **(st.spectrum or {})})
                window = (window + [st])[-keep:]
                if progress:
                    progress(1)
        run.seconds = time.perf_counter() - t0
        return run

    def _gram_summary(self, role: str, run: _RoleRun, metrics: dict) -> dict | None:
        """``roles[R].gram``: how the similarity was computed and why; for a sketch the probes, the target, and
        (into ``metrics``) each sketched metric's 95% interval of the mean and of its ratio to baseline."""
        if not self.config.gram:
            return None
        method, why = self.gram_of[role]
        if method != "sketch":
            return {"method": method, "why": why}
        first, thr = self.config.distances[0], self.config.threshold
        pairs = [p for p in run.pairs if p["distance"] == first]
        straddles = []
        for space in ("in", "out"):
            key = f"gram_{space}"
            m = metrics[key]
            if any(p[f"{key}_ci"] is None for p in pairs):  # one residual probe: no spread, no interval
                m.update(ci=None, ratio_ci=None, straddles_threshold=None)
                continue
            # the mean of the pairs' offsets: no narrower than if the correlation of their errors were known (sketch.py)
            below = sum(p[key] - p[f"{key}_ci"][0] for p in pairs) / len(pairs)
            above = sum(p[f"{key}_ci"][1] - p[key] for p in pairs) / len(pairs)
            m["ci"] = [m["mean"] - below, m["mean"] + above]
            m["ratio_ci"] = [x / m["baseline"] for x in m["ci"]]
            m["straddles_threshold"] = m["ratio_ci"][0] < thr <= m["ratio_ci"][1]
            if m["straddles_threshold"]:
                straddles.append(key)
        fixed = self.config.probes is not None
        return {"method": "sketch", "why": why, "estimator": "hutch++", "confidence": _sketch.CONFIDENCE,
                "probes": {space: sk.N for space, sk in run.sketchers.items()}, "fixed_probes": fixed,
                "rel_error": None if fixed else self.config.target_error,
                "missed_target": {space: sk.missed for space, sk in run.sketchers.items()},
                "cap": {space: sk.cap for space, sk in run.sketchers.items()}, "straddles_threshold": straddles}

    def baselines(self, shape: tuple[int, int], k: int | None = None) -> tuple[dict[str, float], dict[str, float]]:
        k = k or self.config.k
        if self.config.baseline == "analytic":
            return analytic_baselines(shape, k=k), {}
        mc = monte_carlo_baselines(shape, k=k, draws=self.config.draws, seed=self.config.seed,
                                   device=self.device)
        return {key: v[0] for key, v in mc.items()}, {key: v[1] for key, v in mc.items()}

    def summarise(self, role: str, run: _RoleRun) -> dict:
        shape = run.refs[0].shape
        base, base_std = self.baselines(shape, self.k_of[role])
        first = self.config.distances[0]
        metrics = {}
        for key in self.metrics:
            st = _stats([p[key] for p in run.pairs if p["distance"] == first])
            st.update(baseline=base[key], ratio=st["mean"] / base[key])
            if key in base_std:
                st["baseline_std"] = base_std[key]
            metrics[key] = st
        by_distance = {str(d): {key: _stats([p[key] for p in run.pairs if p["distance"] == d])["mean"]
                                for key in self.metrics} for d in self.config.distances}
        gram = self._gram_summary(role, run, metrics)
        r_in, r_out = metrics["v1"]["ratio"], metrics["u1"]["ratio"]
        return {
            "shape": list(shape), "k": self.k_of[role], "layers": [r.layer for r in run.refs],
            "tensors": [r.tensor for r in run.refs], "merged_lora": sum(r.lora is not None for r in run.refs),
            "v1": metrics["v1"]["mean"], "u1": metrics["u1"]["mean"],
            "v1_std": metrics["v1"]["std"], "u1_std": metrics["u1"]["std"],
            "v1_baseline": base["v1"], "u1_baseline": base["u1"], "v1_ratio": r_in, "u1_ratio": r_out,
            "verdict": verdict(r_in, r_out, self.config.threshold),
            "min_gap": min(s["gap"] for s in run.spectra),
            "seconds": run.seconds, "seconds_per_layer": run.seconds / len(run.refs),
            "metrics": metrics, "by_distance": by_distance, "pairs": run.pairs, "spectra": run.spectra,
            **({"gram": gram} if gram else {}),
            **({"layer_spectra": layer_spectra_summary(run.spectra)} if self.config.spectra else {}),
        }


def role_memory(shape: tuple[int, int], *, stored: int, compute: int, batch: int = 1, keep: int = 1,
                gram: bool = True, bf16_window: bool = False, sketch: bool = False) -> int:
    """Bytes one worker holds at its peak for a role of ``(m, n)`` matrices (``d = min(m, n)``).

    ``stored``/``compute``: item sizes of the checkpoint's dtype and the compute dtype. At the peak a
    worker holds the window of the last ``keep`` (= max distance) layers (each its matrix, as stored
    when ``bf16_window``, and its ``d x d`` Gram; nothing with ``gram=False``), the ``batch`` layers
    being read (as stored, converted, and their Grams), the cross product of a pair (``d x d``,
    float32 and bf16) and the Krylov basis with ``G K`` (``2 d (d/3)`` at most,
    spectra.krylov_top_eigenpairs). At Llama-8B shapes (bf16, two workers) it gives 2 x 0.70 GiB; the
    measured peak RSS was 1.9-2.0 GB, torch and the libraries included (docs/continuity.md).
    ``sketch``: the window holds the matrix in the compute dtype and no Gram, plus the probe products
    (``(m + n)`` rows of up to ``cap`` float64 columns, sketch.cap_for in auto).
    """
    m, n = shape
    d = min(m, n)
    if sketch:
        probes = 3 * max(_sketch.START_PROBES, d // _sketch.AUTO_COST_SHARE) * (m + n) * 8  # S, G and Q products
        window = keep * (m * n * compute + probes)
        return window + batch * (m * n * (stored + compute) + d * d * compute) + 2 * d * (d // 3 + 16) * compute \
            + 2 * probes
    window = keep * (m * n * (stored if bf16_window else compute) + d * d * compute) if gram else 0
    current = batch * (m * n * (stored + compute) + d * d * compute)
    work = d * d * 6 + 2 * d * (d // 3 + 16) * compute
    return window + current + work


def _memory_plan(analyzer: Analyzer, config: AnalyzeConfig) -> tuple[int, list[str]]:
    """Workers that fit, and warnings; a :class:`FlowgeomError` when even one role at a time does not fit.

    Each worker analyses one role at a time and needs :func:`role_memory` of it; ``config.workers``
    workers need that many times the largest. The limit is :func:`flowgeom.memory.budget` (80% of
    the memory available now). A cap is reported as a warning, never silent; a role that does not fit
    alone is refused before anything is read, with the figure and the roles that would fit.
    """
    roles = analyzer.layout.roles
    need = {role: analyzer.role_memory(role) for role in roles}
    limit = budget(analyzer.device)
    worst = max(need, key=need.get)
    if need[worst] > limit:
        fit = [role for role in roles if need[role] <= limit]
        fix = (f"analyse the roles that fit with --roles {','.join(fit)}" if fit else
               "no role fits: free memory, or use a machine with more")
        if config.batch > 1:
            fix = f"use --batch 1 (each batched layer adds its matrices), or {fix}"
        raise FlowgeomError(f"role {worst} ({'x'.join(map(str, roles[worst][0].shape))}, {len(roles[worst])} layers) "
                            f"needs about {need[worst] / 2**30:.2f} GiB at its peak, more than the {limit / 2**30:.2f} "
                            f"GiB the analysis may use ({USABLE_FRACTION:.0%} of the memory available on "
                            f"{analyzer.device.type}; --max-layers does not lower it: layers are streamed, two at a "
                            f"time); {fix}")
    workers = min(config.workers, len(roles)) if analyzer.device.type == "cpu" else 1
    if workers < 2:
        return 1, []
    fits = max(1, limit // need[worst])
    if fits < workers:
        return int(fits), [f"analysed {fits} role(s) at a time instead of {workers}: each needs up to "
                           f"~{need[worst] / 2**20:.0f} MiB and {USABLE_FRACTION:.0%} of the free memory holds only "
                           "that many (the report does not depend on it)"]
    return workers, []


def _role_cost(refs: Sequence[MatrixRef], sketch: bool = False) -> int:
    """Relative work of a role, to start the largest first: per layer the Gram and the cross product
    (``3 D d^2`` flops) and the tridiagonal reduction (``4/3 d^3`` flops at about a third of the GEMM rate);
    sketched, the probe products (sketch.sketch_layer_flops) and ~8 Krylov blocks of 20 through ``A^T A``."""
    m, n = refs[0].shape
    d, D = min(m, n), max(m, n)
    if sketch:
        return len(refs) * int(_sketch.sketch_layer_flops((m, n), _sketch.START_PROBES) + 4 * m * n * 160)
    return len(refs) * (3 * D * d * d + 4 * d**3)


class _Stopped(Exception):
    """A parallel role left early because the run is ending (never reaches the caller)."""


def _parallel(fn: Callable[[str], dict], roles: Sequence[str], workers: int, cost: Callable[[str], int],
              stop: threading.Event) -> dict[str, dict]:
    """``{role: fn(role)}`` in the order of ``roles``, computed by ``workers`` threads, costliest first.

    Errors surface as serially: the first failing role in ``roles`` order raises. On that error, or
    on Ctrl-C while waiting, ``stop`` is set: roles not started are cancelled and running ones end
    at their next layer (``fn`` checks ``stop``), so the run ends within a layer, not a role.
    """
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flowgeom-analyze")
    try:  # submitting included: the first roles run (and a Ctrl-C can land) while the last are being queued
        futures = {role: pool.submit(fn, role) for role in sorted(roles, key=cost, reverse=True)}
        return {role: futures[role].result() for role in roles}
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _sketch_warnings(roles: Mapping[str, dict], config: AnalyzeConfig) -> list[str]:
    """What a sketch could not deliver, said once per role: intervals wider than the target, or none at all."""
    out = []
    for role, r in roles.items():
        g = r.get("gram", {})
        if g.get("method") != "sketch":
            continue
        missed = {space: n for space, n in g["missed_target"].items() if n}
        if missed:
            caps = ", ".join(f"{g['cap'][space]} probes in the {space} space" for space in missed)
            out.append(f"role {role}: the probe rule stopped at its cap ({caps}) "
                       f"on {sum(missed.values())} pair(s) whose 95% interval is wider than ±{g['rel_error']:.1%} "
                       "of the value (their intervals say by how much); " + (
                           "--gram sketch lets it grow to the rank bound, " if config.gram_method == "auto" else "")
                       + "--gram exact computes it")
        if any(r["metrics"][key].get("ci", 0) is None for key in ("gram_in", "gram_out")):
            out.append(f"role {role}: --probes {config.probes} leaves one residual probe, so the sketched sigma^2-Gram "
                       "similarity has no spread and no interval; use --probes 3 or more")
    return out


def layer_spectra_summary(spectra: list[dict]) -> dict:
    """Per-role summary of the per-matrix layer spectra: stats of alpha (fitted ones), stable rank, entropy."""
    out = {key: _stats([s[key] for s in spectra]) for key in ("stable_rank", "entropy")}
    alphas = [s["alpha"] for s in spectra if s["alpha"] is not None]
    out["alpha"] = _stats(alphas) if alphas else None
    out["alpha_missing"] = len(spectra) - len(alphas)
    out["eigenvalues"] = sorted({s["eigenvalues"] for s in spectra})
    return out


def _label(spec, src: TensorSource) -> str:
    """The report's ``source``: the path or spec as given, else the source's label (never ``str()`` of a
    mapping of tensors, which formats every tensor)."""
    if isinstance(spec, (str, bytes)):
        return str(spec)
    return getattr(src, "label", None) or type(spec).__name__


def analyze(source, config: AnalyzeConfig | None = None, *, custom_roles: Mapping[str, str] | None = None,
            progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Analyse ``source`` (module, mapping, path, ``builtin:…``); returns the JSON-ready report.

    ``progress(role, done, total)`` is called after every layer (from the
    worker threads when ``config.workers > 1``: it must be thread-safe); a
    ``progress.start`` method, when there is one, is called first with
    ``{role: (layers, relative work)}`` (for an ETA). The report
    holds ``{"source", "scheme", "layers", "config", "roles": {ROLE: {"v1", "u1",
    "v1_baseline", "u1_baseline", "verdict", "metrics", "pairs", …}}, "unmatched":
    [{"tensor", "shape", "reason"}], "lora": [{"module", "adapter", "A", "B", "rank",
    "roles", "merged", …}], "warnings": [str], "seconds"}``. The model config
    (``config.json`` next to the weights, or ``model.config``) gives the head
    counts that split fused q|k|v tensors and, for PEFT, the LoRA scales.
    """
    config = config or AnalyzeConfig()
    src = open_source(source)
    hints = hints_for(source, heads=config.heads, kv_heads=config.kv_heads, merge_lora=config.merge_lora,
                      lora_adapter=config.lora_adapter)
    analyzer = Analyzer(src, config, custom_roles, hints)
    t0 = time.perf_counter()

    stop = threading.Event()  # set when the run ends early (an error, Ctrl-C): parallel roles stop at their next layer

    def one_role(role: str) -> dict:
        done, total = [0], len(analyzer.layout.roles[role])

        def tick(n: int) -> None:
            if stop.is_set():
                raise _Stopped(role)
            done[0] += n
            if progress:
                progress(role, done[0], total)

        return analyzer.summarise(role, analyzer.run_role(role, tick))

    order = list(analyzer.layout.roles)
    start = getattr(progress, "start", None)  # a reporter that wants the plan: {role: (layers, relative work)}
    if callable(start):
        start({role: (len(refs), _role_cost(refs, analyzer.sketched(role)))
               for role, refs in analyzer.layout.roles.items()})
    workers, warnings = _memory_plan(analyzer, config)
    # CPU: torch glue single-threaded; BLAS threads as the caller set them, or one per worker thread
    with _blas.cpu_threads(1 if workers > 1 else None) if analyzer.device.type == "cpu" else nullcontext():
        if workers == 1:
            roles = {role: one_role(role) for role in order}
        else:
            roles = _parallel(one_role, order, workers,
                              cost=lambda r: _role_cost(analyzer.layout.roles[r], analyzer.sketched(r)),
                              stop=stop)
    if analyzer.device.type == "cuda":
        torch.cuda.synchronize()
    first = config.distances[0]
    single = [role for role, r in roles.items() if sum(p["distance"] == first for p in r["pairs"]) == 1]
    if single:  # a mean ± sd over one pair is one number: say so, loudly
        warnings.append(
            f"{'role' if len(single) == 1 else 'roles'} {', '.join(single)}: one layer pair at distance {first}, so each "
            "mean is that pair's value, its sd (±0.000) means nothing and the verdict rests on one pair; analyse a "
            "checkpoint with more layers")
    warnings += _sketch_warnings(roles, config)
    return {
        "source": _label(source, src),
        "scheme": analyzer.layout.scheme,
        "layers": max(len(refs) for refs in analyzer.layout.roles.values()),
        "config": asdict(config),
        "roles": roles,
        "unmatched": analyzer.layout.unmatched,
        "lora": analyzer.layout.lora,
        "warnings": [*analyzer.layout.warnings, *warnings],
        "seconds": time.perf_counter() - t0,
    }
