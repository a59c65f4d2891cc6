"""A per-user cap on the gRPC server's connections, for when grpcio accepts on its own threads.

The daemon normally accepts the gRPC port itself and counts every connection in its budget
(:mod:`edge_server.kserve.grpc_accept`).  Where it cannot (grpc's handler missing or not answering, or
``EDGE_SERVER_GRPC_ACCEPT=grpc``), grpcio accepts and takes only a total
(``grpc.max_allowed_incoming_connections``), and never tells who connected before a call arrives; so one
local user holding the total with idle connections that sent HTTP/2's preface (the handshake timeout
closes those that did not) would turn every other client away.  This module keeps the per-user cap then.

The kernel knows both ends of a loopback connection: the client's socket, owned by its uid, and the
daemon's, by its inode.  :class:`ConnectionCap` asks the kernel for the sockets of the gRPC port
whenever the host's TCP counters move, checked every :data:`TICK_S` (``sock_diag`` netlink, filtered by
port in the kernel: milliseconds, mostly the kernel's walk of its whole table; where it is missing, the
text tables ``/proc/net/tcp{,6}`` every :data:`SLOW_INTERVAL_S`, ~10 ms per 2,000 sockets), pairs each
connection with its client's uid, and shuts down (``shutdown(2)`` on the daemon's descriptor, which grpc
then closes as after any peer reset) the connections of a user past its cap.  Connections from other
hosts have no uid here and obey only the total.  A descriptor is matched to its socket by inode on a
duplicate of it, so a number that grpc closed and reused meanwhile is never touched.

Between two looks a user can fill grpc's total, and every other client's new connection is refused
then (grpc core accepts and closes it; grpc clients wait about a second before they try again).  So
the look is frequent, and a user found over its cap is penalized
(:meth:`~edge_server.limits.Limits.penalize`): while the penalty lasts every one of its gRPC connections
is shut down at each look, and the other listeners refuse it at accept, so that reconnecting at once
does not let it hold the total either.

Reading the text tables costs what the whole host holds (the kernel prints every socket: on a box
with 8,400 of them a pass took 25-30 ms of CPU with the GIL held), hence sock_diag, which filters by
port in the kernel; where only the tables are left, a pass first counts the daemon's own sockets
(:func:`sockets_held`) and reads them only when that count is past the cap.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

from edge_server.kserve import sock_diag
from edge_server.kserve.sock_diag import Socket
from edge_server.limits import Limits

log = logging.getLogger(__name__)

ESTABLISHED = 1  # TCP states as the kernel numbers them
LISTEN = 10
TIME_WAIT = 6
TICK_S = 0.02
SLOW_INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class Link:
    """One TCP connection to the port: the daemon's socket inode and the client's uid."""

    inode: int
    uid: int


def _diag_sockets(port: int) -> Iterator[Socket]:
    """The host's TCP sockets whose local or remote port is ``port``, both families (sock_diag)."""
    states = sock_diag.ALL_STATES & ~((1 << LISTEN) | (1 << TIME_WAIT))
    bytecode = sock_diag.port_filter(port)
    for family in (socket.AF_INET, socket.AF_INET6):
        yield from sock_diag.sockets(family, states=states, bytecode=bytecode)


def links(port: int, proc_net: str | None = None) -> list[Link]:
    """The connections to ``port`` on this host whose client end is on this host too.

    From sock_diag; from the text tables in ``proc_net`` when given or when sock_diag is missing.
    """
    if proc_net is None:
        try:
            return _pair(_diag_sockets(port), port)
        except OSError:
            proc_net = "/proc/net"
    return _pair(sock_diag.table(proc_net), port)


def _pair(found: Iterable[Socket], port: int) -> list[Link]:
    server: dict[tuple[bytes, int, bytes], int] = {}  # (client address, its port, server address): inode
    client: dict[tuple[bytes, int, bytes], int] = {}  # the same key: the client's uid
    for sock in found:
        if sock.state == LISTEN:
            continue
        if sock.local_port == port:
            server[(sock.remote, sock.remote_port, sock.local)] = sock.inode
        elif sock.remote_port == port and sock.state == ESTABLISHED:
            client[(sock.local, sock.local_port, sock.remote)] = sock.uid
    return [Link(inode, client[key]) for key, inode in server.items() if key in client and inode]


