"""Repository control: which model versions serve, and how they are replaced without failing a request.

Three jobs, one module each: :mod:`~edge_server.lifecycle.control` decides which model to bring in line
and when (load, unload, rescan, close, one model at a time); :mod:`~edge_server.lifecycle.sync` brings
one model in line with its files; :mod:`~edge_server.lifecycle.drain` publishes the routing table and
drains and closes what it replaced.
"""

from edge_server.lifecycle.control import DEFAULT_LOAD_TIMEOUT_S, ModelManager
from edge_server.lifecycle.sync import describe_placement

__all__ = ["DEFAULT_LOAD_TIMEOUT_S", "ModelManager", "describe_placement"]
