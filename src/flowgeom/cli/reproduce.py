"""`flowgeom reproduce ...` (not implemented yet)."""

from __future__ import annotations

from flowgeom.cli._common import area


def register(sub) -> None:
    area(sub, "reproduce", "reproduce commands (not implemented yet)")
