"""A per-user cap on the gRPC server's connections, which grpcio accepts on its own threads.

grpcio takes only a total (``grpc.max_allowed_incoming_connections``): it cannot be handed accepted
descriptors (the C core's ``grpc_server_add_channel_from_fd`` is not exported by the Python package,
whose extension module exports nothing but its init function), and it never tells who connected
before a call arrives.  So one local user holding the total with idle connections that sent HTTP/2's
preface (the handshake timeout closes those that did not) turned every other client away.

The kernel knows both ends of a loopback connection: the client's socket, owned by its uid, and the
daemon's, by its inode.  :class:`ConnectionCap` asks the kernel for the sockets of the gRPC port every
:data:`TICK_S` (``sock_diag`` netlink, filtered by port in the kernel: well under a millisecond with
thousands of sockets on the host; where it is missing, the text tables ``/proc/net/tcp{,6}`` every
:data:`SLOW_INTERVAL_S`, ~10 ms per 2,000 sockets), pairs each connection with its client's uid, and
shuts down (``shutdown(2)`` on the daemon's descriptor, which grpc then closes as after any peer
reset) the connections of a user past its cap.  Connections from other hosts have no uid here and obey
only the total.  A descriptor is matched to its socket by inode on a duplicate of it, so a number
that grpc closed and reused meanwhile is never touched.

Between two looks a user can fill grpc's total, and every other client's new connection is refused
then (grpc core accepts and closes it; grpc clients wait about a second before they try again).  So
the look is frequent, and a user found over its cap is penalized
(:meth:`~edge_server.limits.Limits.penalize`): while the penalty lasts every one of its gRPC connections
is shut down at each look, and the other listeners refuse it at accept, so that reconnecting at once
does not let it hold the total either.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from edge_server.limits import Limits

log = logging.getLogger(__name__)

ESTABLISHED = 1  # TCP states as the kernel numbers them
LISTEN = 10
TIME_WAIT = 6
MAPPED = bytes(10) + b"\xff\xff"  # an IPv4 address in an IPv6 socket (::ffff:a.b.c.d)
MAPPED_TEXT = "0000000000000000FFFF0000"  # the same in /proc/net/tcp6
TICK_S = 0.02
SLOW_INTERVAL_S = 0.5

# sock_diag (linux/sock_diag.h, linux/inet_diag.h)
NETLINK_SOCK_DIAG = 4  # NETLINK_INET_DIAG
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
INET_DIAG_REQ_BYTECODE = 1
BC_JMP, BC_S_GE, BC_S_LE, BC_D_GE, BC_D_LE = 1, 2, 3, 4, 5
HEADER = struct.Struct("=IHHII")  # nlmsghdr
REQUEST = struct.Struct("=BBBBI48s")  # inet_diag_req_v2: family, protocol, ext, pad, states, sockid
MESSAGE = struct.Struct("=BBBBHH16s16sI8sIIIII")  # inet_diag_msg (ports in network order)
OP = struct.Struct("=BBH")  # inet_diag_bc_op: code, yes, no


@dataclass(frozen=True, slots=True)
class Link:
    """One TCP connection to the port: the daemon's socket inode and the client's uid."""

    inode: int
    uid: int


#: One socket: (state, local address, local port, remote address, remote port, uid, inode); an
#: IPv4-mapped IPv6 address as its 4 IPv4 bytes.
Row = tuple[int, bytes, int, bytes, int, int, int]


def tcp_sockets(proc_net: str = "/proc/self/net") -> int:
    """TCP sockets in use on the host, both families (``sockstat``: one small read, ~20 us)."""
    total = 0
    for name in ("sockstat", "sockstat6"):
        try:
            with open(os.path.join(proc_net, name)) as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            fields = line.split()
            if fields[:1] in (["TCP:"], ["TCP6:"]) and "inuse" in fields:
                total += int(fields[fields.index("inuse") + 1])
    return total


def _address(raw: bytes, family: int) -> bytes:
    if family == socket.AF_INET:
        return raw[:4]
    return raw[12:] if raw.startswith(MAPPED) else raw


def _port_filter(port: int) -> bytes:
    """Bytecode for "the local or the remote port is ``port``".

    The kernel's audit wants every op on the chain of ``yes`` jumps: hence the unconditional jump
    between the two halves.
    """
    ops = [
        (BC_S_GE, 8, 20), (0, 0, port),  # 0: local < port: try the remote port (20)
        (BC_S_LE, 8, 12), (0, 0, port),  # 8: local > port: try the remote port (20)
        (BC_JMP, 4, 20),  # 16: local == port: accept (36)
        (BC_D_GE, 8, 20), (0, 0, port),  # 20: remote < port: reject (40)
        (BC_D_LE, 8, 12), (0, 0, port),  # 28: remote > port: reject (40); else accept (36)
    ]  # fmt: skip
    return b"".join(OP.pack(*op) for op in ops)


def _diag_rows(port: int) -> Iterator[Row]:
    """The host's TCP sockets whose local or remote port is ``port``, from the kernel (sock_diag)."""
    states = 0xFFF & ~((1 << LISTEN) | (1 << TIME_WAIT))
    bytecode = _port_filter(port)
    attribute = struct.pack("=HH", 4 + len(bytecode), INET_DIAG_REQ_BYTECODE) + bytecode
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as sock:
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), start=1):
            body = REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, states, bytes(48)) + attribute
            flags = NLM_F_REQUEST | NLM_F_DUMP
            sock.sendall(HEADER.pack(HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, flags, seq, 0) + body)
            yield from _replies(sock)


