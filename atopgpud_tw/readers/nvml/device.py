"""One NVML device: the choke point every call goes through, and one poll of it.

`NvmlDevice.call` maps NVML's errors: NOT_SUPPORTED (and a function the binding
or the driver lacks, `NVMLLibraryMismatchError` included) is remembered per
device and not asked again; NOT_FOUND is the idle case; GPU_IS_LOST makes the
device absent for the poll; UNINITIALIZED, DRIVER_NOT_LOADED and
LIB_RM_VERSION_MISMATCH mean NVML must be set up again; anything else, an
unexpected exception included, fails that one reading for this poll.
Everything here runs in the reader's worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from twisted.logger import Logger

from atopgpud_tw.nvml_codes import CODES, LIFECYCLE, NAMES
from atopgpud_tw.problems import Problems, printable
from atopgpud_tw.readers.nvml.samples import (
    DRY_GAP_KNOWN,
    PER_CALL,
    PER_PERIOD,
    ProcessStream,
    SampleStream,
    fold_process_samples,
    fresh_process_samples,
    latest_process_figures,
    lists_busy_periods,
    samples_per_pid,
    windowed_process_figures,
)
from atopgpud_tw.readers.nvml.stamps import HostOffsets, StampMap
from atopgpud_tw.readers.nvml.watchdog import CallWatch
from atopgpud_tw.snapshot import (
    NO_INFO,
    TASK_COMPUTE,
    TASK_GRAPHICS,
    UNSUPPORTED,
    DeviceInfo,
    DeviceSample,
    ProcessSample,
    clamp_percent,
    merge_kind,
    merge_memory,
)

log = Logger(namespace="atopgpud_tw.readers.nvml_device")

INVALID_ARGUMENT = CODES["INVALID_ARGUMENT"]
NOT_SUPPORTED = CODES["NOT_SUPPORTED"]
NO_PERMISSION = CODES["NO_PERMISSION"]
NOT_FOUND = CODES["NOT_FOUND"]
INSUFFICIENT_SIZE = CODES["INSUFFICIENT_SIZE"]
FUNCTION_NOT_FOUND = CODES["FUNCTION_NOT_FOUND"]
GPU_IS_LOST = CODES["GPU_IS_LOST"]
GPU_NOT_FOUND = CODES["GPU_NOT_FOUND"]
#: seconds between attempts to set NVML up again, doubling up to the last
BACKOFF = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)
#: nvmlDeviceGetMigMode's "current" value for a card in MIG mode
MIG_ENABLED = 1
#: nvmlDeviceGetSamples sample types
GPU_UTILIZATION_SAMPLES = 1
MEMORY_UTILIZATION_SAMPLES = 2
#: process and device samples stamped this close are on one clock
SAME_CLOCK_US = 5_000_000
#: what a reading returns when the sample buffer is not there: use the rates call
_NO_SAMPLES = object()
#: what a reading of the sample buffer returns when it holds nothing new
_NOTHING_NEW = object()



def error_name(error: BaseException) -> str:
    """A short stable name for an NVML error (also the key of a logged problem)."""
    value = getattr(error, "value", None)
    if isinstance(value, int):
        return "NVML_ERROR_" + NAMES.get(value, str(value))
    return type(error).__name__


def as_text(value: Any) -> str:
    """Names and bus ids as str, whether the binding returns bytes or str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\0")
    return str(value)


class Backoff:
    """When to try something that failed again: the next delay of `BACKOFF` after
    each failure (the last one kept), from the first again once it worked."""

    def __init__(self, delays: tuple[float, ...] = BACKOFF) -> None:
        self.delays = delays
        self.at = 0.0
        self.failures = 0

    def due(self, now: float) -> bool:
        return now >= self.at

    def failed(self, now: float) -> None:
        self.at = now + self.delays[min(self.failures, len(self.delays) - 1)]
        self.failures += 1

    def succeeded(self) -> None:
        self.failures = 0


