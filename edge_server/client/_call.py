"""One request of the sync client as its transport keeps it: frames to send, then its value or error."""

from __future__ import annotations

import collections
from concurrent.futures import Future
from typing import Any

from edge_server.client._common import Decoder


class Call:
    """One request and, once settled, its value or error.

    Only calls whose caller wants a future (``Client.submit``, the greeting) get one: a synchronous
    round trip reads ``value``/``error`` directly, and building, settling and reading a
    ``concurrent.futures.Future`` would be a good part of its cost.
    """

    __slots__ = (
        *("rid", "frames", "nbytes", "decode", "future", "deadline"),
        *("sent", "early", "settled", "value", "error"),
    )

    def __init__(
        self,
        rid: int,
        frames: list[Any],
        decode: Decoder,
        deadline: float | None,
        *,
        nbytes: int = 0,
        early: bool = False,
        future: bool = False,
    ) -> None:
        self.rid = rid
        self.frames: list[Any] | None = frames
        self.nbytes = nbytes
        self.decode = decode
        self.future: Future[Any] | None = Future() if future else None
        self.deadline = deadline
        self.sent = False
        self.early = early  # sent on connecting, before the daemon's limit is known
        self.settled = False  # set after value/error and before the future: the leader tests it
        self.value: Any = None
        self.error: BaseException | None = None

    def outcome(self) -> Any:
        """The value of a settled call, or its error raised."""
        if self.error is not None:
            raise self.error
        return self.value


class StreamCall(Call):
    """A ``stream`` request: its responses queue up here until the caller takes them.

    ``settled`` means "a response is waiting (or the stream ended)", so the leader's loop stops for
    it exactly as for a plain call; it is reset when the caller takes the last waiting response.
    """

    __slots__ = ("items", "done")

    def __init__(self, rid: int, frames: list[Any], decode: Decoder, *, nbytes: int = 0) -> None:
        super().__init__(rid, frames, decode, None, nbytes=nbytes)
        self.items: collections.deque[tuple[Any, BaseException | None, bool]] = collections.deque()
        self.done = False  # the final response (or the stream's end by error) has arrived
