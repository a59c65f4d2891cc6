"""Build the OCR example repository (this folder) from a checkout: ``python models_ocr/make_models.py``.

The generator is ``edge_server.examples.make_ocr`` (shipped in the package, so that an installed
edge-server makes the same repository with ``edge-server make-examples --ocr DIR``); this script runs it from
the checkout beside it.  Options: ``--repository DIR`` (default: this folder), ``--force``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's edge_server

from edge_server.examples.make_ocr import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
