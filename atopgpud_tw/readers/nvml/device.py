"""One NVML device: the choke point its calls go through (`NvmlDevice.call`), and one poll of it.

A function the binding or the driver lacks, and NOT_SUPPORTED once it has held
(`support.Support`), are not asked again.  Runs in the reader's worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Callable, NamedTuple

from twisted.logger import Logger

from atopgpud_tw.nvml_codes import GPU_UTILIZATION_SAMPLES, MEMORY_UTILIZATION_SAMPLES, NOT_SUPPORTED
from atopgpud_tw.problems import Problems, printable
from atopgpud_tw.readers.nvml.calls import (
    Attempt,
    Failed,
    Missing,
    NotFound,
    NvmlSession,
    Outcome,
    Unsupported,
    answer,
    answer_first,
    call_sized,
    given,
    outcome,
)
from atopgpud_tw.readers.nvml.direct import MEMORY, PROCESS_UTILIZATION, SAMPLES, DirectCalls
from atopgpud_tw.readers.nvml.direct import NAMES as DIRECT
from atopgpud_tw.readers.nvml.samples import (
    DRY_GAP_KNOWN,
    ProcessSamples,
    ProcessStream,
    SampleStream,
)
from atopgpud_tw.readers.nvml.stamps import HostOffsets, StampMap
from atopgpud_tw.readers.nvml.support import Support
from atopgpud_tw.readers.starts import Starts
from atopgpud_tw.snapshot import (
    NO_INFO,
    TASK_COMPUTE,
    TASK_GRAPHICS,
    UNSUPPORTED,
    DeviceInfo,
    DeviceSample,
    ProcessSample,
    clamp_percent,
    merge_by_pid,
)

log = Logger(namespace="atopgpud_tw.readers.nvml_device")

@dataclass(eq=False)
class MigState:
    """What is known of a card's MIG mode and, in MIG mode, of its instances."""

    enabled: bool = False
    #: nvmlDeviceGetMaxMigDeviceCount, asked once per spell in MIG mode
    slots: int | None = None
    #: the instances found at the last poll, by key
    instances: dict[str, NvmlDevice] = field(default_factory=dict)
    #: what asks a fresh MIG handle which instance it is (its memory cleared for each handle)
    probe: NvmlDevice | None = None
    #: by slot, (the handle's value, the instance it was found to be, its ``MIG-`` UUID)
    identified: dict[int, tuple[int, NvmlDevice, str]] = field(default_factory=dict)


