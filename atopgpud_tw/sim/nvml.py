"""The simulated driver: what a scenario's GPUs report, call by call (docs/simulator.md, docs/mig.md).

`SimulatedNvml` is the driver model beneath the simulated libnvidia-ml (`library.py`): a method
per NVML function, answering plain data (`answers.py`) or raising `NvmlFault(code)`, following
the driver where a poller depends on it.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from atopgpud_tw.figures import ENGINE_BUSY, FIGURES, GPM_FIGURES, MEMORY_TEMPERATURE, Play
from atopgpud_tw.nvml_codes import (
    DEVICE_MIG_DISABLE,
    DEVICE_MIG_ENABLE,
    DRIVER_NOT_LOADED,
    EVENT_XID,
    GPU_UTILIZATION_SAMPLES,
    INVALID_ARGUMENT,
    MEMORY_UTILIZATION_SAMPLES,
    NO_INSTANCE,
    NOT_FOUND,
    NOT_SUPPORTED,
    SUCCESS,
    TIMEOUT,
    UNINITIALIZED,
    VALUE_TYPE_UNSIGNED_INT,
    VALUE_TYPE_UNSIGNED_LONG_LONG,
)
from atopgpud_tw.sim.answers import (
    Answers,
    Memory,
    NvmlFault,
    PciInfo,
    ProcessSample,
    Rates,
    RunningProcess,
    Sample,
    raise_fault,
)
from atopgpud_tw.sim.library_symbols import CUDA_VERSIONS, DRIVERS
from atopgpud_tw.sim.replay import SAMPLE_BUFFER, Replayed
from atopgpud_tw.sim.scenario import Fault, GpuSpec, LinkSpec, MigSpec, Played, ProcessSpec, Scenario, cycled, in_span

#: seconds within which a process's cycled utilization is the same sample
HOLD = 0.05
#: the memory temperature's field (its row of the table), answered as an unsigned int
FIELD_MEMORY_TEMP = next(f.nvml.field for f in FIGURES if f.family is MEMORY_TEMPERATURE and f.nvml)
#: the driver's sampling period of the engines' utilization, in microseconds
ENGINE_PERIOD_US = 167_000


def _by_arguments(function: str) -> dict[tuple[int, ...], Play]:
    return {f.nvml.args: f.play for f in FIGURES if f.nvml and f.play and f.nvml.function == function}


#: function (and its older names) -> its arguments -> the field it answers: the table's calls that
#: answer one number (a bit of it, or a value below a bound, is the reader's business)
PLAIN: dict[str, dict[tuple[int, ...], Play]] = {}
for _f in FIGURES:
    if _f.nvml and _f.play and _f.nvml.pick is None and _f.nvml.field is None and not _f.nvml.per_link:
        for _function in (_f.nvml.function, *_f.nvml.older):
            PLAIN.setdefault(_function, {})[_f.nvml.args] = _f.play
#: the plain calls that refuse arguments of no row as invalid (the others: NOT_SUPPORTED)
PICKY = ("nvmlDeviceGetTemperature", "nvmlDeviceGetTotalEccErrors")
#: field id of nvmlDeviceGetFieldValues -> the card's field it answers; a link's field
FIELD_IDS = {f.nvml.field: f.play for f in FIGURES if f.nvml and f.play and f.nvml.field is not None
             and not f.nvml.per_link}
LINK_FIELD_IDS = {f.nvml.field: f.play for f in FIGURES if f.nvml and f.play and f.nvml.field is not None
                  and f.nvml.per_link}
#: nvmlPerfPolicyType_t -> field; nvmlNvLinkErrorCounter_t -> a link's field
VIOLATIONS = _by_arguments("nvmlDeviceGetViolationStatus")
LINK_ERRORS = _by_arguments("nvmlDeviceGetNvLinkErrorCounter")
#: the engines' utilization functions -> field
ENGINES = {f.nvml.function: f.play.field for f in FIGURES if f.nvml and f.play and f.nvml.pick == 0
           and f.family is ENGINE_BUSY}
#: the fields of nvmlDeviceGetRemappedRows' answers, in their order (the table's)
REMAPPED = tuple(f.play.field for f in FIGURES if f.nvml and f.play and f.nvml.function == "nvmlDeviceGetRemappedRows")
#: the metrics the model plays, by NVML_GPM_METRIC_* id: (what it follows, share or rate field)
#: "gpu" metrics are shares of the graphics activity, "mem" of the memory activity,
#: "rate" MiB/s while active; from the table's GPM rows (figures.GPM_FIGURES: `Gpm` and `Play`)
GPM_PLAYED: dict[int, tuple[str, str | None]] = {
    f.gpm.metric: ("rate" if f.gpm.rate else "gpu" if f.play is None else f.play.follows,
                   None if f.play is None else f.play.field)
    for f in GPM_FIGURES if f.gpm is not None
}


#: a change of the host's clocks against the monotonic one smaller than this is not a step
LIVE_STEP_US = 1_000
#: the wall clock (epoch) and the clocks that go on across a suspend
WALL, BOOT = 0, 1


def live_offsets() -> tuple[int, int]:
    """The host's (CLOCK_REALTIME, CLOCK_BOOTTIME) less CLOCK_MONOTONIC, µs."""
    mono = time.monotonic_ns()
    try:
        boot = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    except OSError:  # some LD_PRELOAD time shifters fail it: taken as not moved
        boot = mono
    return (time.time_ns() - mono) // 1000, (boot - mono) // 1000


