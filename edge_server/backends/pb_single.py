"""The response sender of a non-decoupled Python model: one response, sent instead of returned.

Triton lets a non-decoupled model call ``request.get_response_sender()`` too: it may send its one
response there (then ``execute`` returns ``None`` for that request, or a response that is dropped,
as the request is already answered), and the final flag alone only after it.  A second response, or
a final flag with no response before it, raises in the model with Triton's texts.

The response may also come after ``execute`` returned, from a thread or task of the model (Triton's
``response_sender`` QA does so): a request the model took a sender for and returned nothing for is
answered when its sender sends.  The instance waits for that (it has no other way to answer the
request), until the sender is garbage-collected unused, or at most :data:`POST_RETURN_WAIT_S`.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence

from edge_server.backends import pb_utils
from edge_server.errors import ModelExecutionError

MORE_THAN_ONE = "Non-decoupled model cannot send more than one response"
FINAL_FIRST = "Non-decoupled model cannot send complete final before sending a response"
#: The longest a request waits for the response its model sends after ``execute`` returned.
POST_RETURN_WAIT_S = 600.0


class SingleResponse:
    """What a non-decoupled request's sender got (one response at most) until it is closed."""

    __slots__ = ("abandoned", "closed", "response", "_cond")

    def __init__(self) -> None:
        self.response: pb_utils.InferenceResponse | None = None
        self.closed = False
        self.abandoned = False  # the sender was garbage-collected: nothing more can come
        self._cond = threading.Condition()

    def emit(self, response: pb_utils.InferenceResponse | None, final: bool) -> bool:
        with self._cond:
            if self.closed:  # the request is answered: only a final flag after its response is fine
                return response is None and self.response is not None
            if response is None:
                if self.response is None:
                    raise pb_utils.TritonModelException(FINAL_FIRST)
                return True
            if self.response is not None:
                raise pb_utils.TritonModelException(MORE_THAN_ONE)
            self.response = response
            self._cond.notify_all()
            return True

    def abandon(self) -> None:
        with self._cond:
            self.abandoned = True
            self._cond.notify_all()

    def close(self) -> pb_utils.InferenceResponse | None:
        """No more sending (``execute`` returned); the response that was sent, if any."""
        with self._cond:
            self.closed = True
            return self.response

    def wait(self, deadline: float) -> pb_utils.InferenceResponse | None:
        """The response sent by ``deadline`` (monotonic), or None if the sender was dropped unused."""
        with self._cond:
            while self.response is None and not self.abandoned:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self.closed = True
            return self.response


def make_sender(request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponseSender:
    """The sender ``get_response_sender()`` gives a non-decoupled model (its record on the request)."""
    single = SingleResponse()
    request._single = single  # type: ignore[attr-defined]
    sender = pb_utils.InferenceResponseSender(single.emit, lambda: False)
    weakref.finalize(sender, single.abandon)
    return sender


def singles(requests: Sequence[pb_utils.InferenceRequest]) -> list[SingleResponse | None]:
    """Per request, the record of its sender (None: the model never asked for one)."""
    return [getattr(request, "_single", None) for request in requests]


def sent(requests: Sequence[pb_utils.InferenceRequest]) -> list[pb_utils.InferenceResponse | None]:
    """Close the senders of ``requests``: per request, the response sent through it (None: none)."""
    return [single.close() if single is not None else None for single in singles(requests)]


def answers(model: str, records: list[SingleResponse | None], returned: object) -> object:
    """What answers each request: its sent response, else the returned one, else one sent later.

    ``returned`` is what ``execute`` returned; it comes back unchanged when no sender was taken (the
    caller checks it).  Call it holding no reference to the requests: a sender the model dropped
    unused is noticed when it is collected.
    """
    if not any(records):
        return returned
    if returned is None:  # Triton takes None for "nothing returned"
        returned = [None] * len(records)
    if not isinstance(returned, list | tuple) or len(returned) != len(records):
        for single in records:
            if single is not None:
                single.close()
        return returned
    deadline = time.monotonic() + POST_RETURN_WAIT_S
    out: list[object] = []
    for single, response in zip(records, returned, strict=True):
        if single is None:
            out.append(response)
            continue
        # no response sent yet and none returned: it comes later, from the model's own thread or task
        got = single.wait(deadline) if response is None else single.close()
        if got is None and response is None:
            out.append(
                ModelExecutionError(
                    f"model {model!r}: the request's response sender sent no response (it was "
                    f"dropped unused, or nothing came within {POST_RETURN_WAIT_S:g} s)"
                )
            )
            continue
        out.append(got if got is not None else response)
    return out
