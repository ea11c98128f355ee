"""`flowgeom conserve ...` (not implemented yet)."""

from __future__ import annotations

from flowgeom.cli._common import area


def register(sub) -> None:
    area(sub, "conserve", "conserve commands (not implemented yet)")
