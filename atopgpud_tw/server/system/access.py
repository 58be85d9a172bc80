"""Who may connect: peer credentials of UNIX-socket clients, and bursts of refusals.

An abstract socket has no file permissions: any local process in the same network
namespace can connect and see every GPU process.  With ``--allow-uid``/``--allow-gid``
a UNIX client (atop's or ``--metrics``') is accepted only if SO_PEERCRED's uid, or its
primary or a supplementary group (SO_PEERGROUPS: those it had when it connected; /proc,
which ``ProtectProc=invisible`` hides, before Linux 4.13) is listed.  TCP clients carry
no credentials; a local one's socket owner (`SockDiag`) counts only its user's slots.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import connectionDone
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import BurstLog

_UCRED = struct.Struct("3i")
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13; not named in Python 3.11
_GID = struct.Struct("I")
_NGROUPS_MAX = 65536
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NLMSG_HEADER = struct.Struct("=IHHII")
#: inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid
_REQUEST = struct.Struct("=BBBxI")
#: inet_diag_sockid: ports (big-endian), addresses (16 bytes each), interface, cookie
_SOCKID = struct.Struct("!HH16s16s")
_SOCKID_TAIL = struct.Struct("=III")
_NO_COOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
#: inet_diag_msg: family, state, timer, retrans, sockid (48), expires, rqueue, wqueue, uid, inode
_REPLY = struct.Struct("=BBBB48sIIIII")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gids: frozenset[int]


def peer_of(transport: Any) -> Peer | None:
    """The credentials of a UNIX-socket peer; None for other transports."""
    try:
        handle = transport.getHandle()
        if handle.family != socket.AF_UNIX:
            return None
        pid, uid, gid = _ucred(handle)
    except (AttributeError, OSError):
        return None
    groups = _peer_groups(handle)
    if groups is None:
        groups = _proc_groups(pid)
    return Peer(pid, uid, frozenset({gid}) | groups)


def _ucred(sock: socket.socket) -> tuple[int, int, int]:
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def peer_uid(sock: socket.socket, diag: Any = None) -> int | None:
    """The uid of a connected socket's peer: SO_PEERCRED's on a UNIX socket; on
    TCP, with a `SockDiag`, the owner of a client's socket on this host;
    else None."""
    try:
        if sock.family == socket.AF_UNIX:
            return _ucred(sock)[1]
        return None if diag is None else diag.owner(sock.getsockname(), sock.getpeername())
    except OSError:
        return None


def socket_of(transport: Any) -> socket.socket | None:
    """A transport's socket, under any that wrap it (TLS); None for one without (a test's)."""
    while transport is not None:
        try:
            handle = transport.getHandle()
        except (AttributeError, NotImplementedError):
            handle = None
        if isinstance(handle, socket.socket):
            return handle
        transport = getattr(transport, "transport", None)
    return None


def peer_key(transport: Any, diag: Any) -> str:
    """Whom a client's share of a bounded thing is counted to: its address (every UNIX-socket client's is
    "local") and, for a client on this host, the uid that owns its socket, so that one local user's flood
    takes no share of another user's on the same address."""
    address = str(getattr(transport.getPeer(), "host", None) or "local")
    handle = socket_of(transport)
    uid = None if handle is None else peer_uid(handle, diag)
    return address if uid is None else f"{address} (uid {uid})"


def peer_name(transport: Any) -> str:
    return address_name(transport.getPeer())


def address_name(peer: Any) -> str:
    """A client's address (an `IAddress`) as the log names it: its host, or its socket's name."""
    return str(getattr(peer, "host", None) or getattr(peer, "name", None) or "a local client")


def _peer_groups(handle: socket.socket) -> frozenset[int] | None:
    """The peer's supplementary groups (SO_PEERGROUPS); None where the kernel has none."""
    for size in (64, _NGROUPS_MAX):
        try:
            raw = handle.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size * _GID.size)
        except OSError as error:
            if error.errno == errno.ERANGE:
                continue  # more than 64 groups: ask again with room for all
            return None
        return frozenset(gid for (gid,) in _GID.iter_unpack(raw[: len(raw) - len(raw) % _GID.size]))
    return None


def _proc_groups(pid: int) -> frozenset[int]:
    with suppress(OSError, ValueError), open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
        for line in status:
            if line.startswith("Groups:"):
                return frozenset(int(g) for g in line.split()[1:])
    return frozenset()


@dataclass(frozen=True)
class AllowList:
    """uids and gids allowed on UNIX sockets; empty means everyone."""

    uids: frozenset[int] = field(default_factory=frozenset)
    gids: frozenset[int] = field(default_factory=frozenset)

    @property
    def restricts(self) -> bool:
        return bool(self.uids or self.gids)

    def admits(self, peer: Peer | None) -> bool:
        """Whether a client may stay; TCP peers (no credentials) always may."""
        if not self.restricts or peer is None:
            return True
        return peer.uid == 0 or peer.uid in self.uids or bool(peer.gids & self.gids)


