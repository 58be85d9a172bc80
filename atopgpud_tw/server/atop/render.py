"""The daemon's side of the wire format: ``T`` and ``S`` bodies rendered from the counters, within atop's limits.

``T`` body: ``N@busid name tasksupport@busid name tasksupport...``

``S`` body: per device, in ``T`` order, ``@gpupercnow mempercnow memtotal memused
samples gpuperccum memperccum memusedcum`` followed by its processes:

- version 1: ``#A pid gpubusy membusy 0 memnow memcum samples`` (busy percentages,
  which atop shows as the interval's);
- version 2: ``#A pid type gpubusycum membusycum memnow memcum samples``;

``A`` for an active process, ``E`` for one that ended since the client's previous
``S``.  Memory is in KiB, -1 means "not available".  A reply carries at most
`MAX_WIRE_DEVICES` devices, names and bus ids of at most `MAX_TOKEN_CHARS`
characters, and numbers from -1 to the largest value of the C type atop parses
them into (`INT_MAX` for the busy percentages now and the pid, `LLONG_MAX` for the
rest).  When the processes do not fit, `PreparedStats` shares the reply between
active and exited processes (docs/protocol.md).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable, Sequence

from atopgpud_tw.codec.wire import (
    INT_MAX,
    LLONG_MAX,
    MAX_PROCESSES_PER_DEVICE,
    MAX_WIRE_DEVICES,
    PRELUDE,
    REPLY_LIMIT,
    ProtocolError,
    wire_token,
)
from atopgpud_tw.counters import DeviceTotals, ProcessTotals

#: when a device's processes exceed atop's 255, its active processes keep at least
#: this many places (or all they need, if fewer) whatever the exited ones queued
ACTIVE_SHARE_COUNT = (MAX_PROCESSES_PER_DEVICE + 1) // 2
#: the shortest ``#`` record is 16 bytes: no reply holds more exited records than
#: this, so a queue is looked at no further
EXITED_SCAN = (REPLY_LIMIT - PRELUDE.size) // 16

_WIRE_KIND = {"C": b"C", "G": b"G", "C+G": b"C"}


def render_types(devices: Sequence[DeviceTotals]) -> bytes:
    """The ``T`` body (the same for versions 1 and 2)."""
    devices = devices[:MAX_WIRE_DEVICES]
    parts = [b"@%s %s %d" % (wire_token(d.busid), wire_token(d.name), d.task_support & 7) for d in devices]
    return b"%d" % len(devices) + b"".join(parts)


def render_device(device: DeviceTotals) -> bytes:
    """A device's ``@`` record (identical in versions 1 and 2)."""
    now: tuple[int, ...] = (device.gpu_busy_now, device.mem_busy_now)
    rest: tuple[int, ...] = (device.memory_total_kib, device.memory_used_kib, device.samples)
    rest += (device.gpu_busy_total, device.mem_busy_total, device.memory_used_cum_kib)
    if min(now + rest) < -1 or max(now) > INT_MAX or max(rest) > LLONG_MAX:
        now, rest = _clamped(now, INT_MAX), _clamped(rest, LLONG_MAX)
    return b"@%d %d %d %d %d %d %d %d" % (now + rest)


def _clamped(values: tuple[int, ...], top: int) -> tuple[int, ...]:
    """Numbers as atop can read them: -1 to `top`."""
    return tuple(-1 if v < -1 else top if v > top else v for v in values)


