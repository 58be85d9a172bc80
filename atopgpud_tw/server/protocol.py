"""The connection: cut two-byte requests from the stream and write their replies.

Requests may arrive split over reads or several in one read; each is answered in
order.  The first is answered at once, the others one per turn (`turns.Turns`),
so that no client's flood of requests keeps another's waiting.  An unknown
command closes that connection only (after the replies already written), with
one log line.  The protocol never calls a reader: it serves what the `Board`
holds.

Every connection is bounded (`Limits`): the number of clients, the reply bytes a
client may leave unread, how long it may stay silent, and, on UNIX sockets, who
may connect at all (`access.AllowList`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, cast

from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Factory, Protocol
from twisted.protocols.policies import TimeoutMixin
from zope.interface import implementer

from atopgpud_tw import codec
from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import BurstLog
from atopgpud_tw.server.access import AllowList, Gate, peer_name
from atopgpud_tw.server.board import Board, ClientQueue
from atopgpud_tw.server.turns import Turns


@dataclass(frozen=True)
class Limits:
    """What one client, and all of them, may take."""

    max_clients: int = 256
    #: reply bytes a client may leave unread beyond the transport's own buffer
    max_unsent: int = 1024 * 1024
    #: seconds a new connection may take to send its first request
    first_request_timeout: float = 60.0
    #: seconds a client may stay silent between requests (atop asks every
    #: interval; its logging mode asks every 10 minutes)
    idle_timeout: float = 3 * 3600.0
    allow: AllowList = field(default_factory=AllowList)


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
        try:
            request = codec.parse_request(data)
        except codec.ProtocolError as error:
            self.log.warn("closing connection from {peer}: {error}", peer=self._peer(), error=str(error))
            self._buffer, self._start = b"", 0
            self._closing = True
            self.transport.loseConnection()
            return False
        assert self.queue is not None  # set at connectionMade, before any data
        self._write(self.factory.board.reply(request, self.queue))
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
        self.connections: set[AtopGpuProtocol] = set()
        self.turns = Turns(clock)
        self._refused_full = BurstLog(clock)
        self.gate = Gate(self.limits.allow, clock)

    def admit(self, protocol: AtopGpuProtocol) -> bool:
        """Whether a new connection may stay; refusals are logged once per burst."""
        if len(self.connections) >= self.limits.max_clients:
            self._refused_full.event(
                lambda: self.log.warn(
                    "refusing connections: {count} clients connected (--max-clients)",
                    count=len(self.connections),
                ),
                "connections refused (--max-clients)",
            )
            return False
        if not self.gate.admits(protocol.transport):
            return False
        self.connections.add(protocol)
        return True

    def forget(self, protocol: AtopGpuProtocol) -> None:
        self.connections.discard(protocol)
        self.turns.forget(protocol)

    def stopFactory(self) -> None:
        self.turns.stop()
        self._refused_full.stop()
        self.gate.stop()

