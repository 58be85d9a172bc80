"""The simulator's scenario: a JSON description of GPUs, their load and their faults.

Times are seconds since the simulator started; a list may stand for a number (cycled, one
entry per sample); ``null`` for a percentage is "not supported".  docs/simulator.md has the
format; `load_scenario` checks every field, raising `ScenarioError` naming it.  An unknown key
is an error (a misspelt field would be ignored silently); keys starting with ``_`` are comments.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from dataclasses import MISSING, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

from atopgpud_tw import checks
from atopgpud_tw.figures import GPM_FIGURES, NVLINK_MAX_LINKS, Number, Play, link_fields, played_fields
from atopgpud_tw.nvml_codes import CODES
from atopgpud_tw.sim.jsonfile import read_json
from atopgpud_tw.sim.library_symbols import DRIVERS, LIBRARY_SYMBOLS
from atopgpud_tw.sim.replay import Recording, RecordingError, load_recording

Cycled = Number | Sequence[Number] | None

#: the NVML errors a scenario can make a call return, by their C names
NVML_ERRORS = {f"NVML_ERROR_{name}": code for name, code in CODES.items()}
#: faults that are not NVML error codes
OTHER_FAULTS = ("NVMLLibraryMismatchError", "RuntimeError", "hang")
PROCESS_TYPES = ("C", "G", "C+G")
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


PROCESS_UTILIZATION = ("per-period", "per-call")


class ScenarioError(ValueError):
    """A scenario that cannot be used; the message names the file and the field."""


def in_span(now: float, start: float, stop: float | None) -> bool:
    """Whether `now` is from `start` on and before `stop` (None: for ever)."""
    return start <= now and (stop is None or now < stop)


# -- the checks a field's value goes through: (value, where) -> what the spec holds --

Check = Callable[[Any, str], Any]


_number = partial(checks.number, error=ScenarioError)
_integer = partial(checks.integer, error=ScenarioError)
_positive = partial(checks.integer, error=ScenarioError, low=1, words="a positive integer")
_flag = partial(checks.flag, error=ScenarioError)


def _string(test: Callable[[str], bool], words: str) -> Check:
    """A string that passes `test`; else "`where` must `words`"."""

    def check(value: Any, where: str) -> str:
        if not isinstance(value, str) or not test(value):
            raise ScenarioError(f"{where} must {words}")
        return value

    return check


_text = _string(bool, "be a non-empty string")
_call = _string(lambda value: value.startswith("nvml") or value == "*", "name an NVML function, or be * for every call")
_profile = _string(lambda value: bool(value) and " " not in value, "be a name such as 3g.40gb")


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ScenarioError(f"{where} must be a list")
    return value


def number(low: float | None = None, high: float | None = None) -> Check:
    return lambda value, where: _number(value, where, low=low, high=high)


percent = number(0, 100)


def cycled_check(nullable: bool = False, is_percent: bool = False) -> Check:
    """A number, or a list of them cycled one per sample; None only when `nullable`."""

    def check(value: Any, where: str) -> Cycled:
        if value is None:
            if nullable:
                return None
            raise ScenarioError(f"{where} must not be null")
        return checks.cycled(value, where, ScenarioError, 0, 100 if is_percent else None)

    return check


def optional(check: Check) -> Check:
    """`check`, or None for null."""
    return lambda value, where: None if value is None else check(value, where)


def time_check(value: Any, where: str) -> float:
    """A time in seconds; null is 0."""
    return 0.0 if value is None else _number(value, where, low=0)


def choice(options: Sequence[str], words: str) -> Check:
    def check(value: Any, where: str) -> str:
        if value not in options:
            raise ScenarioError(f"{where} must be one of {words}")
        return value  # type: ignore[no-any-return]  # one of the strings

    return check


def pairs(what: str, least: float | None = 0, ordered: bool = False, when: str = "when") -> Check:
    """A list of two numbers each, ``[when, what]``."""

    def check(value: Any, where: str) -> tuple[tuple[float, float], ...]:
        out = []
        for i, entry in enumerate(_list(value, where)):
            if not isinstance(entry, list) or len(entry) != 2:
                raise ScenarioError(f"{where}[{i}] must be [{when}, {what}]")
            # the top level's name each number; a GPU's say only which entry
            first, second = (f"{where}[{i}] when", f"{where}[{i}] {what}") if ordered else (f"{where}[{i}]",) * 2
            out.append((_number(entry[0], first, low=0), _number(entry[1], second, low=least)))
        return tuple(sorted(out)) if ordered else tuple(out)

    return check


def listed(item: Callable[[Any, str, int], Any]) -> Check:
    """A list, each entry checked with its place (``where[i]``) and index."""
    return lambda value, where: tuple(item(entry, f"{where}[{i}]", i) for i, entry in enumerate(_list(value, where)))


def declared(check: Check | None, help: str, default: Any = MISSING, factory: Any = MISSING, json: str | None = None,
             replayed: bool = False) -> Any:
    """A scenario field: its check, the words that say what it does, its default, its JSON key
    (the field's name unless `json`), whether a replayed recording supplies it (a GPU's field).
    `check` None: filled from other fields (`replay`)."""
    metadata = {"check": check, "help": help, "json": json, "replayed": replayed}
    return field(default=default, default_factory=factory, metadata=metadata)


def replayed(check: Check, help: str, default: Any) -> Any:
    """A GPU's field that a replayed recording supplies, so that a replayed GPU cannot also give it."""
    return declared(check, help, default, replayed=True)


