"""Resolve a TARGET string to a module and an input sampler.

TARGET is one of

- a zoo name (``ffn``, ``swiglu``, ``mha``, ``moe``, ``linear2``, ``relu2``,
  ``chain``) with size options, built by :func:`flowgeom.nn.build`;
- ``path/to/file.py:NAME`` or ``package.module:NAME``, NAME being an
  ``nn.Module`` subclass (built with no arguments) or a zero-argument factory
  returning a module.

Inputs come from the module's ``sample_input(batch, generator)`` when it has
one, else from ``input_shape`` (one standard-normal input of exactly that
shape, e.g. ``(4, 8)``). Every failure is a :class:`FlowgeomError` naming
the target and the fix.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flowgeom.errors import FlowgeomError
from flowgeom.laws.fields import Sampler, generator, module_sampler, shape_sampler
from flowgeom.usercode import attribute, call_factory


@dataclass
class Target:
    """A resolved target: the module, its input sampler, a label for reports and the expected count.

    ``expected``: the catalogue's count for a zoo block, an ``hf:`` part's closed
    form, None elsewhere; ``config``: the config values an ``hf:`` part was built with.
    """

    module: nn.Module
    sampler: Sampler
    label: str
    arch: str | None = None
    expected: int | None = None
    config: dict = field(default_factory=dict)


MAX_INPUT_DIMS = 8
MAX_INPUT_ELEMENTS = 2**22  # one input; the engine draws thousands of them per block


def parse_shape(text: str | Sequence[int]) -> tuple[int, ...]:
    """``"4,8"`` -> (4, 8); FlowgeomError unless 1..8 positive integers with at most 2**22 elements in all."""
    usage = f"--input-shape must be 1 to {MAX_INPUT_DIMS} comma-separated positive integers like 4,8, got {text!r}"
    try:
        if isinstance(text, str):
            shape = tuple(int(s) for s in text.replace("x", ",").split(",") if s.strip())
        elif any(isinstance(n, bool) for n in text):
            raise TypeError("bool is not a size")
        else:  # a sequence of whole numbers (numpy ints fine, floats not)
            shape = tuple(operator.index(n) for n in text)
    except (TypeError, ValueError):
        raise FlowgeomError(usage) from None
    if not shape or len(shape) > MAX_INPUT_DIMS or min(shape) < 1:
        raise FlowgeomError(usage)
    if math.prod(shape) > MAX_INPUT_ELEMENTS:
        raise FlowgeomError(f"--input-shape {','.join(map(str, shape))} has {math.prod(shape):,} elements per input, more than "
                            f"the {MAX_INPUT_ELEMENTS:,} allowed (the engine draws thousands of inputs); pass a smaller shape")
    return shape


def _candidates(mod: Any) -> list[str]:
    return sorted(n for n, v in vars(mod).items()
                  if not n.startswith("_") and (inspect.isclass(v) and issubclass(v, nn.Module) and v.__module__ == mod.__name__
                                                or inspect.isfunction(v) and v.__module__ == mod.__name__))


def _instantiate(obj: Any, where: str) -> nn.Module:
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise FlowgeomError(f"{where} is a {type(obj).__name__}, not an nn.Module class or factory")
    module = call_factory(obj, where)
    if not isinstance(module, nn.Module):
        raise FlowgeomError(f"{where}() returned a {type(module).__name__}, not an nn.Module")
    return module


SMALL_BOUND = 1 << 20  # parameters (8 MiB in float64): a zoo module this small is cheaper to build than to measure on meta


def small_config(cfg: Any) -> bool:
    """True when zoo config ``cfg`` surely has at most :data:`SMALL_BOUND` parameters and buffers.

    Every zoo tensor's size is a product of at most three of the config's integer sizes
    (experts × d_model × d_hidden, heads × d_k × d_model, seq_len × d_k, ...), each
    coefficient at most 4, so 8 · (1 + Σ sizes)³ bounds the total without building anything.
    """
    sizes = []
    for value in vars(cfg).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        sizes += [v for v in items if isinstance(v, int) and not isinstance(v, bool)]
    return 8 * (1 + sum(abs(v) for v in sizes)) ** 3 <= SMALL_BOUND


def require_buildable(arch: str, size_options: dict[str, Any], *, max_memory: int | None = None) -> int:
    """Parameters D of zoo ``arch`` at ``size_options``, counted on the meta device (nothing allocated).

    FlowgeomError when the module alone (its weights and a float64 copy, 4 × 8 × D bytes)
    would not fit in ``max_memory`` (default: 80 % of the free memory), so an absurd size
    is refused with the numbers instead of being killed by the kernel.
    """
    from flowgeom.memory import require
    from flowgeom.nn.zoo import config

    cfg = config(arch, **size_options)
    if small_config(cfg):
        # Built for real: any op on the meta device imports all of torch._dynamo (1–4 s per
        # process), longer than building a module this small
        d = sum(p.numel() for p in cfg.build().parameters())
    else:
        with torch.device("meta"):
            d = sum(p.numel() for p in cfg.build().parameters())
    require(4 * 8 * d, f"{arch} at these sizes (D = {d:,} parameters, held with a float64 copy)",
            "pass smaller size options", limit=max_memory)
    return d


def resolve(target: str, *, size_options: dict[str, Any] | None = None, input_shape: str | tuple[int, ...] | None = None,
            seed: int = 0, hf_config: list[str] | None = None, keep_casts: bool = False) -> Target:
    """Build the module named by ``target`` (weights seeded by ``seed``) and its sampler.

    ``hf:MODEL_TYPE:PART`` targets go to :mod:`flowgeom.laws.hf_target`; ``hf_config``
    (``KEY=VALUE`` strings) and ``keep_casts`` apply to them only.
    """
    from flowgeom.nn.zoo import ARCHITECTURES, build

    size_options = dict(size_options or {})
    arch = None
    generator(seed)  # refuse a bad seed before building anything
    shape = parse_shape(input_shape) if input_shape is not None else None  # absurd shapes refused even if unused
    if target.startswith("hf:"):
        if size_options:
            flags = ", ".join("--" + k.replace("_", "-") for k in size_options)
            raise FlowgeomError(f"{flags} only apply to zoo architectures; size {target!r} with --config KEY=VALUE")
        from flowgeom.laws.hf_target import resolve_hf

        built = resolve_hf(target, config_items=hf_config, seed=seed, keep_casts=keep_casts)
        return Target(module=built.module, sampler=module_sampler(built.module), label=built.label,
                      expected=built.expected, config=built.config)
    if hf_config:
        raise FlowgeomError(f"--config only applies to hf:MODEL_TYPE:PART targets, not to {target!r}; drop it")
    if ":" not in target:
        if target not in ARCHITECTURES:
            raise FlowgeomError(f"unknown target {target!r}; give a zoo name ({', '.join(ARCHITECTURES)}), "
                                "path/to/file.py:NAME or package.module:NAME")
        require_buildable(target, size_options)
        module, arch = build(target, seed=seed, **size_options), target
        label = target + "".join(f" --{k.replace('_', '-')} {v}" for k, v in size_options.items())
    else:
        if size_options:
            flags = ", ".join("--" + k.replace("_", "-") for k in size_options)
            raise FlowgeomError(f"{flags} only apply to zoo architectures, not to {target!r}; drop them")
        found = attribute(target, candidates=_candidates)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = _instantiate(found, f"{target}")
        label = target
    if callable(getattr(module, "sample_input", None)):
        sampler = module_sampler(module)
    elif shape is not None:
        sampler = shape_sampler(shape)
    else:
        raise FlowgeomError(f"{label} has no sample_input(batch, generator); pass --input-shape, the shape of one input "
                            "without the batch dimension (e.g. --input-shape 4,8 for inputs of shape (batch, 4, 8))")
    expected = None
    if arch is not None:
        from flowgeom.laws.catalogue import expected_count

        expected = expected_count(module)
    return Target(module=module, sampler=sampler, label=label, arch=arch, expected=expected)
