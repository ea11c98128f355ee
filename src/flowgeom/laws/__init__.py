"""Conservation laws of gradient flow.

- :func:`catalogue`, :func:`laws_of`, :func:`expected_count`: closed-form laws of the zoo;
- :func:`check`, :func:`flow_rate`: independent verification by orthogonality;
- :func:`count`, :func:`discover`: the numeric engine (Lie-algebra rank, quadratic laws) for any module;
- :class:`ConservationMonitor`, :func:`locate`: drift of real training from the laws.
"""

from flowgeom.laws.catalogue import CatalogueEntry, Law, catalogue, expected_count, laws_of
from flowgeom.laws.check import CheckReport, check, flow_rate
from flowgeom.laws.count import CountResult, count
from flowgeom.laws.discover import DiscoveredLaw, DiscoverResult, discover
from flowgeom.laws.locate import locate
from flowgeom.laws.monitor import ConservationMonitor, homogeneity_degree, is_plain_sgd, warn_plain_gd_only

__all__ = [
    "CatalogueEntry", "CheckReport", "ConservationMonitor", "CountResult", "DiscoverResult", "DiscoveredLaw", "Law",
    "catalogue", "check", "count", "discover", "expected_count",
    "flow_rate", "homogeneity_degree", "is_plain_sgd", "laws_of", "locate", "warn_plain_gd_only",
]
