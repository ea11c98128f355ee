"""``flowgeom reproduce``'s machinery: the claim registry, the sweep, one adapter per area and the pipeline.

- :mod:`flowgeom.reproduce.registry`: :class:`Claim`, :class:`Verdict`, run ids, loading the areas' claims;
- :mod:`flowgeom.reproduce.claims_laws`, ``claims_conservation``, ``claims_continuity``, ``claims_langevin``:
  the seeds' claims, their quick/full grids built from the experiments' presets, and their verdicts;
- :mod:`flowgeom.reproduce.pipeline`: plan → sweep → verdict → report (what the CLI and ``flowgeom demo`` call).
"""
