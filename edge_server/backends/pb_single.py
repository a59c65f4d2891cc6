"""The response sender of a non-decoupled Python model: one response, sent instead of returned.

Triton lets a non-decoupled model call ``request.get_response_sender()`` too: it may send its one
response there (then ``execute`` returns ``None`` for that request, or a response that is dropped,
as the request is already answered), and the final flag alone only after it.  A second response, or
a final flag with no response before it, raises in the model with Triton's texts.  Here the sent
response becomes the request's result when ``execute`` returns; a response sent after that (from
a thread of the model) is refused, since the request was answered by then.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from edge_server.backends import pb_utils

MORE_THAN_ONE = "Non-decoupled model cannot send more than one response"
FINAL_FIRST = "Non-decoupled model cannot send complete final before sending a response"


class SingleResponse:
    """What a non-decoupled request's sender got (one response at most) until it is closed."""

    __slots__ = ("closed", "response", "_lock")

    def __init__(self) -> None:
        self.response: pb_utils.InferenceResponse | None = None
        self.closed = False
        self._lock = threading.Lock()

    def emit(self, response: pb_utils.InferenceResponse | None, final: bool) -> bool:
        with self._lock:
            if self.closed:
                return False  # the sender raises: it is closed
            if response is None:
                if self.response is None:
                    raise pb_utils.TritonModelException(FINAL_FIRST)
                return True
            if self.response is not None:
                raise pb_utils.TritonModelException(MORE_THAN_ONE)
            self.response = response
            return True

    def close(self) -> pb_utils.InferenceResponse | None:
        """No more sending (``execute`` returned); the response that was sent, if any."""
        with self._lock:
            self.closed = True
            return self.response


def make_sender(request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponseSender:
    """The sender ``get_response_sender()`` gives a non-decoupled model (its record on the request)."""
    single = SingleResponse()
    request._single = single  # type: ignore[attr-defined]
    return pb_utils.InferenceResponseSender(single.emit, lambda: False)


def sent(requests: Sequence[pb_utils.InferenceRequest]) -> list[pb_utils.InferenceResponse | None]:
    """Close the senders of ``requests``: per request, the response sent through it (None: none)."""
    answers: list[pb_utils.InferenceResponse | None] = []
    for request in requests:
        single: SingleResponse | None = getattr(request, "_single", None)
        answers.append(single.close() if single is not None else None)
    return answers
