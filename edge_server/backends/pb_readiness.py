"""Calling a Python model's ``is_ready()`` once, by Triton's rules (the bounds: ``model_readiness``).

Triton's python_backend calls ``is_ready`` (sync, or ``async def`` awaited on the model's event loop)
whenever the model's readiness is checked; it must return a ``bool``: anything else, or an exception,
means not ready.
"""

from __future__ import annotations

import inspect
from typing import Any

from edge_server.backends import pb_asyncio, pb_context
from edge_server.model_readiness import NotReady

#: the method of ``TritonPythonModel`` that says whether the model is ready (Triton's name)
READY_METHOD = "is_ready"


def has_readiness(model: Any) -> bool:
    return callable(getattr(model, READY_METHOD, None))


def call_is_ready(model: Any, loop: pb_asyncio.ModelLoop, context: pb_context.ModelContext) -> bool:
    """The model's answer; :class:`NotReady` (with why) when it raises or answers a non-boolean."""
    try:
        with pb_context.running(context):
            answer = getattr(model, READY_METHOD)()
        if inspect.iscoroutine(answer):
            answer = loop.run(answer, context)
    except BaseException as exc:  # noqa: BLE001 - sys.exit() in is_ready() too: not ready, never a dead prober
        raise NotReady(f"{READY_METHOD}() raised {exc!r}") from exc
    if not isinstance(answer, bool):
        raise NotReady(f"{READY_METHOD}() must return a boolean value, it returned {type(answer).__name__}")
    return answer
