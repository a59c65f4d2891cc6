"""Where the IPC socket lives, how clients find it, and making its file safe to bind.

One rule, for the daemon and every client.  ``$EDGE_SERVER_IPC`` overrides everything.  Otherwise the
daemon binds in systemd's runtime directory when run as a service (``$RUNTIME_DIRECTORY``, which the
unit makes ``/run/edge-server``), else in the per-user directory (``$XDG_RUNTIME_DIR/edge-server``, or
``edge-server-<uid>`` under the temp directory).  A client tries the service's socket
(``/run/edge-server/edge-server.sock``) when it exists and accepts a connection, then the per-user
one: see :func:`candidate_addresses` and :func:`find_daemon`.

The socket file is always chmod 0660 (owner and group), but who can reach it is decided by its
directory:

* ``$RUNTIME_DIRECTORY`` is made by systemd with the unit's ``RuntimeDirectoryMode=`` (0750 in
  ``systemd/edge-server.service``) and owned by ``User=``/``Group=``; its mode is systemd's business and
  is left alone, so members of the unit's group may connect.
* The per-user fallback directories are created 0700 (a directory under the shared temp directory
  must be ours and closed to others): only the owner may connect, whatever the socket's mode.
  Group access needs the systemd runtime directory, or ``--ipc`` naming a socket in a directory the
  group may traverse.

A missing parent of an explicit ``--ipc`` path is created 0700 as well.  :func:`who_may_connect`
says which case applies; the daemon logs it at start-up.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import tempfile
from pathlib import Path

from edge_server.errors import AddressInUse, DaemonNotRunning, InvalidArgument

log = logging.getLogger(__name__)

SOCKET_NAME = "edge-server.sock"
ENV_ADDRESS = "EDGE_SERVER_IPC"
SERVICE_DIR = Path("/run/edge-server")  # RuntimeDirectory=edge-server in systemd/edge-server.service
SOCKET_MODE = 0o660  # owner and group; whether the group gets there is up to the directory
DIR_MODE = 0o700  # directories this module creates: the per-user fallbacks, a missing --ipc parent
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_IPC_PATH = 107


def default_address() -> str:
    """The address a daemon binds when none is given (its per-user directory is created 0700)."""
    override = os.environ.get(ENV_ADDRESS)
    if override:
        return override
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        # systemd joins several RuntimeDirectory= entries with ':'; the first is ours.
        return f"ipc://{Path(runtime.split(':')[0]) / SOCKET_NAME}"
    directory = user_dir()
    _private_dir(directory)
    return f"ipc://{directory / SOCKET_NAME}"


def user_dir() -> Path:
    """The per-user socket directory: ``$XDG_RUNTIME_DIR/edge-server``, else one under the temp directory."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "edge-server"
    return Path(tempfile.gettempdir()) / f"edge-server-{os.getuid()}"


def candidate_addresses(service_dir: Path = SERVICE_DIR) -> list[str]:
    """Where a client looks for the daemon, in order: ``$EDGE_SERVER_IPC`` alone, else service then user."""
    override = os.environ.get(ENV_ADDRESS)
    if override:
        return [override]
    return [f"ipc://{service_dir / SOCKET_NAME}", f"ipc://{user_dir() / SOCKET_NAME}"]


def reachable(address: str, timeout: float = 1.0) -> bool:
    """Does something accept connections at ``address`` (within ``timeout`` for TCP)?  Sends nothing."""
    path = ipc_path(address)
    if path is None:
        if not address.startswith("tcp://"):
            return False
        host, _, port = address[len("tcp://") :].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except (OSError, ValueError):
            return False
        return True
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(str(path))
    except OSError:  # absent, refused (a stale file), or not ours to reach (permissions)
        return False
    finally:
        probe.close()
    return True


def client_address(service_dir: Path = SERVICE_DIR) -> str:
    """The library's default: the first candidate that answers, else the last one (it may start later)."""
    candidates = candidate_addresses(service_dir)
    return next((a for a in candidates if reachable(a)), candidates[-1])


def find_daemon(explicit: str | None = None, service_dir: Path = SERVICE_DIR) -> str:
    """The address of a running daemon, or :class:`DaemonNotRunning` naming every address tried.

    Answers within about a second, so that a command-line client never waits on an absent daemon.
    """
    tried = [explicit] if explicit else candidate_addresses(service_dir)
    for address in tried:
        if reachable(address):
            return address
    hint = (
        "start it with `edge-server serve` (or `systemctl start edge-server`), pass --ipc ADDRESS or set "
        f"{ENV_ADDRESS}, or use --model-repository DIR to load a repository in this process"
    )
    raise DaemonNotRunning(f"no edge-server daemon answers at {', '.join(tried)}; {hint}")


