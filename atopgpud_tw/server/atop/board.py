"""The state every connection serves: counters, replies cached per poll, client queues.

The poller hands each Snapshot to `Board.fold`; protocols ask `Board.reply` for the
bytes of one request (a handler per command, `Board.HANDLERS`; a command without
one is refused, never answered as another).  Replies are rendered once per poll and
version, only a client's own exits added per request (each exit's record rendered
once per version), so a version 2 request costs no work that grows with the
clients or, unless the reply is cut to atop's limit, with the processes.  Version 1
replies carry busy figures over each client's own interval (`clients.V1Session`).
A reply looks at no more of a client's queued exits than can fit
(`render.EXITED_SCAN`): the cost of a request is bounded by the size of a reply.

The ``P`` reply (`ContextDirectory`, ``atopgpu``'s) lists every active process on
the devices the wide request carries, then the processes that ended most recently
(`RECENT_EXITS`): a client that asks ``S`` and then ``P`` finds there the processes
of its ``S`` reply, the exited ones among them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterable

from twisted.logger import Logger

from atopgpud_tw import codec
from atopgpud_tw.counters import Counters, ExitedProcess, ProcessTotals
from atopgpud_tw.problems import Latch
from atopgpud_tw.server.atop import render
from atopgpud_tw.server.atop.clients import DEFAULT_EXITED_LIMIT, ClientQueue, ExitReport, Shared, V1Session
from atopgpud_tw.snapshot import UNKNOWN_CONTEXT, Snapshot

log = Logger(namespace="atopgpud_tw.board")

#: what a reply shows: its version, and how many devices (the first, in ``T`` order) it carries
_View = tuple[int, int]


@dataclass
class _Rendered:
    generation: int
    prepared: render.PreparedStats
    #: the whole framed reply for a client with no exited processes queued
    framed: bytes


class Board:
    """Counters plus what is needed to answer every client quickly."""

    def __init__(
        self, counters: Counters | None = None, exited_limit: int = DEFAULT_EXITED_LIMIT, layout: Snapshot | None = None
    ) -> None:
        """`layout`: the devices found at start-up, which ``T`` lists before the first poll."""
        self.counters = counters or Counters()
        if layout is not None:
            self.counters.declare(layout)
        self.exited_limit = exited_limit
        self.clients: set[ClientQueue] = set()
        #: per view: the layout generation, the ``T`` body and its framed reply
        self._types: dict[_View, tuple[int, bytes, bytes]] = {}
        self._stats: dict[_View, _Rendered] = {}
        #: the latest poll's exits as queued, and the body per view for a queue holding just them
        self._batch: list[ExitReport] | None = None
        self._batch_bodies: dict[_View, render.StatsBody] = {}
        #: per reply version, whether the replies atop is sent are cut (logged when that changes)
        self._cut: dict[int, Latch] = {}
        #: the most devices said to be more than the wire carries
        self._devices_told = 0
        #: version 1 clients, each with its figures over its own intervals
        self.v1_sessions: dict[ClientQueue, V1Session] = {}
        #: this poll's version 1 records, shared by clients with the same sums
        self._v1_records: Shared = {}
        self.replies_cut = 0
        #: told the exited processes of every poll that has some, after the counters (`fold`)
        self.exit_watchers: list[Callable[[list[ExitedProcess]], None]] = []
        self.directory = ContextDirectory(self.counters)
        self.exit_watchers.append(self.directory.exited)
        self.exited_dropped = 0
        #: clients whose exits did not all fit in their latest reply
        self.behind: set[ClientQueue] = set()
        #: clients whose queue dropped exits since they last asked
        self.losing: set[ClientQueue] = set()
        #: exits dropped since `losing` was last empty
        self._lost_in_burst = 0
        self._clients_in_burst = 0

    def attach(self) -> ClientQueue:
        queue = ClientQueue(self.exited_limit)
        self.clients.add(queue)
        return queue

    def detach(self, queue: ClientQueue) -> None:
        self.clients.discard(queue)
        self.v1_sessions.pop(queue, None)
        self._caught_up(queue)
        self._heard(queue)

    def fold(self, snapshot: Snapshot, taken: float | None = None, since: float = 0.0) -> list[ExitedProcess]:
        """Count one poll (taken at `taken`, the previous at `since`: `Counters.fold`)
        and queue its exited processes for every client."""
        exited = self.counters.fold(snapshot, taken, since)
        if exited:
            for watcher in self.exit_watchers:
                watcher(exited)  # what else keeps ended processes' figures (the workloads of /metrics)
        if len(self.counters.devices) > max(self._devices_told, codec.ATOP_MAX_GPUS):
            self._devices_told = len(self.counters.devices)
            log.warn(
                "{count} devices, more than atop's {most} (MAXGPU): replies to atop carry the first {most} "
                "in T order and no exit of a process on the other {left}; to see them all, --mig card shows "
                "each MIG card as one device, atopgpu shows {wired} and /metrics (--metrics) every one",
                count=self._devices_told,
                most=codec.ATOP_MAX_GPUS,
                left=self._devices_told - codec.ATOP_MAX_GPUS,
                wired=min(self._devices_told, codec.MAX_WIRE_DEVICES),
            )
        self._batch = None
        self._batch_bodies = {}
        self._v1_records.clear()  # (the last poll's, kept no longer than its other replies)
        # a device beyond what the wire carries has no place for its exits
        wired = [e for e in exited if e.device_index < codec.MAX_WIRE_DEVICES]
        if wired:
            shared = self._batch = [ExitReport(e.device_index, e.totals) for e in wired]
            for queue in self.clients:
                dropped = queue.add(shared)
                if dropped:
                    self._dropped(queue, dropped)
        return exited

    def _dropped(self, queue: ClientQueue, count: int) -> None:
        self.exited_dropped += count
        self._lost_in_burst += count
        if queue not in self.losing:
            self._clients_in_burst += 1
        if not self.losing:
            # once per burst: further clients and polls only add to the count
            log.warn(
                "a client's queue of exited processes is full (--max-exited {limit}): its "
                "oldest exits are dropped and never reported to it; raise --max-exited if "
                "clients ask less often than that many processes end",
                limit=queue.limit,
            )
        self.losing.add(queue)

    def _heard(self, queue: ClientQueue) -> None:
        """A client that lost exits asked again (or left): the burst ends with the last."""
        if queue not in self.losing:
            return
        self.losing.discard(queue)
        queue.lost = 0  # the count starts afresh
        if not self.losing:
            log.info(
                "{lost} exited processes were dropped from {clients} clients' full queues "
                "(--max-exited); none is dropping now",
                lost=self._lost_in_burst,
                clients=self._clients_in_burst,
            )
            self._lost_in_burst = self._clients_in_burst = 0

    def _sent(self, queue: ClientQueue, count: int) -> None:
        """Take what a reply sent off a client's queue; note whether it fell behind."""
        queue.take(count)
        self._heard(queue)
        if not queue.entries:
            self._caught_up(queue)
        elif queue not in self.behind:
            if not self.behind:
                log.info(
                    "more exited processes queued than fit in one reply beside the active "
                    "ones: clients hear of the rest, oldest first, in their next replies"
                )
            self.behind.add(queue)

    def _caught_up(self, queue: ClientQueue) -> None:
        if queue in self.behind:
            self.behind.discard(queue)
            if not self.behind:
                log.info("every client has heard of every exited process again")

    def reply(self, request: codec.Request, queue: ClientQueue) -> bytes:
        """The framed reply to one request of one client, by its command (`HANDLERS`);
        a command with no handler is a `codec.ProtocolError`, never another's reply."""
        handler = self.HANDLERS.get(request.command)
        if handler is None:
            raise codec.ProtocolError(f"no reply for command byte 0x{request.command:02x}")
        return handler(self, request, queue)

    def _reply_types(self, request: codec.Request, queue: ClientQueue) -> bytes:
        """``T``: the GPU types."""
        return self._types_of(request.reply_version, request.devices)[2]

    def _reply_stats(self, request: codec.Request, queue: ClientQueue) -> bytes:
        """``S``: the statistics, with this client's exits (version 1: over its own interval)."""
        version = request.reply_version
        devices = request.devices
        if version == 1:
            return codec.frame(version, self.stats_v1(queue))
        if queue.entries or queue.lost:
            return codec.frame(version, self.stats_body(version, queue, devices))
        queue.subscribed = True
        rendered = self._rendered(version, devices)
        self.replies_cut += rendered.prepared.full.active_cut
        return rendered.framed

    def _reply_contexts(self, request: codec.Request, queue: ClientQueue) -> bytes:
        """``P``: who the processes are, for ``atopgpu`` (`ContextDirectory`)."""
        return codec.frame(codec.NEWEST_VERSION, self.directory.body())

    #: the handler of each request command of the wire (`codec.COMMANDS`; a test checks that none lacks one)
    HANDLERS: dict[int, Callable[[Board, codec.Request, ClientQueue], bytes]] = {
        codec.COMMAND_TYPES: _reply_types,
        codec.COMMAND_STATS: _reply_stats,
        codec.COMMAND_CONTEXTS: _reply_contexts,
    }

    def types_body(self, version: int = 2, devices: int = codec.ATOP_MAX_GPUS) -> bytes:
        return self._types_of(version, devices)[1]

    def _types_of(self, version: int, devices: int) -> tuple[int, bytes, bytes]:
        """The ``T`` body and reply of a view, rendered again only when the device list changed."""
        generation = self.counters.layout_generation
        cached = self._types.get((version, devices))
        if cached is None or cached[0] != generation:
            body = render.render_types(self.counters.devices[:devices])
            cached = self._types[(version, devices)] = (generation, body, codec.frame(version, body))
        return cached

    def stats_body(self, version: int, queue: ClientQueue, devices: int = codec.ATOP_MAX_GPUS) -> bytes:
        """The ``S`` body of the first `devices` for one client; takes what it reports off its queue."""
        queue.subscribed = True
        if len(self.counters.devices) > devices:
            queue.only_devices_below(devices)
        view = (version, devices)
        prepared = self._rendered(version, devices).prepared
        result: render.StatsBody | None
        if not queue.entries:
            result = prepared.full
            self._heard(queue)
        else:
            shared = self._batch is not None and queue.batch is self._batch  # one poll's exits, as shared
            result = self._batch_bodies.get(view) if shared else None
            if result is None:
                result = prepared.body(_records(islice(queue.entries, render.EXITED_SCAN), version))
                if shared:
                    self._batch_bodies[view] = result
            self._sent(queue, len(result.exited_sent))
        self.replies_cut += result.active_cut
        return result.body

    def stats_v1(self, queue: ClientQueue) -> bytes:
        """The version 1 ``S`` body for one client, with busy figures over its own
        interval (`clients.V1Session`); takes what it reports off its queue."""
        queue.subscribed = True
        wired = codec.wire_devices(1)
        if len(self.counters.devices) > wired:
            queue.only_devices_below(wired)
        result = self.v1_session(queue).reply(
            queue, self.counters, lambda: self._rendered(1, wired).prepared, self._v1_records
        )
        self._sent(queue, len(result.exited_sent))
        self.replies_cut += result.active_cut
        return result.body

    def v1_session(self, queue: ClientQueue) -> V1Session:
        session = self.v1_sessions.get(queue)
        if session is None:
            session = self.v1_sessions[queue] = V1Session()
        return session

    def _rendered(self, version: int, devices: int) -> _Rendered:
        generation = self.counters.generation
        view = (version, devices)
        cached = self._stats.get(view)
        if cached is None or cached.generation != generation:
            listed = self.counters.devices[:devices]
            prepared = render.PreparedStats(render.render_devices(listed, version))
            cached = _Rendered(generation, prepared, codec.frame(version, prepared.full.body))
            self._stats[view] = cached
            if devices == codec.ATOP_MAX_GPUS:
                # what atop is sent (atopgpu's wider view would only repeat it)
                self._note_cut(version, prepared.full.active_cut)
        return cached

    def _note_cut(self, version: int, cut: bool) -> None:
        if not self._cut.setdefault(version, Latch(False)).change(cut):
            return
        if cut:
            log.warn(
                "version {version} replies: too many processes for atop's 8192-byte "
                "limit; listing those with the most GPU memory",
                version=version,
            )
        else:
            log.info("version {version} replies: every process fits again", version=version)


