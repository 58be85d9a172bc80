"""The uid owning a local TCP client's socket, from the kernel's socket diagnostics.

A TCP connection carries no credentials, but when the client is on this host
its socket is in this network namespace, and the kernel says who owns it: one
``SOCK_DIAG_BY_FAMILY`` request over netlink (``NETLINK_SOCK_DIAG``, what ``ss``
uses), asking for the one socket whose four-tuple is the peer's (not a dump of
them all).  The answer's ``idiag_uid`` is the uid that created the socket.
Nothing is read from /proc (which ``ProtectProc=invisible`` hides).  Where
netlink is not allowed (``RestrictAddressFamilies=`` without ``AF_NETLINK``) or
the socket is not found (a remote client, or one already gone), the answer is
None.
"""

from __future__ import annotations

import ipaddress
import socket
import struct

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


class SockDiag:
    """One netlink socket, opened when first asked and kept; None where netlink is refused."""

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
