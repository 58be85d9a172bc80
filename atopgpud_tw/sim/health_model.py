"""The simulated driver's health figures and XID events (a part of `SimulatedNvml`).

What a scenario GPU's ``health`` object plays (sim/health_scenario.py), as
methods named and shaped like nvidia-ml-py's functions.  The figures are the
card's: on a MIG handle every one is NOT_SUPPORTED, as NVML has most of them
per card only.  A figure the scenario gives as ``null`` is NOT_SUPPORTED.  The
total energy is the integral of the played power since the simulation began
(plus ``energy_start_j``), in millijoules, on the unwrapped clock, so it never
decreases.  XID events are delivered to an event set only once they are due
and only if registered before they happened, as the driver does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from atopgpud_tw.sim.health_scenario import Played
from atopgpud_tw.sim.scenario import NVML_ERRORS

NOT_SUPPORTED = NVML_ERRORS["NVML_ERROR_NOT_SUPPORTED"]
INVALID_ARGUMENT = NVML_ERRORS["NVML_ERROR_INVALID_ARGUMENT"]
TIMEOUT = NVML_ERRORS["NVML_ERROR_TIMEOUT"]
#: nvmlEventTypeXidCriticalError
EVENT_XID = 0x8
TEMPERATURE_GPU = 0
FIELD_MEMORY_TEMP = 82
#: nvmlClockType_t -> scenario field
CLOCKS = {0: "graphics_clock_mhz", 1: "sm_clock_mhz", 2: "memory_clock_mhz"}
ECC = {
    (0, 0): "ecc_corrected_volatile",
    (0, 1): "ecc_corrected_aggregate",
    (1, 0): "ecc_uncorrected_volatile",
    (1, 1): "ecc_uncorrected_aggregate",
}


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
    NVMLError: Any


    def _played(self, call: str, handle: Any, name: str) -> tuple[Played, float]:
        now = self._enter(call, handle)
        gpu = self._gpu(handle)
        played = gpu.health.played(name)
        if played is None or handle.instance is not None:
            raise self.NVMLError(NOT_SUPPORTED)
        return played, now

    def _value(self, call: str, handle: Any, name: str) -> float:
        played, now = self._played(call, handle, name)
        return played.at(now)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        if sensor != TEMPERATURE_GPU:
            self._enter("nvmlDeviceGetTemperature", handle)
            raise self.NVMLError(INVALID_ARGUMENT)
        return int(self._value("nvmlDeviceGetTemperature", handle, "temperature_c"))

    def memory_temperature(self, handle: Any) -> int:
        """``NVML_FI_DEV_MEMORY_TEMP`` of nvmlDeviceGetFieldValues (the library asks per field)."""
        return int(self._value("nvmlDeviceGetFieldValues", handle, "memory_temperature_c"))

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return int(round(self._value("nvmlDeviceGetPowerUsage", handle, "power_w") * 1000))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return int(round(self._value("nvmlDeviceGetEnforcedPowerLimit", handle, "power_limit_w") * 1000))

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        start, _ = self._played("nvmlDeviceGetTotalEnergyConsumption", handle, "energy_start_j")
        power = self._gpu(handle).health.played("power_w")
        if power is None:
            raise self.NVMLError(NOT_SUPPORTED)
        t = self._clock()  # unwrapped: the counter never goes back
        repeat = self.scenario.repeat
        if repeat:
            joules = (t // repeat) * power.integral(repeat) + power.integral(t % repeat)
        else:
            joules = power.integral(t)
        return int((start.at(0) + joules) * 1000)

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:
        name = CLOCKS.get(type)
        if name is None:
            self._enter("nvmlDeviceGetClockInfo", handle)
            raise self.NVMLError(NOT_SUPPORTED)
        return int(self._value("nvmlDeviceGetClockInfo", handle, name))

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return int(self._value("nvmlDeviceGetCurrentClocksEventReasons", handle, "clocks_event_reasons"))

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return int(self._value("nvmlDeviceGetCurrentClocksThrottleReasons", handle, "clocks_event_reasons"))

    def nvmlDeviceGetPerformanceState(self, handle: Any) -> int:
        return int(self._value("nvmlDeviceGetPerformanceState", handle, "performance_state"))

    def nvmlDeviceGetFanSpeed(self, handle: Any) -> int:
        return int(self._value("nvmlDeviceGetFanSpeed", handle, "fan_percent"))

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        name = ECC.get((errorType, counterType))
        if name is None:
            self._enter("nvmlDeviceGetTotalEccErrors", handle)
            raise self.NVMLError(INVALID_ARGUMENT)
        return int(self._value("nvmlDeviceGetTotalEccErrors", handle, name))

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        names = ("correctable", "uncorrectable", "pending", "failed")
        played = [self._gpu(handle).health.played(f"remapped_rows_{n}") for n in names]
        first, now = self._played("nvmlDeviceGetRemappedRows", handle, "remapped_rows_correctable")
        if any(p is None for p in played):
            raise self.NVMLError(NOT_SUPPORTED)
        return tuple(int(p.at(now)) for p in played)  # type: ignore[union-attr,return-value]

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any) -> int:
        return int(self._value("nvmlDeviceGetPcieReplayCounter", handle, "pcie_replays"))

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
            raise self.NVMLError(INVALID_ARGUMENT)
        if eventTypes & ~EVENT_XID or not gpu.health.xid_supported or handle.instance is not None:
            raise self.NVMLError(NOT_SUPPORTED)
        with self._event_lock:
            events.registered.setdefault(handle.gpu, self._clock())

    def nvmlEventSetWait(self, eventSet: int, timeoutms: int) -> tuple[int, int, int]:
        """The next event due: (gpu index, event type, XID); TIMEOUT when none comes in time."""
        self._enter("nvmlEventSetWait_v2")
        events = self._event_sets.get(eventSet)
        if events is None:
            raise self.NVMLError(INVALID_ARGUMENT)
        deadline = self._clock() + timeoutms / 1000.0
        while True:
            now = self._clock()
            due = self._due(events, now)
            if due is not None:
                return due
            if now >= deadline:
                raise self.NVMLError(TIMEOUT)
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
