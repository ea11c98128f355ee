"""The size and type contract for numbers read from files other people made.

``config.json``, GGUF metadata and ``adapter_config.json`` decide allocations
(an embedding of ``vocab_size x hidden_size``), Python loop bounds (one block
per layer) and module construction. Every such number goes through
:func:`file_int` / :func:`file_float` *before* it is used: a bool, a string, a
non-integral or non-finite float, or a value outside its range ends in one
:class:`~flowgeom.errors.FlowgeomError` naming the file, the key, the value and
the range. The same :data:`LIMITS` hold for all three sources, so a GGUF and
an HF folder of one model are accepted or refused alike.

The upper limits are far above any released model (largest known, 2026:
vocabulary 262k, width 16k, MLP width 53k, 126 layers, 128 heads, 10M
context) and far below what exhausts memory or hangs a loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flowgeom.errors import FlowgeomError

# name: (lowest, highest) accepted value
LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2**22),
    "hidden_size": (1, 2**16),
    "intermediate_size": (1, 2**20),
    "num_hidden_layers": (1, 2**12),
    "num_attention_heads": (1, 2**12),
    "num_key_value_heads": (1, 2**12),
    "head_dim": (1, 2**14),
    "max_position_embeddings": (1, 2**27),
    "r": (1, 2**16),  # LoRA rank
}


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def file_int(value: object, name: str, *, where: str, fix: str, limits: tuple[int, int] | None = None,
             beyond: str = "no real model is that size") -> int:
    """``value`` of key ``name`` in ``where`` as an int within ``limits`` (default :data:`LIMITS[name]`).

    Accepts an int or an integral float (JSON writes ``2.0`` for some
    configs); refuses bools, strings, other types, and values out of range.
    """
    low, high = limits or LIMITS[name]
    integral = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if isinstance(value, bool) or not integral:
        raise FlowgeomError(f"{where} {name} must be a whole number between {low} and {high}, got "
                            f"{type(value).__name__} {_shown(value)}; {fix}")
    number = int(value)
    if not low <= number <= high:
        raise FlowgeomError(f"{where} {name} = {_shown(number)} is outside {low}..{high} ({beyond}); {fix}")
    return number


# Image sets (MNIST IDX, CIFAR batches, image folders): each declared dimension, and the values of one image,
# before any array of that shape exists. EMNIST, the largest IDX set, has 0.8M images; photos are ~500 a side,
# the largest scans ~20k; 4 channels is RGBA.
IMAGE_LIMITS: dict[str, tuple[int, int]] = {
    "images": (1, 2**24), "labels": (1, 2**24), "channels": (1, 4), "height": (1, 2**15), "width": (1, 2**15),
}
MAX_IMAGE_VALUES = 2**26  # channels x height x width of one image


def image_shape(dims: Sequence[object], names: Sequence[str], *, where: str, fix: str) -> tuple[int, ...]:
    """Declared ``dims`` of an image array, named by ``names`` (keys of :data:`IMAGE_LIMITS`), as checked ints.

    Each dimension must lie in its range, and one image (all but ``images``/``labels``) may hold at most
    :data:`MAX_IMAGE_VALUES` values: a forged header cannot make flowgeom allocate or loop beyond that.
    """
    if len(dims) != len(names):
        raise FlowgeomError(f"{where} has shape {tuple(dims)}; expected ({', '.join(names)}); {fix}")
    out = tuple(file_int(v, n, where=where, fix=fix, limits=IMAGE_LIMITS[n], beyond="no real image set is that size")
                for v, n in zip(dims, names))
    image = tuple(d for d, n in zip(out, names) if n not in ("images", "labels"))
    values = math.prod(image)
    if values > MAX_IMAGE_VALUES:
        raise FlowgeomError(f"{where}: one image of shape {image} holds {values} values, over {MAX_IMAGE_VALUES} "
                            f"(no real image is that large); {fix}")
    return out


def file_float(value: object, name: str, *, where: str, fix: str, positive: bool = True) -> float:
    """``value`` of key ``name`` in ``where`` as a finite float (``> 0`` when ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FlowgeomError(f"{where} {name} must be a number, got {type(value).__name__} {_shown(value)}; {fix}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float range
        number = math.inf
    if not math.isfinite(number) or (positive and number <= 0):
        raise FlowgeomError(f"{where} {name} must be a finite number{' > 0' if positive else ''}, got "
                            f"{_shown(value)}; {fix}")
    return number
