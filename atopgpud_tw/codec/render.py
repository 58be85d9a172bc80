"""Rendering ``T`` and ``S`` bodies from the counters, within atop's limits.

``T`` body: ``N@busid name tasksupport@busid name tasksupport...``

``S`` body: per device, in ``T`` order, ``@gpupercnow mempercnow memtotal memused
samples gpuperccum memperccum memusedcum`` followed by its processes:

- version 1: ``#A pid gpubusy membusy 0 memnow memcum samples`` (busy percentages,
  which atop shows as the interval's);
- version 2: ``#A pid type gpubusycum membusycum memnow memcum samples``;

``A`` for an active process, ``E`` for one that ended since the client's previous
``S``.  Memory is in KiB, -1 means "not available".
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Iterable, Sequence

from atopgpud_tw.codec.wire import (
    MAX_PROCESSES_PER_DEVICE,
    PRELUDE,
    REPLY_LIMIT,
    ProtocolError,
    wire_token,
)
from atopgpud_tw.counters import DeviceTotals, ProcessTotals

__all__ = [
    "render_types",
    "render_device",
    "render_process",
    "RenderedDevice",
    "render_devices",
    "StatsBody",
    "assemble_stats",
    "render_stats",
    "PreparedStats",
]

_WIRE_KIND = {"C": b"C", "G": b"G", "C+G": b"C"}


# -- T ---------------------------------------------------------------------------


def render_types(devices: Sequence[DeviceTotals]) -> bytes:
    """The ``T`` body (the same for versions 1 and 2)."""
    parts = [b"%d" % len(devices)]
    for device in devices:
        parts.append(
            b"@%s %s %d"
            % (wire_token(device.busid), wire_token(device.name), device.task_support)
        )
    return b"".join(parts)


# -- S ---------------------------------------------------------------------------


def render_device(device: DeviceTotals) -> bytes:
    """A device's ``@`` record (identical in versions 1 and 2)."""
    return b"@%d %d %d %d %d %d %d %d" % (
        device.gpu_busy_now,
        device.mem_busy_now,
        device.memory_total_kib,
        device.memory_used_kib,
        device.samples,
        device.gpu_busy_total,
        device.mem_busy_total,
        device.memory_used_cum_kib,
    )


def _average(cum: int, samples: int) -> int:
    if cum < 0:
        return -1
    return cum // samples if samples else 0


def render_process(
    totals: ProcessTotals, version: int, state: bytes = b"A", busy: tuple[int, int] | None = None
) -> bytes:
    """A process's ``#`` record for a reply version; `state` is ``A`` or ``E``.

    Version 1 carries busy percentages, not sums: atop shows them as the
    interval's figures.  `busy` gives them (the board works them out per client
    over its interval); without it they are the averages since the process began.
    """
    if version == 1:
        gpu, mem = busy or (
            _average(totals.gpu_busy_cum, totals.samples),
            _average(totals.mem_busy_cum, totals.samples),
        )
        return b"#%s %d %d %d 0 %d %d %d" % (
            state,
            totals.pid,
            gpu,
            mem,
            totals.memory_now_kib,
            totals.memory_cum_kib,
            totals.samples,
        )
    return b"#%s %d %s %d %d %d %d %d" % (
        state,
        totals.pid,
        _WIRE_KIND.get(totals.kind, b"U"),
        totals.gpu_busy_cum,
        totals.mem_busy_cum,
        totals.memory_now_kib,
        totals.memory_cum_kib,
        totals.samples,
    )


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
    for device in devices:
        active = sorted(
            (
                (totals.memory_now_kib, totals.pid, render_process(totals, version))
                for totals in device.processes.values()
            ),
            key=lambda item: (-item[0], item[1]),
        )
        rendered.append(RenderedDevice(render_device(device), tuple(active)))
    return tuple(rendered)


@dataclass(frozen=True, slots=True)
class StatsBody:
    body: bytes
    #: positions in the exited list that went into this body (the rest stay queued)
    exited_sent: tuple[int, ...]
    #: True when some active processes were left out to respect the limits
    active_cut: bool


def assemble_stats(
    devices: Sequence[RenderedDevice],
    exited: Sequence[tuple[int, bytes]] = (),
    budget: int = REPLY_LIMIT - PRELUDE.size,
) -> StatsBody:
    """Build an ``S`` body within `budget` bytes and 255 processes per device.

    Device records always go in whole.  Then exited processes (``(device index,
    record)`` in queue order), then active ones, largest memory first.  When all
    fits, the output is the devices' cached records with the exited ones appended.
    """
    room = budget - sum(len(d.header) for d in devices)
    if room < 0:
        raise ProtocolError("the device records alone exceed the reply limit")
    count = [len(d.active) for d in devices]
    exited_size = 0
    for index, record in exited:
        count[index] += 1
        exited_size += len(record)
    if exited_size + sum(d.size - len(d.header) for d in devices) <= room and max(
        count, default=0
    ) <= MAX_PROCESSES_PER_DEVICE:
        return _join_all(devices, exited)
    return _join_selected(devices, exited, room)


