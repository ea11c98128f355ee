"""Reading checkpoints, at the bottom of the house: every other package may import it, it imports none of them.

One job per module:

* :mod:`flowgeom.io.sources`: ``open_source(spec)``, a lazy ``{name: tensor}``
  (:class:`TensorSource`) over an ``nn.Module``, a state dict, a
  ``.safetensors`` file, a sharded index, an HF folder, a ``.gguf`` file or a
  ``builtin:`` name; one tensor is read at a time.
* :mod:`flowgeom.io.checkpoints`: safetensors headers and indexes checked as
  hostile input before anything is opened (schema, byte spans, confinement).
* :mod:`flowgeom.io.gguf`: the GGUF reader (tensor table, lazy metadata,
  dequantisation).
* :mod:`flowgeom.io.builtin`: ``builtin:smollm2`` / ``builtin:minilm``, files
  shipped in installed data packages.

``flowgeom.io`` imports only :mod:`flowgeom.errors`, :mod:`flowgeom.files`
and :mod:`flowgeom.limits` (tests/test_layering.py checks it).
"""

from flowgeom.io.builtin import BUILTINS, builtin_path, is_gguf, local_path
from flowgeom.io.gguf import GGUFFile, open_gguf
from flowgeom.io.sources import GGUFSource, MemorySource, SafetensorsSource, TensorSource, open_source

__all__ = ["BUILTINS", "GGUFFile", "GGUFSource", "MemorySource", "SafetensorsSource", "TensorSource", "builtin_path",
           "is_gguf", "local_path", "open_gguf", "open_source"]