class HostClocks:
    """How far the wall clock and the boot clock are from simulated time, by simulated time: by the
    scenario's ``clock_steps`` and ``suspends`` and, on the real clock, by what the host's clocks did
    (docs/simulator.md, "The driver's clocks")."""

    def __init__(
        self, steps: Sequence[tuple[float, float]] = (), suspends: Sequence[tuple[float, float]] = (),
        live: bool = False,
    ) -> None:
        #: (simulated time, wall shift µs, boot shift µs), in order: the shifts from then on
        self._changes: list[tuple[float, int, int]] = [(float("-inf"), 0, 0)]
        moments = sorted([(when, int(seconds * 1e6), 0) for when, seconds in steps]
                         + [(when, int(seconds * 1e6), int(seconds * 1e6)) for when, seconds in suspends])
        wall = boot = 0
        for when, by_wall, by_boot in moments:
            wall += by_wall
            boot += by_boot
            self._changes.append((when, wall, boot))
        self._times = [when for when, _, _ in self._changes]
        self._live = live_offsets() if live else None
        self._live_shift = (0, 0)

    @property
    def steady(self) -> bool:
        """Whether no clock has moved yet (nor is scripted to)."""
        return len(self._changes) == 1

    def shift_us(self, when: float, which: int) -> int:
        """How far clock `which` (WALL, BOOT) is ahead of simulated time at `when`, µs."""
        change = self._changes[bisect_right(self._times, when) - 1]
        return int(change[1 + which])

    def observe(self, now: float) -> None:
        """On the real clock: note a step of the host's clocks as of simulated time `now`."""
        if self._live is None:
            return
        real, boot = live_offsets()
        shift = (real - self._live[0], boot - self._live[1])
        if abs(shift[0] - self._live_shift[0]) < LIVE_STEP_US and abs(shift[1] - self._live_shift[1]) < LIVE_STEP_US:
            return
        moved = (shift[0] - self._live_shift[0], shift[1] - self._live_shift[1])
        self._live_shift = shift
        # from now on (scripted changes after now move by it too)
        position = bisect_right(self._times, now)
        before = self._changes[position - 1]
        later = [(when, wall + moved[0], boot + moved[1]) for when, wall, boot in self._changes[position:]]
        self._changes[position:] = [(now, before[1] + moved[0], before[2] + moved[1]), *later]
        self._times = [when for when, _, _ in self._changes]


@dataclass(frozen=True)
class Load:
    """What a GPU truly did over a span (`SimulatedNvml.true_load`): busy %, memory busy %, by pid (SM %, memory %)."""

    gpu: float
    mem: float
    processes: dict[int, tuple[float, float]]


@dataclass(frozen=True)
class Handle:
    """A device handle: a card, or a MIG instance of a card."""

    gpu: int
    instance: MigSpec | None = None


@dataclass
class EventSet:
    """An event set: the cards registered, when, and the events each was given."""

    registered: dict[int, float] = field(default_factory=dict)
    delivered: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class GpmRecord:
    """What a filled sample buffer holds: whose counters, when, and their values."""

    #: (GPU index, GPU instance id or None, the instance's start): samples of one source only are compared
    source: tuple[Any, ...]
    at: float
    #: metric id -> its counter: busy seconds (times the share) or MiB
    counters: tuple[tuple[int, float], ...]


def _device(method: Callable[..., Any]) -> Any:
    """An NVML call with a handle: `_enter` (delay, faults, initialisation), then `method` given its GPU and time."""

    @functools.wraps(method)
    def call(self: SimulatedNvml, handle: Handle, *args: Any) -> Any:
        now = self._enter(method.__name__, handle)
        return method(self, handle, self._gpu(handle), now, *args)

    return call


