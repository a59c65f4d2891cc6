"""The ``edge-server`` command line (:func:`main`); :mod:`.main` holds the parser and the dispatch."""

from edge_server.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