def _average(cum: int, samples: int) -> int:
    return -1 if cum < 0 else (cum // samples if samples else 0)


def render_process(
    totals: ProcessTotals, version: int, state: bytes = b"A", busy: tuple[int, int] | None = None
) -> bytes:
    """A process's ``#`` record; `state` is ``A`` or ``E``.  Version 1 carries busy percentages
    (atop shows them as the interval's): `busy`, else the averages since the process began."""
    pid = totals.pid
    if version == 1:
        busy = busy or (_average(totals.gpu_busy_cum, totals.samples), _average(totals.mem_busy_cum, totals.samples))
    else:
        busy = (totals.gpu_busy_cum, totals.mem_busy_cum)
    values: tuple[int, ...] = (*busy, totals.memory_now_kib, totals.memory_cum_kib, totals.samples)
    if min(values) < -1 or max(values) > LLONG_MAX or not 0 <= pid <= INT_MAX:
        pid, values = _clamped((pid,), INT_MAX)[0], _clamped(values, LLONG_MAX)
    if version == 1:
        return b"#%s %d %d %d 0 %d %d %d" % ((state, pid) + values)  # type: ignore[str-format]  # bytes, then ints
    kind = _WIRE_KIND.get(totals.kind, b"U")
    return b"#%s %d %s %d %d %d %d %d" % ((state, pid, kind) + values)  # type: ignore[str-format]  # as above


@dataclass(frozen=True, slots=True)
class RenderedDevice:
    """A device's record and its active processes' records, largest memory first."""

    header: bytes
    #: (memory now in KiB, pid, record), sorted by memory descending then pid
    active: tuple[tuple[int, int, bytes], ...]

    @property
    def size(self) -> int:
        return len(self.header) + sum(len(rec) for _, _, rec in self.active)


def render_devices(devices: Sequence[DeviceTotals], version: int) -> tuple[RenderedDevice, ...]:
    """Render every device and active process once, for reuse until the next poll."""
    rendered = []
    for device in devices[:MAX_WIRE_DEVICES]:
        active = [(t.memory_now_kib, t.pid, render_process(t, version)) for t in device.processes.values()]
        active.sort(key=lambda item: (-item[0], item[1]))
        rendered.append(RenderedDevice(render_device(device), tuple(active)))
    return tuple(rendered)


@dataclass(frozen=True, slots=True)
class StatsBody:
    body: bytes
    #: positions in the exited list that went into this body (the rest stay queued)
    exited_sent: tuple[int, ...]
    #: True when some active processes were left out to respect the limits
    active_cut: bool


def _take_exited(
    active_counts: Sequence[int], active_size: int, exited: Sequence[tuple[int, bytes]], room: int
) -> tuple[list[int], list[list[bytes]], list[int], int]:
    """The exited records that go first, in queue order up to the first that does not fit:
    active processes keep half the room and `ACTIVE_SHARE_COUNT` of each device's 255 places
    (or all they need, if less).  The records taken per device (count and list), their
    positions in `exited`, and the room left."""
    share = room - min(active_size, room // 2)
    caps = [MAX_PROCESSES_PER_DEVICE - min(n, ACTIVE_SHARE_COUNT) for n in active_counts]
    count = [0] * len(active_counts)
    tails: list[list[bytes]] = [[] for _ in active_counts]
    sent: list[int] = []
    for position, (index, record) in enumerate(exited):
        if count[index] >= caps[index] or len(record) > share:
            break
        share -= len(record)
        room -= len(record)
        count[index] += 1
        tails[index].append(record)
        sent.append(position)
    return count, tails, sent, room


def _keep_in_order(
    devices: Sequence[RenderedDevice],
    candidates: Iterable[tuple[int, int, bytes]],
    room: int,
    count: list[int],
    tails: list[list[bytes]],
    sent: list[int],
) -> StatsBody:
    """Active processes in the candidates' order (``(device index, pid, record)``), as far as
    room and each device's cap allow, after the exited ones in `count`, `tails` and `sent`."""
    chosen: list[set[int]] = [set() for _ in devices]
    cut = False
    for index, pid, record in candidates:
        if count[index] < MAX_PROCESSES_PER_DEVICE and len(record) <= room:
            room -= len(record)
            count[index] += 1
            chosen[index].add(pid)
        else:
            cut = True
    parts: list[bytes] = []
    for device, keep, tail in zip(devices, chosen, tails):
        parts.append(device.header)
        parts.extend(rec for _, pid, rec in device.active if pid in keep)
        parts.extend(tail)
    return StatsBody(b"".join(parts), tuple(sent), cut)


class PreparedStats:
    """The part of an ``S`` body that every client shares until the next poll.

    `body` gives one client's body within `budget` bytes and 255 processes per device:
    its exited records appended when all fits; else exited records first, within their
    share (`_take_exited`), then the largest active processes that fit.  The tests'
    oracle (tests/render_oracle.py) renders the same rules record by record.
    """

    __slots__ = ("devices", "full", "_blocks", "_counts", "_room", "_active_size", "_order")

    def __init__(self, devices: Sequence[RenderedDevice], budget: int = REPLY_LIMIT - PRELUDE.size) -> None:
        self.devices = tuple(devices)
        headers = sum(len(d.header) for d in self.devices)
        self._room = budget - headers
        if self._room < 0:
            raise ProtocolError("the device records alone exceed the reply limit")
        self._blocks = [d.header + b"".join([rec for _, _, rec in d.active]) for d in self.devices]
        self._counts = [len(d.active) for d in self.devices]
        self._active_size = sum(map(len, self._blocks)) - headers
        self._order: _Order | None = None
        #: the body for a client with no exited processes to hear of
        self.full = self.body(())

    def body(self, exited: Sequence[tuple[int, bytes]] = ()) -> StatsBody:
        """One client's body: `exited` is its ``(device index, E record)`` list in queue order."""
        count = self._counts
        size = self._active_size
        if exited:
            count = list(count)
            for index, record in exited:
                count[index] += 1
                size += len(record)
        if size > self._room or max(count, default=0) > MAX_PROCESSES_PER_DEVICE:
            return self._select(exited)
        if not exited:
            return StatsBody(b"".join(self._blocks), (), False)
        tails: dict[int, list[bytes]] = {}
        for index, record in exited:
            tails.setdefault(index, []).append(record)
        parts: list[bytes] = []
        for index, block in enumerate(self._blocks):
            parts.append(block)
            parts.extend(tails.get(index, ()))
        return StatsBody(b"".join(parts), tuple(range(len(exited))), False)

    def _select(self, exited: Sequence[tuple[int, bytes]]) -> StatsBody:
        devices = self.devices
        count, tails, sent, room = _take_exited(self._counts, self._active_size, exited, self._room)
        order = self._order = self._order or _Order(devices)
        if any(c + n > MAX_PROCESSES_PER_DEVICE for c, n in zip(count, self._counts)):
            # a device may reach atop's 255 processes: one candidate at a time
            return _keep_in_order(devices, order.candidates, room, count, tails, sent)
        # no device can reach its cap: the largest processes that fit in a row are a
        # prefix of the order (found by bisection), and each device's share of that
        # prefix is a prefix of its own joined records (a slice of its block)
        taken = bisect_right(order.sizes, room) - 1
        room -= order.sizes[taken]
        extra: list[list[bytes]] = [[] for _ in devices]
        kept = taken
        for position in range(taken + 1, len(order.records)):
            if room < order.smallest_after[position]:
                break
            index, record = order.records[position]
            if len(record) <= room:
                room -= len(record)
                extra[index].append(record)
                kept += 1
        parts: list[bytes] = []
        for index, device in enumerate(devices):
            share = bisect_left(order.positions[index], taken)
            parts.append(self._blocks[index][: len(device.header) + order.offsets[index][share]])
            parts.extend(extra[index])
            parts.extend(tails[index])
        return StatsBody(b"".join(parts), tuple(sent), kept < len(order.records))


class _Order:
    """Every active process of a `PreparedStats`, largest memory first, and sums over that order."""

    __slots__ = ("candidates", "records", "sizes", "smallest_after", "positions", "offsets")

    def __init__(self, devices: Sequence[RenderedDevice]) -> None:
        ranked = sorted(
            (-memory, index, pid, record)
            for index, device in enumerate(devices)
            for memory, pid, record in device.active
        )
        self.candidates = [(index, pid, record) for _, index, pid, record in ranked]
        self.records = [(index, record) for index, _, record in self.candidates]
        lengths = [len(record) for _, record in self.records]
        #: sizes[k]: bytes of the first k records
        self.sizes = [0, *accumulate(lengths)]
        #: smallest_after[k]: the shortest record from position k on
        self.smallest_after = [*reversed(list(accumulate(reversed(lengths), min))), 0]
        #: per device, its records' positions in the order, and its cumulative record sizes
        self.positions: list[list[int]] = [[] for _ in devices]
        for position, (index, _) in enumerate(self.records):
            self.positions[index].append(position)
        self.offsets = [[0, *accumulate(len(record) for _, _, record in d.active)] for d in devices]