class Gate:
    """The allow-list where clients connect, its refusals logged once per burst."""

    log = ClassLogger("atopgpud_tw.access.Gate")

    def __init__(self, allow: AllowList, clock: IReactorTime, where: str = "") -> None:
        self.allow = allow
        self.where = where
        self._refused = BurstLog(clock)

    def admits(self, transport: Any) -> bool:
        if not self.allow.restricts:
            return True
        peer = peer_of(transport)
        if self.allow.admits(peer):
            return True
        self._refuse(peer.uid if peer else None)
        return False

    def refuses_uid(self, uid: int) -> bool:
        """Whether a UNIX client of `uid` is refused whatever its groups (logged as
        `admits` logs it); False where its groups could still admit it."""
        if self.allow.gids or self.allow.admits(Peer(0, uid, frozenset())):
            return False
        self._refuse(uid)
        return True

    def _refuse(self, uid: int | None) -> None:
        self._refused.event(
            lambda: self.log.warn(
                "refusing a client with uid {uid}{where}: not in --allow-uid/--allow-gid", uid=uid, where=self.where
            ),
            "clients refused (--allow-uid/--allow-gid)",
        )

    def stop(self) -> None:
        self._refused.stop()


class _GatedProtocol(ProtocolWrapper):
    """Passes a connection on only if the gate admits it; others are closed unread."""

    admitted = False

    def makeConnection(self, transport: Any) -> None:
        if self.factory.gate.admits(transport):
            self.admitted = True
            super().makeConnection(transport)
        else:
            transport.loseConnection()

    def dataReceived(self, data: bytes) -> None:
        if self.admitted:
            super().dataReceived(data)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if self.admitted:
            super().connectionLost(reason)


class GatedFactory(WrappingFactory):
    """Another service's factory (the metrics site) behind a `Gate`."""

    protocol = _GatedProtocol
    noisy = False

    def __init__(self, wrapped: Any, gate: Gate) -> None:
        super().__init__(wrapped)
        self.gate = gate

    def buildProtocol(self, addr: Any) -> Any:
        inner = self.wrappedFactory.buildProtocol(addr)
        if inner is None:  # the site is full
            return None
        return _GatedProtocol(self, inner)  # type: ignore[arg-type]  # WrappingFactory's generic is its protocol

    def doStop(self) -> None:
        self.gate.stop()
        super().doStop()


class SockDiag:
    """The uid owning a local TCP client's socket: the ``idiag_uid`` of one ``SOCK_DIAG_BY_FAMILY``
    request over netlink (as ``ss`` asks) for the socket whose four-tuple is the peer's, nothing read
    from /proc.  None where netlink is refused (``RestrictAddressFamilies=``) or the socket is not
    found (a remote client, or one gone).  One netlink socket, opened when first asked and kept."""

    def __init__(self) -> None:
        self._socket: socket.socket | None = None
        self._refused = False
        self._sequence = 0

    def owner(self, local: tuple, peer: tuple) -> int | None:
        """The uid of the socket at `peer` connected to `local` (getsockname, getpeername
        of the accepted socket); None if it cannot be told, or the peer is not on this host."""
        query = _sockid(peer, local)
        if query is None or self._refused:
            return None
        family, sockid = query
        self._sequence = (self._sequence + 1) & 0xFFFFFFFF
        body = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, _ALL_STATES) + sockid
        message = _NLMSG_HEADER.pack(
            _NLMSG_HEADER.size + len(body), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, self._sequence, 0
        ) + body
        try:
            sock = self._open()
            sock.send(message)
            while True:
                reply = sock.recv(8192, socket.MSG_DONTWAIT)
                length, kind, _, sequence, _ = _NLMSG_HEADER.unpack_from(reply)
                if sequence == self._sequence:
                    break  # an answer to an earlier query that timed out is skipped
        except OSError:
            return None
        if kind == _NLMSG_ERROR or len(reply) < _NLMSG_HEADER.size + _REPLY.size:
            return None
        return int(_REPLY.unpack_from(reply, _NLMSG_HEADER.size)[8])

    def _open(self) -> socket.socket:
        if self._socket is None:
            try:
                self._socket = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
            except OSError:
                self._refused = True
                raise
        return self._socket

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _sockid(source: tuple, destination: tuple) -> tuple[int, bytes] | None:
    """The family and inet_diag_sockid of the socket bound to `source`, connected to `destination`;
    None unless `source` is on this host: on loopback, or at the address it connected to."""
    try:
        src, dst = ipaddress.ip_address(source[0].split("%")[0]), ipaddress.ip_address(destination[0].split("%")[0])
    except ValueError:
        return None
    if not (src.is_loopback or source[0] == destination[0]):
        return None
    if isinstance(src, ipaddress.IPv6Address) and src.ipv4_mapped and isinstance(dst, ipaddress.IPv6Address):
        # a v4 client on a dual-stack listener: its own socket is an AF_INET one
        src, dst = src.ipv4_mapped, dst.ipv4_mapped or dst
    if src.version != dst.version:
        return None
    family = socket.AF_INET if src.version == 4 else socket.AF_INET6
    sockid = _SOCKID.pack(source[1], destination[1], src.packed.ljust(16, b"\0"), dst.packed.ljust(16, b"\0"))
    return family, sockid + _SOCKID_TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
