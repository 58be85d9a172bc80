"""The state every connection serves: counters, replies cached per poll, client queues.

The poller hands each Snapshot to `Board.fold`; protocols ask `Board.reply` for
the bytes of one request.  Everything runs in the reactor thread, so no locks.

Replies are rendered once per poll and version and reused for every request until
the next poll; only a client's own exited processes are added per request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from twisted.logger import Logger

from atopgpud_tw import codec
from atopgpud_tw.counters import Counters, ExitedProcess
from atopgpud_tw.snapshot import Snapshot

log = Logger()

DEFAULT_EXITED_LIMIT = 8192


@dataclass(eq=False)
class ClientQueue:
    """One client's processes that ended and that it has not been told about yet.

    A client is told of exits only after its first ``S``: what ended before
    that has no earlier figures for atop to subtract from.  The queue is
    bounded; when full, the oldest entries are dropped and counted.
    """

    limit: int = DEFAULT_EXITED_LIMIT
    subscribed: bool = False
    entries: deque[ExitedProcess] = field(default_factory=deque)
    dropped: int = 0

    def add(self, exited: list[ExitedProcess]) -> int:
        """Queue exits; returns how many old entries had to be dropped."""
        if not self.subscribed:
            return 0
        self.entries.extend(exited)
        overflow = len(self.entries) - self.limit
        for _ in range(max(0, overflow)):
            self.entries.popleft()
        self.dropped += max(0, overflow)
        return max(0, overflow)


@dataclass
class _Rendered:
    generation: int
    devices: tuple[codec.RenderedDevice, ...]
    full: codec.StatsBody


class Board:
    """Counters plus what is needed to answer every client quickly."""

    def __init__(self, counters: Counters | None = None, exited_limit: int = DEFAULT_EXITED_LIMIT) -> None:
        self.counters = counters or Counters()
        self.exited_limit = exited_limit
        self.clients: set[ClientQueue] = set()
        self._types: tuple[int, bytes] | None = None
        self._stats: dict[int, _Rendered] = {}
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
        if exited:
            dropped = sum(queue.add(exited) for queue in self.clients)
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
            return codec.frame(version, self.types_body())
        return codec.frame(version, self.stats_body(version, queue))

    def types_body(self) -> bytes:
        """The ``T`` body, rendered again only when the device list changed."""
        generation = self.counters.layout_generation
        if self._types is None or self._types[0] != generation:
            self._types = (generation, codec.render_types(self.counters.devices))
        return self._types[1]

    def stats_body(self, version: int, queue: ClientQueue) -> bytes:
        """The ``S`` body for one client; takes what it reports off its queue."""
        queue.subscribed = True
        rendered = self._rendered(version)
        if not queue.entries:
            result = rendered.full
        else:
            entries = list(queue.entries)
            records = [(e.device_index, codec.render_process(e.totals, version, b"E")) for e in entries]
            result = codec.assemble_stats(rendered.devices, records)
            if len(result.exited_sent) == len(entries):
                queue.entries.clear()
            else:
                sent = set(result.exited_sent)
                queue.entries = deque(e for i, e in enumerate(entries) if i not in sent)
        if result.active_cut:
            self.replies_cut += 1
        return result.body

    def _rendered(self, version: int) -> _Rendered:
        generation = self.counters.generation
        cached = self._stats.get(version)
        if cached is None or cached.generation != generation:
            devices = codec.render_devices(self.counters.devices, version)
            cached = _Rendered(generation, devices, codec.assemble_stats(devices))
            self._stats[version] = cached
            self._note_cut(version, cached.full.active_cut)
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