def json_keys(spec: type) -> dict[str, str]:
    """The JSON keys of `spec`'s declared fields, each to its field's name."""
    return {f.metadata.get("json") or f.name: f.name for f in fields(spec)}


def build(spec: type, value: Any, where: str, defaults: dict[str, Any] | None = None) -> Any:
    """A `spec` from a JSON object: each declared field's key checked, or its default when absent
    (`defaults`, then the field's own); a required field that is absent is checked as null."""
    keys = json_keys(spec)
    found = _object(value, where, set(keys))
    prefix = "" if where == "the scenario" else f"{where}."
    values = {}
    for f in fields(spec):
        key = f.metadata.get("json") or f.name
        check = f.metadata["check"]
        if check is not None and key in found:
            values[f.name] = check(found[key], prefix + key)
        elif defaults and f.name in defaults:
            values[f.name] = defaults[f.name]
        elif check is not None and f.default is MISSING and f.default_factory is MISSING:
            values[f.name] = check(None, prefix + key)
    return spec(**values)


def _object(value: Any, where: str, known: set[str]) -> dict[str, Any]:
    """A JSON object whose keys are all known; keys starting with ``_`` are comments."""
    return checks.known(value, where, known, ScenarioError, "" if where == "the scenario" else None)


# -- the scenario's parts, each field declared once --


def _error(value: Any, where: str) -> str:
    if value not in NVML_ERRORS and value not in OTHER_FAULTS:
        raise ScenarioError(f"{where} {value!r} is not a known NVML error")
    return value  # type: ignore[no-any-return]  # one of the names


@dataclass(frozen=True)
class Fault:
    call: str = declared(_call, "the NVML function (`*`: every call)")
    error: str = declared(_error, "an `NVML_ERROR_*` name, `NVMLLibraryMismatchError`, `RuntimeError` or `hang`")
    start: float = declared(time_check, "from this simulated time", 0.0, json="from")
    until: float | None = declared(optional(number(0)), "until this time (`null`: for ever)", None)

    def active(self, now: float) -> bool:
        return in_span(now, self.start, self.until)


def _fault(value: Any, where: str, index: int = 0) -> Fault:
    fault: Fault = build(Fault, value, where)
    if fault.error == "RuntimeError" and fault.call not in DECODED_CALLS:
        raise ScenarioError(
            f"{where}: a RuntimeError comes from a reply the binding decodes, so only from "
            + ", ".join(DECODED_CALLS)
        )
    return fault


def _spells(value: Any, where: str) -> tuple[tuple[float, float], ...]:
    busy: tuple[tuple[float, float], ...] = pairs("until", when="from")(value, where)
    for i in range(1, len(busy)):
        if busy[i][0] < busy[i - 1][1]:
            raise ScenarioError(f"{where}[{i}] overlaps the spell before it")
    return busy


@dataclass(frozen=True)
class Timeline:
    """Busy spells repeated every `period` seconds: ``busy`` is a list of
    ``[from, until]`` offsets within the period, at `level` percent."""

    period: float = declared(number(0.001), "seconds the pattern repeats after")
    busy: tuple[tuple[float, float], ...] = declared(_spells, "`[from, until]` offsets within the period", ())
    level: float = declared(percent, "the busy percentage during a spell", 100.0)

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


