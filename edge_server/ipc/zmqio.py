"""Multipart send and receive for the hot path, shared by the daemon's frontend and the clients.

pyzmq's ``send_multipart`` builds an enum flag (``SNDMORE | flags``) for every frame but the last,
and ``recv_multipart`` asks ``getsockopt(RCVMORE)`` after every frame; together that is about half
the Python time of a small round trip.  These do the same with plain int flags and ``Frame.more``,
and send through the Cython socket's own ``send``: the Python layer over it only adds the DRAFT
``routing_id``/``group`` options, which ROUTER and DEALER sockets do not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
import zmq.backend

NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_send = zmq.backend.Socket.send


def send_frames(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """Send ``frames`` as one message, without copying large ones (``copy=False``).

    Every frame must support the buffer protocol (bytes, contiguous numpy arrays, ``zmq.Frame``), as
    the request and reply builders guarantee: a frame that fails after the first was sent would leave
    a partial message behind.  ZeroMQ accepts the rest of a message whose first frame it took, so
    ``zmq.Again`` (with NOBLOCK) and ``EHOSTUNREACH`` (ROUTER_MANDATORY) come from the first frame only.
    """
    more = flags | _SNDMORE
    for index in range(len(frames) - 1):
        _send(sock, frames[index], more, copy=False)
    _send(sock, frames[-1], flags, copy=False)


def send_one(sock: zmq.Socket, frame: Any, flags: int = 0, *, track: bool = False) -> Any:
    """Send one frame without copying large ones; with ``track``, return its ``MessageTracker``."""
    return _send(sock, frame, flags, copy=False, track=track)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """Receive one whole message as ``zmq.Frame`` objects (zero-copy)."""
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = sock.recv(0, copy=False)
        frames.append(frame)
    return frames


def recv_bounded(sock: zmq.Socket, flags: int, max_frames: int) -> tuple[list[zmq.Frame], int]:
    """:func:`recv_frames`, keeping at most ``max_frames`` frames; returns them and how many were dropped.

    A hostile peer may send a message of a million empty frames: the rest of the message is still
    taken off the socket (libzmq delivers only whole messages, so it holds them all already), but no
    Python object is kept for it, and each is dropped at the cost of one call into the Cython layer
    (``Frame.more``; asking ``getsockopt(RCVMORE)`` through pyzmq's Python layer cost 3x as much).
    """
    frame = sock.recv(flags, copy=False)
    frames = [frame]
    more = frame.more
    while more and len(frames) < max_frames:
        frame = sock.recv(0, copy=False)
        frames.append(frame)
        more = frame.more
    dropped = 0
    recv = _recv
    while more:
        more = recv(sock, 0, copy=False).more
        dropped += 1
    return frames, dropped


_recv = zmq.backend.Socket.recv
