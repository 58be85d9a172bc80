"""The NVML reader: one Snapshot per poll through nvidia-ml-py (or the simulator).

Every NVML call goes through `NvmlDevice.call`, the one choke point that maps
errors: NOT_SUPPORTED is remembered per device and the call is not made again;
NOT_FOUND is the idle case; GPU_IS_LOST makes that device absent for the poll;
UNINITIALIZED, DRIVER_NOT_LOADED and LIB_RM_VERSION_MISMATCH (and a library that
lacks a symbol) mean NVML must be set up again, which `NvmlReader` does with
backoff while reporting every device absent.  All of it runs in one daemon
thread (`SerialWorker`): the reactor never waits for NVML.

A card in MIG mode (docs/mig.md, NVML-FACTS.md section 5) is read as its MIG
instances, each a device named by `atopgpud_tw.identity`, with its own memory and
processes and no utilization (NVML has none under MIG).  The mode and the
instances are looked up again at every poll, a few cheap calls, so instances
created or destroyed while the daemon runs are picked up.  With ``mig="card"``
the instances are summed into one device for the card.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from zope.interface import implementer

from atopgpud_tw.identity import mig_busid, mig_key, mig_profile
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

INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
FUNCTION_NOT_FOUND = 13
#: errors after which NVML has to be initialised again
LIFECYCLE = {1: "UNINITIALIZED", 9: "DRIVER_NOT_LOADED", 18: "LIB_RM_VERSION_MISMATCH"}
GPU_IS_LOST = 15
GPU_NOT_FOUND = 28
_ERROR_NAMES = {
    INVALID_ARGUMENT: "INVALID_ARGUMENT",
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
#: nvmlDeviceGetMigMode's "current" value for a card in MIG mode
MIG_ENABLED = 1
MIG_MODES = ("instances", "card")


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
    """The call failed in this poll; `cause` keys the logged problem, `value` is the NVML code."""

    def __init__(self, cause: str, value: int | None = None) -> None:
        super().__init__(cause)
        self.cause = cause
        self.value = value


class DeviceLost(Failed):
    """The device cannot be read at all in this poll."""


class Reinitialise(Failed):
    """NVML itself has to be set up again."""


@dataclass(eq=False)
class MigState:
    """What is known of a card's MIG mode and, in MIG mode, of its instances."""

    enabled: bool = False
    #: nvmlDeviceGetMaxMigDeviceCount, asked once per spell in MIG mode
    slots: int | None = None
    #: the instances found at the last poll, by key
    instances: dict[str, NvmlDevice] = field(default_factory=dict)


@dataclass(eq=False)
class NvmlDevice:
    """One discovered device (a card or a MIG instance): its handle, identity and what it cannot do."""

    nvml: Any
    handle: Any
    key: str
    busid: str
    name: str
    task_support: int = 0
    unsupported: set[str] = field(default_factory=set)
    #: the newest process-utilization timestamp NVML returned for this device
    last_seen: int = 0
    #: a MIG instance: no utilization of its own, device-wide or per process
    mig_instance: bool = False
    #: a card's MIG mode and instances
    mig: MigState = field(default_factory=MigState)

    def call(self, function: str, *args: Any) -> Any:
        """Call ``nvml.<function>(handle, *args)`` through the error mapping."""
        if function in self.unsupported:
            raise Unsupported(function)
        bound = getattr(self.nvml, function, None)
        if bound is None:
            # a binding too old to have the function: it can never work here
            self.unsupported.add(function)
            raise Unsupported(function)
        try:
            return bound(self.handle, *args)
        except self.nvml.NVMLError as error:
            value = getattr(error, "value", None)
            if value in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                self.unsupported.add(function)
                raise Unsupported(function) from None
            if value == NOT_FOUND:
                raise Idle(function) from None
            cause = f"{function}: {error_name(error)}"
            if value in LIFECYCLE:
                raise Reinitialise(cause, value) from None
            if value in (GPU_IS_LOST, GPU_NOT_FOUND):
                raise DeviceLost(cause, value) from None
            raise Failed(cause, value) from None
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
        except (Failed, Idle):
            support |= bit  # a passing failure says nothing about support
    return support


