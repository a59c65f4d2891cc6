"""Pipelines: ensembles (``platform: "ensemble"``), walked through the members' own schedulers.

``graph`` validates ``ensemble_scheduling`` at load; ``ensemble`` runs requests through it.  Both
reach other models only through the :class:`~edge_server.request.ModelAccess` handed to them.
"""
