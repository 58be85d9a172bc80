"""The connection: cut two-byte requests from the stream and write their replies.

Requests may arrive split over reads or several in one read; each is answered in
order.  The first is answered at once, the others one per turn (`turns.Turns`),
so that no client's flood of requests keeps another's waiting.  An unknown
command closes that connection only (after the replies already written), with
one log line.  The protocol never calls a reader: it serves what the `Board`
holds.

Every connection is bounded (`Limits`): the number of clients, and of one user's
clients (the uid of a UNIX client, or of a TCP client on this host; TCP clients
whose uid cannot be told share one count), the reply bytes a client may leave
unread, how long it may stay silent, and, on UNIX sockets, who may connect at
all (`access.AllowList`).  The factory provides `accepting.IAdmission`, so a
fair port refuses a user whose share is taken before it builds a connection.
"""

from __future__ import annotations

import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, cast

from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Factory, Protocol
from twisted.protocols.policies import TimeoutMixin
from zope.interface import implementer

from atopgpud_tw import codec
from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import BurstLog
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.exits import ClientQueue
from atopgpud_tw.server.atop.turns import Turns
from atopgpud_tw.server.system.accepting import IAdmission
from atopgpud_tw.server.system.access import AllowList, Gate, peer_name, peer_uid
from atopgpud_tw.server.system.sockdiag import SockDiag