def _timeline(value: Any, where: str) -> Timeline | None:
    if value is None:
        return None
    timeline: Timeline = build(Timeline, value, where)
    for i, (a, b) in enumerate(timeline.busy):
        if not a < b <= timeline.period:
            raise ScenarioError(f"{where}.busy[{i}] must have from < until <= period")
    return timeline


def _span(spec: Any, where: str) -> Any:
    """A spec with a `start` and a `stop`, checked that the one comes after the other."""
    if spec.stop is not None and spec.stop <= spec.start:
        raise ScenarioError(f"{where}.stop must come after its start")
    return spec


@dataclass(frozen=True)
class ProcessSpec:
    pid: int = declared(_positive, "the process id")
    type: str = declared(choice(PROCESS_TYPES, "C, G, C+G"), "compute, graphics or both", "C")
    memory_mib: Cycled = declared(cycled_check(nullable=True), "`usedGpuMemory`; null: not available", 0)
    sm_util: Cycled = declared(cycled_check(nullable=True, is_percent=True), "SM busy %", 0)
    mem_util: Cycled = declared(cycled_check(nullable=True, is_percent=True), "memory busy %", 0)
    start: float = declared(time_check, "when it starts", 0.0)
    stop: float | None = declared(optional(number(0)), "when it stops (null: never)", None)
    sm_timeline: Timeline | None = declared(_timeline, "sub-second SM load (the driver's buffer is simulated)", None)
    mem_timeline: Timeline | None = declared(_timeline, "sub-second memory load", None)

    def alive(self, now: float) -> bool:
        """Whether it runs at `now`; one that starts at 0 was already running
        before (the driver's buffer has its past)."""
        return in_span(now, self.start or -math.inf, self.stop)


def _process(value: Any, where: str, index: int = 0) -> ProcessSpec:
    return _span(build(ProcessSpec, value, where), where)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class MigSpec:
    """One MIG instance; it exists from `start` until `stop` (a carving change)."""

    profile: str = declared(_profile, "the profile, e.g. `3g.40gb`")
    memory_total_mib: Number = declared(number(0), "its memory", 0)
    memory_used_mib: Cycled = declared(cycled_check(), "its memory in use", 0)
    gpu_instance: int = declared(_integer, "its GPU instance id (default: its place in the list, from 1)", 1)
    compute_instance: int = declared(_integer, "its compute instance id", 0)
    processes: tuple[ProcessSpec, ...] = declared(listed(_process), "what its process lists report", ())
    start: float = declared(time_check, "when it is made", 0.0)
    stop: float | None = declared(optional(number(0)), "when it is destroyed (null: never)", None)
    slot: int = declared(_integer, "the index nvmlDeviceGetMigDeviceHandleByIndex finds it at", 0)
    faults: tuple[Fault, ...] = declared(
        listed(_fault), "faults of calls made with its handle (and of GPM samples of its GPU instance)", ())
    #: what its GPU instance does, for GPM (NVML reports no utilization under MIG)
    gpu_util: Number = declared(percent, "its GPU instance's busy % (GPM)", 0)
    gpu_timeline: Timeline | None = declared(_timeline, "its GPU instance's sub-second load (GPM)", None)
    mem_util: Number = declared(percent, "its memory busy % (GPM)", 0)
    mem_timeline: Timeline | None = declared(_timeline, "its sub-second memory load (GPM)", None)

    def alive(self, now: float) -> bool:
        return in_span(now, self.start, self.stop)


def _mig(value: Any, where: str, index: int) -> MigSpec:
    defaults = {"gpu_instance": index + 1, "slot": index}
    return _span(build(MigSpec, value, where, defaults), where)  # type: ignore[no-any-return]


def _instances(value: Any, where: str) -> tuple[MigSpec, ...] | None:
    if value is None:
        return None
    instances: tuple[MigSpec, ...] = listed(_mig)(value, where)
    _check_carving(instances, where)
    return instances


def _sample_clock(value: Any, where: str) -> float | None:
    if value == "epoch":
        return None
    if value == "boottime":
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return _number(value, f"{where} (epoch, boottime or seconds)", low=0)


def _whole(value: Any, where: str) -> Cycled:
    """A cycled count: an integer >= 0, or a list of them."""
    for entry in value if isinstance(value, list) else [value]:
        _integer(entry, where)
    return cycled_check()(value, where)