@dataclass(eq=False)
class NvmlDevice:
    """One discovered device (a card or a MIG instance): its handle, identity and what it cannot do."""

    session: NvmlSession = field(repr=False)
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
    #: the driver's sample buffers, per sample type, and its per-process samples
    streams: dict[int, SampleStream] = field(default_factory=dict)
    process_stream: ProcessStream = field(default_factory=ProcessStream)
    #: the driver's sample clock, its steps taken out (stamps.py)
    stamps: StampMap = field(default_factory=StampMap)
    #: the NVML calls whose answers were found wanting, told once
    noticed: set[int] = field(default_factory=set)
    #: a MIG instance: no utilization of its own, device-wide or per process
    is_mig_instance: bool = False
    #: what the device is (UUID, serial, versions), read once at its discovery
    info: DeviceInfo = NO_INFO
    mig_state: MigState = field(default_factory=MigState)
    #: functions the binding or the driver's library lacks (kept across MIG mode changes)
    missing: set[str] = field(default_factory=set)
    #: sample types whose last `nvmlDeviceGetSamples` call failed
    samples_failed: set[int] = field(default_factory=set)
    #: the device's own functions of the poll (`direct`), made at its first such call
    _direct: dict[str, Callable[..., Any]] | None = field(default=None, repr=False)
    #: the device as log lines and the hang watch name it
    where: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        self.where = f"GPU {self.busid}"

    def _function(self, function: str) -> Any:
        if function in DIRECT:
            direct = self._direct
            if direct is None:
                direct = self._direct = DirectCalls(self.session.nvml).functions()
            return direct[function]
        return self.session.function(function)

    def call(self, function: str, *args: Any, variant: str | None = None) -> Any:
        """``nvml.<function>(handle, *args)``, raising its `calls.outcome` (NOT_SUPPORTED a `Failed`
        until it is believed); `variant` names what is remembered when it is not the function."""
        key = variant or function
        if key in self.missing:
            raise Missing(key)
        session = self.session
        # (most devices have no call in a spell of NOT_SUPPORTED: no lookup then)
        support = self.support.get(key) if self.support else None
        if support is not None and support.believed and not support.may_ask(session.now):
            raise Unsupported(key)
        bound = self._function(function)
        if bound is None:
            # a binding too old to have the function: it can never work here
            self.missing.add(key)
            raise Missing(key)
        watch = session.watch
        try:
            if watch is None:
                result = bound(self.handle, *args)
            else:
                result = watch.run(function, self.where, bound, self.handle, *args)
        except Exception as error:
            raise self._outcome(outcome(error, session.nvml, function, key), key, function) from None
        if support is not None:
            # answered after a spell of NOT_SUPPORTED: served again
            del self.support[key]
        self.answered.add(key)
        return result

    def _outcome(self, found: Outcome, key: str, function: str) -> Outcome:
        """What this device makes of an outcome of `key`: a function missing is remembered,
        and NOT_SUPPORTED is a failed reading until it is believed (`Support`)."""
        if isinstance(found, Missing):
            self.missing.add(key)
        if not isinstance(found, Unsupported) or isinstance(found, Missing):
            return found
        now = self.session.now
        cause = f"{function}: NVML_ERROR_NOT_SUPPORTED"
        support = self.support.get(key)
        if support is None:
            support = self.support[key] = Support(key in self.answered, now, cause=cause)
        was = support.believed
        if not support.refused(now):
            return Failed(cause, NOT_SUPPORTED)
        if not was and support.answered:
            support.said = True
            log.warn(
                "nvml: GPU {busid}: {call} has answered NVML_ERROR_NOT_SUPPORTED for {seconds:.0f} s: "
                "taken as not supported (its figures -1 or left out), and asked again from time to time",
                busid=self.busid,
                call=key,
                seconds=now - support.since,
            )
        return found

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


#: the process lists, newest first: the binding's unversioned function is the _v3 one
PROCESS_LISTS = {
    "C": ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"),
    "G": ("nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses_v2"),
}
_LIST_TRIES = {kind: tuple((function, None, ()) for function in functions) for kind, functions in PROCESS_LISTS.items()}


def list_processes(device: NvmlDevice, kind: str) -> tuple[list[int], list[int | None]]:
    """One process list ("C" or "G") as columns (pids, used bytes or None), through the newest
    function the driver has: drivers before 510 lack the _v3 lists, from 450.66 they have _v2."""
    listed = answer_first(call_sized, device, *_LIST_TRIES[kind])
    newest, older = PROCESS_LISTS[kind]
    if newest in device.missing:
        device.session.say_once(
            older,
            "nvml: the driver has no {newest}_v3: process lists through {function} (drivers 450.66 to 510)",
            newest=newest,
            function=older,
        )
    return listed  # type: ignore[no-any-return]


def probe_support(device: NvmlDevice) -> int:
    """The task-support bits of a device found: each list not unsupported (a failure says nothing)."""
    support = 0
    for bit, kind in ((TASK_COMPUTE, "C"), (TASK_GRAPHICS, "G")):
        if not isinstance(answer(list_processes, device, kind, catch=Outcome), Unsupported):
            support |= bit
        elif PROCESS_LISTS[kind][1] in device.missing:
            device.session.say_once(
                f"no {PROCESS_LISTS[kind][0]}",
                "nvml: {which} processes are not listed: the driver has neither {newest}_v3 nor _v2 "
                "(older than 450.66)",
                warn=True,
                which="compute" if kind == "C" else "graphics",
                newest=PROCESS_LISTS[kind][0],
            )
    return support


def served_support(device: NvmlDevice) -> int:
    """The task-support bits of the lists served now: not one taken as not supported; one failing still."""
    support = 0
    for bit, kind in ((TASK_COMPUTE, "C"), (TASK_GRAPHICS, "G")):
        newest, older = PROCESS_LISTS[kind]
        if not device.refuses(older if newest in device.missing else newest):  # (what `list_processes` asks)
            support |= bit
    return support


