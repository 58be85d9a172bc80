"""The simulator's scenario: a JSON description of GPUs, their load and their faults.

Times are seconds since the simulator started.  Wherever a number is expected, a
list of numbers may stand instead: it is cycled, one entry per sample (per call of
the NVML function that reports it).  ``null`` for a percentage means "not
supported".  The format is documented in docs/simulator.md; `load_scenario`
checks every field and raises `ScenarioError` with a one-line message naming it.
A key the format does not know is an error (a misspelt field would otherwise be
ignored silently); keys starting with ``_`` are comments.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

from atopgpud_tw.nvml_codes import CODES
from atopgpud_tw.sim.gpm_scenario import GPM_SYMBOLS, GpmSpec, parse_gpm
from atopgpud_tw.sim.health_scenario import HEALTH_SYMBOLS, HealthSpec, default_health, parse_health
from atopgpud_tw.sim.jsonfile import read_json
from atopgpud_tw.sim.replay import Recording, RecordingError, load_recording

Number = float | int
Cycled = Number | Sequence[Number] | None

#: the NVML errors a scenario can make a call return, by their C names
NVML_ERRORS = {f"NVML_ERROR_{name}": code for name, code in CODES.items()}
#: faults that are not NVML error codes
OTHER_FAULTS = ("NVMLLibraryMismatchError", "RuntimeError", "hang")
PROCESS_TYPES = ("C", "G", "C+G")
#: the C symbols of libnvidia-ml the simulated library has (atopgpud_tw/sim/library.py)
LIBRARY_SYMBOLS = (
    "nvmlInit_v2",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetSamples",
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetSerial",
    "nvmlDeviceGetVbiosVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
) + HEALTH_SYMBOLS + GPM_SYMBOLS
_V3_LISTS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3")
_V2_LISTS = ("nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v2")
#: driver branches: the version the library reports and the symbols its libnvidia-ml lacks
DRIVERS = {
    "current": ("999.99.99-sim", ()),
    # 510.39.01 brought the _v3 process lists and nvmlDeviceGetMemoryInfo_v2
    # GPM is in the R525 NVML reference (Hopper); these older libraries lack its functions
    "470": ("470.256.02", _V3_LISTS + ("nvmlDeviceGetMemoryInfo_v2",) + GPM_SYMBOLS),
    # the _v2 process lists need 450.66: an early R450 has only the unversioned (v1) ones
    "450": ("450.51.06", _V3_LISTS + _V2_LISTS + ("nvmlDeviceGetMemoryInfo_v2",) + GPM_SYMBOLS),
}
#: the CUDA version each driver branch supports, as nvmlSystemGetCudaDriverVersion answers it (12080: 12.8)
CUDA_VERSIONS = {"current": 12080, "470": 11040, "450": 11000}
#: the lists a caller sizes first (a NULL buffer), by their name in grow_between_calls
GROWING_LISTS = ("process_lists", "samples", "process_utilization")
#: calls whose reply the binding itself decodes, so a reply it fails on can be had (fault "RuntimeError")
DECODED_CALLS = (
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
)


class ScenarioError(ValueError):
    """A scenario that cannot be used; the message names the file and the field."""


def in_span(now: float, start: float, stop: float | None) -> bool:
    """Whether `now` is from `start` on and before `stop` (None: for ever)."""
    return start <= now and (stop is None or now < stop)


@dataclass(frozen=True)
class Fault:
    call: str
    error: str
    start: float = 0.0
    until: float | None = None

    def active(self, now: float) -> bool:
        return in_span(now, self.start, self.until)


@dataclass(frozen=True)
class Timeline:
    """Busy spells repeated every `period` seconds: ``busy`` is a list of
    ``[from, until]`` offsets within the period, at `level` percent."""

    period: float
    busy: tuple[tuple[float, float], ...]
    level: float = 100.0

    def busy_time(self, t: float) -> float:
        """Seconds of busy time from 0 to `t` (at full level; negative before 0)."""
        cycles, rest = divmod(t, self.period)
        per_cycle = sum(b - a for a, b in self.busy)
        partial = sum(max(0.0, min(b, rest) - a) for a, b in self.busy)
        return cycles * per_cycle + partial

    def percent(self, start: float, end: float) -> float:
        """The busy percentage over ``(start, end]``."""
        if end <= start:
            return 0.0
        return (self.busy_time(end) - self.busy_time(start)) / (end - start) * self.level

    @property
    def average(self) -> float:
        """The true long-run busy percentage."""
        return sum(b - a for a, b in self.busy) / self.period * self.level


@dataclass(frozen=True)
class ProcessSpec:
    pid: int
    type: str = "C"
    #: None: usedGpuMemory is not available (WDDM, vGPU guests)
    memory_mib: Cycled = 0
    sm_util: Cycled = 0
    mem_util: Cycled = 0
    start: float = 0.0
    stop: float | None = None
    #: sub-second busy timelines (then the driver's sample buffer is simulated)
    sm_timeline: Timeline | None = None
    mem_timeline: Timeline | None = None

    def alive(self, now: float) -> bool:
        """Whether it runs at `now`; one that starts at 0 was already running
        before (the driver's buffer has its past)."""
        return in_span(now, self.start or -math.inf, self.stop)


@dataclass(frozen=True)
class MigSpec:
    """One MIG instance; it exists from `start` until `stop` (a carving change)."""

    profile: str
    memory_total_mib: Number
    memory_used_mib: Cycled = 0
    gpu_instance: int = 1
    compute_instance: int = 0
    processes: tuple[ProcessSpec, ...] = ()
    start: float = 0.0
    stop: float | None = None
    #: the index nvmlDeviceGetMigDeviceHandleByIndex finds it at
    slot: int = 0
    #: faults of calls made with this instance's handle (and of GPM samples of its GPU instance)
    faults: tuple[Fault, ...] = ()
    #: what its GPU instance does, for GPM (NVML reports no utilization under MIG):
    #: a constant busy percentage or a timeline, as a GPU's gpu_util and gpu_timeline
    gpu_util: Number = 0
    gpu_timeline: Timeline | None = None
    mem_util: Number = 0
    mem_timeline: Timeline | None = None

    def alive(self, now: float) -> bool:
        return in_span(now, self.start, self.stop)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    busid: str
    uuid: str
    memory_total_mib: Number = 16384
    memory_used_mib: Cycled = 0
    gpu_util: Cycled = 0
    mem_util: Cycled = 0
    processes: tuple[ProcessSpec, ...] = ()
    mig: tuple[MigSpec, ...] | None = None
    faults: tuple[Fault, ...] = ()
    compute_list: bool = True
    graphics_list: bool = True
    #: nvmlDeviceGetMigMode works (MIG enabled when `mig` is a list, else disabled)
    mig_capable: bool = False
    #: the driver's utilization sample period (1/6 s to 1 s depending on the product)
    sample_period: float = 1 / 6
    #: sub-second busy timelines, instead of gpu_util/mem_util
    gpu_timeline: Timeline | None = None
    mem_timeline: Timeline | None = None
    #: nvmlDeviceGetSamples works for utilization (false: old GPUs, NOT_SUPPORTED)
    samples_supported: bool = True
    #: the driver buffers samples of idle periods too (false: the buffer runs dry when idle)
    idle_samples: bool = True
    #: memory the driver reserves: v2 memory info reports it apart, v1's `used` includes it
    memory_reserved_mib: Number = 0
    #: the size query of nvmlDeviceGetProcessUtilization reports this constant, not the count
    process_list_capacity: int | None = None
    #: entries a list gains between a size query and its fill (cycled per size query), by list
    grow_between_calls: dict[str, Cycled] = field(default_factory=dict)
    #: what the sample clock reads at simulated time 0, in seconds: None for the
    #: Unix epoch (most drivers), or a number (CLOCK_BOOTTIME on some drivers)
    sample_clock: float | None = None
    #: sample period boundaries fall at sample_phase + k * sample_period
    sample_phase: float = 0.0
    #: each sample's stamp is off by up to this many milliseconds, either way
    sample_jitter_ms: float = 0.0
    #: (when, ms): the first sample due at or after `when` is stamped `ms` late
    late_samples: tuple[tuple[float, float], ...] = ()
    #: the first sample due at or after each of these times is never buffered
    missing_samples: tuple[float, ...] = ()
    #: nvmlDeviceGetSamples answers NOT_FOUND for ever (the rates call still works)
    samples_not_found: bool = False
    #: how process utilization is listed: once per busy sample period, or once per
    #: process and call with its average over the window asked for
    process_utilization: str = "per-period"
    #: every process-utilization entry is listed twice
    duplicate_process_samples: bool = False
    #: entries listed in every answer besides the processes': pids in no process
    #: list, figures above 100 %
    stray_process_samples: tuple[tuple[int, int, int], ...] = ()
    #: a calibration recording the driver answers from (sim/replay.py)
    replay: Recording | None = None
    #: temperatures, power, clocks, errors, XID events (sim/health_scenario.py)
    health: HealthSpec = field(default_factory=default_health)
    #: the board's serial number (None: it has none, NOT_SUPPORTED as on GeForce boards)
    serial: str | None = None
    #: the VBIOS version the card reports
    vbios: str = "96.00.5E.00.01"
    #: GPU Performance Monitoring (Hopper and later; sim/gpm_scenario.py): None where it has none
    gpm: GpmSpec | None = None


@dataclass(frozen=True)
class Scenario:
    gpus: tuple[GpuSpec, ...] = ()
    call_delay_ms: float = 0.0
    #: faults of calls that take no device (nvmlInit, nvmlDeviceGetCount)
    faults: tuple[Fault, ...] = ()
    #: when set, simulated time wraps around after this many seconds
    repeat: float | None = None
    #: the driver branch (DRIVERS): which symbols its library has, the version it reports
    driver: str = "current"
    #: C symbols the simulated library lacks, besides those its driver branch lacks
    missing_symbols: tuple[str, ...] = ()
    #: (when, seconds): the host's wall clock is set that far (back when negative) at
    #: simulated time `when`; samples stamped on it step with it (sim/hostclocks.py)
    clock_steps: tuple[tuple[float, float], ...] = ()
    #: (when, seconds): the host sleeps that long at `when`: simulated time (the
    #: monotonic clock) stands still, the wall clock and CLOCK_BOOTTIME go on
    suspends: tuple[tuple[float, float], ...] = ()
    #: nvmlInit answers DRIVER_NOT_LOADED while this file does not exist (a kernel
    #: module loaded later, at boot); None: the driver is loaded
    driver_loaded_file: str | None = None
    #: (from, order): from that simulated time on, NVML index i is the scenario's GPU
    #: order[i] (GPUs enumerated in another order, as after a reset or a reboot)
    reorder: tuple[tuple[float, tuple[int, ...]], ...] = ()

    def order(self, now: float) -> tuple[int, ...] | None:
        """The scenario's GPU at each NVML index now; None: in the scenario's order."""
        found = None
        for since, order in self.reorder:
            if now >= since:
                found = order
        return found

    @property
    def absent_symbols(self) -> frozenset[str]:
        """Every C symbol the simulated library lacks."""
        return frozenset(DRIVERS[self.driver][1]) | frozenset(self.missing_symbols)


def cycled(value: Cycled, index: int) -> Number | None:
    """The value of a cycled field at sample `index`."""
    if isinstance(value, (list, tuple)):
        return value[index % len(value)] if value else None
    return value  # type: ignore[return-value]  # a number, or None


def load_scenario(path: str | Path) -> Scenario:
    """Read and check a scenario file."""
    data = read_json(path, ScenarioError)
    try:
        return parse_scenario(data, base=Path(path).parent)
    except ScenarioError as error:
        raise ScenarioError(f"{path}: {error}") from None


def parse_scenario(data: Any, base: str | Path | None = None) -> Scenario:
    """Check a decoded scenario and build it.

    `base` is the folder relative paths in it (``replay``) start from: the
    scenario file's own, or the working directory when None.
    """
    top = _object(data, "the scenario", _TOP_FIELDS)
    gpus = tuple(
        _gpu(g, f"gpus[{i}]", i, base) for i, g in enumerate(_list(top.get("gpus", []), "gpus"))
    )
    busids = [g.busid for g in gpus]
    if len(set(busids)) != len(busids):
        raise ScenarioError("gpus: two GPUs have the same busid")
    repeat = top.get("repeat")
    driver = top.get("driver", "current")
    if driver not in DRIVERS:
        raise ScenarioError(f"driver must be one of {', '.join(DRIVERS)}")
    missing = _list(top.get("missing_symbols", []), "missing_symbols")
    for i, symbol in enumerate(missing):
        if symbol not in LIBRARY_SYMBOLS:
            raise ScenarioError(f"missing_symbols[{i}] {symbol!r} is not a symbol of the simulated library")
    return Scenario(
        gpus=gpus,
        call_delay_ms=_number(top.get("call_delay_ms", 0), "call_delay_ms", minimum=0),
        faults=tuple(_fault(f, f"faults[{i}]") for i, f in enumerate(_list(top.get("faults", []), "faults"))),
        repeat=None if repeat is None else _number(repeat, "repeat", minimum=0.001),
        driver=driver,
        missing_symbols=tuple(missing),
        clock_steps=_moments(top, "clock_steps", None),
        suspends=_moments(top, "suspends", 0),
        driver_loaded_file=_loaded_file(top.get("driver_loaded_file")),
        reorder=_reorder(top.get("reorder", []), len(gpus)),
    )


def _moments(top: dict[str, Any], name: str, least: float | None) -> tuple[tuple[float, float], ...]:
    """A list of [when, seconds], in the order of `when`."""
    out = []
    for i, entry in enumerate(_list(top.get(name, []), name)):
        if not isinstance(entry, list) or len(entry) != 2:
            raise ScenarioError(f"{name}[{i}] must be [when, seconds]")
        out.append((_number(entry[0], f"{name}[{i}] when", minimum=0), _number(entry[1], f"{name}[{i}] seconds",
                                                                               minimum=least)))
    return tuple(sorted(out))



def _loaded_file(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.startswith("/")):
        raise ScenarioError("driver_loaded_file must be an absolute path")
    return value


def _reorder(value: Any, count: int) -> tuple[tuple[float, tuple[int, ...]], ...]:
    found: list[tuple[float, tuple[int, ...]]] = []
    for i, entry in enumerate(_list(value, "reorder")):
        where = f"reorder[{i}]"
        entry = _object(entry, where, {"from", "order"})
        since = _number(entry.get("from", 0), f"{where}.from", minimum=0)
        order = tuple(_integer(n, f"{where}.order") for n in _list(entry.get("order"), f"{where}.order"))
        if sorted(order) != list(range(count)):
            raise ScenarioError(f"{where}.order must list each GPU's position in gpus once")
        if found and since < found[-1][0]:
            raise ScenarioError(f"{where}.from must not be before the previous entry's")
        found.append((since, order))
    return tuple(found)


def _keys(spec: type, **json_names: str) -> set[str]:
    """The keys a JSON object of `spec` may have: its dataclass fields (named as `json_names` says)."""
    return {json_names.get(f.name, f.name) for f in fields(spec)}


def _default(spec: type, name: str) -> Any:
    """`spec`'s default for the field `name`: what a scenario that leaves the key out gets."""
    return next(f.default for f in fields(spec) if f.name == name)


_TOP_FIELDS = _keys(Scenario)
_GPU_FIELDS = _keys(GpuSpec)
PROCESS_UTILIZATION = ("per-period", "per-call")
#: what a replayed recording supplies, so a replayed GPU cannot also give it
_REPLAYED_FIELDS = (
    "memory_total_mib", "memory_used_mib", "memory_reserved_mib", "gpu_util", "mem_util", "processes", "mig",
    "mig_capable", "sample_period", "gpu_timeline", "mem_timeline", "idle_samples", "sample_phase", "sample_jitter_ms",
    "late_samples", "missing_samples", "process_utilization", "duplicate_process_samples",
    "stray_process_samples",
)
_PROCESS_FIELDS = _keys(ProcessSpec)
_TIMELINE_FIELDS = _keys(Timeline)
_MIG_FIELDS = _keys(MigSpec)
_FAULT_FIELDS = _keys(Fault, start="from")


def _object(value: Any, where: str, known: set[str]) -> dict[str, Any]:
    """A JSON object whose keys are all known; keys starting with ``_`` are comments."""
    if not isinstance(value, dict):
        raise ScenarioError(f"{where} must be an object")
    for key in value:
        if key not in known and not str(key).startswith("_"):
            prefix = "" if where == "the scenario" else f"{where}."
            raise ScenarioError(f"{prefix}{key} is not a known field")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ScenarioError(f"{where} must be a list")
    return value


#: pids, ids and counts: what a C int holds
MAX_INTEGER = 2**31 - 1
#: no figure of a scenario (seconds, MiB, percent) comes near this
LARGEST = 1e15


def _number(value: Any, where: str, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScenarioError(f"{where} must be a number")
    if not -LARGEST <= value <= LARGEST:  # False for NaN too
        raise ScenarioError(f"{where} must be a number from {-LARGEST:g} to {LARGEST:g}")
    if minimum is not None and value < minimum:
        raise ScenarioError(f"{where} must be at least {minimum}")
    return value


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScenarioError(f"{where} must be an integer, 0 or more")
    if value > MAX_INTEGER:
        raise ScenarioError(f"{where} must be at most {MAX_INTEGER}")
    return value


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ScenarioError(f"{where} must be true or false")
    return value


def _cycled(value: Any, where: str, nullable: bool = False, percent: bool = False) -> Cycled:
    if value is None:
        if nullable:
            return None
        raise ScenarioError(f"{where} must not be null")
    entries = value if isinstance(value, list) else [value]
    if not entries:
        raise ScenarioError(f"{where} must not be an empty list")
    for entry in entries:
        _number(entry, where, minimum=0)
        if percent and entry > 100:
            raise ScenarioError(f"{where} is a percentage (0 to 100)")
    return tuple(value) if isinstance(value, list) else value


def _time(spec: dict[str, Any], key: str, where: str) -> float | None:
    value = spec.get(key)
    return None if value is None else _number(value, f"{where}.{key}", minimum=0)


def _span(spec: dict[str, Any], where: str) -> tuple[float, float | None]:
    start = _time(spec, "start", where) or 0.0
    stop = _time(spec, "stop", where)
    if stop is not None and stop <= start:
        raise ScenarioError(f"{where}.stop must come after its start")
    return start, stop


def _timeline(value: Any, where: str) -> Timeline | None:
    if value is None:
        return None
    spec = _object(value, where, _TIMELINE_FIELDS)
    period = _number(spec.get("period"), f"{where}.period", minimum=0.001)
    busy: list[Any] = []
    for i, spell in enumerate(_list(spec.get("busy", []), f"{where}.busy")):
        if not isinstance(spell, list) or len(spell) != 2:
            raise ScenarioError(f"{where}.busy[{i}] must be [from, until]")
        a, b = (_number(x, f"{where}.busy[{i}]", minimum=0) for x in spell)
        if not a < b <= period:
            raise ScenarioError(f"{where}.busy[{i}] must have from < until <= period")
        if busy and a < busy[-1][1]:
            raise ScenarioError(f"{where}.busy[{i}] overlaps the spell before it")
        busy.append((a, b))
    level = _number(spec.get("level", 100), f"{where}.level", minimum=0)
    if level > 100:
        raise ScenarioError(f"{where}.level is a percentage (0 to 100)")
    return Timeline(period, tuple(busy), level)


def _process(spec: Any, where: str) -> ProcessSpec:
    spec = _object(spec, where, _PROCESS_FIELDS)
    pid = spec.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ScenarioError(f"{where}.pid must be a positive integer")
    if pid > MAX_INTEGER:
        raise ScenarioError(f"{where}.pid must be at most {MAX_INTEGER}")
    kind = spec.get("type", "C")
    if kind not in PROCESS_TYPES:
        raise ScenarioError(f"{where}.type must be one of C, G, C+G")
    start, stop = _span(spec, where)
    return ProcessSpec(
        pid=pid,
        type=kind,
        memory_mib=_cycled(spec.get("memory_mib", 0), f"{where}.memory_mib", nullable=True),
        sm_util=_cycled(spec.get("sm_util", 0), f"{where}.sm_util", nullable=True, percent=True),
        mem_util=_cycled(spec.get("mem_util", 0), f"{where}.mem_util", nullable=True, percent=True),
        start=start,
        stop=stop,
        sm_timeline=_timeline(spec.get("sm_timeline"), f"{where}.sm_timeline"),
        mem_timeline=_timeline(spec.get("mem_timeline"), f"{where}.mem_timeline"),
    )


def _processes(spec: dict[str, Any], where: str) -> tuple[ProcessSpec, ...]:
    listed = _list(spec.get("processes", []), f"{where}.processes")
    return tuple(_process(p, f"{where}.processes[{i}]") for i, p in enumerate(listed))


def _fault(spec: Any, where: str) -> Fault:
    spec = _object(spec, where, _FAULT_FIELDS)
    call = spec.get("call")
    if not isinstance(call, str) or not (call.startswith("nvml") or call == "*"):
        raise ScenarioError(f"{where}.call must name an NVML function, or be * for every call")
    error = spec.get("error")
    if error not in NVML_ERRORS and error not in OTHER_FAULTS:
        raise ScenarioError(f"{where}.error {error!r} is not a known NVML error")
    if error == "RuntimeError" and call not in DECODED_CALLS:
        raise ScenarioError(
            f"{where}: a RuntimeError comes from a reply the binding decodes, so only from "
            + ", ".join(DECODED_CALLS)
        )
    return Fault(call, error, _time(spec, "from", where) or 0.0, _time(spec, "until", where))


def _faults(spec: dict[str, Any], where: str) -> tuple[Fault, ...]:
    listed = _list(spec.get("faults", []), f"{where}.faults")
    return tuple(_fault(f, f"{where}.faults[{i}]") for i, f in enumerate(listed))


def _mig(spec: Any, where: str, index: int) -> MigSpec:
    spec = _object(spec, where, _MIG_FIELDS)
    profile = spec.get("profile")
    if not isinstance(profile, str) or not profile or " " in profile:
        raise ScenarioError(f"{where}.profile must be a name such as 3g.40gb")
    start, stop = _span(spec, where)
    return MigSpec(
        profile=profile,
        memory_total_mib=_number(spec.get("memory_total_mib", 0), f"{where}.memory_total_mib", 0),
        memory_used_mib=_cycled(spec.get("memory_used_mib", 0), f"{where}.memory_used_mib"),
        gpu_instance=_integer(spec.get("gpu_instance", index + 1), f"{where}.gpu_instance"),
        compute_instance=_integer(spec.get("compute_instance", 0), f"{where}.compute_instance"),
        processes=_processes(spec, where),
        start=start,
        stop=stop,
        slot=_integer(spec.get("slot", index), f"{where}.slot"),
        faults=_faults(spec, where),
        gpu_util=_percent(spec.get("gpu_util", 0), f"{where}.gpu_util"),
        gpu_timeline=_timeline(spec.get("gpu_timeline"), f"{where}.gpu_timeline"),
        mem_util=_percent(spec.get("mem_util", 0), f"{where}.mem_util"),
        mem_timeline=_timeline(spec.get("mem_timeline"), f"{where}.mem_timeline"),
    )


def _percent(value: Any, where: str) -> float:
    number = _number(value, where, minimum=0)
    if number > 100:
        raise ScenarioError(f"{where} is a percentage (0 to 100)")
    return number


def _overlap(a: MigSpec, b: MigSpec) -> bool:
    """Whether two instances exist at the same time."""
    return (b.stop is None or a.start < b.stop) and (a.stop is None or b.start < a.stop)


def _check_carving(instances: tuple[MigSpec, ...], where: str) -> None:
    """Ids and slots may be reused by a later carving, never by two instances at once."""
    for i, first in enumerate(instances):
        for j in range(i + 1, len(instances)):
            second = instances[j]
            if not _overlap(first, second):
                continue
            if (first.gpu_instance, first.compute_instance) == (second.gpu_instance, second.compute_instance):
                raise ScenarioError(
                    f"{where}[{j}]: gpu_instance/compute_instance {second.gpu_instance}/"
                    f"{second.compute_instance} is in use by mig[{i}] at the same time"
                )
            if first.slot == second.slot:
                raise ScenarioError(f"{where}[{j}].slot {second.slot} is in use by mig[{i}] at the same time")


def _replay(spec: dict[str, Any], where: str, base: str | Path | None) -> Recording | None:
    """The recording a GPU replays, loaded and checked; None without ``replay``."""
    if "replay" not in spec:
        return None
    value = spec["replay"]
    if not isinstance(value, str) or not value:
        raise ScenarioError(f"{where}.replay must be the path of a recording")
    for key in _REPLAYED_FIELDS:
        if key in spec:
            raise ScenarioError(f"{where}.{key} cannot be given with replay (the recording supplies it)")
    path = Path(value)
    if base is not None and not path.is_absolute():
        path = Path(base) / path
    try:
        return load_recording(path)
    except RecordingError as error:
        raise ScenarioError(f"{where}.replay: {error}") from None


def _gpu(spec: Any, where: str, index: int, base: str | Path | None = None) -> GpuSpec:
    spec = _object(spec, where, _GPU_FIELDS)
    recording = _replay(spec, where, base)
    if recording is not None and spec.get("gpm") not in (None, False):
        raise ScenarioError(f"{where}.gpm cannot be given with replay (a recording has no GPM)")
    if recording is not None:
        spec = {"name": recording.name, "uuid": recording.uuid, "busid": recording.busid,
                "memory_total_mib": recording.memory_total / 1048576, **spec}
    busid = spec.get("busid", f"00000000:{0x17 + index:02X}:00.0")
    name = spec.get("name", "NVIDIA Simulated GPU")
    uuid = spec.get("uuid", f"GPU-5111a7ed-0000-4000-8000-{index:012d}")
    for key, value in (("busid", busid), ("name", name), ("uuid", uuid)):
        if not isinstance(value, str) or not value:
            raise ScenarioError(f"{where}.{key} must be a non-empty string")
    mig = spec.get("mig")
    instances = None
    if mig is not None:
        listed = _list(mig, f"{where}.mig")
        instances = tuple(_mig(m, f"{where}.mig[{i}]", i) for i, m in enumerate(listed))
        _check_carving(instances, f"{where}.mig")
    capable = _flag(spec.get("mig_capable", instances is not None), f"{where}.mig_capable")
    if instances is not None and not capable:
        raise ScenarioError(f"{where}.mig_capable cannot be false on a GPU with a mig list")
    return GpuSpec(
        name=name,
        busid=busid,
        uuid=uuid,
        memory_total_mib=_number(
            spec.get("memory_total_mib", _default(GpuSpec, "memory_total_mib")), f"{where}.memory_total_mib", 0
        ),
        memory_used_mib=_cycled(spec.get("memory_used_mib", 0), f"{where}.memory_used_mib"),
        gpu_util=_cycled(spec.get("gpu_util", 0), f"{where}.gpu_util", nullable=True, percent=True),
        mem_util=_cycled(spec.get("mem_util", 0), f"{where}.mem_util", nullable=True, percent=True),
        processes=_processes(spec, where),
        mig=instances,
        faults=_faults(spec, where),
        compute_list=_flag(spec.get("compute_list", True), f"{where}.compute_list"),
        graphics_list=_flag(spec.get("graphics_list", True), f"{where}.graphics_list"),
        mig_capable=capable,
        sample_period=_number(
            spec.get("sample_period", _default(GpuSpec, "sample_period")), f"{where}.sample_period", minimum=0.001
        ),
        gpu_timeline=_timeline(spec.get("gpu_timeline"), f"{where}.gpu_timeline"),
        mem_timeline=_timeline(spec.get("mem_timeline"), f"{where}.mem_timeline"),
        samples_supported=_flag(spec.get("samples_supported", True), f"{where}.samples_supported"),
        idle_samples=_flag(spec.get("idle_samples", True), f"{where}.idle_samples"),
        memory_reserved_mib=_number(spec.get("memory_reserved_mib", 0), f"{where}.memory_reserved_mib", 0),
        process_list_capacity=_capacity(spec.get("process_list_capacity"), f"{where}.process_list_capacity"),
        grow_between_calls=_growth(spec.get("grow_between_calls", 0), f"{where}.grow_between_calls"),
        **_sample_timing(spec, where),
        replay=recording,
        health=parse_health(spec.get("health"), f"{where}.health", ScenarioError),
        serial=_serial(spec.get("serial", f"1324321{index:06d}"), f"{where}.serial"),
        vbios=_text(spec.get("vbios", _default(GpuSpec, "vbios")), f"{where}.vbios"),
        gpm=parse_gpm(spec.get("gpm"), f"{where}.gpm", ScenarioError),
    )


def _serial(value: Any, where: str) -> str | None:
    return None if value is None else _text(value, where)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ScenarioError(f"{where} must be a non-empty string")
    return value


def _capacity(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScenarioError(f"{where} must be a positive integer")
    if value > MAX_INTEGER:
        raise ScenarioError(f"{where} must be at most {MAX_INTEGER}")
    return value


def _whole(value: Any, where: str) -> Cycled:
    """A cycled count: an integer >= 0, or a list of them."""
    for entry in value if isinstance(value, list) else [value]:
        _integer(entry, where)
    return _cycled(value, where)


def _growth(value: Any, where: str) -> dict[str, Cycled]:
    """One count for every sized list, or an object of counts by list."""
    if not isinstance(value, dict):
        count = _whole(value, where)
        return {name: count for name in GROWING_LISTS}
    spec = _object(value, where, set(GROWING_LISTS))
    return {name: _whole(spec[name], f"{where}.{name}") for name in GROWING_LISTS if name in spec}


def _sample_timing(spec: dict[str, Any], where: str) -> dict[str, Any]:
    """The fields of how a GPU's driver stamps and lists its samples."""
    period = spec.get("sample_period", _default(GpuSpec, "sample_period"))
    clock = spec.get("sample_clock", "epoch")
    if clock == "epoch":
        clock = None
    elif clock == "boottime":
        clock = time.clock_gettime(time.CLOCK_BOOTTIME)
    else:
        clock = _number(clock, f"{where}.sample_clock (epoch, boottime or seconds)", minimum=0)
    phase = _number(spec.get("sample_phase", 0), f"{where}.sample_phase", minimum=0)
    if phase >= period:
        raise ScenarioError(f"{where}.sample_phase must be less than the sample_period")
    jitter = _number(spec.get("sample_jitter_ms", 0), f"{where}.sample_jitter_ms", minimum=0)
    if jitter / 1000 >= period / 2:
        raise ScenarioError(f"{where}.sample_jitter_ms must be less than half the sample_period")
    late = []
    for i, entry in enumerate(_list(spec.get("late_samples", []), f"{where}.late_samples")):
        if not isinstance(entry, list) or len(entry) != 2:
            raise ScenarioError(f"{where}.late_samples[{i}] must be [when, ms]")
        late.append(tuple(_number(x, f"{where}.late_samples[{i}]", minimum=0) for x in entry))
    missing = tuple(
        _number(t, f"{where}.missing_samples[{i}]", minimum=0)
        for i, t in enumerate(_list(spec.get("missing_samples", []), f"{where}.missing_samples"))
    )
    how = spec.get("process_utilization", "per-period")
    if how not in PROCESS_UTILIZATION:
        raise ScenarioError(f"{where}.process_utilization must be one of {', '.join(PROCESS_UTILIZATION)}")
    strays = []
    listed = _list(spec.get("stray_process_samples", []), f"{where}.stray_process_samples")
    for i, entry in enumerate(listed):
        entry_where = f"{where}.stray_process_samples[{i}]"
        entry = _object(entry, entry_where, {"pid", "sm_util", "mem_util"})
        strays.append(
            (
                _integer(entry.get("pid", 0), f"{entry_where}.pid"),
                _integer(entry.get("sm_util", 0), f"{entry_where}.sm_util"),
                _integer(entry.get("mem_util", 0), f"{entry_where}.mem_util"),
            )
        )
    return {
        "sample_clock": clock,
        "sample_phase": phase,
        "sample_jitter_ms": jitter,
        "late_samples": tuple(late),
        "missing_samples": missing,
        "samples_not_found": _flag(spec.get("samples_not_found", False), f"{where}.samples_not_found"),
        "process_utilization": how,
        "duplicate_process_samples": _flag(
            spec.get("duplicate_process_samples", False), f"{where}.duplicate_process_samples"
        ),
        "stray_process_samples": tuple(strays),
    }
