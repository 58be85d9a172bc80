"""Parsing replies, for clients (atopgpu) and tests: every field is checked.

A client never trusts a reply: anything that breaks the format, or gives
figures that cannot be, is a `ProtocolError` with a message that says what.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from atopgpud_tw.codec.wire import LLONG_MAX, ProtocolError


@dataclass(frozen=True, slots=True)
class DeviceType:
    busid: str
    name: str
    task_support: int


@dataclass(frozen=True, slots=True)
class ProcessStats:
    state: str
    pid: int
    kind: str
    gpu_busy: int
    mem_busy: int
    memory_now_kib: int
    memory_cum_kib: int
    samples: int


@dataclass(frozen=True, slots=True)
class DeviceStats:
    gpu_busy_now: int
    mem_busy_now: int
    memory_total_kib: int
    memory_used_kib: int
    samples: int
    gpu_busy_cum: int
    mem_busy_cum: int
    memory_used_cum_kib: int
    processes: tuple[ProcessStats, ...]


def _ints(fields: Sequence[str], what: str) -> list[int]:
    # int() alone would also take "+5", " 5" and "1_000", which no daemon sends
    if not all((digits := f.removeprefix("-")).isascii() and digits.isdigit() for f in fields):
        raise ProtocolError(f"non-numeric field in {what}: {' '.join(fields)[:200]!r}")
    # the length first: int() refuses thousands of digits, and later sums overflow floats; atop reads
    # every figure as a signed 64-bit integer
    if any(len(f) > 20 or abs(int(f)) > LLONG_MAX for f in fields):
        raise ProtocolError(f"a field of the {what} is beyond 64 bits")
    return [int(f) for f in fields]


def _ascii(body: bytes) -> str:
    try:
        return body.decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("reply body is not ASCII") from None


def parse_types(body: bytes) -> list[DeviceType]:
    """Parse a ``T`` body; every field is checked."""
    head, *entries = _ascii(body).split("@")
    (count,) = _ints([head], "T count") if head else (None,)
    if count is None or count != len(entries):
        raise ProtocolError(f"T reply announces {head!r} devices and lists {len(entries)}")
    out = []
    for entry in entries:
        fields = entry.split(" ")
        if len(fields) != 3 or not fields[0] or not fields[1]:
            raise ProtocolError(f"malformed T entry {entry!r}")
        (support,) = _ints(fields[2:], "T task support")
        out.append(DeviceType(fields[0], fields[1], support))
    return out


def parse_stats(body: bytes, version: int) -> list[DeviceStats]:
    """Parse an ``S`` body of a given version; every field is checked."""
    text = _ascii(body)
    if not text:
        return []
    if not text.startswith("@"):
        raise ProtocolError("S reply does not start with a device record")
    out = []
    for chunk in text[1:].split("@"):
        head, *procs = chunk.split("#")
        values = _ints(head.split(" "), "device record")
        if len(values) != 8:
            raise ProtocolError(f"device record has {len(values)} fields, not 8")
        gpu_now, mem_now, total, used, samples, gpu_cum, mem_cum, used_cum = values
        processes = tuple(_parse_process(p, version) for p in procs)
        out.append(DeviceStats(gpu_now, mem_now, total, used, samples, gpu_cum, mem_cum, used_cum, processes))
    return out


def _parse_process(text: str, version: int) -> ProcessStats:
    fields = text.split(" ")
    if len(fields) != 8 or fields[0] not in ("A", "E"):
        raise ProtocolError(f"malformed process record {text!r}")
    if version == 1:
        pid, gpu, mem, _zero, now, cum, samples = _ints(fields[1:], "process record")
        kind = "U"
    else:
        kind = fields[2]
        if kind not in ("C", "G", "U"):
            raise ProtocolError(f"unknown process type {kind!r}")
        pid, gpu, mem, now, cum, samples = _ints(fields[1:2] + fields[3:], "process record")
    return ProcessStats(fields[0], pid, kind, gpu, mem, now, cum, samples)


def _check_busy(value: int, high: int, what: str) -> None:
    if not -1 <= value <= high:
        raise ProtocolError(f"{what} {value} is outside -1..{high}")


def _check_not_below(value: int, floor: int, what: str) -> None:
    if value < floor:
        raise ProtocolError(f"{what} {value} is below {floor}")


def check_stats(devices: Sequence[DeviceStats], version: int) -> None:
    """Refuse parsed ``S`` figures no daemon can mean (`ProtocolError`): percentages beyond -1..100 (a sum
    of per-sample ones, 100 per sample), negative counts, memory below -1 ("not available")."""
    for index, dev in enumerate(devices):
        where = f"GPU {index}"
        _check_not_below(dev.samples, 0, f"{where} samples")
        _check_busy(dev.gpu_busy_now, 100, f"{where} gpupercnow")
        _check_busy(dev.mem_busy_now, 100, f"{where} mempercnow")
        _check_busy(dev.gpu_busy_cum, 100 * dev.samples, f"{where} gpuperccum")
        _check_busy(dev.mem_busy_cum, 100 * dev.samples, f"{where} memperccum")
        for name in ("memory_total_kib", "memory_used_kib", "memory_used_cum_kib"):
            _check_not_below(getattr(dev, name), -1, f"{where} {name}")
        for proc in dev.processes:
            what = f"{where} process {proc.pid}"
            _check_not_below(proc.pid, 1, f"{where} process pid")
            _check_not_below(proc.samples, 0, f"{what} samples")
            # version 1 sends averages, version 2 sums of per-sample percentages
            high = 100 if version == 1 else 100 * proc.samples
            _check_busy(proc.gpu_busy, high, f"{what} gpu busy")
            _check_busy(proc.mem_busy, high, f"{what} memory busy")
            _check_not_below(proc.memory_now_kib, -1, f"{what} memory")
            _check_not_below(proc.memory_cum_kib, -1, f"{what} cumulative memory")