class SimulatedNvml:
    """The driver model: a method per NVML function, answering plain data or raising `NvmlFault`."""

    def __init__(self, scenario: Scenario, clock: Callable[[], float] | None = None) -> None:
        self.scenario = scenario
        origin = time.monotonic()
        self._clock = clock or (lambda: time.monotonic() - origin)
        #: microseconds of the Unix epoch at simulated time 0, like the driver's stamps
        self._epoch_us = int(time.time() * 1_000_000)
        #: CLOCK_BOOTTIME at simulated time 0, µs (what `host_offsets` says of it)
        self._boot_us = int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1_000_000)
        #: how the wall and boot clocks move against simulated time (steps, suspends)
        self.clocks = HostClocks(scenario.clock_steps, scenario.suspends, live=clock is None)
        self._initialised = 0
        self._lock = threading.Lock()
        self._samples: dict[tuple[Any, ...], int] = {}
        self._drawn: dict[tuple[Any, ...], tuple[float, Any]] = {}
        self._event_sets: dict[int, EventSet] = {}
        #: by id() of a GpuSpec of the scenario (which keeps them): how its sample stamps are off
        self._shifts = {id(gpu): _stamp_shifts(gpu) for gpu in scenario.gpus}
        #: by id() of a replayed GpuSpec: what answers for it
        self._replayed = {
            id(gpu): Replayed(gpu.replay, self._clock, self._sample_base_us(gpu))
            for gpu in scenario.gpus if gpu.replay is not None
        }
        self._event_lock = threading.Lock()
        #: by pid, when its processes ran (`process_start_time`)
        self._runs = _pid_runs(scenario)
        self._gpm_lock = threading.Lock()
        self._gpm_next = 0
        #: GPM sample buffer id -> what it holds (None: allocated, not filled)
        self._gpm_buffers: dict[int, GpmRecord | None] = {}

    # -- helpers --

    def now(self) -> float:
        """Simulated seconds since start (wrapped when the scenario repeats)."""
        now = self._clock()
        if self.scenario.repeat:
            now %= self.scenario.repeat
        return now

    def _stamp_us(self) -> int:
        now = self._clock()
        self.clocks.observe(now)
        return self._epoch_us + int(now * 1_000_000) + self.clocks.shift_us(now, WALL)

    def host_offsets(self) -> tuple[int, int]:
        """The host's (wall, boot) clocks less simulated time, µs (`NvmlReader.host_offsets`, in tests)."""
        now = self._clock()
        self.clocks.observe(now)
        return self._epoch_us + self.clocks.shift_us(now, WALL), self._boot_us + self.clocks.shift_us(now, BOOT)

    def _enter(self, call: str, handle: Handle | None = None) -> float:
        """What every call does first: delay, initialisation check, faults."""
        delay = self.scenario.call_delay_ms
        if delay:
            time.sleep(delay / 1000.0)
        now = self.now()
        faults: tuple[Fault, ...] = self.scenario.faults
        if isinstance(handle, Handle) and 0 <= handle.gpu < len(self.scenario.gpus):
            faults = faults + self.scenario.gpus[handle.gpu].faults
            if handle.instance is not None:
                faults = faults + handle.instance.faults
        for fault in faults:
            if fault.call in (call, "*") and fault.active(now):
                if fault.error == "hang":
                    # stuck in the driver: until the fault ends (an hour at most)
                    time.sleep(min(3600.0, (fault.until or now + 3600.0) - now))
                    continue
                raise_fault(fault.error)
        if call != "nvmlInit" and not self._initialised:
            raise NvmlFault(UNINITIALIZED)
        return now

    def _next(self, key: tuple[Any, ...], value: Any) -> Any:
        """The value of a cycled field at its next sample."""
        if not isinstance(value, (list, tuple)):
            return value
        with self._lock:
            index = self._samples.get(key, 0)
            self._samples[key] = index + 1
        return cycled(value, index)

    def _held(self, key: tuple[Any, ...], value: Any, now: float) -> Any:
        """A cycled field's next sample, unless it was drawn less than `HOLD`
        seconds ago: asked again at once, a driver answers with the same sample."""
        if not isinstance(value, (list, tuple)):
            return value
        drawn = self._drawn.get(key)
        if drawn is not None and 0 <= now - drawn[0] < HOLD:
            return drawn[1]
        picked = self._next(key, value)
        self._drawn[key] = (now, picked)
        return picked

    def _gpu(self, handle: Any) -> GpuSpec:
        if not isinstance(handle, Handle) or not 0 <= handle.gpu < len(self.scenario.gpus):
            raise NvmlFault(INVALID_ARGUMENT)
        return self.scenario.gpus[handle.gpu]

    def _instances(self, gpu: GpuSpec, now: float) -> list[MigSpec]:
        """The instances that exist now, in slot order."""
        return sorted((m for m in gpu.mig or () if m.alive(now)), key=lambda m: m.slot)

    def _slots(self, gpu: GpuSpec) -> int:
        """nvmlDeviceGetMaxMigDeviceCount: 7 on today's cards, more if the scenario needs them."""
        return 0 if gpu.mig is None else max([7] + [m.slot + 1 for m in gpu.mig])

    def _check_instance(self, handle: Handle, now: float) -> None:
        if handle.instance is not None and not handle.instance.alive(now):
            raise NvmlFault(INVALID_ARGUMENT)

    def process_start_time(self, pid: int) -> int | None:
        """The start time of the process with this pid now, in ``/proc/PID/stat``'s clock ticks
        (hundredths of a simulated second; None: no such process).  Scenario processes of one pid
        whose runs overlap are one process (on two GPUs); one that starts when the others have
        stopped is another (a reused pid); with `repeat`, each round's processes are new ones."""
        clock, now = self._clock(), self.now()
        for start, stop in self._runs.get(pid, ()):
            if in_span(now, start, stop):
                rounds = int(clock // self.scenario.repeat) if self.scenario.repeat else 0
                return round((start + rounds * (self.scenario.repeat or 0)) * 100)
        return None

    # -- library --

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        loaded = self.scenario.driver_loaded_file
        if loaded is not None and not os.path.exists(loaded):
            raise NvmlFault(DRIVER_NOT_LOADED)
        self._initialised += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._initialised = max(0, self._initialised - 1)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return DRIVERS[self.scenario.driver][0]

    def cuda_version(self, call: str) -> int:
        """nvmlSystemGetCudaDriverVersion (`call`: it or its _v2)."""
        self._enter(call)
        return CUDA_VERSIONS[self.scenario.driver]

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.scenario.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        order = self.scenario.order(self.now()) if self.scenario.reorder else None
        handle = Handle(order[index] if order is not None and 0 <= index < len(order) else index)
        self._enter("nvmlDeviceGetHandleByIndex", handle)
        if not 0 <= index < len(self.scenario.gpus):
            raise NvmlFault(INVALID_ARGUMENT)
        return handle

    # -- identity --

    @_device
    def nvmlDeviceGetPciInfo(self, handle: Handle, gpu: GpuSpec, now: float) -> PciInfo:
        return PciInfo(busId=gpu.busid.encode("ascii"), busIdLegacy=gpu.busid[-12:].encode("ascii"))

    @_device
    def nvmlDeviceGetName(self, handle: Handle, gpu: GpuSpec, now: float) -> str:
        self._check_instance(handle, now)
        return gpu.name if handle.instance is None else f"{gpu.name} MIG {handle.instance.profile}"

    @_device
    def nvmlDeviceGetUUID(self, handle: Handle, gpu: GpuSpec, now: float) -> str:
        if handle.instance is not None:
            self._check_instance(handle, now)
            tail = gpu.uuid.removeprefix("GPU-")[:-6]
            return f"MIG-{tail}{handle.instance.gpu_instance:03d}{handle.instance.compute_instance:03d}"
        return gpu.uuid

    @_device
    def nvmlDeviceGetSerial(self, handle: Handle, gpu: GpuSpec, now: float) -> str:
        if gpu.serial is None or handle.instance is not None:
            raise NvmlFault(NOT_SUPPORTED)
        return gpu.serial

    @_device
    def nvmlDeviceGetVbiosVersion(self, handle: Handle, gpu: GpuSpec, now: float) -> str:
        if handle.instance is not None:
            raise NvmlFault(NOT_SUPPORTED)
        return gpu.vbios

    # -- MIG --

    @_device
    def nvmlDeviceGetMigMode(self, device: Handle, gpu: GpuSpec, now: float) -> list[int]:
        if not gpu.mig_capable or device.instance is not None:
            raise NvmlFault(NOT_SUPPORTED)
        mode = DEVICE_MIG_DISABLE if gpu.mig is None else DEVICE_MIG_ENABLE
        return [mode, mode]

    @_device
    def nvmlDeviceGetMaxMigDeviceCount(self, device: Handle, gpu: GpuSpec, now: float) -> int:
        return 0 if device.instance is not None else self._slots(gpu)

    @_device
    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Handle, gpu: GpuSpec, now: float, index: int) -> Handle:
        if device.instance is not None or not 0 <= index < self._slots(gpu):
            raise NvmlFault(INVALID_ARGUMENT)
        for instance in self._instances(gpu, now):
            if instance.slot == index:
                return Handle(device.gpu, instance)
        raise NvmlFault(NOT_FOUND)

    @_device
    def nvmlDeviceIsMigDeviceHandle(self, device: Handle, gpu: GpuSpec, now: float) -> int:
        return 1 if device.instance is not None else 0

    @_device
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Handle, gpu: GpuSpec, now: float) -> Handle:
        if migDevice.instance is None:
            raise NvmlFault(INVALID_ARGUMENT)
        return Handle(migDevice.gpu)

    @_device
    def nvmlDeviceGetGpuInstanceId(self, device: Handle, gpu: GpuSpec, now: float) -> int:
        return self._instance(device, now).gpu_instance

    @_device
    def nvmlDeviceGetComputeInstanceId(self, device: Handle, gpu: GpuSpec, now: float) -> int:
        return self._instance(device, now).compute_instance

    def _instance(self, device: Handle, now: float) -> MigSpec:
        """The MIG instance of a handle that must be one (INVALID_ARGUMENT for a card's)."""
        if device.instance is None:
            raise NvmlFault(INVALID_ARGUMENT)
        self._check_instance(device, now)
        return device.instance

    # -- readings: each call makes its checks, then asks the GPU's `Answers` (`_answers`): this
    # model's `rates`, `samples`, `memory`, `running`, `process_samples`, or a recording's --

    @_device
    def nvmlDeviceGetUtilizationRates(self, handle: Handle, gpu: GpuSpec, now: float) -> Rates:
        self._check_instance(handle, now)
        if gpu.mig is not None or gpu.gpu_util is None or gpu.mem_util is None:
            raise NvmlFault(NOT_SUPPORTED)
        return self._answers(gpu).rates(handle, gpu)

    def rates(self, handle: Handle, gpu: GpuSpec) -> Rates:
        """The rates call: like the driver, the busy share of its last sample period only."""
        last = self._periods(gpu, newest_only=True)
        return Rates(gpu=self._util(handle, gpu, "gpu", last), memory=self._util(handle, gpu, "mem", last))

    @_device
    def nvmlDeviceGetSamples(
        self, device: Handle, gpu: GpuSpec, now: float, sampling_type: int, timeStamp: int
    ) -> tuple[int, list[Sample]]:
        field = {GPU_UTILIZATION_SAMPLES: "gpu", MEMORY_UTILIZATION_SAMPLES: "mem"}.get(sampling_type)
        if field is None:
            raise NvmlFault(NOT_SUPPORTED)
        if gpu.mig is not None or not gpu.samples_supported or gpu.gpu_util is None or gpu.mem_util is None:
            raise NvmlFault(NOT_SUPPORTED)
        if gpu.samples_not_found:
            raise NvmlFault(NOT_FOUND)
        return self._answers(gpu).samples(device, gpu, field, timeStamp)

    def samples(self, device: Handle, gpu: GpuSpec, field: str, timeStamp: int) -> tuple[int, list[Sample]]:
        """The samples call's buffer of `field` ("gpu" or "mem") samples newer than `timeStamp`."""
        if _per_call(gpu, field):
            # a list of values: one new sample per call, the next of the cycled values
            stamp = self._stamp_us()
            if stamp <= timeStamp:
                raise NvmlFault(NOT_FOUND)
            value = self._next((device.gpu, f"{field}_util"), getattr(gpu, f"{field}_util"))
            return VALUE_TYPE_UNSIGNED_INT, [Sample(stamp, int(value))]
        level = _period_level(gpu, field, self.scenario.repeat)
        periods = self._periods(gpu, timeStamp, self._sample_base_us(gpu))
        out = [Sample(stamp, level(start, end)) for stamp, start, end in periods]
        if not gpu.idle_samples:
            out = [s for s in out if s.value]
        if not out:
            raise NvmlFault(NOT_FOUND)
        return VALUE_TYPE_UNSIGNED_INT, out

    def _sample_base_us(self, gpu: GpuSpec) -> int:
        """What the GPU's sample clock reads at simulated time 0, in microseconds."""
        if gpu.sample_clock is None:
            return self._epoch_us
        return int(gpu.sample_clock * 1_000_000)

    def _periods(
        self, gpu: GpuSpec, since: int = 0, base_us: int | None = None, newest_only: bool = False
    ) -> list[tuple[int, float, float]]:
        """The driver's completed sample periods in its buffer stamped after `since`: (stamp, start, end).
        Period k ends at ``sample_phase + k * sample_period``, stamped then on the sample clock (`base_us`
        at time 0, the epoch by default), off by jitter and late stamps; a missing sample is left out,
        and one is there only once its stamp has passed (it is written late).  `newest_only`: the last."""
        period, phase = gpu.sample_period, gpu.sample_phase
        base = self._epoch_us if base_us is None else base_us
        which = WALL if base_us is None or gpu.sample_clock is None else BOOT
        now = self._clock()
        self.clocks.observe(now)
        last = math.floor((now - phase) / period + 1e-9)
        # the buffer has a past: the host ran before the simulation started
        first = last - SAMPLE_BUFFER + 1
        if since > base and self.clocks.steady:
            first = max(first, int(((since - base) / 1_000_000 - phase) / period) - 1)
        shifts = self._shifts[id(gpu)]
        out = []
        numbers = range(first, last + 1)
        for k in reversed(numbers) if newest_only else numbers:
            end = phase + k * period
            shift = shifts(k)
            if shift is None or end + shift > now + 1e-9:
                continue
            # stamped when it was taken, on the clock as it read then
            stamp = base + int(round((end + shift) * 1_000_000)) + self.clocks.shift_us(end, which)
            if stamp > since:
                out.append((stamp, end - period, end))
                if newest_only:
                    break
        return out

    def _util(self, handle: Handle, gpu: GpuSpec, field: str, periods: list[Any]) -> int:
        """The GPU's busy percentage over one period (timeline or constant) or its next cycled value."""
        if _per_call(gpu, field):
            return int(self._next((handle.gpu, f"{field}_util"), getattr(gpu, f"{field}_util")))
        if not periods:
            return 0
        start, end = periods[-1][-2:]
        return _period_level(gpu, field, self.scenario.repeat)(start, end)

    @_device
    def nvmlDeviceGetMemoryInfo(self, handle: Handle, gpu: GpuSpec, now: float, version: Any = None) -> Memory:
        return self._answers(gpu).memory(handle, gpu, version, now)

    def memory(self, handle: Handle, gpu: GpuSpec, version: Any, now: float) -> Memory:
        """Memory info, v1 (`version` None) or v2."""
        if handle.instance is not None:
            self._check_instance(handle, now)
            parts = [handle.instance]
        elif gpu.mig is not None:
            parts = self._instances(gpu, now)
        else:
            parts = [gpu]  # type: ignore[list-item]  # a card out of MIG mode is its own part
        used = sum(self._next((handle.gpu, _part(p), "memory"), p.memory_used_mib) for p in parts)
        # the card itself always has all its memory; its use is what its instances use
        total = gpu.memory_total_mib if handle.instance is None else handle.instance.memory_total_mib
        total_b, used_b = int(total * 1048576), int(used * 1048576)
        reserved_b = int(gpu.memory_reserved_mib * 1048576) if handle.instance is None else 0
        if version is None:
            # v1: the driver's reserved memory counts as used
            used_b += reserved_b
            return Memory(total=total_b, used=used_b, free=max(0, total_b - used_b))
        free_b = max(0, total_b - used_b - reserved_b)
        return Memory(total=total_b, used=used_b, free=free_b, reserved=reserved_b)

    def running(
        self, handle: Handle, gpu: GpuSpec, call: str, kinds: tuple[str, ...], now: float
    ) -> list[RunningProcess]:
        """A process list: the processes of one of the `kinds` running now."""
        if handle.instance is not None:
            self._check_instance(handle, now)
            owners: list[tuple[MigSpec | None, tuple[ProcessSpec, ...]]] = [
                (handle.instance, handle.instance.processes)
            ]
        elif gpu.mig is not None:
            owners = [(m, m.processes) for m in self._instances(gpu, now)]
        else:
            owners = [(None, gpu.processes)]
        out = []
        for owner, processes in owners:
            for proc in processes:
                if proc.type in kinds and proc.alive(now):
                    memory = self._next((handle.gpu, _part(owner), proc.pid, call), proc.memory_mib)
                    ids = (NO_INSTANCE, NO_INSTANCE) if owner is None else (owner.gpu_instance, owner.compute_instance)
                    # usedGpuMemory None: "not available", as pynvml gives it (WDDM, some vGPU guests)
                    out.append(RunningProcess(proc.pid, None if memory is None else int(memory * 1048576), *ids))
        return out

    @_device
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Handle, gpu: GpuSpec, now: float) -> list[RunningProcess]:
        if not gpu.compute_list:
            raise NvmlFault(NOT_SUPPORTED)
        return self._answers(gpu).running(handle, gpu, "nvmlDeviceGetComputeRunningProcesses", ("C", "C+G"), now)

    @_device
    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Handle, gpu: GpuSpec, now: float) -> list[RunningProcess]:
        if not gpu.graphics_list:
            raise NvmlFault(NOT_SUPPORTED)
        return self._answers(gpu).running(handle, gpu, "nvmlDeviceGetGraphicsRunningProcesses", ("G", "C+G"), now)

    @_device
    def nvmlDeviceGetProcessUtilization(self, handle: Handle, gpu: GpuSpec, now: float, timeStamp: int
                                        ) -> list[ProcessSample]:
        self._check_instance(handle, now)
        return self._answers(gpu).process_samples(handle, gpu, timeStamp, now)

    def process_samples(self, handle: Handle, gpu: GpuSpec, timeStamp: int, now: float) -> list[ProcessSample]:
        """Process utilization: the processes' samples newer than `timeStamp`."""
        if gpu.mig is not None or any(p.sm_util is None or p.mem_util is None for p in gpu.processes):
            raise NvmlFault(NOT_SUPPORTED)
        stamp = self._stamp_us()
        periods = self._periods(gpu, timeStamp)
        out = []
        for proc in gpu.processes:
            if _process_per_call(proc):
                # cycled lists: one entry per call, the next of the values
                if not proc.alive(now):
                    continue
                sm = self._held((handle.gpu, proc.pid, "sm_util"), proc.sm_util, self._clock())
                mem = self._held((handle.gpu, proc.pid, "mem_util"), proc.mem_util, self._clock())
                if (sm or mem) and stamp > timeStamp:
                    out.append(ProcessSample(proc.pid, stamp, int(sm), int(mem)))
            else:
                out.extend(_busy(proc, periods, self.scenario.repeat, gpu.process_utilization == "per-call"))
        if periods:
            out.extend(ProcessSample(pid, periods[-1][0], sm, mem) for pid, sm, mem in gpu.stray_process_samples)
        if gpu.duplicate_process_samples:
            out = [copy for sample in out for copy in (sample, replace(sample))]
        if not out:
            raise NvmlFault(NOT_FOUND)
        return out

    def true_load(self, index: int, start: float, end: float) -> Load:
        """What GPU `index` (out of MIG mode) truly did from `start` to `end`, by its answers' rules
        (an oracle for tests): the mean over the sample periods ending in ``(start, end]`` (none:
        the last ended by `end`) of its busy %, memory busy % and, by pid, its processes' SM and
        memory busy % (0 for a period none of that pid ran)."""
        gpu = self.scenario.gpus[index]
        period, phase, repeat = gpu.sample_period, gpu.sample_phase, self.scenario.repeat
        last = math.floor((end - phase) / period + 1e-9)
        first = min(last, math.floor((start - phase) / period + 1e-9) + 1)
        spans = [(phase + (k - 1) * period, phase + k * period) for k in range(first, last + 1)]
        gpu_level, mem_level = _period_level(gpu, "gpu", repeat), _period_level(gpu, "mem", repeat)
        levels = [(proc.pid, _process_levels(proc, repeat)) for proc in gpu.processes]
        sums: dict[int, list[float]] = {pid: [0.0, 0.0] for pid, _ in levels}
        for begin, until in spans:
            for pid, level in levels:
                sm, mem = level(begin, until)
                sums[pid][0] += round(sm)
                sums[pid][1] += round(mem)
        count = len(spans)
        return Load(
            sum(gpu_level(begin, until) for begin, until in spans) / count,
            sum(mem_level(begin, until) for begin, until in spans) / count,
            {pid: (sm / count, mem / count) for pid, (sm, mem) in sums.items()},
        )

    def _answers(self, gpu: GpuSpec) -> Answers:
        """Where `gpu`'s readings come from: its recording, or its scenario's values (this model)."""
        return self._replayed.get(id(gpu), self)

    # -- health figures and XID events --

    def _played(self, call: str, handle: Any, name: str) -> tuple[Played, float]:
        now = self._enter(call, handle)
        gpu = self._gpu(handle)
        played = gpu.health.figures.get(name)
        if played is None or handle.instance is not None:
            raise NvmlFault(NOT_SUPPORTED)
        return played, now

    def _value(self, call: str, handle: Any, name: str) -> float:
        played, now = self._played(call, handle, name)
        return played.at(now)

    def _pick(self, table: dict[Any, Any], key: Any, call: str, handle: Any, code: int) -> Any:
        """`table`'s entry for a call's arguments; none: the call fails with `code` (after its faults)."""
        if key not in table:
            self._enter(call, handle)
            raise NvmlFault(code)
        return table[key]

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        start, _ = self._played("nvmlDeviceGetTotalEnergyConsumption", handle, "energy_start_j")
        power = self._gpu(handle).health.figures.get("power_w")
        if power is None:
            raise NvmlFault(NOT_SUPPORTED)
        return int((start.at(0) + self._integral(power)) * 1000)

    def _integral(self, played: Played) -> float:
        """The integral of a played rate since the simulation began, on the unwrapped clock (it never goes back)."""
        t = self._clock()
        repeat = self.scenario.repeat
        if repeat:
            return (t // repeat) * played.integral(repeat) + played.integral(t % repeat)
        return played.integral(t)

    def plain(self, function: str, handle: Any, *args: int) -> int:
        """A call of the table's that answers one number: the field its arguments pick, in NVML's units."""
        code = INVALID_ARGUMENT if function in PICKY else NOT_SUPPORTED
        play = self._pick(PLAIN[function], tuple(int(a) for a in args), function, handle, code)
        value = self._value(function, handle, play.field) * play.per
        return int(round(value)) if play.per != 1 else int(value)

    def field_value(self, handle: Any, field: int, scope: int) -> tuple[int, int]:
        """One entry of nvmlDeviceGetFieldValues: (value type, value); NOT_SUPPORTED for a field it lacks."""
        if field in LINK_FIELD_IDS:
            link, now = self._link(handle, scope, "nvmlDeviceGetFieldValues")
            played = link.figures.get(LINK_FIELD_IDS[field].field)
            if played is None or not link.active:
                raise NvmlFault(NOT_SUPPORTED)
            return VALUE_TYPE_UNSIGNED_LONG_LONG, int(self._integral(played))
        play = self._pick(FIELD_IDS, field, "nvmlDeviceGetFieldValues", handle, NOT_SUPPORTED)
        value = self._value("nvmlDeviceGetFieldValues", handle, play.field) * play.per
        return (VALUE_TYPE_UNSIGNED_INT, int(value)) if field == FIELD_MEMORY_TEMP else (VALUE_TYPE_UNSIGNED_LONG_LONG,
                                                                                   int(round(value)))

    def nvmlDeviceGetViolationStatus(self, handle: Any, policy: int) -> tuple[int, int]:
        """(reference time in µs, the time the policy held the clocks down in ns)."""
        play = self._pick(VIOLATIONS, (int(policy),), "nvmlDeviceGetViolationStatus", handle, INVALID_ARGUMENT)
        played, now = self._played("nvmlDeviceGetViolationStatus", handle, play.field)
        return int(now * 1e6), int(round(played.at(now) * play.per))

    def engine_utilization(self, function: str, handle: Any) -> tuple[int, int]:
        """An engine's utilization (encoder, decoder, JPEG, OFA): (percent, sampling period in µs)."""
        return int(self._value(function, handle, ENGINES[function])), ENGINE_PERIOD_US

    def _link(self, handle: Any, link: int, call: str) -> tuple[LinkSpec, float]:
        now = self._enter(call, handle)
        links = self._gpu(handle).health.nvlink
        if links is None or handle.instance is not None:
            raise NvmlFault(NOT_SUPPORTED)
        if not 0 <= link < len(links):
            raise NvmlFault(INVALID_ARGUMENT)
        return links[link], now

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        spec, _ = self._link(handle, int(link), "nvmlDeviceGetNvLinkState")
        return 1 if spec.active else 0

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: Any, link: int, counter: int) -> int:
        spec, now = self._link(handle, int(link), "nvmlDeviceGetNvLinkErrorCounter")
        play = LINK_ERRORS.get((int(counter),))
        played = None if play is None else spec.figures.get(play.field)
        if played is None or not spec.active:
            raise NvmlFault(NOT_SUPPORTED)
        return int(played.at(now))

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        played = [self._gpu(handle).health.figures.get(name) for name in REMAPPED]
        first, now = self._played("nvmlDeviceGetRemappedRows", handle, REMAPPED[0])
        if any(p is None for p in played):
            raise NvmlFault(NOT_SUPPORTED)
        return tuple(int(p.at(now)) for p in played)  # type: ignore[union-attr,return-value]

    # -- events --

    def nvmlEventSetCreate(self) -> int:
        self._enter("nvmlEventSetCreate")
        with self._event_lock:
            ident = len(self._event_sets) + 1
            self._event_sets[ident] = EventSet()
        return ident

    @_device
    def nvmlDeviceGetSupportedEventTypes(self, handle: Handle, gpu: GpuSpec, now: float) -> int:
        return EVENT_XID if gpu.health.xid_supported and handle.instance is None else 0

    @_device
    def nvmlDeviceRegisterEvents(self, handle: Handle, gpu: GpuSpec, now: float, eventTypes: int, eventSet: int
                                 ) -> None:
        events = self._event_sets.get(eventSet)
        if events is None:
            raise NvmlFault(INVALID_ARGUMENT)
        if eventTypes & ~EVENT_XID or not gpu.health.xid_supported or handle.instance is not None:
            raise NvmlFault(NOT_SUPPORTED)
        with self._event_lock:
            events.registered.setdefault(handle.gpu, self._clock())

    def nvmlEventSetWait(self, eventSet: int, timeoutms: int) -> tuple[int, int, int]:
        """The next event due: (gpu index, event type, XID); TIMEOUT when none comes in time."""
        self._enter("nvmlEventSetWait_v2")
        events = self._event_sets.get(eventSet)
        if events is None:
            raise NvmlFault(INVALID_ARGUMENT)
        deadline = self._clock() + timeoutms / 1000.0
        while True:
            now = self._clock()
            due = self._due(events, now)
            if due is not None:
                return due
            if now >= deadline:
                raise NvmlFault(TIMEOUT)
            time.sleep(min(0.05, deadline - now))

    def _due(self, events: EventSet, now: float) -> tuple[int, int, int] | None:
        with self._event_lock:
            best = None
            for gpu, since in events.registered.items():
                listed = self.scenario.gpus[gpu].health.xid_events
                index = events.delivered.get(gpu)
                if index is None:
                    # only what happens after registration is delivered
                    index = events.delivered[gpu] = sum(1 for when, _ in listed if when < since)
                if index < len(listed) and listed[index][0] <= now:
                    if best is None or listed[index][0] < best[0]:
                        best = (listed[index][0], gpu, listed[index][1])
            if best is None:
                return None
            events.delivered[best[1]] += 1
            return best[1], EVENT_XID, best[2]

    def nvmlEventSetFree(self, eventSet: int) -> None:
        self._enter("nvmlEventSetFree")
        with self._event_lock:
            self._event_sets.pop(eventSet, None)

    # -- GPU Performance Monitoring --

    @property
    def gpm_buffers(self) -> int:
        """Sample buffers allocated and not freed."""
        return len(self._gpm_buffers)

    @_device
    def nvmlGpmQueryDeviceSupport(self, handle: Handle, gpu: GpuSpec, now: float) -> int:
        return 0 if gpu.gpm is None else 1

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
            if buffer not in self._gpm_buffers:
                raise NvmlFault(INVALID_ARGUMENT)
            del self._gpm_buffers[buffer]

    def _gpm_fill(self, buffer: int, record: GpmRecord) -> None:
        with self._gpm_lock:
            if buffer not in self._gpm_buffers:
                raise NvmlFault(INVALID_ARGUMENT)
            self._gpm_buffers[buffer] = record

    @_device
    def nvmlGpmSampleGet(self, handle: Handle, gpu: GpuSpec, now: float, buffer: int) -> None:
        """The whole card's counters now (a MIG handle: its GPU instance's)."""
        if gpu.gpm is None:
            raise NvmlFault(NOT_SUPPORTED)
        t = self._clock()
        if handle.instance is not None:
            self._gpm_fill(buffer, self._instance_record(handle.gpu, gpu, handle.instance, t))
        else:
            self._gpm_fill(buffer, _record((handle.gpu, None, None), gpu, gpu, 0.0, t, t))

    @_device
    def nvmlGpmMigSampleGet(self, handle: Handle, gpu: GpuSpec, now: float, gpu_instance: int, buffer: int) -> None:
        """The counters of one GPU instance of a card in MIG mode."""
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
            kind = GPM_PLAYED[metric][0]
            out.append((SUCCESS, change / span if kind == "rate" else 100.0 * change / span))
        return out