def _growth(value: Any, where: str) -> dict[str, Cycled]:
    """One count for every sized list, or an object of counts by list."""
    if not isinstance(value, dict):
        count = _whole(value, where)
        return {name: count for name in GROWING_LISTS}
    spec = _object(value, where, set(GROWING_LISTS))
    return {name: _whole(spec[name], f"{where}.{name}") for name in GROWING_LISTS if name in spec}


def _stray(value: Any, where: str, index: int = 0) -> tuple[int, ...]:
    """(pid, sm_util, mem_util)."""
    entry = _object(value, where, {"pid", "sm_util", "mem_util"})
    return tuple(_integer(entry.get(key, 0), f"{where}.{key}") for key in ("pid", "sm_util", "mem_util"))


# -- a GPU's health figures (each a played value: a number, a list cycled one entry per simulated
# second, so what is reported does not depend on who asks how often, steps, or null: NOT_SUPPORTED)
# and its GPM (fixed shares of the graphics or memory activity, traffic in MiB/s while active) --

#: health field -> its `Play` (default, bounds), each of which may be null; those of one NVLink
HEALTH_FIELDS: dict[str, Play] = played_fields()
LINK_FIELDS: dict[str, Play] = link_fields()
#: gpm field -> its `Play`: the table's GPM rows (figures.GPM_FIGURES)
GPM_FIELDS: dict[str, Play] = {f.play.field: f.play for f in GPM_FIGURES if f.gpm is not None and f.play is not None}


