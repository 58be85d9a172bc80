"""The render oracle: ``S`` bodies rendered record by record, with no caching.

`render.PreparedStats` does the shared work of a reply once per poll; these
functions follow the same rules the plain way (every record rendered, then
joined, or selected when the limits bite), so that tests can compare the two
to the byte.  Only tests use them.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from atopgpud_tw.codec.wire import MAX_PROCESSES_PER_DEVICE, PRELUDE, REPLY_LIMIT, ProtocolError
from atopgpud_tw.counters import DeviceTotals, ProcessTotals
from atopgpud_tw.server.atop.render import (
    RenderedDevice,
    StatsBody,
    _keep_in_order,
    _take_exited,
    render_devices,
    render_process,
)


def assemble_stats(
    devices: Sequence[RenderedDevice],
    exited: Sequence[tuple[int, bytes]] = (),
    budget: int = REPLY_LIMIT - PRELUDE.size,
) -> StatsBody:
    """Build an ``S`` body within `budget` bytes and 255 processes per device.

    Device records always go in whole.  When all fits, the output is the devices'
    cached records with the exited ones (``(device index, record)`` in queue
    order) appended.  Otherwise exited records go first, in queue order and up to
    the first that does not fit (the rest stay queued, in order), but never into
    the share kept for the active processes (`_take_exited`); then the active
    ones, largest memory first, in what is left.
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


def _join_selected(
    devices: Sequence[RenderedDevice], exited: Sequence[tuple[int, bytes]], room: int
) -> StatsBody:
    active_counts = [len(d.active) for d in devices]
    active_size = sum(d.size - len(d.header) for d in devices)
    count, tails, sent, room = _take_exited(active_counts, active_size, exited, room)
    candidates = sorted(
        (-memory, index, pid, record) for index, device in enumerate(devices) for memory, pid, record in device.active
    )
    return _keep_in_order(devices, (c[1:] for c in candidates), room, count, tails, sent)


def render_stats(
    devices: Sequence[DeviceTotals],
    version: int,
    exited: Iterable[tuple[int, ProcessTotals]] = (),
) -> StatsBody:
    """An ``S`` body straight from the counters, without any caching."""
    records = [(index, render_process(totals, version, b"E")) for index, totals in exited]
    return assemble_stats(render_devices(devices, version), records)
