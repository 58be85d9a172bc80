"""The state every connection serves: counters, replies cached per poll, client queues.

The poller hands each Snapshot to `Board.fold`; protocols ask `Board.reply` for
the bytes of one request.  Everything runs in the reactor thread, so no locks.

Replies are rendered once per poll and version and reused for every request until
the next poll; only a client's own exited processes are added per request, and
each exited process's record is rendered once per version for all the clients
that hear of it.  A version 2 request costs no work that grows with the number
of clients or, unless the reply must be cut to atop's limit, with the number of
processes.  Version 1 replies carry busy figures over each client's own
interval, so they are rendered per request (`Board.stats_v1`).
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
    #: version 1 only: per (device index, pid), the busy sums and samples at this
    #: client's previous ``S`` and the busy figures it was sent then
    seen_v1: dict[tuple[int, int], tuple[int, int, int, int, int]] = field(default_factory=dict)
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

    def fold(self, snapshot: Snapshot, taken: float | None = None, since: float = 0.0) -> list[ExitedProcess]:
        """Count one poll (taken at `taken`, the previous at `since`: `Counters.fold`)
        and queue its exited processes for every client."""
        exited = self.counters.fold(snapshot, taken, since)
        self._batch = None
        self._batch_bodies = {}
        if exited:
            shared = self._batch = [Exited(e.device_index, e.totals) for e in exited]
            for queue in self.clients:
                first = not queue.dropped
                dropped = queue.add(shared)
                self.exited_dropped += dropped
                if dropped and first:
                    # once per client: one that stopped asking would say it every poll
                    log.warn(
                        "a client's queue of exited processes is full: its oldest are dropped "
                        "({total} dropped from all clients since start); raise --max-exited "
                        "if clients ask less often than that many processes end",
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
        if version == 1:
            return codec.frame(version, self.stats_v1(queue))
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

    def stats_v1(self, queue: ClientQueue) -> bytes:
        """The version 1 ``S`` body for one client, with busy figures over its interval.

        atop 2.12 and older show a process's version 1 busy figures as they come,
        as the figures of the interval since their previous request; so they are
        worked out per client from the sums it saw then.  This costs work in
        proportion to the processes per request, for version 1 clients only.
        """
        queue.subscribed = True
        prepared = self._rendered(1).prepared
        seen, now_seen = queue.seen_v1, {}
        devices = []
        for index, (device, rendered) in enumerate(zip(self.counters.devices, prepared.devices)):
            active = []
            for totals in device.processes.values():
                key = (index, totals.pid)
                busy, now_seen[key] = _interval_busy(totals, seen.get(key))
                active.append((totals.memory_now_kib, totals.pid, codec.render_process(totals, 1, b"A", busy)))
            active.sort(key=lambda item: (-item[0], item[1]))
            devices.append(codec.RenderedDevice(rendered.header, tuple(active)))
        entries = list(queue.entries)
        records = []
        for entry in entries:
            busy, _ = _interval_busy(entry.totals, seen.get((entry.device_index, entry.totals.pid)))
            records.append((entry.device_index, codec.render_process(entry.totals, 1, b"E", busy)))
        result = codec.assemble_stats(devices, records)
        sent = set(result.exited_sent)
        for position, entry in enumerate(entries):
            key = (entry.device_index, entry.totals.pid)
            if position not in sent and key in seen:
                now_seen.setdefault(key, seen[key])  # still to be told: keep its starting point
        queue.entries = deque(e for position, e in enumerate(entries) if position not in sent)
        queue.batch = None
        queue.seen_v1 = now_seen
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


def _interval_busy(
    totals: ProcessTotals, before: tuple[int, int, int, int, int] | None
) -> tuple[tuple[int, int], tuple[int, int, int, int, int]]:
    """A process's busy figures since a client's previous request, and what to remember.

    Without an earlier request (or when the pid is another process now, its
    samples fewer than before) the interval is the process's whole life.  With no
    new sample since, the figures sent last time stand.
    """
    gpu_cum, mem_cum, samples = totals.gpu_busy_cum, totals.mem_busy_cum, totals.samples
    if before is None or before[2] > samples or before[0] > gpu_cum or before[1] > mem_cum:
        before = (0, 0, 0, 0, 0)
    count = samples - before[2]
    if count:
        gpu = -1 if gpu_cum < 0 else (gpu_cum - before[0]) // count
        mem = -1 if mem_cum < 0 else (mem_cum - before[1]) // count
    elif before[2]:
        gpu, mem = before[3], before[4]
    else:
        gpu, mem = (-1 if gpu_cum < 0 else 0), (-1 if mem_cum < 0 else 0)
    return (gpu, mem), (gpu_cum, mem_cum, samples, gpu, mem)


def _records(entries: Sequence[Exited], version: int) -> list[tuple[int, bytes]]:
    return [(e.device_index, e.record(version)) for e in entries]
