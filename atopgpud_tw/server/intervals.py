"""Version 1 busy figures: each client's own, over the interval since its previous ``S``.

atop 2.12 and older show a process's version 1 busy figures as they come, as
the figures of the interval since their previous request; so they are worked
out per client from the sums it saw then (`interval_busy`).  This costs work in
proportion to the processes once per poll per version 1 client: until the next
poll its figures stand, and so do its records.  Clients whose previous ``S``
came in the same poll, with no exit still to be told, remembered the same sums:
their records are rendered once, for the first of them.  Each client's sums
are its `board.ClientQueue`'s (``records_v1``, ``remember_v1``).
"""

from __future__ import annotations

from itertools import islice
from typing import TYPE_CHECKING, Callable

from atopgpud_tw.counters import Counters, ProcessTotals
from atopgpud_tw.server.render import EXITED_SCAN, PreparedStats, RenderedDevice, StatsBody, render_process

if TYPE_CHECKING:
    from atopgpud_tw.server.board import ClientQueue

#: per (device index, pid): busy sums and samples at a client's ``S``, and the figures sent
Seen = dict[tuple[int, int], tuple[int, int, int, int, int]]


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
            busy, _ = interval_busy(entry.totals, seen.get((entry.device_index, entry.totals.pid)))
            records.append((entry.device_index, render_process(entry.totals, 1, b"E", busy)))
        result = prepared.body(records) if records else prepared.full
        sent = len(result.exited_sent)
        # now_seen may be shared with other clients: copied before it is changed
        clean = None
        if not same_poll:
            kept = {}
            for entry in islice(queue.entries, sent, None):
                key = (entry.device_index, entry.totals.pid)
                if key in seen and key not in now_seen:
                    kept[key] = seen[key]  # still to be told: keep its starting point
            if kept:
                now_seen = {**now_seen, **kept}
            clean = not kept
        elif sent:
            processes = [d.processes for d in counters.devices]
            gone = [
                (e.device_index, e.totals.pid)
                for e in entries[:sent]
                if e.totals.pid not in processes[e.device_index]
                and (e.device_index, e.totals.pid) in now_seen
            ]
            if gone:
                now_seen = {k: v for k, v in now_seen.items() if k not in set(gone)}
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
        for index, (device, header) in enumerate(zip(counters.devices, rendered().devices)):
            active = []
            for totals in device.processes.values():
                key = (index, totals.pid)
                before = seen.get(key)
                busy, now_seen[key] = interval_busy(totals, before)
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
