"""A card's health and power figures (`CardHealth`) and its XID errors, read through NVML in the reader's thread.

`read_card_health` asks one card for every figure the metrics page shows
(docs/metrics.md, "Health and power series") through the device's choke point
(`NvmlDevice.call`), so that a figure the card cannot report (NOT_SUPPORTED, or
a function its driver lacks) is asked no more and has no series, a figure
that fails once is left out of that reading only, and a lost card or a broken
NVML gives a reading with no figures.  Nothing here runs unless the metrics
page is fetched: the figures cost no NVML call per poll.

`XidEvents` keeps one NVML event set for XID critical errors, registers every
card with it, and drains it without waiting (timeout 0) whenever the figures
are read, counting the events by card and XID code; the counts are the
daemon's own and never go back.  Everything here runs in the worker thread.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from atopgpud_tw.health import CLOCKS_EVENT_REASONS, CardHealth, Series
from atopgpud_tw.readers.nvml.device import (
    DeviceLost,
    Failed,
    Missing,
    NotFound,
    NvmlDevice,
    Reinitialise,
    Unsupported,
)

TEMPERATURE_GPU = 0
FIELD_MEMORY_TEMP = 82
FIELD_NOT_SUPPORTED = 3
#: nvmlClockType_t by the label it is shown with
CLOCKS = (("graphics", 0), ("sm", 1), ("memory", 2))
ECC_COUNTERS = (
    ("corrected", 0, "volatile", 0),
    ("corrected", 0, "aggregate", 1),
    ("uncorrected", 1, "volatile", 0),
    ("uncorrected", 1, "aggregate", 1),
)
#: nvmlPstates_t NVML_PSTATE_UNKNOWN
PSTATE_UNKNOWN = 32
EVENT_XID = 0x8
TIMEOUT = 10
#: events taken from the set per reading at most (a storm is counted over later readings)
MAX_EVENTS = 1000


def read_card_health(device: NvmlDevice) -> CardHealth:
    """Every health figure of one card, as it is now (runs in the worker thread)."""
    reading = CardHealth(device.key, device.busid, device.name, uuid=device.info.uuid)
    values = reading.values

    def ask(series: Series, scale: float, function: str, *args: Any, variant: str | None = None) -> Any:
        try:
            value = device.call(function, *args, variant=variant)
        except Unsupported as refused:
            cause = device.given_up(str(refused))
            if cause:  # given up after it had answered: a problem until it answers again
                reading.problems.add(f"{device.key} {cause}", f"GPU {device.busid}: {cause}")
            return None
        except (DeviceLost, Reinitialise):
            raise
        except (Failed, NotFound) as failure:
            cause = getattr(failure, "cause", str(failure))
            reading.problems.add(f"{device.key} {cause}", f"GPU {device.busid}: {cause}")
            return None
        if series[0]:
            values[series] = float(value) * scale
        return value

    try:
        ask(("atopgpud_gpu_temperature_celsius", ()), 1, "nvmlDeviceGetTemperature", TEMPERATURE_GPU)
        _memory_temperature(device, values, ask)
        ask(("atopgpud_gpu_power_watts", ()), 0.001, "nvmlDeviceGetPowerUsage")
        ask(("atopgpud_gpu_power_limit_watts", ()), 0.001, "nvmlDeviceGetEnforcedPowerLimit")
        ask(("atopgpud_gpu_energy_joules_total", ()), 0.001, "nvmlDeviceGetTotalEnergyConsumption")
        for label, clock in CLOCKS:
            ask(("atopgpud_gpu_clock_hertz", (("clock", label),)), 1e6, "nvmlDeviceGetClockInfo", clock,
                variant=f"nvmlDeviceGetClockInfo {label}")
        _clocks_event_reasons(device, values, ask)
        state = ask(("", ()), 1, "nvmlDeviceGetPerformanceState")
        if state is not None and 0 <= int(state) < PSTATE_UNKNOWN:
            values[("atopgpud_gpu_performance_state", ())] = float(state)
        ask(("atopgpud_gpu_fan_speed_percent", ()), 1, "nvmlDeviceGetFanSpeed")
        for error, error_type, counter, counter_type in ECC_COUNTERS:
            ask(("atopgpud_gpu_ecc_errors_total", (("error", error), ("counter", counter))), 1,
                "nvmlDeviceGetTotalEccErrors", error_type, counter_type,
                variant=f"nvmlDeviceGetTotalEccErrors {error} {counter}")
        rows = ask(("", ()), 1, "nvmlDeviceGetRemappedRows")
        if rows is not None:
            correctable, uncorrectable, pending, failed = (int(v) for v in rows)
            values[("atopgpud_gpu_remapped_rows", (("cause", "correctable"),))] = correctable
            values[("atopgpud_gpu_remapped_rows", (("cause", "uncorrectable"),))] = uncorrectable
            values[("atopgpud_gpu_row_remap_pending", ())] = 1 if pending else 0
            values[("atopgpud_gpu_row_remap_failed", ())] = 1 if failed else 0
        ask(("atopgpud_gpu_pcie_replays_total", ()), 1, "nvmlDeviceGetPcieReplayCounter")
    except (DeviceLost, Reinitialise) as failure:
        reading.values = {}
        reading.lost = True
        reading.problems.add(f"{device.key} health lost", f"GPU {device.busid}: {failure.cause}")
    return reading


def _memory_temperature(device: NvmlDevice, values: dict[Series, float], ask: Any) -> None:
    """NVML_FI_DEV_MEMORY_TEMP: a field value, with its own return code per field."""
    variant = "nvmlDeviceGetFieldValues memory temperature"
    if variant in device.unsupported or variant in device.missing:
        return
    found = ask(("", ()), 1, "nvmlDeviceGetFieldValues", [FIELD_MEMORY_TEMP], variant=variant)
    if found is None:
        return
    entry = found[0]
    if int(entry.nvmlReturn) == FIELD_NOT_SUPPORTED:
        device.unsupported.add(variant)
    elif int(entry.nvmlReturn) == 0:
        values[("atopgpud_gpu_memory_temperature_celsius", ())] = float(entry.value.uiVal)


def _clocks_event_reasons(device: NvmlDevice, values: dict[Series, float], ask: Any) -> None:
    """The reasons the clocks are held down now, one 0/1 series each; through the older
    name (ThrottleReasons) where the driver lacks the newer one."""
    reasons = None
    for function in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        try:
            reasons = device.call(function)
            break
        except Missing:
            continue
        except Unsupported:
            return
        except (DeviceLost, Reinitialise):
            raise
        except (Failed, NotFound):
            return
    if reasons is None:
        return
    for name, bit in CLOCKS_EVENT_REASONS:
        values[("atopgpud_gpu_clocks_event_active", (("reason", name),))] = 1 if int(reasons) & bit else 0


@dataclass
class XidEvents:
    """XID critical errors from one NVML event set, counted by card key and XID code."""

    counts: dict[tuple[str, int], int] = field(default_factory=dict)
    #: the cards that report XIDs (their keys), and whether any can
    supported: set[str] = field(default_factory=set)
    _set: Any = None
    _registered: dict[int, str] = field(default_factory=dict)
    _refused: set[str] = field(default_factory=set)
    _unavailable: bool = False

    def drain(self, nvml: Any, devices: list[NvmlDevice]) -> tuple[dict[tuple[str, int], int], set[str]]:
        """Register the cards not yet registered, take every event due, and return the
        counts and the cards that report XIDs."""
        if self._unavailable or not devices:
            return dict(self.counts), set(self.supported)
        try:
            if self._set is None:
                self._set = nvml.nvmlEventSetCreate()
                self._registered = {}
            self._register(nvml, devices)
            if self._registered:
                self._take(nvml)
        except nvml.NVMLError as error:
            if getattr(error, "value", None) in (FIELD_NOT_SUPPORTED, 13):
                self._unavailable = True
            self._set = None  # NVML set up again, or the set gone: a new one next time
        except Exception:
            self._unavailable = True  # a binding without events
        return dict(self.counts), set(self.supported)

    def _register(self, nvml: Any, devices: list[NvmlDevice]) -> None:
        for device in devices:
            pointer = _pointer(device.handle)
            if pointer in self._registered or device.key in self._refused:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(device.handle, EVENT_XID, self._set)
            except nvml.NVMLError as error:
                if getattr(error, "value", None) == FIELD_NOT_SUPPORTED:
                    self._refused.add(device.key)
                    continue
                raise
            self._registered[pointer] = device.key
            self.supported.add(device.key)

    def _take(self, nvml: Any) -> None:
        for _ in range(MAX_EVENTS):
            try:
                event = nvml.nvmlEventSetWait_v2(self._set, 0)
            except nvml.NVMLError as error:
                if getattr(error, "value", None) == TIMEOUT:
                    return
                raise
            key = self._registered.get(_pointer(event.device))
            if key is not None and int(event.eventType) & EVENT_XID:
                code = int(event.eventData)
                self.counts[(key, code)] = self.counts.get((key, code), 0) + 1


def _pointer(handle: Any) -> int:
    """A device handle's pointer value, to tell which card an event is of."""
    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
