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
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from atopgpud_tw.nvml_codes import (
    DEVICE_MIG_DISABLE,
    DEVICE_MIG_ENABLE,
    DRIVER_NOT_LOADED,
    GPU_UTILIZATION_SAMPLES,
    INVALID_ARGUMENT,
    MEMORY_UTILIZATION_SAMPLES,
    NO_INSTANCE,
    NOT_FOUND,
    NOT_SUPPORTED,
    UNINITIALIZED,
    VALUE_TYPE_UNSIGNED_INT,
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
from atopgpud_tw.sim.gpm_model import GpmDriver
from atopgpud_tw.sim.health_model import EventSet, HealthDriver
from atopgpud_tw.sim.library_symbols import CUDA_VERSIONS, DRIVERS
from atopgpud_tw.sim.replay import SAMPLE_BUFFER, Replayed
from atopgpud_tw.sim.scenario import Fault, GpuSpec, MigSpec, ProcessSpec, Scenario, cycled, in_span

#: seconds within which a process's cycled utilization is the same sample
HOLD = 0.05


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

    def offsets_us(self, now: float, epoch_us: int, boot_us: int) -> tuple[int, int]:
        """What a reader on simulated time sees of the host clocks at `now`: (wall - monotonic,
        boot - monotonic), µs, given what they read at simulated time 0."""
        return epoch_us + self.shift_us(now, WALL), boot_us + self.shift_us(now, BOOT)


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


def _device(method: Callable[..., Any]) -> Any:
    """An NVML call with a handle: `_enter` (delay, faults, initialisation), then `method` given its GPU and time."""

    @functools.wraps(method)
    def call(self: SimulatedNvml, handle: Handle, *args: Any) -> Any:
        now = self._enter(method.__name__, handle)
        return method(self, handle, self._gpu(handle), now, *args)

    return call


class SimulatedNvml(HealthDriver, GpmDriver):
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
        self._gpm_setup()

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
        return self.clocks.offsets_us(now, self._epoch_us, self._boot_us)

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

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return CUDA_VERSIONS[self.scenario.driver]

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
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
        if handle.instance is not None:
            self._check_instance(handle, now)
            return f"{gpu.name} MIG {handle.instance.profile}"
        return gpu.name

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