@dataclass(eq=False, slots=True)
class DevicePoll:
    """What one poll of one device knows and learns as it goes, handed from call to call."""

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
    starts: Starts | None = field(default=None, repr=False)

    def call_time_us(self) -> int:
        """The time of the call being made (the poll's, without a clock)."""
        return self.now_us if self.clock is None else int(self.clock() * 1_000_000)


def read_device(device: NvmlDevice, problems: Problems, poll: DevicePoll | None = None) -> DeviceSample:
    """Everything about one device in this poll (runs in the worker thread)."""
    poll = poll or DevicePoll()
    attempt = Attempt(device, problems, device.where)
    gpu_busy, mem_busy = read_rates(device, attempt, poll)
    memory = read_memory(device, attempt)
    processes = attempt(_read_processes, device, attempt, poll, unsupported=())
    device.task_support = served_support(device)
    return DeviceSample(device.key, device.busid, device.name, device.task_support, gpu_busy, mem_busy, *memory,
                        processes=processes, info=device.info)


#: the rates call, asked where the sample buffer does not tell
RATES = "nvmlDeviceGetUtilizationRates"
#: a sample buffer that never held a sample: the rates call tells (also its answer while not asked)
_RATES = object()


def read_rates(device: NvmlDevice, attempt: Attempt, poll: DevicePoll) -> tuple[int | None, int | None]:
    """The GPU and memory busy percentages of one device over this poll: from the driver's sample
    buffer (`SampleStream`), else from the rates call (the driver's last sample period only),
    where the samples call is not supported or a buffer never held a sample.  None under MIG."""
    if device.is_mig_instance:
        return UNSUPPORTED, UNSUPPORTED
    gpu = attempt(_sampled, device, GPU_UTILIZATION_SAMPLES, poll)
    rates = attempt(device.call, RATES) if gpu is UNSUPPORTED or gpu is _RATES else _RATES
    if gpu is None:
        poll.samples_failed = True
    elif gpu is UNSUPPORTED:
        return _busy(poll, _rate(rates, 0)), _rate(rates, 1)
    elif gpu is _RATES:
        gpu = _nothing_new(device, GPU_UTILIZATION_SAMPLES, _rate(rates, 0))
    mem = attempt(_sampled, device, MEMORY_UTILIZATION_SAMPLES, poll)
    if mem is UNSUPPORTED or mem is _RATES:
        if rates is _RATES:
            rates = attempt(device.call, RATES)
        if mem is UNSUPPORTED:
            gpu, mem = _rate(rates, 0), _rate(rates, 1)
        else:
            mem = _nothing_new(device, MEMORY_UTILIZATION_SAMPLES, _rate(rates, 1))
    return _busy(poll, gpu), mem


def _rate(found: Any, index: int) -> Any:
    """The GPU (0) or memory (1) figure of the rates call's answer (None: failed)."""
    if found is None or found is UNSUPPORTED:
        return found
    return clamp_percent(found.memory if index else found.gpu)


def _nothing_new(device: NvmlDevice, kind: int, value: Any) -> Any:
    """The figure of a sample buffer that never held a sample: the rates call's."""
    if value is UNSUPPORTED:
        return 0  # no rates call to ask: an empty buffer is an idle GPU
    if value and kind not in device.noticed:
        device.noticed.add(kind)
        log.info(
            "nvml: GPU {busid}: nvmlDeviceGetSamples has no samples while the rates call reports load; "
            "using the rates call until it has",
            busid=printable(device.busid),
        )
    return value


def _busy(poll: DevicePoll, gpu: Any) -> Any:
    """The GPU figure, kept as the poll's busy figure where it is one."""
    poll.busy = gpu if isinstance(gpu, int) and gpu >= 0 else None
    return gpu