def _replies(sock: socket.socket) -> Iterator[Row]:
    while True:
        data = sock.recv(1 << 16)
        offset = 0
        while offset + HEADER.size <= len(data):
            length, kind = HEADER.unpack_from(data, offset)[:2]
            if kind == NLMSG_DONE:
                return
            if kind == NLMSG_ERROR:
                code = -struct.unpack_from("=i", data, offset + HEADER.size)[0]
                raise OSError(code, f"sock_diag: {os.strerror(code)}")
            if kind == SOCK_DIAG_BY_FAMILY and length >= HEADER.size + MESSAGE.size:
                family, state, _t, _r, sport, dport, src, dst, *_rest, uid, inode = MESSAGE.unpack_from(
                    data, offset + HEADER.size
                )
                yield (
                    state,
                    _address(src, family),
                    socket.ntohs(sport),
                    _address(dst, family),
                    socket.ntohs(dport),
                    uid,
                    inode,
                )
            offset += (length + 3) & ~3
        if not data:
            return


def _table_rows(proc_net: str) -> Iterator[Row]:
    """The same from the text tables (``/proc/net/tcp{,6}``: every socket of the host, as text)."""
    for table in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_net, table)) as f:
                next(f, None)
                lines = [line.split() for line in f]
        except OSError:
            continue
        for row in lines:
            if len(row) < 10:
                continue
            local, lport = _text_endpoint(row[1])
            remote, rport = _text_endpoint(row[2])
            yield int(row[3], 16), local, lport, remote, rport, int(row[7]), int(row[9])


def _text_endpoint(text: str) -> tuple[bytes, int]:
    """``ADDRESS:PORT`` as the table prints it; an IPv4-mapped IPv6 address as its IPv4 form."""
    address, port = text.split(":")
    return address.removeprefix(MAPPED_TEXT).encode(), int(port, 16)


def links(port: int, proc_net: str | None = None) -> list[Link]:
    """The connections to ``port`` on this host whose client end is on this host too.

    From sock_diag; from the text tables in ``proc_net`` when given or when sock_diag is missing.
    """
    if proc_net is None:
        try:
            return _pair(_diag_rows(port), port)
        except OSError:
            proc_net = "/proc/net"
    return _pair(_table_rows(proc_net), port)


def _pair(rows: Iterator[Row], port: int) -> list[Link]:
    server: dict[tuple[bytes, int, bytes], int] = {}  # (client address, its port, server address): inode
    client: dict[tuple[bytes, int, bytes], int] = {}  # the same key: the client's uid
    for state, local, lport, remote, rport, uid, inode in rows:
        if state == LISTEN:
            continue
        if lport == port:
            server[(remote, rport, local)] = inode
        elif rport == port and state == ESTABLISHED:
            client[(local, lport, remote)] = uid
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
                return _pair(_diag_rows(self.port), self.port)
            except OSError as exc:
                log.warning("gRPC connection cap: sock_diag failed (%s); reading /proc/net/tcp instead", exc)
                self._diag = False
        return links(self.port, "/proc/net")

    def _run(self) -> None:
        """Look when the host's count of TCP sockets changed since the last look, else every 0.5 s.

        Any change, not only a rise: while grpc closes what was shut down, a user reconnecting at once
        leaves the count flat or falling.  The count is cheap (:func:`tcp_sockets`); with the text
        tables, look only every :data:`SLOW_INTERVAL_S`.
        """
        base, due = -1, 0.0
        while not self._stop.wait(self.tick if self._diag else SLOW_INTERVAL_S):
            count = tcp_sockets()
            if self._diag and count == base and time.monotonic() < due:
                continue
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watcher never dies; the total cap still holds
                log.exception("gRPC connection cap: check failed")
            base, due = tcp_sockets(), time.monotonic() + SLOW_INTERVAL_S