def _attempter(device: NvmlDevice, problems: dict[str, str]) -> Callable[..., Any]:
    """``attempt(function, unsupported)``: one reading, with failures noted in `problems`.

    It returns `unsupported` when the device cannot do it, ``None`` when it
    failed in this poll, and lets a lost device or a broken NVML through.
    """
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
        except Idle as idle:
            # NOT_FOUND where a value was expected: nothing to count in this poll
            problems[f"{device.key} {idle} not found"] = f"{subject}: {idle}: NVML_ERROR_NOT_FOUND"
            return None

    return attempt


def read_device(device: NvmlDevice, problems: dict[str, str]) -> DeviceSample:
    """Everything about one device in this poll (runs in the worker thread)."""
    attempt = _attempter(device, problems)
    gpu_busy, mem_busy = read_rates(device, attempt)
    total, used = read_memory(device, attempt)
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


def read_rates(device: NvmlDevice, attempt: Callable[..., Any]) -> tuple[int | None, int | None]:
    """The GPU and memory busy percentages of one device in this poll.

    A MIG instance has none: NVML reports no utilization under MIG.
    """
    if device.mig_instance:
        return UNSUPPORTED, UNSUPPORTED
    rates = attempt(lambda: device.call("nvmlDeviceGetUtilizationRates"))
    if rates is None or rates is UNSUPPORTED:
        return rates, rates
    return clamp_percent(rates.gpu), clamp_percent(rates.memory)


def read_memory(device: NvmlDevice, attempt: Callable[..., Any]) -> tuple[int | None, int | None]:
    """Total and used memory in KiB (0 when unsupported, ``None`` when the read failed)."""
    memory = attempt(lambda: device.call("nvmlDeviceGetMemoryInfo"))
    if memory is None:
        return None, None
    if memory is UNSUPPORTED:
        return 0, 0
    return int(memory.total) // 1024, int(memory.used) // 1024


def _read_processes(device: NvmlDevice, attempt: Callable[..., Any]) -> tuple[ProcessSample, ...] | None:
    found: dict[int, tuple[str, int]] = {}
    for kind, function in (
        ("C", "nvmlDeviceGetComputeRunningProcesses"),
        ("G", "nvmlDeviceGetGraphicsRunningProcesses"),
    ):
        listed = attempt(lambda function=function: device.call(function), unsupported=())
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
    # no per-process utilization under MIG: not asked, so no failure can be mistaken for it
    busy = UNSUPPORTED if device.mig_instance else attempt(lambda: _process_busy(device))
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


# -- MIG --


def read_card(card: NvmlDevice, mig: str, problems: dict[str, str]) -> list[DeviceSample]:
    """A card's devices in this poll: the card, or its MIG instances (or their sum).

    A lost card raises `DeviceLost`; a MIG instance that fails does not touch
    the card or the other instances.
    """
    if not _mig_enabled(card, mig, problems):
        return [read_device(card, problems)]
    instances, complete = _enumerate(card, problems)
    if not instances and complete:
        problems[f"{card.key} mig-empty"] = (
            f"GPU {card.busid} is in MIG mode with no instances: nothing can run on it"
        )
        total, used = read_memory(card, _attempter(card, problems))
        return [_card_sample(card, total, used, ())]
    samples = [_read_instance(instance, problems) for instance in instances]
    if not complete:
        # an instance that could not be looked at now is not gone: it counts nothing this poll
        seen = {instance.key for instance in instances}
        samples += [_unread(i) for key, i in card.mig.instances.items() if key not in seen]
        if not samples:
            return [_card_sample(card, None, None, None)] if mig == "card" else []
    if mig == "card":
        return [_card_total(card, samples)]
    return samples


