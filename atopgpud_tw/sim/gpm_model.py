"""The simulated driver's GPU Performance Monitoring (a part of `SimulatedNvml`; docs/simulator.md, GPM).

A sample holds a card's (or a MIG GPU instance's) activities integrated over simulated time, so a
metric of two samples is the exact average of the played timelines between them, as the hardware's
counters give it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from atopgpud_tw.figures import GPM_FIGURES
from atopgpud_tw.nvml_codes import INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED, SUCCESS
from atopgpud_tw.sim.answers import NvmlFault, raise_fault
from atopgpud_tw.sim.scenario import GpuSpec, MigSpec, cycled

#: the metrics the model plays, by NVML_GPM_METRIC_* id: (what it follows, share or rate field)
#: "gpu" metrics are shares of the graphics activity, "mem" of the memory activity,
#: "rate" MiB/s while active; from the table's GPM rows (figures.GPM_FIGURES: `Gpm` and `Play`)
PLAYED: dict[int, tuple[str, str | None]] = {
    f.gpm.metric: ("rate" if f.gpm.rate else "gpu" if f.play is None else f.play.follows,
                   None if f.play is None else f.play.field)
    for f in GPM_FIGURES if f.gpm is not None
}


@dataclass(frozen=True)
class GpmRecord:
    """What a filled sample buffer holds: whose counters, when, and their values."""

    #: (GPU index, GPU instance id or None, the instance's start): samples of one source only are compared
    source: tuple[Any, ...]
    at: float
    #: metric id -> its counter: busy seconds (times the share) or MiB
    counters: tuple[tuple[int, float], ...]


def _busy_seconds(part: GpuSpec | MigSpec, which: str, start: float, end: float) -> float:
    """Seconds of `part`'s `which` ("gpu", "mem") activity from `start` to `end` (weighted by the level)."""
    timeline = getattr(part, f"{which}_timeline")
    if timeline is not None:
        return timeline.busy_time(end) * timeline.level / 100.0 - timeline.busy_time(start) * timeline.level / 100.0
    level = float(cycled(getattr(part, f"{which}_util"), 0) or 0)
    return level / 100.0 * end - level / 100.0 * start


class GpmDriver:
    """The GPM calls of the driver model; mixed into `SimulatedNvml`."""

    scenario: Any
    _enter: Any
    _gpu: Any
    _clock: Any
    _instances: Any

    def _gpm_setup(self) -> None:
        self._gpm_lock = threading.Lock()
        self._gpm_next = 0
        #: buffer id -> what it holds (None: allocated, not filled)
        self._gpm_buffers: dict[int, GpmRecord | None] = {}

    @property
    def gpm_buffers(self) -> int:
        """Sample buffers allocated and not freed."""
        return len(self._gpm_buffers)

    def nvmlGpmQueryDeviceSupport(self, handle: Any) -> int:
        self._enter("nvmlGpmQueryDeviceSupport", handle)
        return 0 if self._gpu(handle).gpm is None else 1

    def gpm_alloc(self) -> int:
        """nvmlGpmSampleAlloc: a new buffer's id."""
        self._enter("nvmlGpmSampleAlloc")
        with self._gpm_lock:
            self._gpm_next += 1
            self._gpm_buffers[self._gpm_next] = None
            return self._gpm_next

    def gpm_free(self, buffer: int) -> None:
        self._enter("nvmlGpmSampleFree")
        with self._gpm_lock:
            if self._gpm_buffers.pop(buffer, _MISSING) is _MISSING:
                raise NvmlFault(INVALID_ARGUMENT)

    def _gpm_fill(self, buffer: int, record: GpmRecord) -> None:
        with self._gpm_lock:
            if buffer not in self._gpm_buffers:
                raise NvmlFault(INVALID_ARGUMENT)
            self._gpm_buffers[buffer] = record

    def gpm_sample(self, handle: Any, buffer: int) -> None:
        """nvmlGpmSampleGet: the whole card's counters now (a MIG handle: its GPU instance's)."""
        self._enter("nvmlGpmSampleGet", handle)
        gpu = self._gpu(handle)
        if gpu.gpm is None:
            raise NvmlFault(NOT_SUPPORTED)
        t = self._clock()
        if handle.instance is not None:
            self._gpm_fill(buffer, self._instance_record(handle.gpu, gpu, handle.instance, t))
        else:
            self._gpm_fill(buffer, _record((handle.gpu, None, None), gpu, gpu, 0.0, t, t))

    def gpm_mig_sample(self, handle: Any, gpu_instance: int, buffer: int) -> None:
        """nvmlGpmMigSampleGet: the counters of one GPU instance of a card in MIG mode."""
        now = self._enter("nvmlGpmMigSampleGet", handle)
        gpu: GpuSpec = self._gpu(handle)
        if gpu.gpm is None or gpu.mig is None or handle.instance is not None:
            raise NvmlFault(NOT_SUPPORTED)
        found = [m for m in self._instances(gpu, now) if m.gpu_instance == gpu_instance]
        if not found:
            raise NvmlFault(NOT_FOUND)
        # an instance's own faults: its GPU instance's samples fail with it (the first
        # of its compute instances, in slot order, plays the GPU instance)
        for fault in found[0].faults:
            if fault.call == "nvmlGpmMigSampleGet" and fault.active(now):
                raise_fault(fault.error)
        self._gpm_fill(buffer, self._instance_record(handle.gpu, gpu, found[0], self._clock()))

    def _instance_record(self, index: int, gpu: GpuSpec, instance: MigSpec, t: float) -> GpmRecord:
        """A GPU instance's counters (those its `MigSpec` plays): they run only while it exists."""
        end = t if instance.stop is None else min(t, instance.stop)
        return _record((index, instance.gpu_instance, instance.start), gpu, instance, instance.start, end, t)

    def gpm_metrics(self, first: int, second: int, metric_ids: list[int]) -> list[tuple[int, float]]:
        """nvmlGpmMetricsGet: each metric's (return code, value) between two filled buffers."""
        self._enter("nvmlGpmMetricsGet")
        with self._gpm_lock:
            one, two = self._gpm_buffers.get(first), self._gpm_buffers.get(second)
        if one is None or two is None or one.source != two.source or two.at <= one.at:
            raise NvmlFault(INVALID_ARGUMENT)
        span = two.at - one.at
        before, after = dict(one.counters), dict(two.counters)
        out = []
        for metric in metric_ids:
            if metric not in after:
                out.append((NOT_SUPPORTED, 0.0))
                continue
            change = after[metric] - before[metric]
            kind = PLAYED[metric][0]
            out.append((SUCCESS, change / span if kind == "rate" else 100.0 * change / span))
        return out


_MISSING = object()


def _record(source: tuple[Any, ...], gpu: GpuSpec, part: GpuSpec | MigSpec, start: float, end: float, at: float
            ) -> GpmRecord:
    """The counters of a source (`part`: the card or a MIG instance) active from `start` to `end`, sampled at `at`."""
    spec = gpu.gpm
    assert spec is not None
    end = max(start, end)
    active, memory = _busy_seconds(part, "gpu", start, end), _busy_seconds(part, "mem", start, end)
    counters = []
    values = dict(spec.values)
    for metric, (kind, name) in PLAYED.items():
        scale = 1.0 if name is None else values[name]
        counters.append((metric, (memory if kind == "mem" else active) * scale))
    return GpmRecord(source, at, tuple(counters))