@dataclass(frozen=True)
class Limits:
    """What one client, and all of them, may take."""

    max_clients: int = 256
    #: clients of one uid at once; None: three quarters of `max_clients`, so that
    #: a quarter is always left to other users
    max_clients_per_uid: int | None = None
    #: reply bytes a client may leave unread beyond the transport's own buffer
    max_unsent: int = 1024 * 1024
    #: seconds a new connection may take to send its first request
    first_request_timeout: float = 60.0
    #: seconds a client may stay silent between requests (atop asks every
    #: interval; its logging mode asks every 10 minutes)
    idle_timeout: float = 3 * 3600.0
    allow: AllowList = field(default_factory=AllowList)

    @property
    def uid_share(self) -> int:
        """The clients one uid may have connected at once."""
        if self.max_clients_per_uid is not None:
            return min(self.max_clients_per_uid, self.max_clients)
        return max(1, self.max_clients - self.max_clients // 4)


#: request bytes a client may send ahead of its turns before it is no longer read
MAX_PENDING = 64 * 1024


@implementer(IPushProducer)
class AtopGpuProtocol(Protocol, TimeoutMixin):
    """One client connection (atop keeps one open and asks every interval)."""

    log = ClassLogger("atopgpud_tw.protocol.AtopGpuProtocol")
    factory: AtopGpuFactory
    #: a connected stream transport (TCP or UNIX): also an IPushProducer's consumer
    transport: Any

    def __init__(self) -> None:
        self._buffer = b""
        #: where the first request not yet answered starts in `_buffer`
        self._start = 0
        self._reading_paused = False
        self._closing = False
        self._paused = False
        self._backlog = 0
        self.queue: ClientQueue | None = None

    # -- connection --

    def connectionMade(self) -> None:
        factory = self.factory
        if not factory.admit(self):
            self._closing = True
            self.transport.abortConnection()
            return
        self.setTimeout(factory.limits.first_request_timeout)
        self.queue = factory.board.attach()
        self.transport.registerProducer(self, True)

    def callLater(self, period: float, func: Callable[[], object]) -> IDelayedCall:  # noqa: N802
        """TimeoutMixin's timer, on the factory's clock."""
        return self.factory.clock.callLater(period, func)

    def connectionLost(self, reason: object = None) -> None:
        self.setTimeout(None)
        self._closing = True
        self.factory.forget(self)
        if self.queue is not None:
            self.factory.board.detach(self.queue)
            self.queue = None

    def timeoutConnection(self) -> None:
        self.log.info("closing idle connection from {peer}", peer=self._peer())
        self._closing = True
        self.transport.loseConnection()

    # -- requests --

    def dataReceived(self, data: bytes) -> None:
        """Queue the stream's requests; answer the first now if none was waiting.

        The rest are answered one per turn (`serve_one`), each written as soon
        as it is made, so the transport can say (pauseProducing) when the client
        stops reading, before a flood of requests turns into a flood of
        buffered replies.
        """
        if self._closing:
            return
        if self._start:
            self._buffer = self._buffer[self._start :]
            self._start = 0
        self._buffer += data
        turns = self.factory.turns
        if len(self._buffer) > MAX_PENDING and not self._reading_paused:
            # a client far ahead of its turns: stop reading from it until it is not
            self._reading_paused = True
            self.transport.pauseProducing()
        if len(self._buffer) < codec.REQUEST_SIZE or turns.waiting(self):
            return
        if self.serve_one():
            turns.queue(self)

    def serve_one(self) -> bool:
        """Answer the first request in the buffer; whether a whole one is left after it."""
        size = codec.REQUEST_SIZE
        start = self._start
        if self._closing or len(self._buffer) - start < size:
            return False
        data = self._buffer[start : start + size]
        self._start = start = start + size
        if self._reading_paused and len(self._buffer) - start <= MAX_PENDING // 2:
            self._reading_paused = False
            self.transport.resumeProducing()
        assert self.queue is not None  # set at connectionMade, before any data
        try:
            reply = self.factory.board.reply(codec.parse_request(data), self.queue)
        except codec.ProtocolError as error:
            self.log.warn("closing connection from {peer}: {error}", peer=self._peer(), error=str(error))
            self._buffer, self._start = b"", 0
            self._closing = True
            self.transport.loseConnection()
            return False
        self._write(reply)
        if self._closing:
            return False
        self.setTimeout(self.factory.limits.idle_timeout)
        return len(self._buffer) - start >= size

    def _write(self, reply: bytes) -> None:
        if self._paused:
            self._backlog += len(reply)
            if self._backlog > self.factory.limits.max_unsent:
                self.log.warn(
                    "closing connection from {peer}: {size} bytes of replies left unread",
                    peer=self._peer(),
                    size=self._backlog,
                )
                self._closing = True
                self.transport.abortConnection()
                return
        self.transport.write(reply)

    # -- IPushProducer: the transport tells us when the client stops reading --

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._backlog = 0

    def stopProducing(self) -> None:
        self._closing = True

    def _peer(self) -> str:
        return peer_name(self.transport)


@implementer(IAdmission)
class AtopGpuFactory(Factory):
    """Makes a protocol per connection, all serving one Board, within `Limits`."""

    protocol = AtopGpuProtocol  # type: ignore[assignment]  # Twisted types it as a callable
    noisy = False
    log = ClassLogger("atopgpud_tw.protocol.AtopGpuFactory")

    def __init__(self, board: Board, limits: Limits | None = None, clock: IReactorTime | None = None) -> None:
        if clock is None:
            from twisted.internet import reactor

            clock = cast(IReactorTime, reactor)
        self.board = board
        self.limits = limits or Limits()
        self.clock = clock
        self.connections: dict[AtopGpuProtocol, int | None] = {}
        #: connections per uid (None: TCP clients whose uid cannot be told)
        self.per_uid: Counter[int | None] = Counter()
        self.turns = Turns(clock)
        self._refused_full = BurstLog(clock)
        self._refused_share = BurstLog(clock)
        self.gate = Gate(self.limits.allow, clock)
        self._diag = SockDiag()

    def room_for(self, uid: int | None, family: int) -> bool:
        """Whether a connection of `uid` may be admitted now (`IAdmission`); refusals
        are logged once per burst."""
        if len(self.connections) >= self.limits.max_clients:
            self._refused_full.event(
                lambda: self.log.warn(
                    "refusing connections: {count} clients connected (--max-clients)",
                    count=len(self.connections),
                ),
                "connections refused (--max-clients)",
            )
            return False
        if self.per_uid[uid] >= self.limits.uid_share:
            self._refused_share.event(
                lambda: self.log.warn(
                    "refusing connections of {who}: {count} connected, its share of --max-clients "
                    "(--max-clients-per-uid)",
                    who=f"uid {uid}" if uid is not None else "TCP clients of unknown uid",
                    count=self.per_uid[uid],
                ),
                "connections refused (--max-clients-per-uid)",
            )
            return False
        if family == socket.AF_UNIX and uid is not None and self.gate.refuses_uid(uid):
            return False
        return True

    def admit(self, protocol: AtopGpuProtocol) -> bool:
        """Whether a new connection may stay; refusals are logged once per burst."""
        handle = _handle(protocol.transport)
        uid = peer_uid(handle, self._diag) if handle is not None else None
        family = handle.family if handle is not None else socket.AF_INET
        if not self.room_for(uid, family):
            return False
        if not self.gate.admits(protocol.transport):
            return False
        self.connections[protocol] = uid
        self.per_uid[uid] += 1
        return True

    def forget(self, protocol: AtopGpuProtocol) -> None:
        if protocol in self.connections:
            uid = self.connections.pop(protocol)
            self.per_uid[uid] -= 1
            if not self.per_uid[uid]:
                del self.per_uid[uid]
        self.turns.forget(protocol)

    def stopFactory(self) -> None:
        self.turns.stop()
        self._refused_full.stop()
        self._refused_share.stop()
        self.gate.stop()
        self._diag.close()


def _handle(transport: Any) -> socket.socket | None:
    """A transport's socket; None for one without (a test's StringTransport)."""
    try:
        handle = transport.getHandle()
    except (AttributeError, NotImplementedError):
        return None
    return handle if isinstance(handle, socket.socket) else None