def _mig_enabled(card: NvmlDevice, mig: str, problems: dict[str, str]) -> bool:
    """Whether the card is in MIG mode now; NOT_SUPPORTED means it cannot be (and is not asked again)."""
    try:
        enabled = int(card.call("nvmlDeviceGetMigMode")[0]) == MIG_ENABLED
    except Unsupported:
        enabled = False
    except Idle:
        return card.mig.enabled
    except (DeviceLost, Reinitialise):
        raise
    except Failed as failure:
        problems[f"{card.key} {failure.cause}"] = f"GPU {card.busid}: {failure.cause}"
        return card.mig.enabled
    if enabled != card.mig.enabled:
        card.mig = MigState(enabled=enabled)
        # what a card supports depends on its mode
        card.unsupported.clear()
        shown = "each MIG instance as a device" if mig == "instances" else "the card as one device"
        log.info(
            "nvml: GPU {busid} is {state}",
            busid=card.busid,
            state=f"in MIG mode: showing {shown}" if enabled else "out of MIG mode",
        )
    return enabled


def _enumerate(card: NvmlDevice, problems: dict[str, str]) -> tuple[list[NvmlDevice], bool]:
    """The card's MIG instances now, in slot order, and whether the list is complete.

    Slots are sparse: NOT_FOUND or INVALID_ARGUMENT means nothing is there (or it
    was destroyed while being looked at).  Any other failure leaves the list
    incomplete, so that no instance is taken for gone on a passing error.
    """
    state = card.mig
    if state.slots is None:
        slots = _attempter(card, problems)(lambda: card.call("nvmlDeviceGetMaxMigDeviceCount"), 0)
        if slots is None:
            return [], False
        state.slots = int(slots)
    found: dict[str, NvmlDevice] = {}
    complete = True
    for slot in range(state.slots):
        try:
            handle = card.call("nvmlDeviceGetMigDeviceHandleByIndex", slot)
        except (Idle, Unsupported):
            continue
        except (DeviceLost, Reinitialise):
            raise
        except Failed as failure:
            complete &= _empty_slot(card, slot, failure, problems)
            continue
        try:
            instance = _identify(card, handle)
        except Idle:
            continue
        except Unsupported as unsupported:
            # a driver that cannot say which instance this is: said once, not guessed
            problems[f"{card.key} mig identity"] = (
                f"GPU {card.busid}: MIG device {slot} left out: {unsupported} is not supported"
            )
            continue
        except Reinitialise:
            raise
        except Failed as failure:
            complete &= _empty_slot(card, slot, failure, problems)
            continue
        found.setdefault(instance.key, instance)
    _note_changes(card, found, complete)
    return list(found.values()), complete


def _empty_slot(card: NvmlDevice, slot: int, failure: Failed, problems: dict[str, str]) -> bool:
    """Whether a failure at a slot means "nothing there" (else it is a problem)."""
    if failure.value == INVALID_ARGUMENT:
        return True
    problems[f"{card.key} mig slot {slot} {failure.cause}"] = (
        f"GPU {card.busid}: MIG device {slot}: {failure.cause}"
    )
    return False


def _identify(card: NvmlDevice, handle: Any) -> NvmlDevice:
    """The instance behind a fresh MIG handle: one already known by its ids, or a new one.

    Handles of destroyed instances become invalid and may be reused, so the ids
    and the profile are read again at every poll.
    """
    probe = NvmlDevice(card.nvml, handle, card.key, card.busid, card.name, mig_instance=True)
    gpu_instance = int(probe.call("nvmlDeviceGetGpuInstanceId"))
    compute_instance = int(probe.call("nvmlDeviceGetComputeInstanceId"))
    profile = mig_profile(as_text(probe.call("nvmlDeviceGetName")))
    key = mig_key(card.key, gpu_instance, compute_instance)
    instance = card.mig.instances.get(key)
    if instance is None or instance.name != profile:
        busid = mig_busid(card.busid, gpu_instance, compute_instance)
        instance = NvmlDevice(card.nvml, handle, key, busid, profile, mig_instance=True)
        instance.task_support = _probe_support(instance)
    instance.handle = handle
    return instance