@dataclass(frozen=True)
class Played:
    """A value over simulated time: constant, cycled per second, or steps."""
    constant: Number | None = None
    cycle: tuple[Number, ...] = ()
    steps: tuple[tuple[float, Number], ...] = ()

    def at(self, t: float) -> Number:
        if self.cycle:
            return self.cycle[int(math.floor(t)) % len(self.cycle)]
        if self.steps:  # the last step by `t`; before the first, its value
            return self.steps[max(0, bisect_right([when for when, _ in self.steps], t) - 1)][1]
        assert self.constant is not None
        return self.constant

    def integral(self, t: float) -> float:
        """The integral of the value from 0 to `t`."""
        if t <= 0:
            return 0.0
        if self.cycle:
            whole, rest = int(math.floor(t)), t - math.floor(t)
            n = len(self.cycle)
            done = (whole // n) * sum(self.cycle) + sum(self.cycle[: whole % n])
            return done + self.cycle[whole % n] * rest
        if self.steps:
            total, start, value = 0.0, 0.0, self.steps[0][1]
            for when, step in self.steps:
                if when >= t:
                    break
                if when > start:
                    total += value * (when - start)
                    start = when
                value = step
            return total + value * (t - start)
        assert self.constant is not None
        return float(self.constant) * t


@dataclass(frozen=True)
class LinkSpec:
    """One NVLink: whether it is active, and its figures (throughput played in KiB/s, errors as counts)."""

    active: bool
    figures: dict[str, Played | None]


@dataclass(frozen=True)
class HealthSpec:
    """A GPU's health figures (None where it cannot report one) and XID events."""

    figures: dict[str, Played | None]
    #: (time, XID code): an XID critical-error event at that time
    xid_events: tuple[tuple[float, int], ...] = ()
    #: the device has XID events (``"xid_events": null``: registering for them is NOT_SUPPORTED)
    xid_supported: bool = True
    #: its NVLinks, or None: it has none (nvmlDeviceGetNvLinkState is NOT_SUPPORTED)
    nvlink: tuple[LinkSpec, ...] | None = None


def parse_health(value: Any, where: str) -> HealthSpec:
    """Check a scenario GPU's ``health`` object (None: every default)."""
    spec = _object({} if value is None else value, where, {*HEALTH_FIELDS, "xid_events", "nvlink"})
    figures = _figures(spec, where, HEALTH_FIELDS)
    links = _links(spec.get("nvlink"), f"{where}.nvlink")
    events = []
    listed = spec.get("xid_events", [])
    if listed is None:
        return HealthSpec(figures, (), xid_supported=False, nvlink=links)
    if not isinstance(listed, list):
        raise ScenarioError(f"{where}.xid_events must be a list of [time, xid]")
    for i, entry in enumerate(listed):
        if (
            not isinstance(entry, list) or len(entry) != 2 or not checks.is_number(entry[0]) or entry[0] < 0
            or isinstance(entry[1], bool) or not isinstance(entry[1], int) or entry[1] <= 0
        ):
            raise ScenarioError(f"{where}.xid_events[{i}] must be [time, xid]: seconds >= 0 and a positive integer")
        events.append((float(entry[0]), entry[1]))
    return HealthSpec(figures, tuple(sorted(events)), nvlink=links)


def _figures(spec: dict[str, Any], where: str, known: dict[str, Play]) -> dict[str, Played | None]:
    """Each of `known` played as `spec` has it, or its default."""
    played = ((name, spec.get(name, play.default), play) for name, play in known.items())
    return {name: None if raw is None else _played(raw, f"{where}.{name}", play.low, play.high)
            for name, raw, play in played}


def _links(value: Any, where: str) -> tuple[LinkSpec, ...] | None:
    """``nvlink``: null (no NVLink), or a list of links, each an object of played fields and ``active``."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > NVLINK_MAX_LINKS:
        raise ScenarioError(f"{where} must be null or a list of at most {NVLINK_MAX_LINKS} links")
    links = []
    for i, link in enumerate(value):
        here = f"{where}[{i}]"
        _object(link, here, {*LINK_FIELDS, "active"})
        links.append(LinkSpec(_flag(link.get("active", True), f"{here}.active"), _figures(link, here, LINK_FIELDS)))
    return tuple(links)


#: what a played value is, in words
_PLAYED = 'a number, a list of numbers, {"steps": [[t, v], ...]} or null'


def _played(value: Any, where: str, low: float, high: float | None) -> Played:
    if isinstance(value, dict):
        if set(value) != {"steps"} or not isinstance(value["steps"], list) or not value["steps"]:
            raise ScenarioError(f"{where} as an object must be {{\"steps\": [[t, v], ...]}}, at least one step")
        steps: list[Any] = []
        for i, step in enumerate(value["steps"]):
            if not isinstance(step, list) or len(step) != 2 or not checks.is_number(step[0]) or step[0] < 0:
                raise ScenarioError(f"{where}.steps[{i}] must be [t, v] with t >= 0")
            if steps and step[0] <= steps[-1][0]:
                raise ScenarioError(f"{where}.steps[{i}] must come after the step before it")
            steps.append((float(step[0]), _number(step[1], f"{where}.steps[{i}]", low=low, high=high, words=_PLAYED)))
        return Played(steps=tuple(steps))
    found = checks.cycled(value, where, ScenarioError, low, high, _PLAYED)
    return Played(cycle=found) if isinstance(found, tuple) else Played(constant=found)


def parse_gpm(value: Any, where: str) -> dict[str, float] | None:
    """Check a scenario GPU's ``gpm``: absent, null or false for none, true or an object for GPM
    (each of `GPM_FIELDS`, its default where not given)."""
    if value is None or value is False:
        return None
    if value is not True and not isinstance(value, dict):
        raise ScenarioError(f"{where} must be true, false or an object")
    given = {} if value is True else _object(value, where, set(GPM_FIELDS))
    return {name: float(_number(given[name], f"{where}.{name}", low=0, high=play.high)) if name in given
            else float(play.default or 0) for name, play in GPM_FIELDS.items()}


_cycled_percent = cycled_check(nullable=True, is_percent=True)


@dataclass(frozen=True)
class GpuSpec:
    name: str = declared(_text, "nvmlDeviceGetName", "NVIDIA Simulated GPU")
    busid: str = declared(_text, "the PCI bus id (default by index)", "")
    uuid: str = declared(_text, "nvmlDeviceGetUUID (default by index)", "")
    memory_total_mib: Number = replayed(number(0), "nvmlDeviceGetMemoryInfo().total", 16384)
    memory_used_mib: Cycled = replayed(cycled_check(), "memory in use, reserved memory left out", 0)
    gpu_util: Cycled = replayed(_cycled_percent, "GPU busy % (null: NOT_SUPPORTED)", 0)
    mem_util: Cycled = replayed(_cycled_percent, "memory busy % (null: NOT_SUPPORTED)", 0)
    processes: tuple[ProcessSpec, ...] = replayed(listed(_process), "what the process lists report", ())
    mig: tuple[MigSpec, ...] | None = replayed(_instances, "MIG instances: a list puts the card in MIG mode", None)
    faults: tuple[Fault, ...] = declared(listed(_fault), "faults of calls made with its handles", ())
    compute_list: bool = declared(_flag, "false: the compute process list is NOT_SUPPORTED", True)
    graphics_list: bool = declared(_flag, "false: the graphics process list is NOT_SUPPORTED", True)
    mig_capable: bool = replayed(_flag, "nvmlDeviceGetMigMode works (default: with `mig`)", False)
    sample_period: float = replayed(number(0.001), "the driver's utilization sample period", 1 / 6)
    gpu_timeline: Timeline | None = replayed(_timeline, "sub-second load, instead of gpu_util", None)
    mem_timeline: Timeline | None = replayed(_timeline, "sub-second load, instead of mem_util", None)
    samples_supported: bool = declared(_flag, "nvmlDeviceGetSamples works (false: NOT_SUPPORTED)", True)
    idle_samples: bool = replayed(_flag, "the driver buffers samples of idle periods too", True)
    memory_reserved_mib: Number = replayed(number(0), "memory the driver reserves (v2 apart, v1 in `used`)", 0)
    process_list_capacity: int | None = declared(
        optional(_positive), "the process-utilization size query reports this, not the count", None)
    grow_between_calls: dict[str, Cycled] = declared(
        _growth, "entries a list gains between a size query and its fill",
        factory=lambda: dict.fromkeys(GROWING_LISTS, 0))
    sample_clock: float | None = declared(
        _sample_clock, "the sample clock at time 0: epoch (None), boottime or seconds", None)
    sample_phase: float = replayed(number(0), "period boundaries fall at sample_phase + k * sample_period", 0.0)
    sample_jitter_ms: float = replayed(number(0), "each sample's stamp is off by up to this, either way", 0.0)
    late_samples: tuple[tuple[float, float], ...] = replayed(
        pairs("ms"), "(when, ms): the first sample due at or after `when` is stamped `ms` late", ())
    missing_samples: tuple[float, ...] = replayed(
        listed(lambda value, where, i: _number(value, where, low=0)),
        "the first sample due at or after each of these times is never buffered", ())
    samples_not_found: bool = declared(_flag, "nvmlDeviceGetSamples answers NOT_FOUND for ever", False)
    process_utilization: str = replayed(
        choice(PROCESS_UTILIZATION, ", ".join(PROCESS_UTILIZATION)),
        "per busy sample period, or per call with the average over the window", PROCESS_UTILIZATION[0])
    duplicate_process_samples: bool = replayed(_flag, "every process-utilization entry is listed twice", False)
    stray_process_samples: tuple[tuple[int, ...], ...] = replayed(
        listed(_stray), "entries besides the processes': pids in no list, figures above 100 %", ())
    replay: Recording | None = declared(None, "a calibration recording the driver answers from (sim/replay.py)", None)
    health: HealthSpec = declared(parse_health, "temperatures, power, clocks, errors, XID events",
                                  factory=lambda: parse_health(None, "health"))
    serial: str | None = declared(optional(_text), "the serial number (null: NOT_SUPPORTED)", None)
    vbios: str = declared(_text, "the VBIOS version", "96.00.5E.00.01")
    gpm: dict[str, float] | None = declared(parse_gpm, "GPU Performance Monitoring: its fields; None: none", None)


#: what a replayed recording supplies: the fields declared `replayed`
_REPLAYED_FIELDS = tuple(f.name for f in fields(GpuSpec) if f.metadata["replayed"])


def _gpu(value: Any, where: str, index: int, base: str | Path | None = None) -> GpuSpec:
    spec = _object(value, where, set(json_keys(GpuSpec)))
    recording = _replay(spec, where, base)
    if recording is not None and spec.get("gpm") not in (None, False):
        raise ScenarioError(f"{where}.gpm cannot be given with replay (a recording has no GPM)")
    if recording is not None:
        spec = {"name": recording.name, "uuid": recording.uuid, "busid": recording.busid,
                "memory_total_mib": recording.memory_total / 1048576, **spec}
    defaults = {
        "busid": f"00000000:{0x17 + index:02X}:00.0",
        "uuid": f"GPU-5111a7ed-0000-4000-8000-{index:012d}",
        "serial": f"1324321{index:06d}",
        "mig_capable": spec.get("mig") is not None,
        "replay": recording,
    }
    gpu: GpuSpec = build(GpuSpec, spec, where, defaults)
    if gpu.mig is not None and not gpu.mig_capable:
        raise ScenarioError(f"{where}.mig_capable cannot be false on a GPU with a mig list")
    if gpu.sample_phase >= gpu.sample_period:
        raise ScenarioError(f"{where}.sample_phase must be less than the sample_period")
    if gpu.sample_jitter_ms / 1000 >= gpu.sample_period / 2:
        raise ScenarioError(f"{where}.sample_jitter_ms must be less than half the sample_period")
    return gpu


def _symbols(value: Any, where: str) -> tuple[str, ...]:
    for i, symbol in enumerate(_list(value, where)):
        if symbol not in LIBRARY_SYMBOLS:
            raise ScenarioError(f"{where}[{i}] {symbol!r} is not a symbol of the simulated library")
    return tuple(value)


def _reorder_entry(value: Any, where: str, index: int) -> tuple[float, tuple[int, ...]]:
    entry = _object(value, where, {"from", "order"})
    since = _number(entry.get("from", 0), f"{where}.from", low=0)
    return since, tuple(_integer(n, f"{where}.order") for n in _list(entry.get("order"), f"{where}.order"))


@dataclass(frozen=True)
class Scenario:
    gpus: tuple[GpuSpec, ...] = declared(None, "the cards, in NVML index order", ())
    call_delay_ms: float = declared(number(0), "every NVML call sleeps this long", 0.0)
    faults: tuple[Fault, ...] = declared(
        listed(_fault), "faults of calls that take no device (nvmlInit, nvmlDeviceGetCount)", ())
    repeat: float | None = declared(
        optional(number(0.001)), "when set, simulated time wraps around after this many seconds", None)
    driver: str = declared(choice(tuple(DRIVERS), ", ".join(DRIVERS)),
                           "the driver branch (DRIVERS): its symbols and the version it reports", "current")
    missing_symbols: tuple[str, ...] = declared(
        _symbols, "C symbols the simulated library lacks, besides those its driver branch lacks", ())
    clock_steps: tuple[tuple[float, float], ...] = declared(
        pairs("seconds", None, ordered=True), "(when, seconds): the host's wall clock is set that far at `when`", ())
    suspends: tuple[tuple[float, float], ...] = declared(
        pairs("seconds", 0, ordered=True), "(when, seconds): the host sleeps that long at `when`", ())
    driver_loaded_file: str | None = declared(
        optional(_string(lambda value: value.startswith("/"), "be an absolute path")),
        "nvmlInit answers DRIVER_NOT_LOADED while this file does not exist", None)
    reorder: tuple[tuple[float, tuple[int, ...]], ...] = declared(
        listed(_reorder_entry), "(from, order): from then on, NVML index i is the scenario's GPU order[i]", ())

    def order(self, now: float) -> tuple[int, ...] | None:
        """The scenario's GPU at each NVML index now; None: in the scenario's order."""
        return next((order for since, order in reversed(self.reorder) if now >= since), None)

    @property
    def absent_symbols(self) -> frozenset[str]:
        """Every C symbol the simulated library lacks."""
        return frozenset(DRIVERS[self.driver][1]) | frozenset(self.missing_symbols)


#: every part of a scenario whose fields are declared, by its name in docs/simulator.md
SPECS = (Scenario, GpuSpec, ProcessSpec, MigSpec, Timeline, Fault)


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
    """Check a decoded scenario and build it; relative paths in it (``replay``) start from `base`
    (the scenario file's folder; None: the working directory)."""
    top = _object(data, "the scenario", set(json_keys(Scenario)))
    gpus = tuple(_gpu(g, f"gpus[{i}]", i, base) for i, g in enumerate(_list(top.get("gpus", []), "gpus")))
    busids = [g.busid for g in gpus]
    if len(set(busids)) != len(busids):
        raise ScenarioError("gpus: two GPUs have the same busid")
    scenario: Scenario = build(Scenario, top, "the scenario", {"gpus": gpus})
    for i, (since, order) in enumerate(scenario.reorder):
        if sorted(order) != list(range(len(gpus))):
            raise ScenarioError(f"reorder[{i}].order must list each GPU's position in gpus once")
        if i and since < scenario.reorder[i - 1][0]:
            raise ScenarioError(f"reorder[{i}].from must not be before the previous entry's")
    return scenario


def _check_carving(instances: tuple[MigSpec, ...], where: str) -> None:
    """Ids and slots may be reused by a later carving, never by two instances at once."""
    for i, first in enumerate(instances):
        for j in range(i + 1, len(instances)):
            second = instances[j]
            if (second.stop is not None and first.start >= second.stop) or (
                    first.stop is not None and second.start >= first.stop):
                continue  # not at the same time
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
