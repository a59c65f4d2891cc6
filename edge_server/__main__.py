"""``python -m edge_server``: the same as the ``edge-server`` command."""

from __future__ import annotations

import sys

from edge_server.cli import main

sys.exit(main())
