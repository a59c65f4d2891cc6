"""Triton's system shared-memory extension for HTTP and gRPC; off unless ``--allow-client-shm=true``.

A TCP client names a POSIX segment (``/dev/shm/<key>``) and the daemon reads inputs from it and writes
outputs into it.  Two rules keep that safe next to strangers:

* **Only memory the client could open itself.**  The peer of a TCP connection on this host is a socket
  in this network namespace; ``/proc/net/tcp`` (and ``tcp6``) lists it with the uid that created it
  (found by the connection's address pair).  A segment is used for a request only if that uid (its
  primary and supplementary groups from the user database) passes the segment's owner/group/other
  permission bits, read for inputs, write for outputs; root passes.  A peer not found there (another
  host) cannot use shared memory at all.
* **No mapping, so no SIGBUS.**  The daemon never maps a client's segment: it reads with ``os.pread``
  and writes with ``os.pwrite`` after checking the registration's bounds and the segment's current size
  (``fstat``), so a client that shrinks its segment gets an error, not a dead daemon.  Inputs cost one
  copy into the daemon (the price of that safety; the IPC frontend's descriptor passing avoids it).

Regions are global, as in Triton: any client may use a region by name, but every use is checked
against the using peer's uid.  The daemon never creates or unlinks a segment.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import pwd
import re
import stat
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from edge_server.errors import (
    InvalidArgument,
    ShmAlreadyRegistered,
    ShmNameRejected,
    ShmNotRegistered,
    ShmOutOfBounds,
    ShmUnavailable,
)

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MAX_REGIONS = 256
_KEY = re.compile(r"/?([A-Za-z0-9._-]{1,200})")
_NAME_MAX = 256


@dataclass(frozen=True, slots=True)
class Peer:
    """A TCP connection as the frontend sees it: the client's address and our listening port."""

    host: str
    port: int
    server_port: int


def _parse_hex_address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # The kernel prints each 32-bit word of the address in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, int(port, 16)


def peer_uid(peer: Peer, proc_net: str = "/proc/net") -> int | None:
    """The uid owning the client's end of ``peer``'s connection, or None if it is not on this host."""
    try:
        want = ipaddress.ip_address(peer.host.strip("[]"))
    except ValueError:
        return None
    if isinstance(want, ipaddress.IPv6Address) and want.ipv4_mapped is not None:
        want = want.ipv4_mapped
    for table in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_net, table)) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) < 8:
                        continue
                    local, local_port = _parse_hex_address(fields[1])
                    if local_port != peer.port or local != want:
                        continue
                    _remote, remote_port = _parse_hex_address(fields[2])
                    if remote_port == peer.server_port:
                        return int(fields[7])
        except FileNotFoundError:
            continue
    return None


def may_access(uid: int, st: os.stat_result, *, write: bool) -> bool:
    """Whether ``uid`` passes the permission bits of ``st`` (read, or write) as open(2) would check."""
    if uid == 0:
        return True
    if uid == st.st_uid:
        bit = stat.S_IWUSR if write else stat.S_IRUSR
    elif st.st_gid in _groups(uid):
        bit = stat.S_IWGRP if write else stat.S_IRGRP
    else:
        bit = stat.S_IWOTH if write else stat.S_IROTH
    return bool(st.st_mode & bit)


def _groups(uid: int) -> set[int]:
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return set()
    return set(os.getgrouplist(entry.pw_name, entry.pw_gid))


class _Region:
    """One registered segment: an open fd (closed when the last user lets go), its bounds."""

    def __init__(self, name: str, key: str, offset: int, byte_size: int, fd: int) -> None:
        self.name = name
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self.fd = fd
        # In-flight requests may hold the region after it is unregistered; the fd must not be closed
        # (and its number reused for another file) under them.
        weakref.finalize(self, os.close, fd)

    def span(self, offset: int, byte_size: int, where: str) -> int:
        """The absolute file offset of ``offset .. offset + byte_size`` inside the region, checked."""
        if offset < 0 or byte_size < 0 or offset + byte_size > self.byte_size:
            raise ShmOutOfBounds(
                f"{where}: bytes {offset}..{offset + byte_size} lie outside shared-memory region "
                f"{self.name!r} ({self.byte_size} bytes)"
            )
        start = self.offset + offset
        size = os.fstat(self.fd).st_size
        if start + byte_size > size:
            raise ShmOutOfBounds(
                f"{where}: region {self.name!r} needs bytes up to {start + byte_size} of segment "
                f"{self.key!r}, which now has {size}"
            )
        return start