def _private_dir(directory: Path) -> None:
    """Create ``directory`` 0700, or accept it only if it is ours and closed to others.

    The temp directory is shared by every user: a directory someone else made there must not be used.
    """
    try:
        directory.mkdir(mode=DIR_MODE, parents=True)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise InvalidArgument(f"{directory} exists and is not a directory")
    if info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise InvalidArgument(
            f"{directory} is not a private directory of this user (owner uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):o}); remove it or pass --ipc"
        )


def ipc_path(address: str) -> Path | None:
    """The socket file of an ``ipc://`` address; None for other transports."""
    if not address.startswith("ipc://"):
        return None
    return Path(address[len("ipc://") :])


def check_address(address: str) -> None:
    """Reject addresses the daemon should not bind: unknown transports, over-long socket paths."""
    if address.startswith("tcp://"):
        host = address[len("tcp://") :].rsplit(":", 1)[0]
        if host not in ("127.0.0.1", "localhost", "[::1]"):
            log.warning("IPC frontend on %s: the protocol has no authentication; bind to 127.0.0.1", address)
        return
    path = ipc_path(address)
    if path is None:
        raise InvalidArgument(f"IPC address {address!r} must start with ipc:// or tcp://")
    if path.name == "" or address == "ipc://":
        raise InvalidArgument(f"IPC address {address!r} names no socket file")
    if len(os.fsencode(str(path))) > MAX_IPC_PATH:
        raise InvalidArgument(
            f"IPC socket path {path} is {len(os.fsencode(str(path)))} bytes; the limit is {MAX_IPC_PATH}"
        )


def paused_path(path: Path) -> Path:
    """Where a daemon at its connection cap keeps its socket file, out of ``connect``'s way."""
    return path.with_name(f".{path.name}.full")


def prepare_bind(address: str) -> None:
    """Before binding: make the parent directory, and refuse if a live daemon already owns the socket.

    ZeroMQ silently replaces an existing socket file, which would steal the address from a running
    daemon; a stale file left by a crash is removed here instead.  A daemon at its connection cap
    listens under :func:`paused_path` until a connection closes, and owns the address all the same.
    """
    check_address(address)
    path = ipc_path(address)
    if path is None:
        return
    if not path.parent.exists():
        path.parent.mkdir(mode=DIR_MODE, parents=True)
    # The name again last: a daemon that resumed accepting between the first two looks is seen there.
    for candidate, paused in ((path, False), (paused_path(path), True), (path, False)):
        if _listened_on(candidate, strict=not paused):
            at_cap = (
                f" (at its connection cap, its socket file is {candidate.name} until a connection closes)"
                if paused
                else ""
            )
            raise AddressInUse(
                f"another process is serving on {address}{at_cap}; stop it or choose another --ipc address"
            )


def _listened_on(path: Path, *, strict: bool) -> bool:
    """Whether a process listens on the socket file ``path``; a stale one is removed.

    ``strict``: something there that is not a socket is an error (we would replace it by binding).
    """
    if not path.exists() and not path.is_symlink():
        return False
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        if strict:
            raise InvalidArgument(f"{path} exists and is not a socket; refusing to replace it")
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise
        log.info("removing stale IPC socket %s", path)
        path.unlink(missing_ok=True)
        return False
    finally:
        probe.close()
    return True


def secure_socket(address: str) -> None:
    """After binding: owner and group may use the socket file, nobody else; log who can reach it."""
    path = ipc_path(address)
    if path is None:
        return
    os.chmod(path, SOCKET_MODE)
    if who_may_connect(address) == "owner and group":
        log.info("IPC socket %s: its owner and group may connect", path)
    else:
        log.info(
            "IPC socket %s: only its owner may connect (directory %s is mode %o); for group access run "
            "under systemd (RuntimeDirectory=, RuntimeDirectoryMode=0750) or pass --ipc in a directory "
            "the group may traverse",
            path,
            path.parent,
            stat.S_IMODE(os.stat(path.parent).st_mode),
        )


def who_may_connect(address: str) -> str:
    """``"owner and group"`` when the socket's directory lets the group through, else ``"owner"``.

    Only the socket's own directory is looked at: the ones above it are system directories (``/run``,
    ``/tmp``, ``$XDG_RUNTIME_DIR``'s parent) in every default.  Other transports answer ``"anyone"``.
    """
    path = ipc_path(address)
    if path is None:
        return "anyone"
    if os.stat(path.parent).st_mode & stat.S_IXGRP and os.stat(path).st_mode & stat.S_IWGRP:
        return "owner and group"
    return "owner"


def socket_identity(address: str) -> tuple[int, int] | None:
    """(device, inode) of the socket file just bound, to recognise it at shutdown."""
    path = ipc_path(address)
    if path is None:
        return None
    info = os.lstat(path)
    return info.st_dev, info.st_ino


def remove_socket(address: str, identity: tuple[int, int] | None) -> None:
    """Remove our socket file at shutdown, unless another daemon has bound the path since."""
    path = ipc_path(address)
    if path is None or identity is None:
        return
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if (info.st_dev, info.st_ino) == identity:
        path.unlink(missing_ok=True)
