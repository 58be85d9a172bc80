"""Version 1 busy figures: each client's own, over the interval since its previous ``S``.

atop 2.12 and older show a process's version 1 busy figures as those of the
interval since their previous request; so they are worked out per client from
the sums it saw then (`interval_busy`), kept per process life
(`counters.ProcessTotals.life`), never per pid (a pid reused, or a GPU lost and
read again, is a new process).  A `V1Session` costs work in proportion to the
processes once per poll; clients whose previous ``S`` came in the same poll, with
no exit still to be told, remembered the same sums: their records are rendered
once, for the first of them (`Shared`).
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Sequence

from atopgpud_tw.counters import Counters, ProcessTotals
from atopgpud_tw.server.atop.exits import ClientQueue, ExitReport
from atopgpud_tw.server.atop.render import EXITED_SCAN, PreparedStats, RenderedDevice, StatsBody, render_process

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
            if shared and next(iter(shared))[0] != counters.generation:
                shared.clear()  # an earlier poll's
            shared[(counters.generation, since)] = result
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
