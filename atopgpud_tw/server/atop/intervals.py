"""Version 1 busy figures: each client's own, over the interval since its previous ``S``.

atop 2.12 and older show a process's version 1 busy figures as they come, as
the figures of the interval since their previous request; so they are worked
out per client from the sums it saw then (`interval_busy`).  This costs work in
proportion to the processes once per poll per version 1 client: until the next
poll its figures stand, and so do its records.  Clients whose previous ``S``
came in the same poll, with no exit still to be told, remembered the same sums:
their records are rendered once, for the first of them.  Each client's sums
are its `board.ClientQueue`'s (``records_v1``, ``remember_v1``), kept per
process life (`counters.ProcessTotals.life`), never per pid: a pid reused, or
a GPU lost and read again, is a new process whose figures are its own.
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING, Callable

from atopgpud_tw.counters import Counters, ProcessTotals
from atopgpud_tw.server.atop.render import EXITED_SCAN, PreparedStats, RenderedDevice, StatsBody, render_process

if TYPE_CHECKING:
    from atopgpud_tw.server.atop.board import ClientQueue

#: per process life (`ProcessTotals.life`): busy sums and samples at a client's ``S``, and the figures sent
Seen = dict[int, tuple[int, int, int, int, int]]


class V1Intervals:
    """The version 1 replies of every client, with the records shared within a poll."""

    def __init__(self) -> None:
        #: records this poll, by the generation of the clients' previous S
        self._shared: dict[int, tuple[PreparedStats, Seen]] = {}
        self._generation = -1

    def reply(self, queue: ClientQueue, counters: Counters, rendered: Callable[[], PreparedStats]) -> StatsBody:
        """One client's ``S`` body with its figures, its sums remembered for its next;
        `rendered` gives this poll's version 1 records (their device headers are used)."""
        generation = counters.generation
        seen = queue.seen_v1
        prepared = queue.records_v1(generation)
        same_poll = prepared is not None
        if prepared is not None:
            now_seen = seen  # no poll since this client's previous S: every active figure stands
        else:
            prepared, now_seen = self._prepared(queue, counters, rendered)
        entries = list(islice(queue.entries, EXITED_SCAN))
        records = []
        for entry in entries:
            busy, _ = interval_busy(entry.totals, seen.get(entry.totals.life))
            records.append((entry.device_index, render_process(entry.totals, 1, b"E", busy)))
        result = prepared.body(records) if records else prepared.full
        sent = len(result.exited_sent)
        # now_seen may be shared with other clients: copied before it is changed
        clean = None
        if not same_poll:
            kept = {}
            for entry in islice(queue.entries, sent, None):
                life = entry.totals.life
                if life in seen:
                    kept[life] = seen[life]  # still to be told: keep its starting point
            if kept:
                now_seen = {**now_seen, **kept}
            clean = not kept
        elif sent:
            # an ended life is never active again: once told, its starting point goes
            gone = {e.totals.life for e in entries[:sent]} & now_seen.keys()
            if gone:
                now_seen = {k: v for k, v in now_seen.items() if k not in gone}
        queue.remember_v1(now_seen, generation, prepared, clean)
        return result

    def _prepared(
        self, queue: ClientQueue, counters: Counters, rendered: Callable[[], PreparedStats]
    ) -> tuple[PreparedStats, Seen]:
        """One client's version 1 records this poll, and the sums to remember for its next ``S``.

        Clients whose previous ``S`` came in the same poll, with no exit still to
        be told, remembered the same sums: their records are the same, rendered
        for the first of them, unless a process had no sample since (its
        figures are then those that client was sent last).
        """
        generation = counters.generation
        if self._generation != generation:
            self._generation = generation
            self._shared = {}
        since = queue.v1_generation if queue.v1_clean else None
        shared = self._shared.get(since) if since is not None else None
        if shared is not None:
            return shared
        shared_ok = True
        seen, now_seen = queue.seen_v1, {}
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
            self._shared[since] = result
        return result


def interval_busy(
    totals: ProcessTotals, before: tuple[int, int, int, int, int] | None
) -> tuple[tuple[int, int], tuple[int, int, int, int, int]]:
    """A process's busy figures since a client's previous request, and what to remember.

    Without an earlier request for this process's life (`before` is None) the
    interval is its whole life.  With no new sample since, the figures sent
    last time stand.  A busy sum that was -1 then (not reported) and is a sum
    now started again from 0: the interval is that sum's.
    """
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