def over_cap(found: list[Link], cap: int, penalized: Collection[int] = ()) -> list[Link]:
    """Each user's connections past ``cap``, newest first (a larger inode is a later socket).

    A ``penalized`` user keeps none.
    """
    by_uid: dict[int, list[Link]] = defaultdict(list)
    for link in found:
        by_uid[link.uid].append(link)
    excess: list[Link] = []
    for uid, held in by_uid.items():
        keep = 0 if uid in penalized else cap
        if len(held) > keep:
            excess += sorted(held, key=lambda link: link.inode)[keep:]
    return excess


def sockets_held(fd_dir: str = "/proc/self/fd") -> int:
    """How many of this process's descriptors are sockets (of any kind: an upper bound on gRPC's)."""
    held = 0
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return -1  # not known: the caller reads the tables
    for name in names:
        try:
            if os.readlink(os.path.join(fd_dir, name)).startswith("socket:["):
                held += 1
        except OSError:
            continue
    return held


def shut_down(inodes: set[int], fd_dir: str = "/proc/self/fd") -> int:
    """Shut down this process's sockets with these inodes; returns how many."""
    done = 0
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return 0
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if not target.startswith("socket:[") or int(target[8:-1]) not in inodes:
            continue
        try:
            copy = os.dup(int(name))
        except OSError:
            continue
        try:
            if os.fstat(copy).st_ino not in inodes:  # the number was closed and reused meanwhile
                continue
            sock = socket.socket(fileno=copy)
            copy = -1  # the socket object owns it now
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass
            finally:
                sock.close()
        finally:
            if copy >= 0:
                os.close(copy)
    return done


class ConnectionCap:
    """Keeps each local user at ``cap`` connections to ``port`` (see the module docstring)."""

    def __init__(self, port: int, cap: int, limits: Limits, *, tick: float = TICK_S) -> None:
        self.port, self.cap, self.limits, self.tick = port, max(1, cap), limits, tick
        self.shed = 0  # connections shut down so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edge-grpc-connections", daemon=True)
        self._diag = True  # sock_diag answers (else the text tables, every SLOW_INTERVAL_S)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def check(self) -> int:
        """One look: penalize users over the cap, shut down what they may not hold; returns how many."""
        found = self._links()
        held: dict[int, int] = defaultdict(int)
        for link in found:
            held[link.uid] += 1
        penalized = {uid for uid in held if self.limits.penalty(uid) is not None}
        for uid in sorted(held.keys() - penalized):
            if held[uid] > self.cap:
                self.limits.penalize(uid, f"held {held[uid]} gRPC connections, more than {self.cap}")
                if self.limits.penalty(uid) is not None:  # the daemon's own uid is never penalized
                    penalized.add(uid)
                log.warning(
                    "gRPC: uid %d held %d connections, more than %d (--max-client-connections, at most "
                    "half of gRPC's share): shutting them down%s",
                    uid,
                    held[uid],
                    self.cap,
                    ", all of them while its penalty lasts" if uid in penalized else "",
                )
        excess = over_cap(found, self.cap, penalized)
        if not excess:
            return 0
        done = shut_down({link.inode for link in excess})
        self.shed += done
        return done

    def _links(self) -> list[Link]:
        if self._diag:
            try:
                return _pair(_diag_sockets(self.port), self.port)
            except OSError as exc:
                log.warning("gRPC connection cap: sock_diag failed (%s); reading /proc/net/tcp instead", exc)
                self._diag = False
        if 0 <= sockets_held() <= self.cap:  # nobody can be over it: the tables are not read
            return []
        return links(self.port, "/proc/net")

    def _run(self) -> None:
        """Look when the host's TCP counters moved since the last look, else every 0.5 s.

        Any change, not only a rise: while grpc closes what was shut down, a user reconnecting at once
        leaves the count flat or falling.  The counters are cheap (:func:`sock_diag.tcp_activity`); with
        the text tables, look only every :data:`SLOW_INTERVAL_S`.
        """
        base: tuple[int, ...] = (-1,)
        due = 0.0
        while not self._stop.wait(self.tick if self._diag else SLOW_INTERVAL_S):
            counters = sock_diag.tcp_activity()
            if self._diag and counters == base and time.monotonic() < due:
                continue
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watcher never dies; the total cap still holds
                log.exception("gRPC connection cap: check failed")
            base, due = sock_diag.tcp_activity(), time.monotonic() + SLOW_INTERVAL_S
