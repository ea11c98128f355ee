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

# transformers' Auto classes learn factored folders once their modules are imported, before or after flowgeom
# (flowgeom.compress.auto); transformers itself is never imported here.
from flowgeom.after_import import when_imported as _when_imported  # noqa: E402 - after the names above

_when_imported("transformers.models.auto.configuration_auto", "flowgeom.compress.auto:register_config")
_when_imported("transformers.models.auto.modeling_auto", "flowgeom.compress.auto:register_model")
