"""How much memory a device has free, for refusing work that would not fit.

Used by every command that estimates its own footprint before allocating (the
law engine, the Villani probe), so a too-large request ends with the numbers
and the fix instead of the kernel's OOM killer. Depends on torch only: no
feature package (``flowgeom.laws``, ``flowgeom.langevin``) is imported.
"""

from __future__ import annotations

import torch

FALLBACK_BYTES = 16 * 2**30  # assumed when the OS does not say (no /proc/meminfo)


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
