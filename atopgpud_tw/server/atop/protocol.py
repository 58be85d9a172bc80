"""The connection: cut two-byte requests from the stream and write their replies.

Requests may arrive split over reads or several in one read; each is answered in
order: the first at once, the others one per connection in turn (each connection
a task of the factory's `Cooperator`), so that no client's flood keeps another
waiting.  An unknown command closes that connection only, with one log line.

Every connection is bounded (`Limits`): the clients, and one user's (the uid of a
UNIX client, or of a TCP client on this host; other TCP clients share one count),
the reply bytes left unread, the time silent, and, on UNIX sockets, who may
connect (`access.AllowList`).  A fair port asks the factory (`room_for`) before it
builds a connection.  Root and each ``--allow-uid`` user have slots kept that no
other uid can take, however many uids an attacker controls; the rest are shared,
one uid taking at most its share.  When the shared slots are all taken, a uid
holding less than an even part of them gets the longest-silent connection of the
uid holding the most, and connections silent for ``--busy-idle-timeout`` are closed.
"""

from __future__ import annotations

import socket
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, cast

from twisted.internet.interfaces import IDelayedCall, IPushProducer, IReactorTime
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.task import CooperativeTask, Cooperator, SchedulerStopped, TaskFinished, TaskStopped
from twisted.protocols.policies import TimeoutMixin
from twisted.python.failure import Failure
from zope.interface import implementer

from atopgpud_tw import codec
from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import UidBurstLogs
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.clients import ClientQueue
from atopgpud_tw.server.system.access import AllowList, Gate, SockDiag, peer_name, peer_uid, socket_of


