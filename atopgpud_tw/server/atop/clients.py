"""Each client's own state: its queue of exits not yet told, and a version 1 client's session.

The Board queues one poll's exits for every client at once, as one shared list of
`ExitReport`s; a reply takes off the front of a client's queue what it sent.

atop 2.12 and older show a process's version 1 busy figures as those of the
interval since their previous request: they are worked out per client from the
sums it saw then (`interval_busy`), per process life (`counters.ProcessTotals.life`),
never per pid (a pid reused, or a GPU lost and read again, is a new process).
Clients whose previous ``S`` came in the same poll, with no exit still to be told,
remembered the same sums: their records are rendered once (`Shared`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Callable, Sequence

from atopgpud_tw.counters import Counters, ProcessTotals
from atopgpud_tw.server.atop import render
from atopgpud_tw.server.atop.render import EXITED_SCAN, PreparedStats, RenderedDevice, StatsBody, render_process

DEFAULT_EXITED_LIMIT = 8192


@dataclass(eq=False)
class ExitReport:
    """An exited process (`counters.ExitedProcess`) as every client's queue holds it:
    one object shared by all, its ``E`` records rendered once per version."""

    device_index: int
    totals: ProcessTotals
    records: dict[int, bytes] = field(default_factory=dict)

    def record(self, version: int) -> bytes:
        record = self.records.get(version)
        if record is None:
            record = self.records[version] = render.render_process(self.totals, version, b"E")
        return record


@dataclass(eq=False)
class ClientQueue:
    """One client's exits not yet told, at most `limit` (the oldest dropped and counted).

    A client is told of exits only after its first ``S`` (`subscribed`): what ended
    before that has no earlier figures for atop to subtract from.
    """

    limit: int = DEFAULT_EXITED_LIMIT
    subscribed: bool = False
    entries: deque[ExitReport] = field(default_factory=deque)
    dropped: int = 0
    #: one poll's exits when the queue holds exactly that list (a client that asks once per
    #: poll), else None: its reply is then every such client's, rendered once
    batch: Sequence[ExitReport] | None = None
    #: exits dropped from this queue since the client last asked
    lost: int = 0

    def add(self, exited: Sequence[ExitReport]) -> int:
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
        self.lost += overflow
        return overflow

    def take(self, count: int) -> None:
        self.batch = None
        for _ in range(min(count, len(self.entries))):
            self.entries.popleft()

    def only_devices_below(self, count: int) -> None:
        """Drop the exits on devices from index `count` on, which no reply to this client carries."""
        if any(entry.device_index >= count for entry in self.entries):
            self.entries = deque(entry for entry in self.entries if entry.device_index < count)
            self.batch = None


#: per process life (`ProcessTotals.life`): busy sums and samples at a client's ``S``, and the figures sent
Seen = dict[int, tuple[int, int, int, int, int]]
#: one poll's version 1 records and sums, by (that poll, the poll of the clients' previous ``S``)
Shared = dict[tuple[int, int], tuple[PreparedStats, Seen]]


class V1Session:
    """One version 1 client: the sums of its previous ``S``, its records, and its replies."""

    __slots__ = ("seen", "prepared", "generation", "clean")

    def __init__(self) -> None:
        #: at this client's previous ``S``
        self.seen: Seen = {}
        #: its records at its previous ``S``, the same until the next poll
        self.prepared: PreparedStats | None = None
        #: the poll (counters' generation) of its previous ``S`` (-1: never)
        self.generation = -1
        #: `seen` holds only that ``S``'s active processes, so its sums are every such client's
        self.clean = True

    def reply(
        self, queue: ClientQueue, counters: Counters, rendered: Callable[[], PreparedStats], shared: Shared
    ) -> StatsBody:
        """This client's ``S`` body, its sums remembered for its next; `rendered` gives this
        poll's version 1 records (for their device headers)."""
        generation = counters.generation
        seen = self.seen
        same_poll = self.prepared is not None and self.generation == generation
        if same_poll:
            assert self.prepared is not None
            prepared, now_seen = self.prepared, seen  # no poll since: every active figure stands
        else:
            prepared, now_seen = self._prepared(counters, rendered, shared)
        entries: Sequence[ExitReport] = list(islice(queue.entries, EXITED_SCAN))
        records = []
        for entry in entries:
            busy, _ = interval_busy(entry.totals, seen.get(entry.totals.life))
            records.append((entry.device_index, render_process(entry.totals, 1, b"E", busy)))
        result = prepared.body(records) if records else prepared.full
        sent = len(result.exited_sent)
        # now_seen may be shared with other clients: copied before it is changed
        if not same_poll:
            kept = {}
            for entry in islice(queue.entries, sent, None):
                life = entry.totals.life
                if life in seen:
                    kept[life] = seen[life]  # still to be told: keep its starting point
            if kept:
                now_seen = {**now_seen, **kept}
            self.clean = not kept
        elif sent:
            # an ended life is never active again: once told, its starting point goes
            gone = {e.totals.life for e in entries[:sent]} & now_seen.keys()
            if gone:
                now_seen = {k: v for k, v in now_seen.items() if k not in gone}
        self.seen, self.generation, self.prepared = now_seen, generation, prepared
        return result

    def _prepared(
        self, counters: Counters, rendered: Callable[[], PreparedStats], shared: Shared
    ) -> tuple[PreparedStats, Seen]:
        """This client's version 1 records this poll, and the sums to remember for its next ``S``:
        those of the clients with the same sums (`Shared`), unless a process had no sample since
        (its figures are then those this client was sent last)."""
        since = self.generation if self.clean else None
        found = shared.get((counters.generation, since)) if since is not None else None
        if found is not None:
            return found
        shared_ok = True
        seen, now_seen = self.seen, {}
        devices = []
        for device, header in zip(counters.devices, rendered().devices):
            active = []
            for totals in device.processes.values():
                before = seen.get(totals.life)
                busy, now_seen[totals.life] = interval_busy(totals, before)
                if before is not None and before[2] == totals.samples and before[2]:
                    shared_ok = False  # the figures sent last stand: this client's own
                active.append((totals.memory_now_kib, totals.pid, render_process(totals, 1, b"A", busy)))
            active.sort(key=lambda item: (-item[0], item[1]))
            devices.append(RenderedDevice(header.header, tuple(active)))
        result = PreparedStats(devices), now_seen
        if since is not None and shared_ok:
            shared[(counters.generation, since)] = result  # (emptied as the Board folds a poll)
        return result


