"""Cumulative counters per device and per process, folded from one Snapshot per poll.

Pure Python, no I/O and no clock: `Counters.fold` is the whole behaviour atop's arithmetic
depends on, by the rules of docs/design.md, "Counter semantics" (``cum / samples`` exact,
-1 for "cannot report", a failed read skipped, every counter monotonic).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from itertools import count
from operator import attrgetter
from typing import Mapping

from atopgpud_tw.snapshot import (
    NO_INFO,
    UNSUPPORTED,
    DeviceInfo,
    DeviceSample,
    GpmFigures,
    ProcessContext,
    ProcessSample,
    Snapshot,
    merge_by_pid,
)

_PID = attrgetter("pid")
#: numbers every process's life on a device, across all counters: never reused
_lives = count(1)


@cache
def _weights() -> dict[str, int]:
    """What a GPM figure is multiplied by besides its seconds: one in MiB/s by a MiB, summed as bytes
    (every other is a percentage).  The table (figures.py) is loaded at the first GPM figures: a
    host without GPM never needs it."""
    from atopgpud_tw.figures import GPM_FIGURES, MIB

    return {f.gpm.name: MIB for f in GPM_FIGURES if f.gpm is not None and f.gpm.rate}


@dataclass(slots=True)
class GpmTotals:
    """One device's GPM sums: seconds covered, and per figure its percent-seconds or bytes.  Each
    poll's figures are exact averages over the seconds between two GPM samples, so the sums'
    ``rate()`` is exact (a poll whose GPM failed is covered by the next one's span)."""

    seconds: float = 0.0
    polls: int = 0
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, figures: GpmFigures) -> None:
        """Count one poll's figures over the seconds they cover (none: a poll too soon after the
        last GPM sample carries the last figures on, over 0 seconds, and adds nothing)."""
        span = figures.seconds
        if span <= 0:
            return
        self.seconds += span
        self.polls += 1
        sums = self.sums
        weights = _weights()
        for name, value in figures.values:
            sums[name] = sums.get(name, 0.0) + value * span * weights.get(name, 1)


@dataclass(slots=True)
class ProcessTotals:
    """The running sums of one process on one device.  `life` tells it apart from any other
    with the same pid there (a reused pid, a GPU lost and read again): per-process state
    elsewhere (version 1's per-client sums) is keyed by it.  `started`: its start time."""

    pid: int
    kind: str = "C"
    samples: int = 0
    memory_now_kib: int = 0
    memory_cum_kib: int = 0
    gpu_busy_cum: int = 0
    mem_busy_cum: int = 0
    #: the poll time of its latest counted sample, and its busy figures each times
    #: the seconds its sample covers (timed polls only; see `Counters.fold`)
    counted_at: float | None = None
    gpu_busy_seconds: float = 0.0
    mem_busy_seconds: float = 0.0
    started: int | None = None
    life: int = field(default_factory=_lives.__next__)
    #: its memory times the seconds each sample covers (timed polls only)
    memory_kib_seconds: float = 0.0
    #: who it is (user, command, cgroup), once the reader has read it (None: not yet)
    context: ProcessContext | None = None

    def add(self, sample: ProcessSample, taken: float | None = None, since: float = 0.0) -> None:
        """Count one poll of this process, unless one of its readings failed."""
        self.kind = sample.kind
        gpu, mem, memory = sample.gpu_busy, sample.mem_busy, sample.memory_kib
        if memory is not None and gpu is not None and mem is not None and memory >= 0 and gpu >= 0 and mem >= 0:
            # the common case, run for every process every poll: three real readings,
            # which `_reading` passes through and `_accumulate` adds unless a sum is -1
            self.samples += 1
            self.memory_now_kib = memory
            if self.memory_cum_kib != UNSUPPORTED:
                self.memory_cum_kib += memory
            if taken is not None:
                span = taken - (since if self.counted_at is None else self.counted_at)
                self.counted_at = taken
                self.gpu_busy_seconds += gpu * span
                self.mem_busy_seconds += mem * span
                self.memory_kib_seconds += memory * span
            # a busy sum that was -1 (not reported) starts again from 0 when it is
            self.gpu_busy_cum = gpu if self.gpu_busy_cum == UNSUPPORTED else self.gpu_busy_cum + gpu
            self.mem_busy_cum = mem if self.mem_busy_cum == UNSUPPORTED else self.mem_busy_cum + mem
            return
        gpu = _reading(self.gpu_busy_cum if self.samples else None, sample.gpu_busy)
        mem = _reading(self.mem_busy_cum if self.samples else None, sample.mem_busy)
        memory = _reading(self.memory_cum_kib if self.samples else None, sample.memory_kib)
        if gpu is None or mem is None or memory is None:
            if memory is not None:
                # the busy figures failed, the memory did not: it is still what is used now
                self.memory_now_kib = memory
            return
        self.samples += 1
        self.memory_now_kib = memory
        if self.memory_cum_kib != UNSUPPORTED:
            # unknown memory is decided by the first sample (WDDM, some vGPU guests: for good)
            self.memory_cum_kib = UNSUPPORTED if memory == UNSUPPORTED else self.memory_cum_kib + memory
        self.gpu_busy_cum = _accumulate(self.gpu_busy_cum, gpu)
        self.mem_busy_cum = _accumulate(self.mem_busy_cum, mem)
        if taken is not None:
            span = taken - (since if self.counted_at is None else self.counted_at)
            self.counted_at = taken
            self.gpu_busy_seconds += max(gpu, 0) * span
            self.mem_busy_seconds += max(mem, 0) * span
            self.memory_kib_seconds += max(memory, 0) * span