@dataclass(frozen=True)
class Limits:
    """What one client, and all of them, may take."""

    max_clients: int = 256
    #: clients of one uid in the shared slots; None: three quarters, a quarter left to others
    max_clients_per_uid: int | None = None
    #: slots kept for root and for each --allow-uid user, which no other uid can take
    reserved_clients: int = 8
    #: reply bytes a client may leave unread beyond the transport's own buffer
    max_unsent: int = 1024 * 1024
    #: seconds a new connection may take to send its first request
    first_request_timeout: float = 60.0
    #: seconds a client may stay silent between requests (atop's logging mode asks every 10 min)
    idle_timeout: float = 3 * 3600.0
    #: seconds a client may stay silent while the shared slots are all taken
    busy_idle_timeout: float = 60.0
    allow: AllowList = field(default_factory=AllowList)

    @property
    def privileged(self) -> frozenset[int]:
        return frozenset({0}) | self.allow.uids

    @property
    def reserve(self) -> int:
        """The slots kept for each privileged uid: at most half of `max_clients` in all, at least one."""
        return max(1, min(self.reserved_clients, self.max_clients // 2 // len(self.privileged)))

    @property
    def shared(self) -> int:
        return max(1, self.max_clients - self.reserve * len(self.privileged))

    @property
    def uid_share(self) -> int:
        if self.max_clients_per_uid is not None:
            return min(self.max_clients_per_uid, self.shared)
        return max(1, self.shared - self.shared // 4)

    def kept_for(self, uid: int | None) -> int:
        return self.reserve if uid in self.privileged else 0


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
        #: serving the requests queued beyond a read's first, one per turn
        self._turns: CooperativeTask | None = None
        #: when the client last asked (or connected), on the factory's clock
        self.last_asked = 0.0

    def connectionMade(self) -> None:
        factory = self.factory
        if not factory.admit(self):
            self.give_up_slot()
            return
        self.setTimeout(factory.limits.first_request_timeout)
        self.last_asked = factory.clock.seconds()
        self.queue = factory.board.attach()
        self.transport.registerProducer(self, True)

    def callLater(self, period: float, func: Callable[[], object]) -> IDelayedCall:  # noqa: N802
        """TimeoutMixin's timer, on the factory's clock."""
        return self.factory.clock.callLater(period, func)

    def connectionLost(self, reason: object = None) -> None:
        self.setTimeout(None)
        self._closing = True
        if self._turns is not None:
            with suppress(TaskFinished):  # the factory stopped
                self._turns.stop()
        self.factory.forget(self)
        if self.queue is not None:
            self.factory.board.detach(self.queue)
            self.queue = None

    def timeoutConnection(self) -> None:
        self.log.info("closing idle connection from {peer}", peer=peer_name(self.transport))
        self._closing = True
        self.transport.loseConnection()

    def give_up_slot(self) -> None:
        """Close at once: refused, or for another client (the factory has forgotten it)."""
        self.setTimeout(None)
        self._closing = True
        self.transport.abortConnection()

    def dataReceived(self, data: bytes) -> None:
        """Queue the stream's requests; answer the first now if none was waiting, the rest
        one per turn, each written as it is made, so that the transport can say (pauseProducing)
        that the client stopped reading before a flood of requests is one of buffered replies."""
        if self._closing:
            return
        if self._start:
            self._buffer = self._buffer[self._start :]
            self._start = 0
        self._buffer += data
        if len(self._buffer) > MAX_PENDING and not self._reading_paused:
            # a client far ahead of its turns: stop reading from it until it is not
            self._reading_paused = True
            self.transport.pauseProducing()
        if len(self._buffer) < codec.REQUEST_SIZE or self._turns is not None:
            return
        if self.serve_one():
            self._turns = self.factory.cooperator.cooperate(self._serve_in_turn())
            self._turns.whenDone().addErrback(self._turn_failed)

    def _serve_in_turn(self) -> Iterator[None]:
        try:
            while self.serve_one():
                yield None
        finally:
            self._turns = None

    def _turn_failed(self, failure: Failure) -> None:
        """A queued request whose answer raised: logged, and the connection closed (as Twisted does
        for one answered in `dataReceived`), not left waiting for a turn that never comes."""
        if failure.check(TaskStopped, SchedulerStopped):
            return  # the connection closed, or the factory stopped
        self.log.failure("closing connection from {peer}: a queued request failed", failure,
                         peer=peer_name(self.transport))
        self._closing = True
        self.transport.loseConnection()

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
            self.log.warn("closing connection from {peer}: {error}", peer=peer_name(self.transport), error=str(error))
            self._buffer, self._start = b"", 0
            self._closing = True
            self.transport.loseConnection()
            return False
        self._write(reply)
        if self._closing:
            return False
        self.last_asked = self.factory.clock.seconds()
        self.setTimeout(self.factory.limits.idle_timeout)
        return len(self._buffer) - start >= size

    def _write(self, reply: bytes) -> None:
        if self._paused:
            self._backlog += len(reply)
            if self._backlog > self.factory.limits.max_unsent:
                self.log.warn(
                    "closing connection from {peer}: {size} bytes of replies left unread",
                    peer=peer_name(self.transport),
                    size=self._backlog,
                )
                self._closing = True
                self.transport.abortConnection()
                return
        self.transport.write(reply)

    def pauseProducing(self) -> None:
        self._paused = True

    def resumeProducing(self) -> None:
        self._paused = False
        self._backlog = 0

    def stopProducing(self) -> None:
        self._closing = True


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
        #: shared slots taken (connections beyond each uid's kept slots)
        self.shared_taken = 0
        self.cooperator = Cooperator(scheduler=lambda step: clock.callLater(0, step))
        self._refused = UidBurstLogs(clock)
        self._closed_for_room = UidBurstLogs(clock)
        self._last_sweep = float("-inf")
        self.gate = Gate(self.limits.allow, clock)
        self._diag = SockDiag()

    def _in_shared(self, uid: int | None, count: int) -> int:
        return max(0, count - self.limits.kept_for(uid))

    def room_for(self, uid: int | None, family: int) -> bool:
        """Whether a connection of `uid` may be admitted now (asked by a fair port), making room
        for it if it is owed some; refusals are logged once per uid and burst."""
        if family == socket.AF_UNIX and uid is not None and self.gate.refuses_uid(uid):
            return False
        limits = self.limits
        count = self.per_uid[uid]
        if count >= limits.kept_for(uid):  # it needs a shared slot
            held = count - limits.kept_for(uid)
            if held >= limits.uid_share:
                self._refuse(uid, lambda: f"{held} connected, its share of the shared slots (--max-clients-per-uid)")
                return False
            if self.shared_taken >= limits.shared and not self._make_room(uid, held):
                self._refuse(uid, lambda: f"the {limits.shared} shared slots are taken ({self._holders()}; "
                                          "--max-clients)")
                return False
        return True

    def _refuse(self, uid: int | None, why: Callable[[], str]) -> None:
        """Log a refusal of `uid` once per burst; `why` is only worked out for the line."""
        who = _who(uid)
        self._refused.event(
            uid,
            lambda: self.log.warn("refusing connections of {who}: {why}", who=who, why=why()),
            f"connections of {who} refused",
        )

    def _holders(self, most: int = 3) -> str:
        top = Counter({uid: self._in_shared(uid, n) for uid, n in self.per_uid.items()}).most_common(most)
        return ", ".join(f"{'uid ' + str(uid) if uid is not None else 'unknown uid'} holds {n}" for uid, n in top if n)

    def _make_room(self, uid: int | None, held: int) -> bool:
        """With every shared slot taken: close the connections silent for
        --busy-idle-timeout (at most once a second); else, if `uid` holds less than an
        even part of the shared slots, the longest-silent one of the uid holding the
        most.  Whether a shared slot is free now."""
        now = self.clock.seconds()
        if now - self._last_sweep >= 1.0:
            self._last_sweep = now
            cutoff = now - self.limits.busy_idle_timeout
            for protocol in [p for p in self._shared_connections() if p.last_asked < cutoff]:
                self._close_for_room(protocol, "silent for more than {timeout:g} s while the shared slots "
                                               "are all taken (--busy-idle-timeout)")
            if self.shared_taken < self.limits.shared:
                return True
        shared = {u: self._in_shared(u, n) for u, n in self.per_uid.items()}
        holders = sum(1 for n in shared.values() if n) + (0 if held else 1)
        even = self.limits.shared // holders
        biggest = max(shared, key=lambda u: shared[u])
        if held >= even or shared[biggest] <= held + 1:
            return False
        silent = min((p for p in self._shared_connections() if self.connections[p] == biggest),
                     key=lambda p: p.last_asked)
        self._close_for_room(silent, "its uid holds more than an even part of the shared slots, "
                                     "and another uid less (--max-clients)")
        return True

    def _shared_connections(self) -> list[AtopGpuProtocol]:
        """The connections in shared slots: for a uid with kept slots, all but its
        most recently asking ones."""
        by_uid: dict[int | None, list[AtopGpuProtocol]] = {}
        for protocol, uid in self.connections.items():
            by_uid.setdefault(uid, []).append(protocol)
        shared = []
        for uid, protocols in by_uid.items():
            kept = self.limits.kept_for(uid)
            if kept:
                protocols.sort(key=lambda p: p.last_asked, reverse=True)
            shared.extend(protocols[kept:])
        return shared

    def _close_for_room(self, protocol: AtopGpuProtocol, why: str) -> None:
        uid = self.connections[protocol]
        who = _who(uid)
        self._closed_for_room.event(
            uid,
            lambda: self.log.warn("closing a connection of {who} to make room: " + why, who=who,
                                  timeout=self.limits.busy_idle_timeout),
            f"connections of {who} closed to make room",
        )
        self.forget(protocol)
        protocol.give_up_slot()

    def admit(self, protocol: AtopGpuProtocol) -> bool:
        """Whether a new connection may stay; refusals are logged once per uid and burst."""
        handle = socket_of(protocol.transport)
        uid = peer_uid(handle, self._diag) if handle is not None else None
        family = handle.family if handle is not None else socket.AF_INET
        if not (self.room_for(uid, family) and self.gate.admits(protocol.transport)):
            return False
        self.take_slot(protocol, uid)
        return True

    def take_slot(self, protocol: AtopGpuProtocol, uid: int | None) -> None:
        self.connections[protocol] = uid
        self._count(uid, 1)

    def forget(self, protocol: AtopGpuProtocol) -> None:
        if protocol in self.connections:
            self._count(self.connections.pop(protocol), -1)

    def _count(self, uid: int | None, step: int) -> None:
        """A connection of `uid` more or less: in one of its kept slots, else a shared one."""
        count = self.per_uid[uid]
        self.shared_taken += self._in_shared(uid, count + step) - self._in_shared(uid, count)
        self.per_uid[uid] = count + step
        if not self.per_uid[uid]:
            del self.per_uid[uid]

    def stopFactory(self) -> None:
        self.cooperator.stop()
        self._refused.stop()
        self._closed_for_room.stop()
        self.gate.stop()
        self._diag.close()


def _who(uid: int | None) -> str:
    return f"uid {uid}" if uid is not None else "TCP clients of unknown uid"
