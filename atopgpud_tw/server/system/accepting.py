"""Accepting fairly: no local user's flood of connections holds up atop or locks it out.

Twisted's listening port accepts in a loop that grows by 20 each time it drains the
backlog, building a transport and a protocol for every connection; a process that
connects, sends a request and resets, in a loop, made that loop thousands long every
turn and filled ``--max-clients`` with dead connections.  A `FairPort` takes its turn
in the reactor's turn after the listener was readable (an atop connected is served first):

1. **Drain**: up to `DRAIN_LIMIT` connections off the backlog as bare descriptors (the
   C accept: Python's socket objects cost more than the kernel's accept and close).
2. **Reap**: one ``poll`` over them; a connection its client already closed or reset
   is closed unread (no TIME_WAIT on our side); the others wait by their peer's uid.
3. **Admit**: at most `ACCEPT_BUDGET` a turn become transports and protocols, one uid
   in turn.  A factory with ``room_for(uid, family)`` may refuse a uid (and logs it)
   before anything is built.  A user's connections beyond `PENDING_PER_UID` waiting
   are closed at once; the others wait for the next turn, checked again for a hang-up.
"""

from __future__ import annotations

import os
import select
import socket
import struct
from collections import deque
from contextlib import suppress
from typing import Any, Iterable

from twisted.internet import tcp, unix
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.posixbase import PosixReactorBase
from twisted.python.failure import Failure

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.server.system.access import SockDiag, peer_uid

#: connections a port hands to its factory per reactor turn
ACCEPT_BUDGET = 16
#: connections a port takes off the kernel's backlog per reactor turn
DRAIN_LIMIT = 1024
#: connections of one user accepted but not yet admitted; more are closed at once
PENDING_PER_UID = 64

#: closed or reset by the peer; not POLLRDHUP: a client that has only shut down
#: its sending side (``socat``, ``nc -N``) still waits for its reply
_DEAD = select.POLLHUP | select.POLLERR | select.POLLNVAL
_WATCHED = select.POLLIN | _DEAD
_LINGER_RESET = struct.pack("ii", 1, 0)
#: the socket type, by a name the ports' own `socket` attribute does not hide
Socket = socket.socket


def hung_up(fds: Iterable[int]) -> set[int]:
    """Those of the descriptors `fds` whose peer has closed or reset the connection (one poll)."""
    poller = select.poll()
    register = poller.register
    for fd in fds:
        register(fd, _WATCHED)
    return {fd for fd, events in poller.poll(0) if events & _DEAD}


def close_now(sock: socket.socket) -> None:
    """Close an accepted socket without a TCP TIME_WAIT on our side."""
    if sock.family != socket.AF_UNIX:
        with suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    sock.close()