class SystemShmRegistry:
    """Named regions of client segments; reads and writes checked against the using peer's uid."""

    def __init__(self, *, shm_dir: str = SHM_DIR, proc_net: str = "/proc/net") -> None:
        self._dir = shm_dir
        self._proc_net = proc_net
        self._lock = threading.Lock()
        self._regions: dict[str, _Region] = {}

    def register(self, name: object, key: object, offset: object, byte_size: object, peer: Peer) -> None:
        if not isinstance(name, str) or not 0 < len(name) <= _NAME_MAX:
            raise InvalidArgument(f"a region name must be a string of 1-{_NAME_MAX} characters")
        match = _KEY.fullmatch(key) if isinstance(key, str) else None
        if match is None or match.group(1) in (".", ".."):
            raise ShmNameRejected(
                f"shared-memory key {key!r} is not allowed: use '/' and 1-200 characters from [A-Za-z0-9._-]"
            )
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise InvalidArgument(f"region {name!r}: {field} must be a non-negative integer")
        assert isinstance(offset, int) and isinstance(byte_size, int)
        uid = self._uid(peer)
        path = os.path.join(self._dir, match.group(1))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise ShmUnavailable(f"cannot open shared-memory key {key!r}: {exc.strerror}") from None
        region = _Region(name, str(key), offset, byte_size, fd)  # owns fd from here on
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShmUnavailable(f"shared-memory key {key!r} is not a shared-memory segment")
        if not (may_access(uid, st, write=False) or may_access(uid, st, write=True)):
            raise ShmUnavailable(f"shared-memory key {key!r}: permission denied for the client's user")
        if offset + byte_size > st.st_size:
            raise ShmOutOfBounds(
                f"region {name!r}: bytes {offset}..{offset + byte_size} lie outside segment {key!r} "
                f"({st.st_size} bytes)"
            )
        with self._lock:
            if name in self._regions:
                raise ShmAlreadyRegistered(f"a shared-memory region named {name!r} is already registered")
            if len(self._regions) >= MAX_REGIONS:
                raise InvalidArgument(f"at most {MAX_REGIONS} shared-memory regions may be registered")
            self._regions[name] = region
        log.debug("registered region %s (%s, %d+%d) for uid %d", name, key, offset, byte_size, uid)

    def unregister(self, name: str = "") -> None:
        """Unregister one region, or every region when ``name`` is empty (unknown names are no error)."""
        with self._lock:
            if name:
                self._regions.pop(name, None)
            else:
                self._regions.clear()

    def status(self, name: str = "") -> list[dict[str, Any]]:
        with self._lock:
            if name and name not in self._regions:
                raise ShmNotRegistered(f"no shared-memory region named {name!r} is registered")
            chosen = [self._regions[name]] if name else list(self._regions.values())
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in chosen]

    def read(self, name: object, offset: object, byte_size: object, peer: Peer, where: str) -> bytes:
        """The bytes of an input tensor, copied out of the segment with ``pread``."""
        region, offset, byte_size = self._use(name, offset, byte_size, peer, where, write=False)
        start = region.span(offset, byte_size, where)
        data = os.pread(region.fd, byte_size, start)
        if len(data) != byte_size:  # shrunk between fstat and pread
            raise ShmOutOfBounds(f"{where}: segment {region.key!r} shrank while it was read")
        return data

    def write(
        self, name: object, offset: object, byte_size: object, data: bytes, peer: Peer, where: str
    ) -> None:
        """Write an output tensor's bytes into the segment with ``pwrite``; they must fit ``byte_size``."""
        region, offset, byte_size = self._use(name, offset, byte_size, peer, where, write=True)
        if len(data) > byte_size:
            raise ShmOutOfBounds(
                f"{where}: the output has {len(data)} bytes, the shared-memory span holds {byte_size}"
            )
        start = region.span(offset, len(data), where)
        view = memoryview(data)
        while view:
            written = os.pwrite(region.fd, view, start)
            view, start = view[written:], start + written

    def check_output(self, name: object, offset: object, byte_size: object, peer: Peer, where: str) -> None:
        """Refuse an output reference before the request runs (unknown region, bounds, permission)."""
        region, offset, byte_size = self._use(name, offset, byte_size, peer, where, write=True)
        region.span(offset, byte_size, where)

    def _use(
        self, name: object, offset: object, byte_size: object, peer: Peer, where: str, *, write: bool
    ) -> tuple[_Region, int, int]:
        if not isinstance(name, str):
            raise InvalidArgument(f"{where}: shared_memory_region must be a string")
        if offset is None:
            offset = 0
        for field, value in (("shared_memory_offset", offset), ("shared_memory_byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise InvalidArgument(f"{where}: {field} must be a non-negative integer")
        assert isinstance(offset, int) and isinstance(byte_size, int)
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise ShmNotRegistered(f"{where}: no shared-memory region named {name!r} is registered")
        uid = self._uid(peer)
        if not may_access(uid, os.fstat(region.fd), write=write):
            raise ShmUnavailable(
                f"{where}: the client's user may not {'write' if write else 'read'} segment {region.key!r}"
            )
        return region, offset, byte_size

    def _uid(self, peer: Peer) -> int:
        uid = peer_uid(peer, self._proc_net)
        if uid is None:
            raise ShmUnavailable(
                "shared memory is only for clients on this host; the connection's peer socket was not found"
            )
        return uid