def _sampled(device: NvmlDevice, kind: int, poll: DevicePoll) -> Any:
    """This poll's figure from the sample buffer, or `_RATES`."""
    stream = device.streams.get(kind)
    if stream is None:
        stream = device.streams[kind] = SampleStream()
    stamps = _stamp_map(device, poll)
    # the driver's clock is learnt from when the call was made, not when the poll began
    now_us = poll.call_time_us()
    name = f"samples {kind}"  # (what the device's `StampMap` calls the stamps of this sample type)
    asked = stamps.ask(name, stream.since, now_us)
    found = answer(call_sized, device, SAMPLES, kind, asked, catch=Outcome)
    if isinstance(found, NotFound):
        found = [], []
    elif isinstance(found, Outcome) and not isinstance(found, Unsupported):
        device.samples_failed.add(kind)
    raws, values = given(found)
    # placed as of the call's end: a step of the host clock while it ran is seen there, and the
    # stamps of its answer taken after the step go to the segment that began with the call
    ended_us = poll.call_time_us()
    steady = stamps.steady(name, raws, ended_us, asked)
    pairs = list(zip(steady, map(float, values)))
    if kind in device.samples_failed and pairs:
        device.samples_failed.discard(kind)
        _unknown_since_failure(stream, pairs)
    value, periods = stream.fold(pairs, now_us, whole=not stamps.set_back_during(now_us, ended_us),
                                 answered_us=ended_us)
    if kind == GPU_UTILIZATION_SAMPLES:
        poll.periods = periods
    return _RATES if value is None else value  # (None: the buffer never had a sample)


def _unknown_since_failure(stream: SampleStream, pairs: list[tuple[int, float]]) -> None:
    """The first samples after calls that failed: a gap of more than a skipped sample before the
    oldest (the buffer kept less than the spell) is not known, not idle: the next window starts there."""
    fresh = [stamp for stamp, _ in pairs if stamp > stream.since]
    period = stream.period_us
    if not fresh or not period or stream.window_end is None:
        return
    oldest = min(fresh) - period
    if oldest - stream.covered_to > DRY_GAP_KNOWN * period:
        stream.covered_to = stream.window_end = oldest
        stream.cover = [part for part in stream.cover if part[1] > oldest]


class MemoryKib(NamedTuple):
    """A device's memory in KiB: total and used (0 when unsupported), free and reserved (None
    where not reported: reserved through v1); every one None when the read failed."""

    total: int | None
    used: int | None
    free: int | None = None
    reserved: int | None = None