def _records(entries: Iterable[ExitReport], version: int) -> list[tuple[int, bytes]]:
    return [(e.device_index, e.record(version)) for e in entries]


#: ended processes whose contexts are kept for ``P``
RECENT_EXITS = 1024


def _info(totals: ProcessTotals) -> codec.ProcessInfo:
    context = totals.context
    if context is None:
        return codec.ProcessInfo(totals.pid, -1, "", "", "", "")  # not read yet
    kind, name = context.workload("auto") if context is not UNKNOWN_CONTEXT else ("unknown", "unknown")
    return codec.ProcessInfo(totals.pid, context.uid, context.user_name, kind, name, context.comm)


class ContextDirectory:
    """The processes' contexts as ``P`` tells them; told of exits by the Board."""

    def __init__(self, counters: Counters) -> None:
        self.counters = counters
        self.recent: deque[ProcessTotals] = deque(maxlen=RECENT_EXITS)
        self._body: tuple[int, bytes] | None = None

    def exited(self, exits: Iterable[ExitedProcess]) -> None:
        """Keep the most recent exits (a Board exit watcher)."""
        self.recent.extend(exit.totals for exit in exits)

    def body(self) -> bytes:
        """The ``P`` body now, rendered once per poll."""
        generation = self.counters.generation
        if self._body is None or self._body[0] != generation:
            # the active processes, then the newest exits first, as many as fit
            records = [_info(t) for d in self.counters.devices[: codec.MAX_WIRE_DEVICES] for t in d.processes.values()]
            active = len(records)
            records += [_info(totals) for totals in reversed(self.recent)]
            kept = records[: codec.render_contexts(records).count(b"\n")]
            active = min(len(kept), active)
            # written exits oldest first, the active last: a later line wins for a pid listed twice
            self._body = (generation, codec.render_contexts(kept[active:][::-1] + kept[:active]))
        return self._body[1]