def _pid_runs(scenario: Scenario) -> dict[int, list[tuple[float, float | None]]]:
    """By pid: when the processes of that pid ran, overlapping runs joined."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for gpu in scenario.gpus:
        for proc in gpu.processes + tuple(p for m in gpu.mig or () for p in m.processes):
            stop = math.inf if proc.stop is None else proc.stop
            spans.setdefault(proc.pid, []).append((proc.start or -math.inf, stop))
    runs: dict[int, list[tuple[float, float | None]]] = {}
    for pid, found in spans.items():
        joined: list[list[float]] = []
        for start, stop in sorted(found):
            if joined and start < joined[-1][1]:
                joined[-1][1] = max(joined[-1][1], stop)
            else:
                joined.append([start, stop])
        runs[pid] = [(max(start, 0.0), None if stop == math.inf else stop) for start, stop in joined]
    return runs


def _per_call(gpu: GpuSpec, field: str) -> bool:
    """A GPU figure given as a list of values: one new value per call."""
    return getattr(gpu, f"{field}_timeline") is None and isinstance(getattr(gpu, f"{field}_util"), (list, tuple))


def _process_per_call(proc: ProcessSpec) -> bool:
    """A process given lists of values: one new entry per call."""
    if proc.sm_timeline is not None or proc.mem_timeline is not None:
        return False
    return isinstance(proc.sm_util, (list, tuple)) or isinstance(proc.mem_util, (list, tuple))


def _in_round(level: Callable[[float, float], tuple[float, ...]], repeat: float | None
              ) -> Callable[[float, float], tuple[float, ...]]:
    """`level` (of a span of scenario time) asked with simulated time, which a scenario with
    `repeat` wraps: a period that spans the end of a round is weighed from both rounds' parts."""
    if not repeat:
        return level

    def wrapped(start: float, end: float) -> tuple[float, ...]:
        length = end - start
        start %= repeat
        if length <= 0 or start + length <= repeat + 1e-9:
            return level(start, start + length)
        before, after = repeat - start, start + length - repeat
        first, second = level(start, repeat), level(0.0, min(after, repeat))
        return tuple((a * before + b * after) / length for a, b in zip(first, second))

    return wrapped