def read_memory(device: NvmlDevice, attempt: Attempt) -> MemoryKib:
    """Total, used, free and reserved memory in KiB, through the v2 structure where the driver has
    it (510 on): its "used" leaves out what the driver reserves, as nvidia-smi's "Used" does."""
    memory = attempt(_memory_info, device)
    if memory is None or memory is UNSUPPORTED:
        return MemoryKib(None, None) if memory is None else MemoryKib(0, 0)
    return MemoryKib(*(None if part is None else part // 1024 for part in memory))


def _memory_info(device: NvmlDevice) -> tuple[int, int, int, int | None]:
    """(total, used, free, reserved) bytes, from the v2 structure where the binding and the driver
    have it (reserved None from v1: a driver before 510, or a binding without v2)."""
    version = device.session.function("nvmlMemory_v2")
    if version is None:
        return device.call(MEMORY)  # type: ignore[no-any-return]
    v2 = (MEMORY, "nvmlDeviceGetMemoryInfo_v2", (version,))
    return answer_first(NvmlDevice.call, device, v2, (MEMORY, None, ()))  # type: ignore[no-any-return]


def _read_processes(device: NvmlDevice, attempt: Attempt, poll: DevicePoll) -> tuple[ProcessSample, ...] | None:
    """The processes of both lists, one per pid in the order they are first listed, with memory
    in KiB (`UNSUPPORTED` where NVML cannot tell: WDDM, some vGPU guests), busy figures and
    start times."""
    pids: list[int] = []
    kinds: list[str] = []
    kib: list[int | None] = []
    for kind in ("C", "G"):
        listed = attempt(list_processes, device, kind, unsupported=())
        if listed is None:
            # a partial list would make processes seem to end: none now; their samples are
            # taken off the buffer all the same, so the next poll's figures cover that poll alone
            _skip_process_busy(device, attempt, poll)
            return None
        if listed:  # (not `()`: the list is not supported)
            pids += listed[0]
            kinds += [kind] * len(listed[0])
            kib += [UNSUPPORTED if m is None else m // 1024 for m in listed[1]]
    merged = dict(zip(pids, zip(kinds, kib)))  # (kind, KiB) by pid
    if len(merged) < len(pids):
        # a pid in both lists (one allocation listed under both kinds), or twice in one, is one
        # process: `merge_by_pid`'s "max" rule
        rows = merge_by_pid(map(ProcessSample, pids, kinds, kib), "max").values()
        merged = {row.pid: (row.kind, row.memory_kib) for row in rows}
    if not merged:
        # the last processes left: their samples taken off now count for no later process (a pid reused)
        _skip_process_busy(device, attempt, poll)
        return ()
    starts = poll.starts
    # right after the lists were taken, before the busy call (which may take long): a kept start
    # time then is of the process they listed, and one that exits in between is still read
    started = repeat(None) if starts is None else list(starts.of(list(merged)))
    # no per-process utilization under MIG: not asked, so no failure can be mistaken for it
    busy = UNSUPPORTED if device.is_mig_instance else attempt(_process_busy, device, poll)
    # a listed pid with no sample in the poll was idle; without figures, each has None or UNSUPPORTED
    figures = busy if isinstance(busy, dict) else {}
    gpu, mem = zip(*map(figures.get, merged, repeat((0, 0) if isinstance(busy, dict) else (busy, busy))))
    kinds, kib = zip(*merged.values())  # type: ignore[assignment]
    return tuple(map(ProcessSample._make, zip(merged, kinds, kib, gpu, mem, started)))


def _skip_process_busy(device: NvmlDevice, attempt: Attempt, poll: DevicePoll) -> None:
    """Read the per-process samples of this poll and let them go, where processes were listed before."""
    if device.process_stream.figures and not device.is_mig_instance:
        attempt(_process_busy, device, poll)


def _process_busy(device: NvmlDevice, poll: DevicePoll) -> dict[int, tuple[int, int]] | None:
    """Per-pid busy percentages of this poll (`ProcessStream.busy`)."""
    stream = device.process_stream
    before = stream.mode
    figures = stream.busy(
        device.streams.get(GPU_UTILIZATION_SAMPLES),
        lambda since: _process_samples(device, since, poll),
        lambda since: _process_samples(device, since),
        now_us=poll.now_us, periods=poll.periods, busy=poll.busy, samples_failed=poll.samples_failed,
    )
    if stream.mode != before:
        log.info(
            "nvml: GPU {busid}: the driver reports process utilization {how}",
            busid=printable(device.busid),
            how="per busy sample period" if stream.mode == "per-period" else "once per process and call",
        )
    return figures


def _process_samples(device: NvmlDevice, since: int, poll: DevicePoll | None = None) -> ProcessSamples:
    """The process samples newer than `since`, their stamps on the steady clock (stamps.py)."""
    stamps = device.stamps if poll is None else _stamp_map(device, poll)
    now_us = poll.call_time_us() if poll is not None else (stamps.seen_at or 0)
    asked = stamps.ask("processes", since, now_us)
    found = answer(call_sized, device, PROCESS_UTILIZATION, asked)
    if isinstance(found, NotFound):
        return ProcessSamples([], [], [], [])  # nothing ran since then
    pids, raw, sm, mem = given(found)
    if poll is not None:
        now_us = poll.call_time_us()  # as of the call's end (`_sampled`)
    steady = stamps.steady("processes", raw, now_us, asked, pids)
    return ProcessSamples(pids, steady, sm, mem)


def _stamp_map(device: NvmlDevice, poll: DevicePoll) -> StampMap:
    """The device's `StampMap`, watching the host clocks this poll names."""
    stamps = device.stamps
    if stamps.host is None and poll.host is not None:
        stamps.host = poll.host
    return stamps


def placeholder(device: NvmlDevice) -> DeviceSample:
    return DeviceSample(device.key, device.busid, device.name, device.task_support, info=device.info)