@dataclass(frozen=True, slots=True)
class ExitedProcess:
    """A process that ended on the device at `device_index` (T order)."""

    device_index: int
    totals: ProcessTotals


@dataclass(slots=True)
class DeviceTotals:
    """The running sums of one device, and its active processes."""

    key: str
    busid: str
    name: str
    task_support: int
    present: bool = True
    gpu_busy_now: int = UNSUPPORTED
    mem_busy_now: int = UNSUPPORTED
    memory_total_kib: int = 0
    memory_used_kib: int = 0
    #: free and reserved memory at the last read (None: the reader does not report it)
    memory_free_kib: int | None = None
    memory_reserved_kib: int | None = None
    samples: int = 0
    #: None until the first reading decides whether the device supports the value
    gpu_busy_cum: int | None = None
    mem_busy_cum: int | None = None
    memory_used_cum_kib: int = 0
    processes: dict[int, ProcessTotals] = field(default_factory=dict)
    #: the poll time of its latest counted sample (None: none since it was last
    #: present), and each figure times the seconds its sample covers
    counted_at: float | None = None
    gpu_busy_seconds: float = 0.0
    mem_busy_seconds: float = 0.0
    memory_used_kib_seconds: float = 0.0
    #: what the device is (UUID, serial, versions), as its reader last told it
    info: DeviceInfo = NO_INFO
    #: GPM's sums; None while it has given no GPM figures
    gpm: GpmTotals | None = None

    @property
    def gpu_busy_total(self) -> int:
        """The cumulative GPU busy figure as atop gets it (-1: unsupported)."""
        return 0 if self.gpu_busy_cum is None else self.gpu_busy_cum

    @property
    def mem_busy_total(self) -> int:
        """The cumulative memory busy figure as atop gets it (-1: unsupported)."""
        return 0 if self.mem_busy_cum is None else self.mem_busy_cum


def _reading(cum: int | None, value: int | None) -> int | None:
    """A reading as the sum sees it: support is decided by the first reading, and
    "unsupported" after real values is a failed read (None), which must not end the sum."""
    return None if value == UNSUPPORTED and cum is not None and cum != UNSUPPORTED else value


def _accumulate(cum: int | None, value: int | None) -> int:
    """Add one reading (through `_reading`) to a sum: -1 while the readings are -1; a sum
    that was -1 (NOT_SUPPORTED from the start, N/A) starts from 0 when a figure comes."""
    if value == UNSUPPORTED:
        return UNSUPPORTED
    if cum == UNSUPPORTED:
        return value or 0
    return (cum or 0) + (value or 0)