def interval_busy(
    totals: ProcessTotals, before: tuple[int, int, int, int, int] | None
) -> tuple[tuple[int, int], tuple[int, int, int, int, int]]:
    """A process's busy figures since a client's previous request (`before`; None: its whole
    life), and what to remember.  With no new sample since, the figures sent last time stand.
    A busy sum that was -1 then (not reported) and is a sum now started again from 0."""
    gpu_cum, mem_cum, samples = totals.gpu_busy_cum, totals.mem_busy_cum, totals.samples
    if before is None or before[2] > samples:
        before = (0, 0, 0, 0, 0)
    count = samples - before[2]
    if count:
        gpu = -1 if gpu_cum < 0 else (gpu_cum - _start(before[0], gpu_cum)) // count
        mem = -1 if mem_cum < 0 else (mem_cum - _start(before[1], mem_cum)) // count
    elif before[2]:
        gpu, mem = before[3], before[4]
    else:
        gpu, mem = (-1 if gpu_cum < 0 else 0), (-1 if mem_cum < 0 else 0)
    return (gpu, mem), (gpu_cum, mem_cum, samples, gpu, mem)


def _start(before: int, cum: int) -> int:
    """Where a busy sum stood at the previous request: 0 if it was -1 then (it started again)."""
    return before if 0 <= before <= cum else 0
