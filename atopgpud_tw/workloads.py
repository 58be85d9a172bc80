"""Exact GPU time per workload (``--workloads``): its exited processes' final figures, kept here, plus its
active ones' as they are now, so they never go down; beyond `limit` series, or `expiry` seconds idle, they
go into ``other``.  A process is given to one workload, once (docs/metrics.md, "Workloads")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from twisted.logger import Logger

from atopgpud_tw.counters import Counters, ExitedProcess, ProcessTotals
from atopgpud_tw.snapshot import DEFAULT_WORKLOAD_EXPIRY, DEFAULT_WORKLOAD_LIMIT, UNKNOWN_CONTEXT

log = Logger(namespace="atopgpud_tw.workloads")

OTHER = ("other", "other")


@dataclass(eq=False, slots=True)
class WorkloadSums:
    """One workload's sums on one GPU: its exited processes' figures, and how many it has now."""

    device_index: int
    kind: str
    name: str
    #: percent-seconds, percent-seconds and KiB-seconds of its exited processes (and of
    #: workloads expired into it, for ``other``)
    busy: float = 0.0
    mem_busy: float = 0.0
    memory_kib: float = 0.0
    seen: int = 0
    ended: int = 0
    energy_joules: float = 0.0
    #: its processes active now and counted here
    active: int = 0
    #: when its last active process ended (None: one is active)
    idle_since: float | None = None

    def absorb(self, other: WorkloadSums) -> None:
        """Take `other`'s sums (a workload that leaves the page goes into ``other``)."""
        for name in ("busy", "mem_busy", "memory_kib", "seen", "ended", "energy_joules"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True, slots=True)
class WorkloadRow:
    """A workload's figures on one GPU as the page shows them."""

    sums: WorkloadSums
    busy: float
    mem_busy: float
    memory_kib: float


class WorkloadBook:
    """Every workload's sums, by GPU, within the bounds."""

    def __init__(
        self,
        counters: Counters,
        grouping: str = "unit",
        limit: int = DEFAULT_WORKLOAD_LIMIT,
        expiry: float = DEFAULT_WORKLOAD_EXPIRY,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.counters = counters
        self.grouping = grouping
        self.limit = limit
        self.expiry = expiry
        self.clock = clock or (lambda: 0.0)
        self.entries: dict[tuple[int, str, str], WorkloadSums] = {}
        self.others: dict[int, WorkloadSums] = {}
        #: by process life: the sums it counts in, while it is active
        self._given: dict[int, WorkloadSums] = {}
        self._capped = False
        #: workloads that left the page (into ``other``)
        self.expired = 0
        #: by GPU: its energy counter, and each workload's busy sum, when it was last shared out
        self._energy: dict[int, tuple[float, dict[int, float]]] = {}

    def _other(self, index: int) -> WorkloadSums:
        other = self.others.get(index)
        if other is None:
            other = self.others[index] = WorkloadSums(index, *OTHER)
        return other

    def _sums_for(self, index: int, totals: ProcessTotals) -> WorkloadSums:
        kind, name = (totals.context or UNKNOWN_CONTEXT).workload(self.grouping)
        key = (index, kind, name)
        sums = self.entries.get(key)
        if sums is not None:
            return sums
        if len(self.entries) >= self.limit:
            if not self._capped:
                self._capped = True
                log.warn("more than {limit} workload series (--workload-limit): the rest are summed under "
                         "workload=\"other\"", limit=self.limit)
            return self._other(index)
        sums = self.entries[key] = WorkloadSums(index, kind, name)
        return sums

    def _give(self, index: int, totals: ProcessTotals) -> WorkloadSums:
        sums = self._sums_for(index, totals)
        sums.seen += 1
        sums.active += 1
        sums.idle_since = None
        self._given[totals.life] = sums
        return sums

    def exited(self, exits: Iterable[ExitedProcess]) -> None:
        """Keep the final figures of processes that ended (the Board's fold hands them here)."""
        now = self.clock()
        for exit in exits:
            totals = exit.totals
            sums = self._given.pop(totals.life, None)
            if sums is None:
                sums = self._give(exit.device_index, totals)
                del self._given[totals.life]
            sums.busy += totals.gpu_busy_seconds
            sums.mem_busy += totals.mem_busy_seconds
            sums.memory_kib += totals.memory_kib_seconds
            sums.ended += 1
            sums.active -= 1
            if sums.active <= 0:
                sums.active = 0
                sums.idle_since = now

    def rows(self) -> list[WorkloadRow]:
        """Every workload's figures now, ``other`` last per GPU; expires idle ones first."""
        live: dict[int, list[float]] = {}
        for index, device in enumerate(self.counters.devices):
            for totals in device.processes.values():
                sums = self._given.get(totals.life)
                if sums is None:
                    if totals.context is None:
                        continue  # not read yet: counted once it is
                    sums = self._give(index, totals)
                figures = live.get(id(sums))
                if figures is None:
                    figures = live[id(sums)] = [0.0, 0.0, 0.0]
                figures[0] += totals.gpu_busy_seconds
                figures[1] += totals.mem_busy_seconds
                figures[2] += totals.memory_kib_seconds
        self._expire(self.clock())
        found = []
        for sums in [*sorted(self.entries.values(), key=_order), *sorted(self.others.values(), key=_order)]:
            busy, mem_busy, memory = live.get(id(sums), (0.0, 0.0, 0.0))
            found.append(WorkloadRow(sums, sums.busy + busy, sums.mem_busy + mem_busy, sums.memory_kib + memory))
        return found

    def _expire(self, now: float) -> None:
        gone = [
            key for key, sums in self.entries.items()
            if sums.active == 0 and sums.idle_since is not None and now - sums.idle_since >= self.expiry
        ]
        for key in gone:
            sums = self.entries.pop(key)
            other = self._other(sums.device_index)
            other.absorb(sums)
            _, shared = self._energy.get(sums.device_index, (0.0, {}))
            # its busy figure so far goes with it: no energy share for that
            shared[id(other)] = shared.get(id(other), 0.0) + shared.pop(id(sums), 0.0)
            self.expired += 1

    def share_energy(self, energy: dict[int, float], rows: list[WorkloadRow]) -> None:
        """Share out each GPU's energy used since the previous call (`energy`: joules
        by device index, its counter now) by the workloads' busy percent-seconds added since."""
        for index, joules in energy.items():
            previous = self._energy.get(index)
            busy = {id(row.sums): row.busy for row in rows if row.sums.device_index == index}
            self._energy[index] = (joules, busy)
            if previous is None or joules < previous[0]:
                continue  # the first reading, or a counter that went back (driver reloaded)
            spent = joules - previous[0]
            added = {key: value - previous[1].get(key, 0.0) for key, value in busy.items()}
            total = sum(value for value in added.values() if value > 0)
            if total <= 0 or spent <= 0:
                continue  # the GPU's processes were idle: nothing to share (docs/metrics.md)
            for row in rows:
                share = added.get(id(row.sums), 0.0)
                if row.sums.device_index == index and share > 0:
                    row.sums.energy_joules += spent * share / total

    def __iter__(self) -> Iterator[WorkloadSums]:
        yield from self.entries.values()
        yield from self.others.values()


def _order(sums: WorkloadSums) -> tuple[int, str, str]:
    return sums.device_index, sums.kind, sums.name
