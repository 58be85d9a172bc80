"""Builders of Snapshots for tests: valid defaults, each test changes one field."""

from __future__ import annotations

import zlib

from atopgpud_tw.snapshot import DeviceSample, ProcessSample, Snapshot


def proc(
    pid: int, kind: str = "C", memory: int | None = 1024, gpu: int | None = 10, mem: int | None = 5
) -> ProcessSample:
    return ProcessSample(pid, kind, memory, gpu, mem)


def dev(
    key: str = "gpu0",
    processes: tuple[ProcessSample, ...] | None = (),
    gpu: int | None = 40,
    mem: int | None = 10,
    total: int | None = 16 * 1024 * 1024,
    used: int | None = 2 * 1024 * 1024,
    present: bool = True,
    busid: str | None = None,
    name: str = "NVIDIA Test GPU",
) -> DeviceSample:
    return DeviceSample(
        key=key,
        busid=busid or f"00000000:{zlib.crc32(key.encode()) % 200 + 16:02X}:00.0",  # the same every run
        name=name,
        task_support=3,
        gpu_busy=gpu,
        mem_busy=mem,
        memory_total_kib=total,
        memory_used_kib=used,
        processes=processes,
        present=present,
    )


def snap(*devices: DeviceSample) -> Snapshot:
    return Snapshot(tuple(devices))
