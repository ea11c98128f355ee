"""``python -m flowgeom.cli`` runs the ``flowgeom`` command."""

import sys

from flowgeom.cli import main

sys.exit(main())