class Counters:
    """All devices' totals, in the order they were first seen (the ``T`` order)."""

    def __init__(self, weigh_processes: bool = False) -> None:
        #: keep the processes' time-weighted sums too (--metrics-processes: they are
        #: a quarter of a fold's time with hundreds of processes, for nobody otherwise)
        self.weigh_processes = weigh_processes
        self.devices: list[DeviceTotals] = []
        self._by_key: dict[str, int] = {}
        #: bumped by every fold, so renderings can be cached per poll
        self.generation = 0
        #: bumped whenever what ``T`` shows (devices, bus ids, names) changes
        self.layout_generation = 0
        #: whether polls come with their times (the daemon's do): the *_seconds sums are kept
        self.timed = False

    def declare(self, snapshot: Snapshot) -> None:
        """Take the devices' identity and order from a snapshot (start-up's), counting nothing."""
        for sample in snapshot.devices:
            self._device_index(sample)

    def fold(self, snapshot: Snapshot, taken: float | None = None, since: float = 0.0) -> list[ExitedProcess]:
        """Count one poll and return the processes that ended in it.  With `taken` (the poll's time on the
        poller's schedule) and `since` (the previous poll's), each counted figure is also summed times the
        seconds since its previous counted sample (or `since`): a skipped sample is covered by the next."""
        exited: list[ExitedProcess] = []
        seen: set[int] = set()
        if taken is not None:
            self.timed = True
        devices = self.devices
        for sample in snapshot.devices:
            index = self._device_index(sample)
            if index in seen:
                continue
            seen.add(index)
            exited.extend(self._fold_device(index, sample, taken, since, snapshot.contexts))
        if len(seen) != len(devices):
            for index, device in enumerate(devices):
                if index not in seen:
                    exited.extend(self._mark_absent(index, device))
        self.generation += 1
        return exited

    def _device_index(self, sample: DeviceSample) -> int:
        index = self._by_key.get(sample.key)
        if index is None:
            index = self._by_key[sample.key] = len(self.devices)
            self.devices.append(
                DeviceTotals(sample.key, sample.busid, sample.name, sample.task_support, info=sample.info)
            )
            self.layout_generation += 1
            return index
        device = self.devices[index]
        info = sample.info
        if info is not device.info and info is not NO_INFO and info != device.info:
            device.info = info  # a reader that could not tell it (NO_INFO) leaves it as it was
        if sample.busid != device.busid or sample.name != device.name or sample.task_support != device.task_support:
            device.busid, device.name, device.task_support = sample.busid, sample.name, sample.task_support
            self.layout_generation += 1
        return index

    def _mark_absent(self, index: int, device: DeviceTotals) -> list[ExitedProcess]:
        device.present = False
        device.counted_at = None  # its absence is no span of its next sample
        device.gpu_busy_now = device.mem_busy_now = UNSUPPORTED
        gone = [ExitedProcess(index, totals) for totals in device.processes.values()]
        device.processes = {}
        return gone

    def _fold_device(
        self, index: int, sample: DeviceSample, taken: float | None, since: float,
        contexts: Mapping[int, ProcessContext],
    ) -> list[ExitedProcess]:
        device = self.devices[index]
        if not sample.present:
            return self._mark_absent(index, device)
        device.present = True
        if sample.gpm is not None:
            device.gpm = device.gpm or GpmTotals()  # at the first figures a device has
            device.gpm.add(sample.gpm)
        device.gpu_busy_now = UNSUPPORTED if sample.gpu_busy is None else sample.gpu_busy
        device.mem_busy_now = UNSUPPORTED if sample.mem_busy is None else sample.mem_busy
        if sample.memory_total_kib is not None:
            device.memory_total_kib = sample.memory_total_kib
        if sample.memory_used_kib is not None:
            # (a read that failed keeps the last figures, as it does the used)
            device.memory_used_kib = sample.memory_used_kib
            device.memory_free_kib = sample.memory_free_kib
            device.memory_reserved_kib = sample.memory_reserved_kib
        gpu = _reading(device.gpu_busy_cum, sample.gpu_busy)
        mem = _reading(device.mem_busy_cum, sample.mem_busy)
        if None not in (gpu, mem, sample.memory_used_kib):
            device.samples += 1
            device.gpu_busy_cum = _accumulate(device.gpu_busy_cum, gpu)
            device.mem_busy_cum = _accumulate(device.mem_busy_cum, mem)
            device.memory_used_cum_kib += sample.memory_used_kib or 0
            if taken is not None:
                span = taken - (since if device.counted_at is None else device.counted_at)
                device.counted_at = taken
                device.gpu_busy_seconds += max(gpu or 0, 0) * span
                device.mem_busy_seconds += max(mem or 0, 0) * span
                device.memory_used_kib_seconds += (sample.memory_used_kib or 0) * span
        processes = sample.processes
        if processes is None:
            return []
        taken = taken if self.weigh_processes else None
        merged = dict(zip(map(_PID, processes), processes))  # no Python frame per process
        if len(merged) != len(processes):
            merged = merge_by_pid(processes)  # one sample per pid, its kinds merged (C+G)
        active = device.processes
        reused: list[ExitedProcess] = []
        for pid, proc in merged.items():
            totals = active.get(pid)
            if totals is None:
                totals = active[pid] = ProcessTotals(pid, proc.kind, started=proc.started)
            elif proc.started != totals.started and proc.started is not None:
                if totals.started is not None:
                    # another process with the same pid: the one before it ended
                    reused.append(ExitedProcess(index, totals))
                    totals = active[pid] = ProcessTotals(pid, proc.kind, started=proc.started)
                else:
                    totals.started = proc.started  # first seen now: the same process
            totals.add(proc, taken, since)
            if totals.context is None and contexts:
                totals.context = contexts.get(pid)  # read once per process, by the reader
        if len(active) == len(merged):
            return reused  # every active process was seen in this poll
        ended = [pid for pid in active if pid not in merged]
        return reused + [ExitedProcess(index, active.pop(pid)) for pid in ended]
