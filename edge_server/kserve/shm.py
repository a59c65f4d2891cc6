"""Triton's system shared-memory extension for HTTP and gRPC; off unless ``--allow-client-shm=true``.

A TCP client names a POSIX segment (``/dev/shm/<key>``) and the daemon reads inputs from it and writes
outputs into it.  The regions live in the daemon's one shared-memory registry
(:mod:`edge_server.shm`), under the same rules as IPC regions; this module supplies only what is
particular to KServe:

* **Who the peer is.**  The peer of a TCP connection on this host is a socket in this network
  namespace, and the kernel knows the uid that created it: asked by the connection's address pair
  through sock_diag (netlink), or read from ``/proc/net/tcp`` (and ``tcp6``).  A peer not found there
  (another host) cannot use shared memory at all.  That uid owns the regions it registers: other
  users cannot see, use, unregister or replace them (Triton's regions are global; ours are not).
* **Only memory the client could open itself.**  The daemon opens the segment by key, so every use
  is checked against the owner's permission bits (:func:`edge_server.shm.may_use`).
* **No mapping, so no SIGBUS**, and never more than the tensor needs: a segment opened by key may be
  shrunk by its owner, so it is read with ``preadv`` and written with ``pwrite`` after checking the
  registration's bounds and the segment's current size; an input's byte size is compared with its
  datatype and shape (or, for strings, with the request limit) before a byte is read.

The daemon never creates or unlinks a segment.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import stat
from dataclasses import dataclass
from typing import Any

from edge_server.errors import (
    InvalidArgument,
    MessageTooLarge,
    ShmCannotOpen,
    ShmNameRejected,
    ShmOutOfBounds,
    ShmUnavailable,
    TensorSizeMismatch,
)
from edge_server.kserve import sock_diag
from edge_server.shm import Lease, Owner, Registry, Segment, check_use, may_access, user_groups

__all__ = ["InputBudget", "Peer", "SystemSharedMemory", "may_access", "peer_uid", "user_groups"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_KEY = re.compile(r"/?([A-Za-z0-9._-]{1,200})")
_NAME_MAX = 256
#: Triton refuses keys with this prefix (its Python backend's own segments); so do we, with its text
_RESERVED_KEY_PREFIX = "triton_python_backend_shm_region_"


@dataclass(slots=True)
class Peer:
    """A TCP connection as the frontend sees it: the client's address and our listening port.

    Built per request (per stream for gRPC streams); the uid found for it is kept on it, since one
    connection's socket never changes owner.
    """

    host: str
    port: int
    server_port: int
    server_host: str = ""  # the address the client connected to ("": the client's own, as on loopback)
    uid: int | None = None  # filled on first use


def known_uid(peer: Peer) -> int | None:
    """``peer``'s uid, asked of the kernel once per :class:`Peer` (None: not on this host)."""
    if peer.uid is None:
        peer.uid = peer_uid(peer)
    return peer.uid


def peer_uid(peer: Peer, proc_net: str = "/proc/net") -> int | None:
    """The uid owning the client's end of ``peer``'s connection, or None if it is not on this host.

    Asks the kernel for exactly that socket (sock_diag over netlink, what ``ss`` uses: tens of
    microseconds); where that is unavailable, scans ``/proc/net/tcp{,6}`` (milliseconds: the kernel
    walks every socket to print that file).
    """
    try:
        want = ipaddress.ip_address(peer.host.strip("[]"))
    except ValueError:
        return None
    if isinstance(want, ipaddress.IPv6Address) and want.ipv4_mapped is not None:
        want = want.ipv4_mapped
    try:
        server = ipaddress.ip_address(peer.server_host) if peer.server_host else want
    except ValueError:
        server = want
    if isinstance(server, ipaddress.IPv6Address) and server.ipv4_mapped is not None:
        server = server.ipv4_mapped
    if server.version == want.version:
        try:
            return _diag_uid(want, peer.port, server, peer.server_port)
        except OSError:
            pass  # no sock_diag here (a restricted container): fall back to the table
    return _scan_uid(want, peer.port, peer.server_port, proc_net)