def _note_changes(card: NvmlDevice, found: dict[str, NvmlDevice], complete: bool) -> None:
    known = card.mig.instances
    for key, instance in found.items():
        if key not in known:
            log.info(
                "nvml: GPU {card}: MIG instance {busid} ({profile}) is there",
                card=card.busid,
                busid=instance.busid,
                profile=instance.name,
            )
    if not complete:
        known.update(found)
        return
    for key, instance in known.items():
        if key not in found:
            log.info("nvml: GPU {card}: MIG instance {busid} is gone", card=card.busid, busid=instance.busid)
    card.mig.instances = dict(found)


def _read_instance(instance: NvmlDevice, problems: dict[str, str]) -> DeviceSample:
    try:
        return read_device(instance, problems)
    except DeviceLost as failure:
        problems[f"{instance.key} lost"] = f"MIG instance {instance.busid}: {failure.cause}"
        return _absent(_placeholder(instance))


def _unread(instance: NvmlDevice) -> DeviceSample:
    """An instance that is there but could not be read in this poll."""
    return DeviceSample(
        instance.key, instance.busid, instance.name, instance.task_support,
        memory_total_kib=None, memory_used_kib=None, processes=None,
    )


def _card_sample(
    card: NvmlDevice, total: int | None, used: int | None, processes: tuple[ProcessSample, ...] | None
) -> DeviceSample:
    """A card in MIG mode as one device: no utilization of its own."""
    return DeviceSample(
        card.key, card.busid, card.name, card.task_support,
        gpu_busy=UNSUPPORTED, mem_busy=UNSUPPORTED,
        memory_total_kib=total, memory_used_kib=used, processes=processes,
    )


def _card_total(card: NvmlDevice, parts: list[DeviceSample]) -> DeviceSample:
    """``--mig card``: the card's instances summed; a lost instance no longer counts."""
    parts = [part for part in parts if part.present]
    lists = [part.processes for part in parts]
    processes = None if any(listed is None for listed in lists) else _sum_processes(lists)
    return _card_sample(
        card,
        _sum([part.memory_total_kib for part in parts]),
        _sum([part.memory_used_kib for part in parts]),
        processes,
    )


def _sum(values: list[int | None]) -> int | None:
    return None if None in values else sum(values)  # type: ignore[arg-type]


def _sum_processes(lists: list[Any]) -> tuple[ProcessSample, ...]:
    """One entry per pid; a pid on two instances holds memory on both."""
    merged: dict[int, ProcessSample] = {}
    for listed in lists:
        for proc in listed:
            seen = merged.get(proc.pid)
            if seen is None:
                merged[proc.pid] = proc
                continue
            merged[proc.pid] = ProcessSample(
                proc.pid,
                seen.kind if seen.kind == proc.kind else "C+G",
                _sum([seen.memory_kib, proc.memory_kib]),
                seen.gpu_busy,
                seen.mem_busy,
            )
    return tuple(merged.values())


@implementer(IReader)
class NvmlReader:
    """Reads every GPU through an NVML binding (`pynvml` or the simulator).

    `mig` is how a card in MIG mode is shown: ``"instances"`` (each MIG instance
    a device) or ``"card"`` (one device holding its instances' memory and processes).
    """

    name = "nvml"

    def __init__(self, nvml: ModuleType | Any, reactor: Any, mig: str = "instances") -> None:
        if mig not in MIG_MODES:
            raise ValueError(f"mig must be one of {', '.join(MIG_MODES)}, not {mig!r}")
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
        for card in self._devices:
            try:
                found = read_card(card, self.mig, problems)
            except Reinitialise as failure:
                problems["init"] = f"{failure.cause}; setting NVML up again"
                self._shutdown()
                self._schedule_retry(now)
                return self._absent(), problems
            except DeviceLost as failure:
                problems[f"{card.key} lost"] = f"GPU {card.busid}: {failure.cause}"
                if card.mig.enabled and card.mig.instances and self.mig == "instances":
                    continue  # its instances are shown absent, as vanished ones are
                found = [_absent(self._known.get(card.key) or _placeholder(card))]
            for sample in found:
                self._known[sample.key] = sample
            samples.extend(found)
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
