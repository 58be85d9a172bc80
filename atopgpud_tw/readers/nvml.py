"""The NVML reader: one Snapshot per poll through nvidia-ml-py (or the simulator).

Every NVML call goes through `NvmlDevice.call`, the one choke point that maps
errors: NOT_SUPPORTED is remembered per device and the call is not made again;
NOT_FOUND is the idle case; GPU_IS_LOST makes that device absent for the poll;
UNINITIALIZED, DRIVER_NOT_LOADED and LIB_RM_VERSION_MISMATCH (and a library that
lacks a symbol) mean NVML must be set up again, which `NvmlReader` does with
backoff while reporting every device absent.  All of it runs in one daemon
thread (`SerialWorker`): the reactor never waits for NVML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from zope.interface import implementer

from atopgpud_tw.problems import ProblemLog
from atopgpud_tw.readers.base import IReader, ReaderUnavailable
from atopgpud_tw.snapshot import (
    TASK_COMPUTE,
    TASK_GRAPHICS,
    UNSUPPORTED,
    DeviceSample,
    ProcessSample,
    Snapshot,
    clamp_percent,
)
from atopgpud_tw.worker import SerialWorker

log = Logger()

NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
FUNCTION_NOT_FOUND = 13
#: errors after which NVML has to be initialised again
LIFECYCLE = {1: "UNINITIALIZED", 9: "DRIVER_NOT_LOADED", 18: "LIB_RM_VERSION_MISMATCH"}
GPU_IS_LOST = 15
GPU_NOT_FOUND = 28
_ERROR_NAMES = {
    2: "INVALID_ARGUMENT",
    NOT_SUPPORTED: "NOT_SUPPORTED",
    NO_PERMISSION: "NO_PERMISSION",
    NOT_FOUND: "NOT_FOUND",
    7: "INSUFFICIENT_SIZE",
    10: "TIMEOUT",
    12: "LIBRARY_NOT_FOUND",
    FUNCTION_NOT_FOUND: "FUNCTION_NOT_FOUND",
    GPU_IS_LOST: "GPU_IS_LOST",
    17: "OPERATING_SYSTEM",
    GPU_NOT_FOUND: "GPU_NOT_FOUND",
    999: "UNKNOWN",
    **LIFECYCLE,
}
#: seconds between attempts to set NVML up again, doubling up to the last
BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)


def error_name(error: BaseException) -> str:
    """A short stable name for an NVML error (also the key of a logged problem)."""
    value = getattr(error, "value", None)
    if isinstance(value, int):
        return "NVML_ERROR_" + _ERROR_NAMES.get(value, str(value))
    return type(error).__name__


def as_text(value: Any) -> str:
    """Names and bus ids as str, whether the binding returns bytes or str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\0")
    return str(value)


class Unsupported(Exception):
    """The device cannot do this; the call is not made again."""


class Idle(Exception):
    """NOT_FOUND: no samples since the last read (the device was idle)."""


