"""The state every connection serves: counters, replies cached per poll, client queues.

The poller hands each Snapshot to `Board.fold`; protocols ask `Board.reply` for
the bytes of one request.  Everything runs in the reactor thread, so no locks.

Replies are rendered once per poll and version and reused for every request until
the next poll; only a client's own exited processes are added per request, and
each exited process's record is rendered once per version for all the clients
that hear of it.  A request costs no work that grows with the number of clients
or, unless the reply must be cut to atop's limit, with the number of processes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from twisted.logger import Logger

from atopgpud_tw import codec
from atopgpud_tw.counters import Counters, ExitedProcess, ProcessTotals
from atopgpud_tw.snapshot import Snapshot

log = Logger()

DEFAULT_EXITED_LIMIT = 8192


@dataclass(eq=False)
class Exited:
    """An exited process as every client's queue holds it: one object shared by all."""

    device_index: int
    totals: ProcessTotals
    #: its ``E`` record per reply version, rendered for the first client that asks
    records: dict[int, bytes] = field(default_factory=dict)

    def record(self, version: int) -> bytes:
        """Its ``E`` record in a reply version."""
        record = self.records.get(version)
        if record is None:
            record = self.records[version] = codec.render_process(self.totals, version, b"E")
        return record


@dataclass(eq=False)
class ClientQueue:
    """One client's processes that ended and that it has not been told about yet.

    A client is told of exits only after its first ``S``: what ended before
    that has no earlier figures for atop to subtract from.  The queue is
    bounded; when full, the oldest entries are dropped and counted.
    """

    limit: int = DEFAULT_EXITED_LIMIT
    subscribed: bool = False
    entries: deque[Exited] = field(default_factory=deque)
    dropped: int = 0
    #: the list of one poll's exits when the queue holds exactly that list, else None
    #: (a client that asks once per poll): its reply is then the same as that of every
    #: other such client, and is rendered once
    batch: Sequence[Exited] | None = None

    def add(self, exited: Sequence[Exited]) -> int:
        """Queue exits; returns how many old entries had to be dropped."""
        if not self.subscribed:
            return 0
        self.batch = None if self.entries else exited
        self.entries.extend(exited)
        overflow = len(self.entries) - self.limit
        if overflow <= 0:
            return 0
        self.batch = None
        for _ in range(overflow):
            self.entries.popleft()
        self.dropped += overflow
        return overflow


@dataclass
class _Rendered:
    generation: int
    prepared: codec.PreparedStats
    #: the whole framed reply for a client with no exited processes queued
    framed: bytes


class Board:
    """Counters plus what is needed to answer every client quickly."""

    def __init__(self, counters: Counters | None = None, exited_limit: int = DEFAULT_EXITED_LIMIT) -> None:
        self.counters = counters or Counters()
        self.exited_limit = exited_limit
        self.clients: set[ClientQueue] = set()
        self._types: tuple[int, bytes] | None = None
        self._types_framed: dict[int, bytes] = {}
        self._stats: dict[int, _Rendered] = {}
        #: the latest poll's exits as queued, and the body for a queue holding just them
        self._batch: list[Exited] | None = None
        self._batch_bodies: dict[int, codec.StatsBody] = {}
        self._cut_logged: dict[int, bool] = {}
        self.replies_cut = 0
        self.exited_dropped = 0

    # -- clients --

    def attach(self) -> ClientQueue:
        """A new connection's queue of exited processes."""
        queue = ClientQueue(self.exited_limit)
        self.clients.add(queue)
        return queue

    def detach(self, queue: ClientQueue) -> None:
        """Forget a connection that closed."""
        self.clients.discard(queue)

    # -- polls --

    def fold(self, snapshot: Snapshot) -> list[ExitedProcess]:
        """Count one poll and queue its exited processes for every client."""
        exited = self.counters.fold(snapshot)
        self._batch = None
        self._batch_bodies = {}
        if exited:
            shared = self._batch = [Exited(e.device_index, e.totals) for e in exited]
            dropped = sum(queue.add(shared) for queue in self.clients)
            if dropped:
                self.exited_dropped += dropped
                log.warn(
                    "{count} exited processes dropped from full client queues "
                    "({total} since start); raise --max-exited if clients are slow",
                    count=dropped,
                    total=self.exited_dropped,
                )
        return exited

    # -- replies --

    def reply(self, request: codec.Request, queue: ClientQueue) -> bytes:
        """The framed reply to one request of one client."""
        version = request.reply_version
        if request.command == codec.COMMAND_TYPES:
            body = self.types_body()
            framed = self._types_framed.get(version)
            if framed is None:
                framed = self._types_framed[version] = codec.frame(version, body)
            return framed
        if queue.entries:
            return codec.frame(version, self.stats_body(version, queue))
        queue.subscribed = True
        rendered = self._rendered(version)
        if rendered.prepared.full.active_cut:
            self.replies_cut += 1
        return rendered.framed

    def types_body(self) -> bytes:
        """The ``T`` body, rendered again only when the device list changed."""
        generation = self.counters.layout_generation
        if self._types is None or self._types[0] != generation:
            self._types = (generation, codec.render_types(self.counters.devices))
            self._types_framed = {}
        return self._types[1]

    def stats_body(self, version: int, queue: ClientQueue) -> bytes:
        """The ``S`` body for one client; takes what it reports off its queue."""
        queue.subscribed = True
        prepared = self._rendered(version).prepared
        if not queue.entries:
            result = prepared.full
        else:
            shared = queue.batch is not None and queue.batch is self._batch
            result = self._batch_bodies.get(version) if shared else None
            if result is None:
                result = prepared.body(_records(queue.entries, version))
                if shared:
                    self._batch_bodies[version] = result
            queue.batch = None
            if len(result.exited_sent) == len(queue.entries):
                queue.entries.clear()
            else:
                sent = set(result.exited_sent)
                queue.entries = deque(e for i, e in enumerate(queue.entries) if i not in sent)
        if result.active_cut:
            self.replies_cut += 1
        return result.body

    def _rendered(self, version: int) -> _Rendered:
        generation = self.counters.generation
        cached = self._stats.get(version)
        if cached is None or cached.generation != generation:
            prepared = codec.PreparedStats(codec.render_devices(self.counters.devices, version))
            cached = _Rendered(generation, prepared, codec.frame(version, prepared.full.body))
            self._stats[version] = cached
            self._note_cut(version, prepared.full.active_cut)
        return cached

    def _note_cut(self, version: int, cut: bool) -> None:
        if cut == self._cut_logged.get(version, False):
            return
        self._cut_logged[version] = cut
        if cut:
            log.warn(
                "version {version} replies: too many processes for atop's 8192-byte "
                "limit; listing those with the most GPU memory",
                version=version,
            )
        else:
            log.info("version {version} replies: every process fits again", version=version)


def _records(entries: Sequence[Exited], version: int) -> list[tuple[int, bytes]]:
    return [(e.device_index, e.record(version)) for e in entries]
