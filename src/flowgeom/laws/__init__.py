"""Conservation laws of gradient flow: closed-form catalogue and independent check."""

from flowgeom.laws.catalogue import CatalogueEntry, Law, catalogue, expected_count, laws_of
from flowgeom.laws.check import CheckReport, check, flow_rate

__all__ = ["CatalogueEntry", "CheckReport", "Law", "catalogue", "check", "expected_count", "flow_rate", "laws_of"]