def _join_all(devices: Sequence[RenderedDevice], exited: Sequence[tuple[int, bytes]]) -> StatsBody:
    tails: list[list[bytes]] = [[] for _ in devices]
    for index, record in exited:
        tails[index].append(record)
    parts: list[bytes] = []
    for device, tail in zip(devices, tails):
        parts.append(device.header)
        parts.extend(rec for _, _, rec in device.active)
        parts.extend(tail)
    return StatsBody(b"".join(parts), tuple(range(len(exited))), False)


def _take_exited(
    devices: int, exited: Sequence[tuple[int, bytes]], room: int
) -> tuple[list[int], list[list[bytes]], list[int], int]:
    """Exited records first, in queue order, as far as room and each device's cap allow.

    Returns the records taken per device (count and list), their positions in
    `exited`, and the room left.
    """
    count = [0] * devices
    tails: list[list[bytes]] = [[] for _ in range(devices)]
    sent: list[int] = []
    for position, (index, record) in enumerate(exited):
        if count[index] < MAX_PROCESSES_PER_DEVICE and len(record) <= room:
            room -= len(record)
            count[index] += 1
            tails[index].append(record)
            sent.append(position)
    return count, tails, sent, room


def _join_selected(
    devices: Sequence[RenderedDevice], exited: Sequence[tuple[int, bytes]], room: int
) -> StatsBody:
    count, tails, sent, room = _take_exited(len(devices), exited, room)
    candidates = sorted(
        (-memory, index, pid, record) for index, device in enumerate(devices) for memory, pid, record in device.active
    )
    return _keep_in_order(devices, (c[1:] for c in candidates), room, count, tails, sent)


def _keep_in_order(
    devices: Sequence[RenderedDevice],
    candidates: Iterable[tuple[int, int, bytes]],
    room: int,
    count: list[int],
    tails: list[list[bytes]],
    sent: list[int],
) -> StatsBody:
    """Active processes in the candidates' order, as far as room and each device's cap allow.

    `candidates` are ``(device index, pid, record)``, largest memory first; the
    exited records already taken are in `count`, `tails` and `sent`.
    """
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


def render_stats(
    devices: Sequence[DeviceTotals],
    version: int,
    exited: Iterable[tuple[int, ProcessTotals]] = (),
) -> StatsBody:

    """An ``S`` body straight from the counters, without any caching."""
    records = [(index, render_process(totals, version, b"E")) for index, totals in exited]
    return assemble_stats(render_devices(devices, version), records)


class PreparedStats:
    """The part of an ``S`` body that every client shares until the next poll.

    Built once per poll and version from `render_devices`; `body` then gives one
    client's body with its own exited records added.  It follows the rules of
    `assemble_stats` to the byte (a test compares the two) but does the shared
    work once: each device's records are joined in advance, so a reply that fits
    costs work in proportion to the devices and the client's exited records only,
    and the order in which active processes are kept when the limit bites is
    sorted once.
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
        """The rules of `_join_selected`: exited records first, then the largest active processes."""
        devices = self.devices
        count, tails, sent, room = _take_exited(len(devices), exited, self._room)
        order = self._order or self._sorted()
        if any(c + n > MAX_PROCESSES_PER_DEVICE for c, n in zip(count, self._counts)):
            return self._select_capped(order, room, count, tails, sent)
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

    def _select_capped(
        self, order: _Order, room: int, count: list[int], tails: list[list[bytes]], sent: list[int]
    ) -> StatsBody:
        """`_select` where a device may reach atop's 255 processes: one candidate at a time."""
        return _keep_in_order(self.devices, order.candidates, room, count, tails, sent)

    def _sorted(self) -> _Order:
        self._order = _Order(self.devices)
        return self._order


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
        #: sizes[k]: bytes of the first k records
        self.sizes = [0]
        for _, record in self.records:
            self.sizes.append(self.sizes[-1] + len(record))
        #: smallest_after[k]: the shortest record from position k on
        self.smallest_after = [0] * len(self.records) + [0]
        shortest = 1 << 30
        for position in range(len(self.records) - 1, -1, -1):
            shortest = min(shortest, len(self.records[position][1]))
            self.smallest_after[position] = shortest
        #: per device, its records' positions in the order, and its cumulative record sizes
        self.positions: list[list[int]] = [[] for _ in devices]
        for position, (index, _) in enumerate(self.records):
            self.positions[index].append(position)
        self.offsets = []
        for device in devices:
            sums = [0]
            for _, _, record in device.active:
                sums.append(sums[-1] + len(record))
            self.offsets.append(sums)