def _period_level(gpu: GpuSpec, field: str, repeat: float | None = None) -> Callable[[float, float], int]:
    """The GPU's busy percentage (`field` "gpu" or "mem") over a sample period from
    start to end: its timeline's share of the period, or its constant load."""
    timeline = getattr(gpu, f"{field}_timeline")
    if timeline is None:
        value = int(getattr(gpu, f"{field}_util"))
        return lambda start, end: value
    share = _in_round(lambda start, end: (timeline.percent(start, end),), repeat)
    return lambda start, end: int(round(share(start, end)[0]))


def _process_levels(proc: ProcessSpec, repeat: float | None = None) -> Callable[[float, float], tuple[float, ...]]:
    """A process's SM and memory busy percentages over a period from start to end
    (0 when it did not run): its timelines' shares, or its steady levels; with
    `repeat`, those of the round's scenario time."""
    alive, sm_timeline, mem_timeline = proc.alive, proc.sm_timeline, proc.mem_timeline
    steady = float(cycled(proc.sm_util, 0) or 0), float(cycled(proc.mem_util, 0) or 0)

    def levels(start: float, end: float) -> tuple[float, float]:
        if not (alive(start) or alive(end)):
            return 0.0, 0.0
        if sm_timeline is None and mem_timeline is None:
            return steady
        sm = sm_timeline.percent(start, end) if sm_timeline else 0.0
        mem = mem_timeline.percent(start, end) if mem_timeline else 0.0
        return float(sm or 0), float(mem or 0)

    return _in_round(levels, repeat)


