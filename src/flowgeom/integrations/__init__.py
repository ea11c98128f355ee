"""The conservation monitor where people train (optional extras: ``flowgeom[hf]``, ``flowgeom[integrations]``).

- :class:`ConservationCallback` — ``transformers.Trainer`` (needs transformers);
- :class:`ConservationLightningCallback` — Lightning (needs lightning);
- :class:`CSVWriter`, :class:`TensorBoardWriter`, :class:`WandbWriter` — a plain loop's records;
- :class:`MonitorSession` — the framework-free contract both callbacks share;
- :func:`checkpoint_drift` — the laws' drift over saved checkpoints (``flowgeom conserve drift``).

Importing this package imports none of transformers, lightning, tensorboard or
wandb: each name is loaded on first use, so ``import flowgeom.integrations``
works with the core alone and a missing extra is one clear error naming it.
"""

from __future__ import annotations

import importlib
from typing import Any

from flowgeom.errors import FlowgeomError

_WHERE = {
    "ConservationCallback": ("flowgeom.integrations.trainer", "pip install 'flowgeom[hf]'"),
    "ConservationLightningCallback": ("flowgeom.integrations.lightning", "pip install 'flowgeom[integrations]'"),
    "CSVWriter": ("flowgeom.integrations.writers", ""),
    "TensorBoardWriter": ("flowgeom.integrations.writers", ""),
    "WandbWriter": ("flowgeom.integrations.writers", ""),
    "MonitorSession": ("flowgeom.integrations.session", ""),
    "checkpoint_drift": ("flowgeom.integrations.checkpoints", "pip install 'flowgeom[hf]'"),
    "plot_drift": ("flowgeom.integrations.figure", ""),
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'flowgeom.integrations' has no attribute {name!r}")
    module, fix = _WHERE[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise FlowgeomError(f"flowgeom.integrations.{name} needs {exc.name or 'an optional package'}; "
                            f"install the extra: {fix or 'pip install flowgeom[integrations]'}") from exc
    return getattr(mod, name)
