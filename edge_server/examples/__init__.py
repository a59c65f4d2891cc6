"""The example model repository, made on demand: ``edge-server make-examples DIR``.

The generator (:mod:`edge_server.examples.make_models`) ships in the package with the hand-written files
it copies (package data under ``repository/``), so an installed wheel makes the same repository as a
checkout's ``python models/make_models.py``.  The ONNX files themselves are built, not shipped: they
need the ``models`` extra (onnx, scikit-learn, OpenCV).
"""