def _busy(proc: ProcessSpec, periods: list[tuple[int, float, float]], repeat: float | None, window: bool
          ) -> list[ProcessSample]:
    """A process's entries: one per period in which it was busy, as some drivers keep them, or (`window`)
    one for the whole window asked for, its average stamped with the newest period, as drivers are
    reported to answer."""
    level = _process_levels(proc, repeat)
    entries = [(stamp, level(start, end)) for stamp, start, end in periods]
    if window and entries:
        entries = [(entries[-1][0], tuple(sum(x) / len(entries) for x in zip(*(e[1] for e in entries))))]
    out = []
    for stamp, (sm, mem) in entries:
        if round(sm) or round(mem):
            out.append(ProcessSample(proc.pid, stamp, round(sm), round(mem)))
    return out


def _stamp_shifts(gpu: GpuSpec) -> Callable[[int], float | None]:
    """Seconds a GPU's sample k's stamp is off by (jitter, a late stamp), by k; None when it is missing."""
    period, phase, jitter = gpu.sample_period, gpu.sample_phase, gpu.sample_jitter_ms

    def due(when: float) -> int:
        return math.ceil((when - phase) / period - 1e-9)

    missing = {due(when) for when in gpu.missing_samples}
    late: dict[int, list[float]] = {}
    for when, ms in gpu.late_samples:
        late.setdefault(due(when), []).append(ms / 1000)

    def shift(k: int) -> float | None:
        if k in missing:
            return None
        total = 0.0
        if jitter:
            spread = ((k * 2654435761) % 4294967296) / 4294967296.0
            total += (2 * spread - 1) * jitter / 1000
        for seconds in late.get(k, ()):
            total += seconds
        return total

    return shift


