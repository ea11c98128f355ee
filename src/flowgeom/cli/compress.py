"""The ``flowgeom compress`` area: ``run``, ``sweep`` and ``evaluate`` (:mod:`flowgeom.cli.compress_run`)
and ``heal`` (:mod:`flowgeom.cli.compress_heal`), which distils the dense model back into a compressed folder.

The maths and the run live in :mod:`flowgeom.compress`; these modules
parse, validate, call and print. See docs/compression.md.
"""

from __future__ import annotations

from flowgeom.cli._common import area


def register(sub) -> None:
    from flowgeom.cli.compress_heal import register_heal
    from flowgeom.cli.compress_run import register_verbs

    verbs = area(sub, "compress", "compressed models that still work: compress (low rank, shared bases, dropped "
                                  "blocks), heal by distillation, judge by perplexity")
    register_verbs(verbs)
    register_heal(verbs)
