"""flowgeom: the geometry of training dynamics in modern neural networks.

Public areas (each re-exports its API):

- :mod:`flowgeom.io` -- reading checkpoints (safetensors, GGUF, HF folders, ``builtin:`` models);
- :mod:`flowgeom.nn` -- the architecture zoo (HF-Llama parameter names);
- :mod:`flowgeom.laws` -- conservation laws: catalogue, check, count, discover;
- :mod:`flowgeom.continuity` -- cross-layer singular-vector alignment;
- :mod:`flowgeom.langevin` -- Langevin training with super-quadratic regularisers.
"""

from flowgeom.errors import FlowgeomError

__version__ = "0.1.0"
__all__ = ["FlowgeomError", "__version__"]
