"""Bytes of replies produced for a user and not yet taken by it, over every frontend together.

A client that sends requests and never reads the replies makes the daemon hold them.  Counting that
per connection (IPC) or per stream (gRPC) let one local user multiply the bound by opening more of
them: 32 gRPC streams held 32 x ``--max-client-reply-bytes``.  So every holder of unsent replies (an
IPC client's backlog in ZeroMQ, a gRPC stream's response queue) counts in one :class:`ReplyBudget`
under its uid, and once a uid holds more than ``--max-client-reply-bytes`` the holder with the most
unsent bytes is cut off (:meth:`ReplyHolder.over_budget`): the one that does not read, whichever
frontend it came through, never a reading client beside it.  Its uid is then penalized
(:meth:`~edge_server.limits.Limits.penalize`), as it was over IPC alone.

A peer whose uid is unknown (a TCP client on another host) counts under ``None``; such peers share
one user's bound, as they share the other per-user caps.  Thread-safe: IPC counts on its frontend
thread, gRPC on the model threads that produce responses and on the threads that send them.
"""

from __future__ import annotations

import abc
import threading

#: What the cut-off client is told in the log and its uid's penalty says.
OVER_BUDGET = "left over {limit} bytes of replies unread (--max-client-reply-bytes)"


class ReplyHolder(abc.ABC):
    """Unsent replies of one connection or stream, counted in its uid's share of a :class:`ReplyBudget`.

    ``unsent`` is changed only by the budget (under its lock).
    """

    def __init__(self, uid: int | None) -> None:
        self.uid = uid if uid is None or uid >= 0 else None
        self.unsent = 0
        self.joined = False

    @abc.abstractmethod
    def over_budget(self, why: str) -> None:
        """Its uid is over the bound and this holder has the most unsent bytes: cut it off.

        Called on any thread with no lock of the budget held; a holder that can only act on a thread
        of its own (an IPC client: the frontend thread) may do it there, soon.
        """


class ReplyBudget:
    """Unsent reply bytes per uid, at most ``max_bytes`` each (see the module's docstring)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: dict[int | None, int] = {}
        self._holders: dict[int | None, set[ReplyHolder]] = {}

    @property
    def why(self) -> str:
        return OVER_BUDGET.format(limit=self.max_bytes)

    def add(self, holder: ReplyHolder, nbytes: int) -> bool:
        """``holder`` has ``nbytes`` more unsent; True when its uid is now over the bound."""
        uid = holder.uid
        with self._lock:
            if not holder.joined:
                holder.joined = True
                self._holders.setdefault(uid, set()).add(holder)
            holder.unsent += nbytes
            held = self._held.get(uid, 0) + nbytes
            self._held[uid] = held
        return held > self.max_bytes

    def sent(self, holder: ReplyHolder, nbytes: int) -> None:
        """``nbytes`` of ``holder``'s replies left (or were freed)."""
        with self._lock:
            if not holder.joined:
                return
            nbytes = min(nbytes, holder.unsent)
            holder.unsent -= nbytes
            self._held[holder.uid] -= nbytes

    def leave(self, holder: ReplyHolder) -> None:
        """``holder`` is gone (closed, cut off): what it held no longer counts.  Idempotent."""
        uid = holder.uid
        with self._lock:
            if not holder.joined:
                return
            holder.joined = False
            held = self._held[uid] - holder.unsent
            holder.unsent = 0
            holders = self._holders[uid]
            holders.discard(holder)
            if holders:
                self._held[uid] = held
            else:
                del self._holders[uid], self._held[uid]

    def over(self, uid: int | None) -> bool:
        return self._held.get(uid, 0) > self.max_bytes

    def heaviest(self, uid: int | None) -> ReplyHolder | None:
        """The holder of ``uid`` with the most unsent bytes (None: it has none)."""
        with self._lock:
            holders = list(self._holders.get(uid, ()))
        return max(holders, key=lambda h: h.unsent, default=None)

    def enforce(self, uid: int | None) -> None:
        """``uid`` may be over the bound: tell its heaviest holder (one; it acts on its own thread)."""
        if not self.over(uid):
            return
        heaviest = self.heaviest(uid)
        if heaviest is not None:
            heaviest.over_budget(self.why)
