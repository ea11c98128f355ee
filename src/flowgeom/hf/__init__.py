"""Hugging Face ``transformers`` models: the family table and tiny test models.

- :mod:`flowgeom.hf.families`: which blocks each supported ``model_type``
  has and their layout (read from ``model.config`` and module classes);
- :mod:`flowgeom.hf.tiny`: tiny random configs / models per family (float64,
  eager attention), for tests and examples.

Nothing here imports ``transformers`` at import time.
"""

from flowgeom.hf.tiny import SUPPORTED, tiny_config, tiny_model

__all__ = ["SUPPORTED", "tiny_config", "tiny_model"]
