"""The kernel's TCP socket table over netlink (sock_diag, what ``ss`` uses), for the TCP listeners.

A TCP peer on this host is known by the uid owning its socket: the shared-memory rules ask for one
connection's (:func:`sockets` with ``exact``), the gRPC connection cap for every connection to one port
(a dump, filtered by port in the kernel: :func:`port_filter`).  Reading ``/proc/net/tcp{,6}`` instead
makes the kernel print every socket of the host as text: milliseconds per thousand sockets, where this
takes tens of microseconds.  Where sock_diag is missing (a restricted container) the netlink
functions here raise ``OSError`` and callers fall back to the text tables (:func:`table`), read
into the same :class:`Socket` records.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
INET_DIAG_REQ_BYTECODE = 1
BC_JMP, BC_S_GE, BC_S_LE, BC_D_GE, BC_D_LE = 1, 2, 3, 4, 5
ALL_STATES = 0xFFF
HEADER = struct.Struct("=IHHII")  # nlmsghdr
REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2: family, protocol, ext, pad, states; then the id
SOCKID = struct.Struct(">HH16s16sI8s")  # sport, dport, src, dst (network order), interface, cookie
MESSAGE = struct.Struct("=BBBB48sIIIII")  # inet_diag_msg: family, state, timer, retrans, id, ..., uid, inode
OP = struct.Struct("=BBH")  # inet_diag_bc_op: code, yes, no
ANY_COOKIE = b"\xff" * 8
MAPPED = bytes(10) + b"\xff\xff"  # an IPv4 address in an IPv6 socket (::ffff:a.b.c.d)


@dataclass(frozen=True, slots=True)
class Socket:
    """One TCP socket as the kernel reports it (an IPv4-mapped IPv6 address as its 4 IPv4 bytes)."""

    state: int
    local: bytes
    local_port: int
    remote: bytes
    remote_port: int
    uid: int
    inode: int


def port_filter(port: int) -> bytes:
    """Bytecode for "the local or the remote port is ``port``".

    The kernel's audit wants every op on the chain of ``yes`` jumps: hence the unconditional jump
    between the two halves (accept: reach the end, byte 36; reject: byte 40).
    """
    ops = [
        (BC_S_GE, 8, 20), (0, 0, port),  # 0: local < port: try the remote port (20)
        (BC_S_LE, 8, 12), (0, 0, port),  # 8: local > port: try the remote port (20)
        (BC_JMP, 4, 20),  # 16: local == port: accept (36)
        (BC_D_GE, 8, 20), (0, 0, port),  # 20: remote < port: reject (40)
        (BC_D_LE, 8, 12), (0, 0, port),  # 28: remote > port: reject (40); else accept (36)
    ]  # fmt: skip
    return b"".join(OP.pack(*op) for op in ops)


def local_port_filter(port: int) -> bytes:
    """Bytecode for "the local port is ``port``": a listener's ends of its connections (not its clients')."""
    ops = [
        (BC_S_GE, 8, 20), (0, 0, port),  # 0: local < port: reject (20)
        (BC_S_LE, 8, 12), (0, 0, port),  # 8: local > port: reject (20); else accept (16)
    ]  # fmt: skip
    return b"".join(OP.pack(*op) for op in ops)


def tcp_activity(proc_net: str = "/proc/self/net") -> tuple[int, ...]:
    """The host's TCP counters that move when a connection opens or closes (``sockstat``: ~20 µs).

    Sockets in use, orphaned (closed by their process, not yet by the kernel), in TIME_WAIT and
    allocated, per family.  A dump (:func:`sockets`) walks the kernel's whole table of TCP sockets,
    however few of them the filter keeps: about 2.5 ms per family on a 24 GB host.  A caller that only
    looks for connections that opened or closed dumps when these moved.
    """
    counters: list[int] = []
    for name in ("sockstat", "sockstat6"):
        try:
            with open(os.path.join(proc_net, name)) as f:
                text = f.read()
        except OSError:
            continue
        for line in text.splitlines():
            fields = line.split()
            if fields[:1] in (["TCP:"], ["TCP6:"]):
                pairs = zip(fields[1::2], fields[2::2], strict=False)
                counters += (int(value) for key, value in pairs if key != "mem")
    return tuple(counters)


def sockets(
    family: int, *, states: int = ALL_STATES, exact: bytes | None = None, bytecode: bytes = b""
) -> Iterator[Socket]:
    """The host's TCP sockets of ``family`` in ``states``.

    With ``exact`` (a packed :data:`SOCKID`), that one socket, or none if the kernel has no such
    socket; else every one that ``bytecode`` accepts.
    """
    body = REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, states) + (exact or bytes(SOCKID.size))
    if bytecode:
        body += struct.pack("=HH", 4 + len(bytecode), INET_DIAG_REQ_BYTECODE) + bytecode
    flags = NLM_F_REQUEST if exact is not None else NLM_F_REQUEST | NLM_F_DUMP
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as sock:
        sock.settimeout(1.0)
        sock.sendall(HEADER.pack(HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, flags, 1, 0) + body)
        yield from _replies(sock, dump=exact is None)


def address(raw: bytes, family: int) -> bytes:
    if family == socket.AF_INET:
        return raw[:4]
    return raw[12:] if raw.startswith(MAPPED) else raw


def _replies(sock: socket.socket, *, dump: bool) -> Iterator[Socket]:
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return
        offset = 0
        while offset + HEADER.size <= len(data):
            length, kind = HEADER.unpack_from(data, offset)[:2]
            if kind == NLMSG_DONE:
                return
            if kind == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", data, offset + HEADER.size)
                if code in (0, -2):  # ENOENT: no such socket (an exact query)
                    return
                raise OSError(-code, "sock_diag refused the query")
            if kind != SOCK_DIAG_BY_FAMILY or length < HEADER.size + MESSAGE.size:
                raise OSError("unexpected sock_diag reply")
            family, state, _timer, _retrans, sockid, *_queues, uid, inode = MESSAGE.unpack_from(
                data, offset + HEADER.size
            )
            sport, dport, src, dst, _interface, _cookie = SOCKID.unpack(sockid)
            yield Socket(state, address(src, family), sport, address(dst, family), dport, uid, inode)
            offset += (length + 3) & ~3
        if not dump:
            return


def table(proc_net: str = "/proc/net") -> Iterator[Socket]:
    """The host's TCP sockets from the text tables ``/proc/net/tcp{,6}``, as :func:`sockets` reads them."""
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(os.path.join(proc_net, name)) as f:
                next(f, None)
                rows = [line.split() for line in f]
        except OSError:
            continue
        for row in rows:
            if len(row) < 10:
                continue
            local, local_port = _text_endpoint(row[1], family)
            remote, remote_port = _text_endpoint(row[2], family)
            yield Socket(int(row[3], 16), local, local_port, remote, remote_port, int(row[7]), int(row[9]))


def _text_endpoint(text: str, family: int) -> tuple[bytes, int]:
    """``ADDRESS:PORT`` as the table prints it: each 32-bit word of the address in host order."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return address(words, family), int(port, 16)