class FairPort:
    """Mixed into Twisted's TCP and UNIX ports: their accept loop, drained, reaped
    and admitted fairly (see the module's docstring)."""

    log = ClassLogger("atopgpud_tw.accepting.FairPort")
    budget = ACCEPT_BUDGET
    drain_limit = DRAIN_LIMIT
    pending_per_uid = PENDING_PER_UID

    # what Twisted's ports have (tcp.Port)
    socket: Socket
    factory: Any
    reactor: Any
    sessionno: int
    transport: Any
    _buildAddr: Any  # noqa: N815  # Twisted's name
    _logger: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: accepted connections waiting for a turn, by uid; dict order is the round
        self._pending: dict[int | None, deque[tuple[Socket, Any]]] = {}
        self._next_turn: IDelayedCall | None = None
        #: the drain asked for by the listener's readiness, for the start of the next turn
        self._drain_call: IDelayedCall | None = None
        self._diag = SockDiag()
        #: since listening: reaped (dead), refused (by the factory), excess (`pending_per_uid`), admitted
        self.counts = {"reaped": 0, "refused": 0, "excess": 0, "admitted": 0}

    def doRead(self) -> None:  # noqa: N802  # Twisted's name
        """The listening socket is readable: its connections are taken at the start of the
        reactor's next turn (`take_turn`), once the connections readable in this one are
        served, so that an atop already connected never waits behind a drain."""
        if self._drain_call is None:
            self._drain_call = self.reactor.callLater(0, self.take_turn)

    def take_turn(self) -> None:
        self._drain_call = None
        if not self.connected or self.disconnecting:  # type: ignore[attr-defined]  # the port's
            return  # stopping: what waits in the backlog goes with the socket
        try:
            arrived = self._drain()
            if arrived:
                dead = hung_up(fd for fd, _ in arrived)
                listener = self.socket
                for fd, address in arrived:
                    if fd in dead:
                        os.close(fd)  # its peer is gone: no linger, no TIME_WAIT on our side
                    else:
                        sock = Socket(listener.family, listener.type, listener.proto, fileno=fd)
                        sock.setblocking(False)
                        self._wait(sock, address)
                self.counts["reaped"] += len(dead)
            if self._next_turn is None:
                self._admit()
        except BaseException:  # as Twisted's own accept loop: log it and go on listening
            self.log.failure("accepting connections")

    def _drain(self) -> list[tuple[int, Any]]:
        """Up to `drain_limit` connections off the backlog, each a bare descriptor and
        its address: no socket object is built for a connection reaped at once."""
        accept = self.socket._accept  # type: ignore[attr-defined]  # the C accept: (fd, address)
        arrived: list[tuple[int, Any]] = []
        append = arrived.append
        for _ in range(self.drain_limit):
            try:
                append(accept())
            except BlockingIOError:
                break
            except OSError:
                # EMFILE, ENOBUFS, a netfilter EPERM...: what Twisted's own loop does with them
                room = range(max(0, self.drain_limit - len(arrived)))
                with tcp._BuffersLogs(self._logger.namespace, self._logger.observer) as logger:
                    for sock, address in tcp._accept(logger, room, self.socket, tcp._reservedFD):
                        append((sock.detach(), address))
                break
        return arrived

    def _wait(self, sock: Socket, address: Any) -> None:
        queue = self._pending.setdefault(peer_uid(sock, self._diag), deque())
        if len(queue) >= self.pending_per_uid:
            self.counts["excess"] += 1
            close_now(sock)
            return
        queue.append((sock, address))

    def _turn(self, limit: int) -> list[tuple[int | None, Socket, Any]]:
        chosen: list[tuple[int | None, Socket, Any]] = []
        while self._pending and len(chosen) < limit:
            for uid in list(self._pending):
                queue = self._pending.pop(uid)
                chosen.append((uid, *queue.popleft()))
                if queue:
                    self._pending[uid] = queue  # to the end of the round
                if len(chosen) == limit:
                    break
        return chosen

    def _admit(self) -> None:
        self._next_turn = None
        room_for = getattr(self.factory, "room_for", None)
        admitted = 0
        while admitted < self.budget and self._pending:
            chosen = self._turn(self.budget - admitted)
            dead = hung_up(sock.fileno() for _, sock, _ in chosen)
            for uid, sock, address in chosen:
                if sock.fileno() in dead:
                    self.counts["reaped"] += 1
                    close_now(sock)
                elif room_for is not None and not room_for(uid, sock.family):
                    self.counts["refused"] += 1
                    close_now(sock)
                else:
                    admitted += 1
                    self._connect(sock, address)
        if self._pending and self.connected:  # type: ignore[attr-defined]  # the port's
            self._next_turn = self.reactor.callLater(0, self._turn_again)

    def _turn_again(self) -> None:
        try:
            self._admit()
        except BaseException:
            self.log.failure("accepting connections")

    def _connect(self, sock: Socket, address: Any) -> None:
        """What Twisted's accept loop does with each connection it accepts."""
        self.counts["admitted"] += 1
        if isinstance(address, tuple) and len(address) == 4:  # IPv6: keep the scope id
            host = socket.getnameinfo(address, socket.NI_NUMERICHOST | socket.NI_NUMERICSERV)
            address = (host[0], *address[1:])
        protocol = self.factory.buildProtocol(self._buildAddr(address))
        if protocol is None:
            sock.close()
            return
        session = self.sessionno
        self.sessionno = session + 1
        transport = self.transport(sock, protocol, address, self, session, self.reactor)
        protocol.makeConnection(transport)

    def connectionLost(self, reason: Failure) -> None:  # noqa: N802  # Twisted's name
        self.stop_admitting()
        super().connectionLost(reason)  # type: ignore[misc]  # the port's own

    def stop_admitting(self) -> None:
        for call in (self._next_turn, self._drain_call):
            if call is not None and call.active():
                call.cancel()
        self._next_turn = self._drain_call = None
        for queue in self._pending.values():
            for sock, _ in queue:
                sock.close()
        self._pending.clear()
        self._diag.close()


class FairTCPPort(FairPort, tcp.Port):
    """A TCP port that accepts fairly."""


class FairUNIXPort(FairPort, unix.Port):
    """A UNIX port (filesystem or abstract) that accepts fairly."""


class _FairReactor:
    """A reactor whose listenTCP and listenUNIX make fair ports; the rest is the reactor's."""

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reactor, name)

    def listenTCP(self, port: int, factory: Any, backlog: int = 50, interface: str = "") -> Any:  # noqa: N802
        listening = FairTCPPort(port, factory, backlog, interface, self._reactor)
        listening.startListening()
        return listening

    def listenUNIX(  # noqa: N802  # Twisted's name
        self, address: Any, factory: Any, backlog: int = 50, mode: int = 0o666, wantPID: int = 0  # noqa: N803
    ) -> Any:
        listening = FairUNIXPort(address, factory, backlog, mode, self._reactor, wantPID)
        listening.startListening()
        return listening


def fair_reactor(reactor: Any) -> Any:
    """`reactor` for endpoints to listen with, on fair ports where it is Twisted's POSIX reactor."""
    if isinstance(reactor, PosixReactorBase):
        return _FairReactor(reactor)
    return reactor