def _part(part: GpuSpec | MigSpec | None) -> tuple[int, int] | None:
    """Which part of a card a cycled value belongs to: an instance's ids, or the card."""
    if isinstance(part, MigSpec):
        return (part.gpu_instance, part.compute_instance)
    return None


def _busy_seconds(part: GpuSpec | MigSpec, which: str, start: float, end: float) -> float:
    """Seconds of `part`'s `which` ("gpu", "mem") activity from `start` to `end` (weighted by the level)."""
    timeline = getattr(part, f"{which}_timeline")
    if timeline is not None:
        return timeline.busy_time(end) * timeline.level / 100.0 - timeline.busy_time(start) * timeline.level / 100.0
    level = float(cycled(getattr(part, f"{which}_util"), 0) or 0)
    return level / 100.0 * end - level / 100.0 * start


def _record(source: tuple[Any, ...], gpu: GpuSpec, part: GpuSpec | MigSpec, start: float, end: float, at: float
            ) -> GpmRecord:
    """The counters of a source (`part`: the card or a MIG instance) active from `start` to `end`, sampled at `at`."""
    shares = gpu.gpm
    assert shares is not None
    end = max(start, end)
    active, memory = _busy_seconds(part, "gpu", start, end), _busy_seconds(part, "mem", start, end)
    counters = [(metric, (memory if kind == "mem" else active) * (1.0 if name is None else shares[name]))
                for metric, (kind, name) in GPM_PLAYED.items()]
    return GpmRecord(source, at, tuple(counters))