#: NOT_SUPPORTED from a call that has answered is believed once it has held this
#: long and for this many polls, whichever is longer; until then it is a failed reading
HOLD_SECONDS = 30.0
HOLD_POLLS = 20
#: seconds between asking again a call taken as not supported
RETRY_UNSUPPORTED = (60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


@dataclass(eq=False)
class PollTime:
    """The reader's time of the poll in progress, shared by its devices (what
    `Support` holds its spells and backoffs to)."""

    now: float = 0.0


@dataclass(eq=False)
class Support:
    """One call's spell of NOT_SUPPORTED on one device, and whether it is believed.

    From a call that has answered on this device, NOT_SUPPORTED is a failed
    reading until it has held for `HOLD_SECONDS` and `HOLD_POLLS` polls (a driver
    answers so for a moment during a GPU reset, a MIG change or a driver
    reload); then it is believed.  From a call that never answered, it is
    believed at once: that is what the device is.  A call believed unsupported
    is asked again at every poll until the spell has held as long, then at
    `RETRY_UNSUPPORTED`; when it answers it is served again.
    """

    #: whether the call answered on this device before the spell began
    answered: bool
    since: float
    polls: int = 0
    last: float | None = None
    #: whether the spell is believed (the figure is served as not supported)
    believed: bool = False
    #: what a failed reading of it is logged as, and whether the giving up was said (then that
    #: problem stands while it is given up, and its recovery is the line that says it is back)
    cause: str = ""
    said: bool = False
    retry: Backoff = field(default_factory=lambda: Backoff(RETRY_UNSUPPORTED))

    def held(self) -> bool:
        return self.polls >= HOLD_POLLS and (self.last or 0.0) - self.since >= HOLD_SECONDS

    def refused(self, now: float) -> bool:
        """Count one refusal; whether it is believed now."""
        if now != self.last:
            self.polls += 1
            self.last = now
        if self.held():
            self.retry.failed(now)  # asked again at the next delay
            self.believed = True
        elif not self.answered:
            self.believed = True
        return self.believed

    def may_ask(self, now: float) -> bool:
        """Whether the call is made in this poll: at every poll until the spell has held, then at the backoff."""
        return not self.held() or self.retry.due(now)


class Unsupported(Exception):
    """The device cannot do this; the call is not made again (but at `Support`'s backoff)."""


class Missing(Unsupported):
    """The binding or the driver's library lacks the function: a fallback may have it."""


class NotFound(Exception):
    """NVML_ERROR_NOT_FOUND: nothing there (no samples since the last read of an idle
    device, an empty MIG slot, no such instance)."""


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
    #: what the health figures' field values cannot report (an entry's own return code)
    unsupported: set[str] = field(default_factory=set)
    #: calls that answered on this device, and those in a spell of NOT_SUPPORTED (`Support`)
    answered: set[str] = field(default_factory=set)
    support: dict[str, Support] = field(default_factory=dict)
    #: the poll's time, shared by the reader's devices
    times: PollTime = field(default_factory=PollTime, repr=False)
    #: the driver's utilization sample buffers, per sample type
    streams: dict[int, SampleStream] = field(default_factory=dict)
    #: the driver's per-process utilization samples
    process_stream: ProcessStream = field(default_factory=ProcessStream)
    #: the driver's sample clock, its steps taken out (stamps.py)
    stamps: StampMap = field(default_factory=StampMap)
    #: the NVML calls whose answers were found wanting, told once
    noticed: set[int] = field(default_factory=set)
    #: a MIG instance: no utilization of its own, device-wide or per process
    is_mig_instance: bool = False
    #: what the device is (UUID, serial, versions), read once at its discovery
    info: DeviceInfo = NO_INFO
    #: a card's MIG mode and instances
    mig_state: MigState = field(default_factory=MigState)
    #: functions the binding or the driver's library lacks (kept across MIG mode changes)
    missing: set[str] = field(default_factory=set)
    #: sample types whose last `nvmlDeviceGetSamples` call failed
    samples_failed: set[int] = field(default_factory=set)
    #: how each process list is read, once found: kind ("C", "G") -> binding function
    list_functions: dict[str, str] = field(default_factory=dict)
    #: what was said once per reader (shared by its devices)
    said: set[str] = field(default_factory=set, repr=False)
    #: where the reader's thread notes the call in progress, for the hang watchdog
    watch: CallWatch | None = field(default=None, repr=False)
    #: the binding's functions by name, looked up once
    _bound: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def where(self) -> str:
        """The device as log lines name it."""
        return f"GPU {self.busid}"

    def call(self, function: str, *args: Any, variant: str | None = None) -> Any:
        """Call ``nvml.<function>(handle, *args)`` through the error mapping.

        `variant` names what is remembered as unsupported or missing when it is
        not the function itself (one function asked for a newer structure).
        """
        key = variant or function
        if key in self.missing:
            raise Missing(key)
        support = self.support.get(key)
        if support is not None and support.believed and not support.may_ask(self.times.now):
            raise Unsupported(key)
        bound = self._bound.get(function)
        if bound is None:
            bound = self._bound[function] = getattr(self.nvml, function, None)
        if bound is None:
            # a binding too old to have the function: it can never work here
            self.missing.add(key)
            raise Missing(key)
        watch = self.watch
        if watch is not None:
            watch.begin(function, self.where)
        try:
            result = bound(self.handle, *args)
        except self.nvml.NVMLError as error:
            value = getattr(error, "value", None)
            if value == FUNCTION_NOT_FOUND:
                self.missing.add(key)
                raise Missing(key) from None
            if value == NOT_SUPPORTED:
                if self._refused(key, function):
                    raise Unsupported(key) from None
                raise Failed(f"{function}: NVML_ERROR_NOT_SUPPORTED", value) from None
            if value == NOT_FOUND:
                raise NotFound(function) from None
            cause = f"{function}: {error_name(error)}"
            if value in LIFECYCLE:
                raise Reinitialise(cause, value) from None
            if value in (GPU_IS_LOST, GPU_NOT_FOUND):
                raise DeviceLost(cause, value) from None
            raise Failed(cause, value) from None
        except getattr(self.nvml, "NVMLLibraryMismatchError", ()) as error:
            # the binding wants a symbol the installed driver lacks: the call can
            # never work with this library
            self.missing.add(key)
            raise Missing(f"{key}: {error}") from None
        except Exception as error:
            # a binding or driver bug: this reading fails, the rest of the poll goes on
            raise Failed(f"{function}: {type(error).__name__}: {error}") from None
        finally:
            if watch is not None:
                watch.end()
        if support is not None:
            self._answers_again(key, support)
        else:
            self.answered.add(key)
        return result

    def _refused(self, key: str, function: str) -> bool:
        """NOT_SUPPORTED from `key`: whether it is believed now (`Support`)."""
        now = self.times.now
        support = self.support.get(key)
        if support is None:
            cause = f"{function}: NVML_ERROR_NOT_SUPPORTED"
            support = self.support[key] = Support(key in self.answered, now, cause=cause)
        was = support.believed
        believed = support.refused(now)
        if believed and not was and support.answered:
            support.said = True
            log.warn(
                "nvml: GPU {busid}: {call} has answered NVML_ERROR_NOT_SUPPORTED for {seconds:.0f} s: "
                "taken as not supported (its figures -1 or left out), and asked again from time to time",
                busid=self.busid,
                call=key,
                seconds=now - support.since,
            )
        return believed

    def _answers_again(self, key: str, support: Support) -> None:
        """`key` answered after a spell of NOT_SUPPORTED: served again (a problem that stood
        while it was given up ends, and its recovery is logged)."""
        del self.support[key]
        self.answered.add(key)

    def given_up(self, key: str) -> str | None:
        """The cause of `key` given up after it had answered: a problem while it is."""
        support = self.support.get(key)
        return support.cause if support is not None and support.said else None

    def forget_support(self) -> None:
        """What the device can do is to be found again (its MIG mode changed)."""
        self.unsupported.clear()
        self.answered.clear()
        self.support.clear()

    def refuses(self, key: str) -> bool:
        """Whether `key` is taken as not supported (or missing) now."""
        support = self.support.get(key)
        return key in self.missing or (support is not None and support.believed)

    def say_once(self, what: str, message: str, *, warn: bool = False, **fields: Any) -> None:
        """Log `message` the first time this reader meets `what`."""
        if what in self.said:
            return
        self.said.add(what)
        (log.warn if warn else log.info)(message, **fields)


#: the process lists, newest first: the binding's unversioned function is the _v3 one
PROCESS_LISTS = {
    "C": ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"),
    "G": ("nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
}
#: times one poll asks again for a list or samples that grew between the size query and the fill
SIZE_RETRIES = 3


def call_sized(device: NvmlDevice, function: str, *args: Any, variant: str | None = None) -> Any:
    """`NvmlDevice.call` for a function that sizes a buffer first: INSUFFICIENT_SIZE (the
    list grew between the binding's size query and its fill) is asked again, a few times."""
    for _ in range(SIZE_RETRIES):
        try:
            return device.call(function, *args, variant=variant)
        except Failed as failure:
            if failure.value != INSUFFICIENT_SIZE:
                raise
    return device.call(function, *args, variant=variant)


def list_processes(device: NvmlDevice, kind: str) -> Any:
    """One process list ("C" or "G"), through the newest function the driver has.

    Drivers before 510 lack the _v3 lists the binding calls by default; from
    450.66 they have the _v2 ones.  Which is used is said once per reader; a
    driver with neither lists no processes, and that is said once too.
    """
    newest, *older = PROCESS_LISTS[kind]
    for function in (newest, *older):
        try:
            listed = call_sized(device, function)
        except Missing:
            continue  # remembered: the next poll goes straight to the one that works
        if device.list_functions.get(kind) == function:
            return listed
        device.list_functions[kind] = function
        if function != newest:
            device.say_once(
                function,
                "nvml: the driver has no {newest}_v3: process lists through {function} (drivers 450.66 to 510)",
                newest=newest,
                function=function,
            )
        return listed
    device.say_once(
        f"no {newest}",
        "nvml: {which} processes are not listed: the driver has neither {newest}_v3 nor _v2 (older than 450.66)",
        warn=True,
        which="compute" if kind == "C" else "graphics",
        newest=newest,
    )
    raise Unsupported(newest)


def probe_support(device: NvmlDevice) -> int:
    support = 0
    for bit, kind in ((TASK_COMPUTE, "C"), (TASK_GRAPHICS, "G")):
        try:
            list_processes(device, kind)
            support |= bit
        except Unsupported:
            pass
        except (Failed, NotFound):
            support |= bit  # a passing failure says nothing about support
    return support


def served_support(device: NvmlDevice) -> int:
    """The task-support bits of the process lists served now: a list taken as not
    supported (or missing) is not; one failing for a moment still is."""
    support = 0
    for bit, kind in ((TASK_COMPUTE, "C"), (TASK_GRAPHICS, "G")):
        for function in PROCESS_LISTS[kind]:
            if function in device.missing:
                continue
            if not device.refuses(function):
                support |= bit
            break
    return support


def attempter(device: NvmlDevice, problems: Problems) -> Callable[..., Any]:
    """``attempt(function, unsupported)``: one reading, with failures noted in `problems`.

    It returns `unsupported` when the device cannot do it, ``None`` when it
    failed in this poll, and lets a lost device or a broken NVML through.
    """
    subject = f"GPU {device.busid}"

    def attempt(function: Callable[[], Any], unsupported: Any = UNSUPPORTED) -> Any:
        try:
            return function()
        except Unsupported as refused:
            cause = device.given_up(str(refused))
            if cause:
                problems.add(f"{device.key} {cause}", f"{subject}: {cause}")
            return unsupported
        except (DeviceLost, Reinitialise):
            raise
        except Failed as failure:
            problems.add(f"{device.key} {failure.cause}", f"{subject}: {failure.cause}")
            return None
        except NotFound as idle:
            # NOT_FOUND where a value was expected: nothing to count in this poll
            problems.add(f"{device.key} {idle} not found", f"{subject}: {idle}: NVML_ERROR_NOT_FOUND")
            return None

    return attempt


@dataclass(eq=False)
class DevicePoll:
    """What one poll of one device knows and learns as it goes, handed from call to
    call rather than left on the device: the poll's time, and what its rates
    reading tells its process reading."""

    #: the poll's time in microseconds on the reader's clock
    now_us: int = 0
    #: the reader's clock, read at the calls that need the time they were made
    clock: Callable[[], float] | None = field(default=None, repr=False)
    #: how many GPU utilization samples this poll brought (None: not known)
    periods: int | None = None
    #: this poll's GPU busy figure (None: not known), which process figures may carry on from
    busy: int | None = None
    #: the host clocks against the reader's, to find steps of the driver's clock (None: not looked for)
    host: HostOffsets | None = field(default=None, repr=False)
    #: whether the device's own GPU samples call failed in this poll (no window of its own)
    samples_failed: bool = False
    #: where the processes' start times are read (`readers.starts`; None: not read)
    starts: Callable[[int], int | None] | None = field(default=None, repr=False)

    def call_time_us(self) -> int:
        """The time of the call being made (the poll's, without a clock)."""
        return self.now_us if self.clock is None else int(self.clock() * 1_000_000)


def read_device(device: NvmlDevice, problems: Problems, poll: DevicePoll | None = None) -> DeviceSample:
    """Everything about one device in this poll (runs in the worker thread)."""
    poll = poll or DevicePoll()
    attempt = attempter(device, problems)
    gpu_busy, mem_busy = read_rates(device, attempt, poll)
    total, used = read_memory(device, attempt)
    processes = attempt(lambda: _read_processes(device, attempt, poll), unsupported=())
    device.task_support = served_support(device)
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
        info=device.info,
    )


def read_rates(device: NvmlDevice, attempt: Callable[..., Any], poll: DevicePoll) -> tuple[int | None, int | None]:
    """The GPU and memory busy percentages of one device over this poll.

    From the driver's sample buffer where it has one (`SampleStream`: a poll
    with no new sample carries the last figure on, or counts a dry spell as
    idle), else from the rates call, which covers only the driver's last sample
    period: where the samples call is not supported, and while a buffer has
    never held a sample (a driver that answers NOT_FOUND for ever).  A MIG
    instance has none: NVML reports no utilization under MIG.
    """
    if device.is_mig_instance:
        return UNSUPPORTED, UNSUPPORTED
    rates: list[Any] = []

    def rate(index: int) -> Any:
        if not rates:
            rates.append(attempt(lambda: device.call("nvmlDeviceGetUtilizationRates")))
        found = rates[0]
        if found is None or found is UNSUPPORTED:
            return found
        return clamp_percent(found.memory if index else found.gpu)

    figures = []
    for index, kind in enumerate((GPU_UTILIZATION_SAMPLES, MEMORY_UTILIZATION_SAMPLES)):
        value = attempt(lambda kind=kind: _sampled(device, kind, poll), unsupported=_NO_SAMPLES)
        if value is None and kind == GPU_UTILIZATION_SAMPLES:
            poll.samples_failed = True
        if value is _NO_SAMPLES:
            figures = [rate(0), rate(1)]
            break
        if value is _NOTHING_NEW:
            value = rate(index)
            if value is UNSUPPORTED:
                value = 0  # no rates call to ask: an empty buffer is an idle GPU
            elif value and kind not in device.noticed:
                device.noticed.add(kind)
                log.info(
                    "nvml: GPU {busid}: nvmlDeviceGetSamples has no samples while the rates call reports load; "
                    "using the rates call until it has",
                    busid=printable(device.busid),
                )
        figures.append(value)
    poll.busy = figures[0] if isinstance(figures[0], int) and figures[0] >= 0 else None
    return figures[0], figures[1]


def _sampled(device: NvmlDevice, kind: int, poll: DevicePoll) -> Any:
    """This poll's figure from the sample buffer, or `_NOTHING_NEW`."""
    stream = device.streams.get(kind)
    if stream is None:
        stream = device.streams[kind] = SampleStream()
    stamps = _stamp_map(device, poll)
    # the driver's clock is learnt from when the call was made, not when the poll began
    now_us = poll.call_time_us()
    asked = stamps.ask(f"samples {kind}", stream.since, now_us)
    try:
        _, samples = call_sized(device, "nvmlDeviceGetSamples", kind, asked)
    except NotFound:
        samples = []
    except Failed:
        device.samples_failed.add(kind)
        raise
    steady = stamps.steady(f"samples {kind}", [int(_field(s, "timeStamp")) for s in samples], now_us, asked)
    pairs = [(stamp, _sample_value(s)) for stamp, s in zip(steady, samples)]
    if kind in device.samples_failed and pairs:
        device.samples_failed.discard(kind)
        _unknown_since_failure(stream, pairs)
    value, periods = stream.fold(pairs, now_us)
    if kind == GPU_UTILIZATION_SAMPLES:
        poll.periods = periods
    if value is None:
        return _NOTHING_NEW  # the buffer never had a sample: the rates call tells
    return value


def _unknown_since_failure(stream: SampleStream, pairs: list[tuple[int, float]]) -> None:
    """The first samples after calls that failed: where a gap of more than a skipped
    sample lies before the oldest (the buffer no longer holds all that came since the
    last read, after a spell longer than it keeps), that time is not known, and is
    not taken for idle: the next window starts there."""
    fresh = [stamp for stamp, _ in pairs if stamp > stream.since]
    period = stream.period_us
    if not fresh or not period or stream.window_end is None:
        return
    oldest = min(fresh) - period
    if oldest - stream.covered_to > DRY_GAP_KNOWN * period:
        stream.covered_to = stream.window_end = oldest
        stream.cover = [part for part in stream.cover if part[1] > oldest]


def _sample_value(sample: Any) -> float:
    value = _field(sample, "sampleValue")
    return float(getattr(value, "uiVal", value))


#: a field of an NVML structure as ctypes reads it, without pynvml's `_PrintableStructure.__getattribute__`
#: (a Python function called per field, which only converts bytes: none of the numbers read here is);
#: as plain attribute access for any other object
_field = object.__getattribute__


class UtilSample(NamedTuple):
    """One entry of ``nvmlDeviceGetProcessUtilization``, read once from the binding's structure."""

    pid: int
    timeStamp: int  # noqa: N815 - the structure's own names, which `samples` reads
    smUtil: int  # noqa: N815
    memUtil: int  # noqa: N815


def read_memory(device: NvmlDevice, attempt: Callable[..., Any]) -> tuple[int | None, int | None]:
    """Total and used memory in KiB (0 when unsupported, ``None`` when the read failed).

    Through the v2 structure where the driver has it (510 on): its "used"
    leaves out the memory the driver reserves, as nvidia-smi's "Used" does;
    v1's "used" includes it.
    """
    memory = attempt(lambda: _memory_info(device))
    if memory is None:
        return None, None
    if memory is UNSUPPORTED:
        return 0, 0
    return int(memory.total) // 1024, int(memory.used) // 1024


def _memory_info(device: NvmlDevice) -> Any:
    version = getattr(device.nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return device.call("nvmlDeviceGetMemoryInfo", version, variant="nvmlDeviceGetMemoryInfo_v2")
        except Missing:
            pass  # a driver before 510, or a binding without the v2 structure
    return device.call("nvmlDeviceGetMemoryInfo")


def _read_processes(
    device: NvmlDevice, attempt: Callable[..., Any], poll: DevicePoll
) -> tuple[ProcessSample, ...] | None:
    found: dict[int, tuple[str, int | None]] = {}
    for kind in ("C", "G"):
        listed = attempt(lambda kind=kind: list_processes(device, kind), unsupported=())
        if listed is None:
            # a partial list would make processes seem to end: they count no sample now.
            # Their busy samples of this poll are taken off the buffer all the same, so
            # that the next poll's figures are over that poll alone (as a driver's buffer
            # may not hold a long spell's)
            _skip_process_busy(device, attempt, poll)
            return None
        for proc in listed:
            pid = int(proc.pid)
            memory = proc.usedGpuMemory  # None where NVML cannot tell (WDDM, some vGPU guests)
            memory_kib = UNSUPPORTED if memory is None else int(memory) // 1024
            seen = found.get(pid)
            if seen is None:
                found[pid] = (kind, memory_kib)
            else:  # one allocation listed under both kinds (or twice): merge_processes's "max" rule
                found[pid] = (merge_kind(seen[0], kind), merge_memory(seen[1], memory_kib, "max"))
    if not found:
        # the last processes left: their samples are taken off the buffer now, so that
        # none is counted for a later process (a pid reused after a poll that listed nobody)
        _skip_process_busy(device, attempt, poll)
        return ()
    # no per-process utilization under MIG: not asked, so no failure can be mistaken for it
    busy = UNSUPPORTED if device.is_mig_instance else attempt(lambda: _process_busy(device, poll))
    starts = poll.starts or _no_start
    if not isinstance(busy, dict):  # failed (None), or no per-process figures (UNSUPPORTED)
        return tuple(
            ProcessSample(pid, kind, memory, busy, busy, starts(pid)) for pid, (kind, memory) in found.items()
        )
    idle = (0, 0)
    return tuple(
        ProcessSample(pid, kind, memory, gpu, mem, starts(pid))
        for pid, (kind, memory) in found.items()
        for gpu, mem in (busy.get(pid, idle),)
    )


def _skip_process_busy(device: NvmlDevice, attempt: Callable[..., Any], poll: DevicePoll) -> None:
    """Read the per-process samples of this poll and let them go, where processes were listed before."""
    if device.process_stream.figures and not device.is_mig_instance:
        attempt(lambda: _process_busy(device, poll))


def _no_start(pid: int) -> None:
    """No start time is read (synchronous reads without a host to ask)."""
    return None


def _process_busy(device: NvmlDevice, poll: DevicePoll) -> dict[int, tuple[int, int]] | None:
    """Per-pid busy percentages since the device's last-seen timestamp (`samples`).

    A poll that brings no new process sample while the device's own buffer had
    no new period either, yet the GPU is busy, carries the last figures on: the
    next sample is not due yet, which is not idleness.
    """
    stream = device.process_stream
    gpu = device.streams.get(GPU_UTILIZATION_SAMPLES)
    if (
        poll.samples_failed and stream.mode != PER_CALL and stream.same_stamps is not False
        and gpu is not None and gpu.recent
    ):
        # the device's own samples failed: no window of the device's in this poll, which
        # process samples on its stamps are shown over.  Not asked now, the processes count
        # no sample in this poll, as the device does not; the next poll's window and
        # process samples cover this poll's time too.  (Where the device has never had a
        # sample, no buffer or none yet, its processes are counted by time, on no window of
        # the device's: read as in any poll, lest a long spell outlast the driver's buffer
        # of process samples and its lost time be counted as idle.)
        return None
    since = stream.since
    if stream.mode == PER_CALL and since and gpu is not None and abs(gpu.before - since) < SAME_CLOCK_US:
        # a driver that averages over the window asked for: ask for this poll's,
        # from the device's newest sample of the previous poll, on the same clock
        # (polls that listed nobody would leave `since` behind)
        since = max(since, gpu.before)
    elapsed = None if stream.polled_us is None else poll.now_us - stream.polled_us
    stream.polled_us = poll.now_us
    samples = _process_samples(device, since, poll)
    if samples:
        _learn_process_mode(device, stream, samples)
    if stream.mode == PER_CALL:
        busy, newest = latest_process_figures(samples, since)
    elif since and gpu is not None and _on_device_stamps(stream, gpu, samples, since):
        # stamped as the device's samples: shown over the device's own windows
        newest = max([since, *stream.pending])
        if gpu.shown:
            stream.figures = windowed_process_figures(stream.pending, gpu.shown, {
                pid for stamp in stream.pending for pid in stream.pending[stamp]
            })
            end = gpu.window_end or 0  # set whenever figures are shown
            stream.pending = {stamp: found for stamp, found in stream.pending.items() if stamp > end}
        stream.previous_since, stream.since = since, newest
        stream.listed = set(stream.figures)
        return stream.figures
    else:
        learnt = stream.learn_period(samples, since)
        period = (gpu.period_us if gpu else None) or learnt
        periods = poll.periods
        if gpu is not None and gpu.before == 0 and since:
            # the device's first samples (after its calls failed): their periods are of the
            # buffer's past, not of this poll's process samples, which are counted by time
            periods = None
        if periods is not None and since:
            # a skipped sample is a period nobody knows of: not an idle one
            periods = max(0, periods - (gpu.skipped if gpu else 0) - stream.credit)
            stream.credit = max(0, samples_per_pid(samples, since) - periods)
        busy, newest = fold_process_samples(samples, since, periods or None, period, elapsed)
        if not since and gpu is not None:
            # the first read: what comes after the device's first window is shown in the next
            # (if these samples turn out to carry the device's stamps)
            for (pid, stamp), figures in fresh_process_samples(samples, gpu.since).items():
                stream.pending.setdefault(stamp, {})[pid] = figures
            if period and abs(newest - gpu.since) < SAME_CLOCK_US:
                # periods that ended between the device's call and this one
                stream.credit = max(0, round((newest - gpu.since) / period))
    if newest <= since:
        if poll.periods == 0 and poll.busy:
            return stream.figures  # no new period yet: the load goes on
        stream.figures = {}
        return {}
    stream.previous_since, stream.since = since, newest
    stream.figures = busy
    stream.listed = set(busy)
    return busy


def _on_device_stamps(stream: ProcessStream, gpu: SampleStream, samples: list[Any], since: int) -> bool:
    """Whether the driver stamps its process samples as its device samples
    (decided on the first few, then kept); the samples are kept by stamp
    until the device's windows have shown them."""
    if stream.same_stamps is False or not gpu.recent:
        return False  # (a device whose own samples never came, so far: nothing to tell by)
    for (pid, stamp), figures in fresh_process_samples(samples, since).items():
        stream.pending.setdefault(stamp, {})[pid] = figures
        if stream.same_stamps is None:
            stream.stamps_seen.add(stamp)
    if stream.same_stamps is None and len(stream.stamps_seen) >= 3:
        stream.same_stamps = stream.stamps_seen <= set(gpu.recent)
        stream.stamps_seen = set()  # decided: kept no longer
        if not stream.same_stamps:
            stream.pending = {}  # on a clock of their own: never shown over the device's windows
    return bool(stream.same_stamps)


def _learn_process_mode(device: NvmlDevice, stream: ProcessStream, samples: list[Any]) -> None:
    """Which way the driver reports process utilization (`ProcessStream`).

    The first answer that lists a process decides for now, asked with 0 (the
    whole buffer): a pid at two timestamps means periods, else calls.  "Calls"
    is then put to the test once a pid is listed in two polls running: asked
    for both polls' window, a driver that lists periods lists that pid twice.
    """
    if stream.mode == PER_PERIOD:
        return  # settled for good: nothing below would change it
    since = stream.since
    before = stream.mode
    if stream.mode is None:
        probe = samples if since == 0 else _process_samples(device, 0)
        stream.mode = PER_PERIOD if lists_busy_periods(probe) else PER_CALL
        stream.settled = stream.mode == PER_PERIOD
    elif lists_busy_periods(samples, since):
        stream.mode, stream.settled = PER_PERIOD, True
    elif not stream.settled and stream.listed & {int(s.pid) for s in samples if int(s.timeStamp) > since}:
        probe = _process_samples(device, stream.previous_since)
        stream.mode = PER_PERIOD if lists_busy_periods(probe, stream.previous_since) else PER_CALL
        stream.settled = True
    if stream.mode != before:
        log.info(
            "nvml: GPU {busid}: the driver reports process utilization {how}",
            busid=printable(device.busid),
            how="per busy sample period" if stream.mode == PER_PERIOD else "once per process and call",
        )


def _process_samples(device: NvmlDevice, since: int, poll: DevicePoll | None = None) -> list[Any]:
    """The process samples newer than `since` (on the steady clock, stamps.py), each read
    once (they are looked at several times)."""
    stamps = device.stamps if poll is None else _stamp_map(device, poll)
    now_us = poll.call_time_us() if poll is not None else (stamps.seen_at or 0)
    asked = stamps.ask("processes", since, now_us)
    try:
        found = call_sized(device, "nvmlDeviceGetProcessUtilization", asked)
    except NotFound:
        return []  # nothing ran since then
    except Failed as failure:
        if failure.value == 0:
            return []  # SUCCESS on the size query: the wrapper's way of saying "none"
        raise
    pids = [_field(s, "pid") for s in found]
    steady = stamps.steady("processes", [int(_field(s, "timeStamp")) for s in found], now_us, asked, pids)
    return [
        UtilSample(pid, stamp, _field(s, "smUtil"), _field(s, "memUtil"))
        for pid, stamp, s in zip(pids, steady, found)
    ]


def _stamp_map(device: NvmlDevice, poll: DevicePoll) -> StampMap:
    """The device's `StampMap`, watching the host clocks this poll names."""
    stamps = device.stamps
    if stamps.host is None and poll.host is not None:
        stamps.host = poll.host
    return stamps


def placeholder(device: NvmlDevice) -> DeviceSample:
    return DeviceSample(device.key, device.busid, device.name, device.task_support, info=device.info)
