"""``python -m flowgeom`` runs the ``flowgeom`` command."""

import sys

from flowgeom.cli import main

sys.exit(main())
