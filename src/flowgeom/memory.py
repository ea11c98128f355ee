"""How much memory a computation may use, and the one gate that refuses work that would not fit.

Every command that estimates its own footprint before allocating (the law
engine's count, discover and check, the ``hf:``/zoo builder, the Villani
probe, the continuity analyzer's worker count) asks :func:`require` (or
:func:`budget`), so a too-large request ends with the numbers and the fix
instead of the kernel's OOM killer. Depends on torch and
:mod:`flowgeom.errors` only: no feature package is imported.

The rule, one for every gate: a computation may plan to use
``USABLE_FRACTION`` (80 %) of the memory the device reports available.
Available already means "usable without swapping" (Linux ``MemAvailable``
counts reclaimable page cache, CUDA's free memory excludes what is held),
so the remaining 20 % only has to absorb what the estimates leave out
(interpreter growth, allocator slack, the caller's own tensors). The
estimates themselves are deliberately pessimistic (see
``flowgeom.laws.describe.check_memory``), so half of the available memory
would refuse work that fits.
"""

from __future__ import annotations

import torch

from flowgeom.errors import FlowgeomError, InputError

FALLBACK_BYTES = 16 * 2**30  # assumed when the OS does not say (no /proc/meminfo)
USABLE_FRACTION = 0.8  # of the available memory a computation may plan to use (module docstring)


def available_memory(device: torch.device) -> int:
    """Bytes free on ``device``: CUDA's free memory, else the OS's ``MemAvailable`` (``FALLBACK_BYTES`` if unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB -> bytes
    except OSError:
        pass
    return FALLBACK_BYTES


def budget(device: str | torch.device = "cpu") -> int:
    """Bytes a computation on ``device`` may plan to use: ``USABLE_FRACTION`` of :func:`available_memory`."""
    return int(USABLE_FRACTION * available_memory(torch.device(device)))


def require(need: int, what: str, fix: str, *, device: str | torch.device = "cpu", limit: int | None = None,
            cli_fix: str | None = None) -> None:
    """Refuse ``what`` when its estimate ``need`` (bytes) exceeds :func:`budget` (or ``limit``, when given).

    The message names the estimate, the limit and where it comes from, then ``fix``:
    ``"{what} needs about 3.2 GiB, more than the 2.4 GiB it may use (80% of the 3.0 GiB available); {fix}"``.
    With ``cli_fix`` the error is an :class:`~flowgeom.errors.InputError`, whose CLI form names the flag.
    """
    if limit is None:
        have = available_memory(torch.device(device))
        limit = int(USABLE_FRACTION * have)
        where = f"it may use ({USABLE_FRACTION:.0%} of the {have / 2**30:.1f} GiB available)"
    else:
        where = "allowed (max_memory)"
    if need <= limit:
        return
    problem = f"{what} needs about {need / 2**30:.1f} GiB, more than the {limit / 2**30:.1f} GiB {where}"
    if cli_fix is not None:
        raise InputError(problem, python_fix=fix, cli_fix=cli_fix)
    raise FlowgeomError(f"{problem}; {fix}")


def trim_heap() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``). glibc raises its mmap threshold to the
    size of the largest block freed (up to 32 MB), so the many few-MB tensors of a layer-by-layer pass come from
    the heap, and the freed ones stay resident, fragmented: each layer's work stacks on the leftovers of the one
    before (SmolLM2's calibration gradients peaked 0.35 GB higher without it). Elsewhere than glibc: nothing."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