def _diag_uid(
    client: ipaddress.IPv4Address | ipaddress.IPv6Address,
    client_port: int,
    server: ipaddress.IPv4Address | ipaddress.IPv6Address,
    server_port: int,
) -> int | None:
    family = socket.AF_INET if client.version == 4 else socket.AF_INET6
    exact = sock_diag.SOCKID.pack(
        client_port,
        server_port,
        client.packed.ljust(16, b"\0"),
        server.packed.ljust(16, b"\0"),
        0,  # any interface
        sock_diag.ANY_COOKIE,
    )
    for found in sock_diag.sockets(family, exact=exact):
        return found.uid
    return None


def _scan_uid(
    want: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, server_port: int, proc_net: str
) -> int | None:
    for found in sock_diag.table(proc_net):
        if found.local_port == port and found.remote_port == server_port and found.local == want.packed:
            return found.uid
    return None


class SystemSharedMemory:
    """Triton's register/unregister/status and tensor reads and writes, over the one registry.

    ``max_input_bytes``: the most one input may take from shared memory when its size is not fixed
    by its datatype and shape (strings): the request limit, as for a body.
    """

    def __init__(
        self,
        registry: Registry | None = None,
        *,
        max_input_bytes: int,
        shm_dir: str = SHM_DIR,
        proc_net: str = "/proc/net",
    ) -> None:
        self.registry = registry if registry is not None else Registry()
        self.max_input_bytes = max_input_bytes
        self._dir = shm_dir
        self._proc_net = proc_net

    def owner(self, peer: Peer) -> Owner:
        """Every connection of one uid is one owner (HTTP clients reconnect at will)."""
        return Owner(self._uid(peer))

    def register(self, name: object, key: object, offset: object, byte_size: object, peer: Peer) -> None:
        if not isinstance(name, str) or not 0 < len(name) <= _NAME_MAX:
            raise InvalidArgument(f"a region name must be a string of 1-{_NAME_MAX} characters")
        if isinstance(key, str) and key.lstrip("/").startswith(_RESERVED_KEY_PREFIX):
            raise ShmNameRejected(  # Triton keeps these for its Python backend's own regions
                f"cannot register shared memory region {name[:60]!r} with key {key[:120]!r} as the key "
                f"contains the reserved prefix '{_RESERVED_KEY_PREFIX}'"
            )
        match = _KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None or match.group(1) in (".", ".."):
            raise ShmNameRejected(  # Triton's text first, then ours
                f"cannot register shared memory region {name[:60]!r} - invalid shm key {str(key)[:60]!r} "
                "(use '/' and 1-200 characters from [A-Za-z0-9._-])"
            )
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise InvalidArgument(f"region {name!r}: {field} must be a non-negative integer")
        assert isinstance(offset, int) and isinstance(byte_size, int) and isinstance(key, str)
        owner = self.owner(peer)
        segment = self._open(key, match.group(1), owner.uid)
        self.registry.register(owner, name, segment, byte_size, offset)  # owns the fd from here on
        log.debug("registered region %s (%s, %d+%d) for uid %d", name, key, offset, byte_size, owner.uid)

    def _open(self, key: str, file_name: str, uid: int) -> Segment:
        path = os.path.join(self._dir, file_name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise ShmCannotOpen(f"Unable to open shared memory region: {key!r} ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmUnavailable(f"shared-memory key {key!r} is not a shared-memory segment")
            if not (may_access(uid, st, write=False) or may_access(uid, st, write=True)):
                raise ShmUnavailable(f"shared-memory key {key!r}: permission denied for the client's user")
        except BaseException:
            os.close(fd)
            raise
        return Segment(fd=fd, size=st.st_size, sealed=False, writable=True, uid=uid, proven=False, key=key)

    def unregister(self, name: str, peer: Peer) -> None:
        """Unregister the caller's region, or all of the caller's regions when ``name`` is empty.

        Unknown names are no error (as in Triton); another user's regions are never touched.
        """
        self.registry.unregister(self.owner(peer), name or None, missing_ok=True)

    def status(self, name: str, peer: Peer) -> list[dict[str, Any]]:
        regions = self.registry.regions(self.owner(peer), name or None)
        return [
            {"name": r.name, "key": r.segment.key, "offset": r.base, "byte_size": r.byte_size}
            for r in regions
        ]

    def read(
        self,
        name: object,
        offset: object,
        byte_size: object,
        want: int | None,
        peer: Peer,
        where: str,
        budget: InputBudget | None = None,
    ) -> bytes | bytearray:
        """An input tensor's bytes, copied out of the segment (once).

        Checked before anything is read: ``want`` (the bytes its datatype and shape need; None for
        strings), and the request's ``budget`` (what all its inputs together may read, the request
        limit, as for a body; without one, this input alone is held to the limit).
        """
        offset, byte_size = _span(offset, byte_size, where)
        if want is not None and byte_size != want:
            raise TensorSizeMismatch(
                f"input byte size mismatch for {where}. Expected {want}, got {byte_size} (the bytes its "
                "datatype and shape need, and the bytes its shared-memory reference holds)"
            )
        (budget or self.budget()).take(byte_size, where)
        # One fstat: the owner's permission bits and the segment's current size, for this read.
        region, size = self.registry.access(Owner(self._uid(peer)), name, where)
        data = region.read(offset, byte_size, where, size)  # a segment opened by key: copied out, once
        return bytes(data) if isinstance(data, memoryview) else data  # never a view the owner can change

    def budget(self) -> InputBudget:
        """A fresh budget for one request's inputs."""
        return InputBudget(self.max_input_bytes)

    def write(
        self,
        name: object,
        offset: object,
        byte_size: object,
        data: bytes,
        peer: Peer,
        where: str,
        lease: Lease | None = None,
    ) -> None:
        """Write an output tensor's bytes into the segment with ``pwrite``; they must fit ``byte_size``.

        ``lease``: the region the request held since :meth:`check_output` (still there if the client
        unregistered it meanwhile); without one the region is looked up by name now.
        """
        offset, byte_size = _span(offset, byte_size, where)
        if len(data) > byte_size:
            raise ShmOutOfBounds(
                f"{where}: the output has {len(data)} bytes, the shared-memory span holds {byte_size}"
            )
        owner = Owner(self._uid(peer))
        # One fstat: the owner's permission bits now (it may have changed them while the request
        # ran) and the segment's current size (pwrite must not grow a segment its owner shrank).
        if lease is not None:
            region = lease.region
            allowed, size = check_use(owner, region, write=True)
            if not allowed:
                raise ShmUnavailable(
                    f"{where}: the client's user may not write segment {region.segment.key!r}"
                )
        else:
            region, size = self.registry.access(owner, name, where, write=True)
        region.write(offset, data, where, size)

    def check_output(self, name: object, offset: object, byte_size: object, peer: Peer, where: str) -> Lease:
        """Refuse an output reference before the request runs (unknown region, bounds, permission).

        The lease keeps the region registered until the output is written (or the request is dropped).
        """
        offset, byte_size = _span(offset, byte_size, where)
        lease = self.registry.hold(Owner(self._uid(peer)), name, where)
        lease.region.check(offset, byte_size, where, output=True)
        return lease

    def close(self) -> None:
        self.registry.close()

    def _uid(self, peer: Peer) -> int:
        if peer.uid is not None:
            return peer.uid
        uid = peer_uid(peer, self._proc_net)
        if uid is None:
            raise ShmUnavailable(
                "shared memory is only for clients on this host; the connection's peer socket was not found"
            )
        peer.uid = uid
        return uid


class InputBudget:
    """Bytes one request may still copy out of shared memory: the request limit, as for a body.

    A copied input costs the daemon its size in memory, so a request naming a sparse segment of
    gigabytes must be refused before anything is read, not after.
    """

    __slots__ = ("limit", "left")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def take(self, nbytes: int, where: str) -> None:
        if nbytes > self.left:
            total = self.limit - self.left + nbytes
            raise MessageTooLarge(
                f"{where}: the request's inputs in shared memory would take {total} "
                f"bytes; this server takes at most {self.limit} per request (its limit, as for a body; "
                "--max-message-bytes)"
            )
        self.left -= nbytes


def _span(offset: object, byte_size: object, where: str) -> tuple[int, int]:
    if offset is None:
        offset = 0
    if type(offset) is not int or offset < 0:
        raise InvalidArgument(f"{where}: shared_memory_offset must be a non-negative integer")
    if type(byte_size) is not int or byte_size < 0:
        raise InvalidArgument(f"{where}: shared_memory_byte_size must be a non-negative integer")
    return offset, byte_size
