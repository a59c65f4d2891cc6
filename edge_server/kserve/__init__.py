"""KServe v2 (Triton's HTTP/REST and gRPC protocols) over the data plane.

* :mod:`~edge_server.kserve.codec`: tensors to and from JSON, raw bytes and the binary extension.
* :mod:`~edge_server.kserve.service`: the protocol's operations, transport-free (both frontends call it).
* :mod:`~edge_server.kserve.shm`: Triton's system shared-memory extension (the TCP peer's uid,
  segments by key; the registry and access rule are :mod:`edge_server.shm`).
* :mod:`~edge_server.kserve.http`: the HTTP/REST frontend's ASGI app; ``http_frontend`` runs it under
  uvicorn (``http_protocol``: connections and bodies counted in the daemon's budget).
* :mod:`~edge_server.kserve.grpc_frontend`: the gRPC server (grpcio's thread pool, Triton's generated
  protos); ``grpc_servicer`` its RPCs, ``grpc_stream`` ``ModelStreamInfer``.

Importing this package imports neither uvicorn nor grpcio; the frontends import them when built.
"""
