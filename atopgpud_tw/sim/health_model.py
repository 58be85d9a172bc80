"""The simulated driver's health figures and XID events (a part of `SimulatedNvml`; docs/simulator.md).

A call of the table of figures (figures.py) that answers one number is `plain`: its arguments pick
the row.  On a MIG handle every figure is NOT_SUPPORTED (NVML has most per card only), as is one
played as ``null``; the energy is the integral of the power on the unwrapped clock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from atopgpud_tw.figures import ENGINE_BUSY, FIGURES, MEMORY_TEMPERATURE, Figure, Play
from atopgpud_tw.nvml_codes import (
    EVENT_XID,
    INVALID_ARGUMENT,
    NOT_SUPPORTED,
    TEMPERATURE_GPU,
    TIMEOUT,
    VALUE_TYPE_UNSIGNED_INT,
    VALUE_TYPE_UNSIGNED_LONG_LONG,
)
from atopgpud_tw.sim.answers import NvmlFault
from atopgpud_tw.sim.health_scenario import LinkSpec, Played

#: the memory temperature's field (its row of the table), answered as an unsigned int
FIELD_MEMORY_TEMP = next(f.nvml.field for f in FIGURES if f.family is MEMORY_TEMPERATURE and f.nvml)
#: the driver's sampling period of the engines' utilization, in microseconds
ENGINE_PERIOD_US = 167_000


def _plain(figure: Figure) -> bool:
    """A figure whose call answers one number: the call's arguments pick the field it is played from."""
    how = figure.nvml
    return (how is not None and figure.play is not None and how.pick is None and how.bit is None and not how.flag
            and how.field is None and not how.per_link and not how.older and how.below is None)


def _by_arguments(function: str) -> dict[tuple[int, ...], Play]:
    return {f.nvml.args: f.play for f in FIGURES if f.nvml and f.play and f.nvml.function == function}


#: function -> its arguments -> the field it answers (the table's plain rows)
PLAIN: dict[str, dict[tuple[int, ...], Play]] = {}
for _figure in FIGURES:
    if _plain(_figure) and _figure.nvml is not None and _figure.play is not None:
        PLAIN.setdefault(_figure.nvml.function, {})[_figure.nvml.args] = _figure.play
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
#: nvmlMemoryErrorType_t and nvmlEccCounterType_t -> field
ECC = {args: play.field for args, play in _by_arguments("nvmlDeviceGetTotalEccErrors").items()}
#: the fields of nvmlDeviceGetRemappedRows' answers, in their order (the table's)
REMAPPED = tuple(f.play.field for f in FIGURES if f.nvml and f.play and f.nvml.function == "nvmlDeviceGetRemappedRows")


@dataclass
class EventSet:
    """An event set: the cards registered, when, and the events each was given."""

    registered: dict[int, float] = field(default_factory=dict)
    delivered: dict[int, int] = field(default_factory=dict)


class HealthDriver:
    """The health calls of the driver model; mixed into `SimulatedNvml`."""

    scenario: Any
    _event_sets: dict[int, EventSet]
    _event_lock: threading.Lock
    #: SimulatedNvml's own: faults and delays, the scenario GPU of a handle, the unwrapped clock
    _enter: Any
    _gpu: Any
    _clock: Any

    def _played(self, call: str, handle: Any, name: str) -> tuple[Played, float]:
        now = self._enter(call, handle)
        gpu = self._gpu(handle)
        played = gpu.health.played(name)
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

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        self._pick({TEMPERATURE_GPU: None}, sensor, "nvmlDeviceGetTemperature", handle, INVALID_ARGUMENT)
        return int(self._value("nvmlDeviceGetTemperature", handle, "temperature_c"))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        start, _ = self._played("nvmlDeviceGetTotalEnergyConsumption", handle, "energy_start_j")
        power = self._gpu(handle).health.played("power_w")
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
        play = self._pick(PLAIN[function], tuple(int(a) for a in args), function, handle, NOT_SUPPORTED)
        value = self._value(function, handle, play.field) * play.per
        return int(round(value)) if play.per != 1 else int(value)

    def field_value(self, handle: Any, field: int, scope: int) -> tuple[int, int]:
        """One entry of nvmlDeviceGetFieldValues: (value type, value); NOT_SUPPORTED for a field it lacks."""
        if field in LINK_FIELD_IDS:
            link, now = self._link(handle, scope, "nvmlDeviceGetFieldValues")
            played = link.played(LINK_FIELD_IDS[field].field)
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
        played = None if play is None else spec.played(play.field)
        if played is None or not spec.active:
            raise NvmlFault(NOT_SUPPORTED)
        return int(played.at(now))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return int(self._value("nvmlDeviceGetCurrentClocksEventReasons", handle, "clocks_event_reasons"))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return int(self._value("nvmlDeviceGetCurrentClocksThrottleReasons", handle, "clocks_event_reasons"))

    def nvmlDeviceGetPerformanceState(self, handle: Any) -> int:
        return int(self._value("nvmlDeviceGetPerformanceState", handle, "performance_state"))

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        name = self._pick(ECC, (errorType, counterType), "nvmlDeviceGetTotalEccErrors", handle, INVALID_ARGUMENT)
        return int(self._value("nvmlDeviceGetTotalEccErrors", handle, name))

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        played = [self._gpu(handle).health.played(name) for name in REMAPPED]
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

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetSupportedEventTypes", handle)
        gpu = self._gpu(handle)
        return EVENT_XID if gpu.health.xid_supported and handle.instance is None else 0

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: int) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)
        gpu = self._gpu(handle)
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