class Failed(Exception):
    """The call failed in this poll; `cause` keys the logged problem."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class DeviceLost(Failed):
    """The device cannot be read at all in this poll."""


class Reinitialise(Failed):
    """NVML itself has to be set up again."""


@dataclass
class NvmlDevice:
    """One discovered device: its handle, identity and what it cannot do."""

    nvml: Any
    handle: Any
    key: str
    busid: str
    name: str
    task_support: int = 0
    unsupported: set[str] = field(default_factory=set)
    #: the newest process-utilization timestamp NVML returned for this device
    last_seen: int = 0

    def call(self, function: str, *args: Any) -> Any:
        """Call ``nvml.<function>(handle, *args)`` through the error mapping."""
        if function in self.unsupported:
            raise Unsupported(function)
        try:
            return getattr(self.nvml, function)(self.handle, *args)
        except self.nvml.NVMLError as error:
            value = getattr(error, "value", None)
            if value in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                self.unsupported.add(function)
                raise Unsupported(function) from None
            if value == NOT_FOUND:
                raise Idle(function) from None
            cause = f"{function}: {error_name(error)}"
            if value in LIFECYCLE:
                raise Reinitialise(cause) from None
            if value in (GPU_IS_LOST, GPU_NOT_FOUND):
                raise DeviceLost(cause) from None
            raise Failed(cause) from None
        except getattr(self.nvml, "NVMLLibraryMismatchError", ()) as error:
            # the binding wants a symbol the installed driver lacks: the call can
            # never work with this library, like NOT_SUPPORTED
            self.unsupported.add(function)
            raise Unsupported(f"{function}: {error}") from None


def _probe_support(device: NvmlDevice) -> int:
    support = 0
    for bit, function in (
        (TASK_COMPUTE, "nvmlDeviceGetComputeRunningProcesses"),
        (TASK_GRAPHICS, "nvmlDeviceGetGraphicsRunningProcesses"),
    ):
        try:
            device.call(function)
            support |= bit
        except Unsupported:
            pass
        except Failed:
            support |= bit  # a passing failure says nothing about support
    return support


def read_device(device: NvmlDevice, problems: dict[str, str]) -> DeviceSample:
    """Everything about one device in this poll (runs in the worker thread)."""
    subject = f"GPU {device.busid}"

    def attempt(function: Callable[[], Any], unsupported: Any = UNSUPPORTED) -> Any:
        try:
            return function()
        except Unsupported:
            return unsupported
        except (DeviceLost, Reinitialise):
            raise
        except Failed as failure:
            problems[f"{device.key} {failure.cause}"] = f"{subject}: {failure.cause}"
            return None

    rates = attempt(lambda: device.call("nvmlDeviceGetUtilizationRates"))
    if rates in (None, UNSUPPORTED):
        gpu_busy = mem_busy = rates
    else:
        gpu_busy, mem_busy = clamp_percent(rates.gpu), clamp_percent(rates.memory)
    memory = attempt(lambda: device.call("nvmlDeviceGetMemoryInfo"))
    if memory is None:
        total = used = None
    elif memory is UNSUPPORTED:
        total = used = 0
    else:
        total, used = int(memory.total) // 1024, int(memory.used) // 1024
    processes = attempt(lambda: _read_processes(device, attempt), unsupported=())
    return DeviceSample(
        key=device.key,
        busid=device.busid,
        name=device.name,
        task_support=device.task_support,
        gpu_busy=gpu_busy,
        mem_busy=mem_busy,
        memory_total_kib=total,
        memory_used_kib=used,
        processes=processes,
    )


def _read_processes(device: NvmlDevice, attempt: Callable[..., Any]) -> tuple[ProcessSample, ...] | None:
    found: dict[int, tuple[str, int]] = {}
    for kind, function in (
        ("C", "nvmlDeviceGetComputeRunningProcesses"),
        ("G", "nvmlDeviceGetGraphicsRunningProcesses"),
    ):
        listed = attempt(lambda: device.call(function), unsupported=())
        if listed is None:
            return None  # a partial list would make processes seem to end
        for proc in listed:
            memory = getattr(proc, "usedGpuMemory", None)
            memory_kib = int(memory) // 1024 if isinstance(memory, int) else 0
            seen = found.get(int(proc.pid))
            if seen is None:
                found[int(proc.pid)] = (kind, memory_kib)
            else:
                merged = seen[0] if seen[0] == kind else "C+G"
                found[int(proc.pid)] = (merged, max(seen[1], memory_kib))
    if not found:
        return ()
    busy = attempt(lambda: _process_busy(device))
    result = []
    for pid, (kind, memory_kib) in found.items():
        if busy is None or busy is UNSUPPORTED:
            gpu = mem = busy
        else:
            gpu, mem = busy.get(pid, (0, 0))
        result.append(ProcessSample(pid, kind, memory_kib, gpu, mem))
    return tuple(result)


def _process_busy(device: NvmlDevice) -> dict[int, tuple[int, int]]:
    """Per-pid busy percentages since the device's last-seen timestamp.

    Samples no newer than the timestamp we asked with, or over 100 %, are bogus
    (NVML-FACTS.md section 3) and dropped.  Several samples of one pid are
    averaged.  On the first read (no timestamp yet) the whole driver buffer comes
    back; only each pid's newest sample is used then.  A pid without a sample was
    idle: 0 %.
    """
    since = device.last_seen
    try:
        samples = device.call("nvmlDeviceGetProcessUtilization", since)
    except Idle:
        return {}
    except Failed as failure:
        if "NVML_ERROR_0" in failure.cause:
            return {}  # SUCCESS on the size query: the wrapper's way of saying "none"
        raise
    per_pid: dict[int, list[tuple[int, int, int]]] = {}
    newest = since
    for sample in samples:
        stamp = int(sample.timeStamp)
        if stamp <= since or sample.smUtil > 100 or sample.memUtil > 100:
            continue
        newest = max(newest, stamp)
        per_pid.setdefault(int(sample.pid), []).append((stamp, sample.smUtil, sample.memUtil))
    device.last_seen = newest
    busy = {}
    for pid, entries in per_pid.items():
        if since == 0:
            entries = [max(entries)]
        busy[pid] = (
            clamp_percent(sum(e[1] for e in entries) / len(entries)),
            clamp_percent(sum(e[2] for e in entries) / len(entries)),
        )
    return busy


@implementer(IReader)
class NvmlReader:
    """Reads every GPU through an NVML binding (`pynvml` or the simulator)."""

    name = "nvml"

    def __init__(self, nvml: ModuleType | Any, reactor: Any, mig: str = "instances") -> None:
        self.nvml = nvml
        self.mig = mig
        self._reactor = reactor
        self._worker = SerialWorker(reactor)
        self._problems = ProblemLog("nvml")
        self._devices: list[NvmlDevice] = []
        #: devices ever discovered, by key, so a device that vanishes stays listed
        self._known: dict[str, DeviceSample] = {}
        self._initialised = False
        self._retry_at = 0.0
        self._attempts = 0

    # -- start-up (blocking, before the reactor runs) --

    def open(self) -> None:
        """Initialise NVML and discover the devices; raise ReaderUnavailable if NVML is not usable."""
        try:
            self._initialise()
        except Exception as error:
            raise ReaderUnavailable(_describe_init_failure(error)) from None
        if not self._devices:
            log.warn("nvml: no GPU found; serving an empty list and looking again every poll")

    def _initialise(self) -> None:
        self.nvml.nvmlInit()
        self._initialised = True
        self._devices = self._discover()
        self._attempts = 0

    def _discover(self) -> list[NvmlDevice]:
        devices = []
        for index in range(self.nvml.nvmlDeviceGetCount()):
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
                busid = as_text(self.nvml.nvmlDeviceGetPciInfo(handle).busId)
                name = as_text(self.nvml.nvmlDeviceGetName(handle))
            except self.nvml.NVMLError as error:
                if getattr(error, "value", None) in LIFECYCLE:
                    raise
                log.warn(
                    "nvml: GPU index {index} cannot be used: {error}",
                    index=index,
                    error=error_name(error),
                )
                continue
            try:
                key = as_text(self.nvml.nvmlDeviceGetUUID(handle))
            except self.nvml.NVMLError:
                key = busid
            device = NvmlDevice(self.nvml, handle, key, busid, name)
            device.task_support = _probe_support(device)
            devices.append(device)
        for device in devices:
            log.info(
                "nvml: GPU {busid} {name} (processes: {support})",
                busid=device.busid,
                name=device.name,
                support=_support_text(device.task_support),
            )
        return devices

    # -- polling --

    def poll(self) -> Deferred:
        """Read all devices in the worker thread; fires with a Snapshot."""
        result = self._worker.submit(self.read, self._reactor.seconds())
        result.addCallback(self._reported)
        return result

    def _reported(self, outcome: tuple[Snapshot, dict[str, str]]) -> Snapshot:
        snapshot, problems = outcome
        self._problems.report(problems)
        return snapshot

    def read(self, now: float) -> tuple[Snapshot, dict[str, str]]:
        """One blocking poll of every device, and the problems it met."""
        problems: dict[str, str] = {}
        if not self._initialised or not self._devices:
            if now < self._retry_at:
                problems["init"] = "NVML is being set up again"
                return self._absent(), problems
            try:
                if self._initialised:
                    self._devices = self._discover()
                else:
                    self._initialise()
            except Exception as error:
                self._schedule_retry(now)
                problems["init"] = f"cannot set up NVML ({_describe_init_failure(error)})"
                return self._absent(), problems
        samples = []
        for device in self._devices:
            try:
                sample = read_device(device, problems)
            except Reinitialise as failure:
                problems["init"] = f"{failure.cause}; setting NVML up again"
                self._shutdown()
                self._schedule_retry(now)
                return self._absent(), problems
            except DeviceLost as failure:
                problems[f"{device.key} lost"] = f"GPU {device.busid}: {failure.cause}"
                sample = self._known.get(device.key) or _placeholder(device)
                sample = _absent(sample)
            self._known[device.key] = sample
            samples.append(sample)
        return self._with_vanished(samples), problems

    def _with_vanished(self, samples: list[DeviceSample]) -> Snapshot:
        present = {s.key for s in samples}
        gone = [_absent(s) for key, s in self._known.items() if key not in present]
        return Snapshot(tuple(samples) + tuple(gone))

    def _absent(self) -> Snapshot:
        return Snapshot(tuple(_absent(s) for s in self._known.values()))

    def _schedule_retry(self, now: float) -> None:
        self._retry_at = now + BACKOFF[min(self._attempts, len(BACKOFF) - 1)]
        self._attempts += 1

    def _shutdown(self) -> None:
        if self._initialised:
            self._initialised = False
            self._devices = []
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass  # shutting down a broken library may fail; it is let go anyway

    def close(self) -> None:
        """Shut NVML down (from the worker, after any poll in flight) and stop the worker."""
        self._worker.submit(self._shutdown)
        self._worker.stop()


def _placeholder(device: NvmlDevice) -> DeviceSample:
    return DeviceSample(device.key, device.busid, device.name, device.task_support)


def _absent(sample: DeviceSample) -> DeviceSample:
    return DeviceSample(
        key=sample.key,
        busid=sample.busid,
        name=sample.name,
        task_support=sample.task_support,
        present=False,
    )


def _support_text(support: int) -> str:
    kinds = [name for bit, name in ((TASK_COMPUTE, "compute"), (TASK_GRAPHICS, "graphics")) if support & bit]
    return " and ".join(kinds) or "none"


def _describe_init_failure(error: BaseException) -> str:
    value = getattr(error, "value", None)
    if value == 12:
        return "the NVML library (libnvidia-ml.so.1) is not installed"
    if value == 9:
        return "the NVIDIA driver is not loaded"
    if value == 18:
        return "the NVML library does not match the loaded driver (reboot or reload the module)"
    if value == NO_PERMISSION:
        return "no permission to use the GPUs"
    return f"NVML cannot be initialised: {error_name(error)} ({error})"
