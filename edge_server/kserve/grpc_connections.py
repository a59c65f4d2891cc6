"""A per-user cap on the gRPC server's connections, which grpcio accepts on its own threads.

grpcio takes only a total (``grpc.max_allowed_incoming_connections``): it cannot be handed accepted
descriptors (the C core's ``grpc_server_add_channel_from_fd`` is not exported by the Python package,
whose extension module exports nothing but its init function), and it never tells who connected
before a call arrives.  So one local user holding the total with idle connections that sent HTTP/2's
preface (the handshake timeout closes those that did not) turned every other client away.

The kernel knows both ends of a loopback connection: the client's socket, owned by its uid, and the
daemon's, by its inode.  :class:`ConnectionCap` reads the socket tables (``/proc/net/tcp{,6}``) every
``interval`` seconds, pairs each connection to the gRPC port with its client's uid, and shuts down
(``shutdown(2)`` on the daemon's descriptor, which grpc then closes as after any peer reset) the
newest connections of a user past its cap.  Connections from other hosts have no uid here and obey
only the total.  A descriptor is matched to its socket by inode on a duplicate of it, so a number
that grpc closed and reused meanwhile is never touched.

Reading those tables costs what the whole host holds: the kernel prints every socket, and on a box
with 8,400 of them (other services' TIME_WAITs) a pass took 25-30 ms of the daemon's CPU with the
GIL held, every ``interval``: 6% of a core, stalling every frontend thread meanwhile.  So a pass
first counts the daemon's own sockets (:func:`sockets_held`, a few hundred descriptors at most while
nobody floods it): no user can hold more connections than the daemon holds sockets, so while those
are within the cap the tables are not read.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import defaultdict
from dataclasses import dataclass

log = logging.getLogger(__name__)

ESTABLISHED = "01"
MAPPED = "0000000000000000FFFF0000"  # an IPv4 address in tcp6 (grpc listens on 127.0.0.1 that way)
LISTEN = "0A"
INTERVAL_S = 0.5


@dataclass(frozen=True, slots=True)
class Link:
    """One TCP connection to the port: the daemon's socket inode and the client's uid."""

    inode: int
    uid: int


def _rows(proc_net: str) -> list[list[str]]:
    rows = []
    for table in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_net, table)) as f:
                next(f, None)
                rows += [line.split() for line in f]
        except OSError:
            continue
    return rows


def _endpoint(text: str) -> str:
    """``ADDRESS:PORT`` as the table prints it, an IPv4-mapped IPv6 address as its IPv4 form."""
    return text[len(MAPPED) :] if text.startswith(MAPPED) else text


def links(port: int, proc_net: str = "/proc/net") -> list[Link]:
    """The connections to ``port`` on this host whose client end is on this host too."""
    suffix = f":{port:04X}"
    server: dict[tuple[str, str], int] = {}  # (client address, server address) -> the daemon's inode
    client: dict[tuple[str, str], int] = {}  # the same key -> the client's uid
    for row in _rows(proc_net):
        if len(row) < 10 or row[3] == LISTEN:
            continue
        local, remote = _endpoint(row[1]), _endpoint(row[2])
        if local.endswith(suffix):
            server[(remote, local)] = int(row[9])
        elif remote.endswith(suffix) and row[3] == ESTABLISHED:
            client[(local, remote)] = int(row[7])
    return [Link(inode, client[key]) for key, inode in server.items() if key in client and inode]


def over_cap(found: list[Link], cap: int) -> list[Link]:
    """Each user's connections past ``cap``, newest first (a larger inode is a later socket)."""
    by_uid: dict[int, list[Link]] = defaultdict(list)
    for link in found:
        by_uid[link.uid].append(link)
    excess: list[Link] = []
    for held in by_uid.values():
        if len(held) > cap:
            excess += sorted(held, key=lambda link: link.inode)[cap:]
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

    def __init__(self, port: int, cap: int, interval: float = INTERVAL_S) -> None:
        self.port, self.cap, self.interval = port, max(1, cap), interval
        self.shed = 0  # connections shut down so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edge-grpc-connections", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def check(self) -> int:
        """One pass: shut down what is over the cap; returns how many."""
        if 0 <= sockets_held() <= self.cap:  # nobody can be over it: the tables are not read
            return 0
        excess = over_cap(links(self.port), self.cap)
        if not excess:
            return 0
        done = shut_down({link.inode for link in excess})
        self.shed += done
        uids = sorted({link.uid for link in excess})
        log.warning(
            "gRPC: uid %s held more than %d connections (--max-client-connections, at most half of "
            "gRPC's share): shut down %d",
            ", ".join(map(str, uids)),
            self.cap,
            done,
        )
        return done

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watcher never dies; the total cap still holds
                log.exception("gRPC connection cap: check failed")
