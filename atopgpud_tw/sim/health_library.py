"""The simulated libnvidia-ml's health and event functions (a part of `SimulatedLibrary`).

Each C function asks the driver model (sim/health_model.py) and writes its
answer through the caller's pointers, as `library.py` does for the rest.
``nvmlDeviceGetFieldValues`` answers per field in each entry's ``nvmlReturn``
(the call itself succeeds); the simulator knows ``NVML_FI_DEV_MEMORY_TEMP``
only, and any other field id is NOT_SUPPORTED.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

from atopgpud_tw.sim.health_model import FIELD_MEMORY_TEMP, NOT_SUPPORTED
from atopgpud_tw.sim.nvml import Handle, NVMLError

SUCCESS = 0
INVALID_ARGUMENT = 2
_int = ctypes.c_int
_uint = ctypes.c_uint
_ull = ctypes.c_ulonglong
_ptr = ctypes.c_void_p
#: nvmlValueType_t NVML_VALUE_TYPE_UNSIGNED_INT
VALUE_UNSIGNED_INT = 1
_EVENT_SET_BASE = 0x5200_0000


def _at(address: int, ctype: Any) -> Any:
    """The C value of type `ctype` at `address` (not NULL), read and written as ``[0]``."""
    return (ctype * 1).from_address(address)


def health_table(library: Any) -> dict[str, tuple[Any, tuple[Any, ...], Callable[..., int]]]:
    """The C symbols of the health figures and events, for `SimulatedLibrary._table`."""
    h = _ptr

    def out_uint(method: str) -> Callable[..., int]:
        def answer(device: int | None, *args: Any) -> int:
            *values, out = args
            result = library._call(method, library.model_handle(device), *values)
            if not out:
                return INVALID_ARGUMENT
            _at(out, _uint)[0] = int(result)
            return SUCCESS

        return answer

    def out_ull(method: str) -> Callable[..., int]:
        def answer(device: int | None, *args: Any) -> int:
            *values, out = args
            result = library._call(method, library.model_handle(device), *values)
            if not out:
                return INVALID_ARGUMENT
            _at(out, _ull)[0] = int(result)
            return SUCCESS

        return answer

    def remapped(device: int | None, *outs: int | None) -> int:
        values = library._call("nvmlDeviceGetRemappedRows", library.model_handle(device))
        if not all(outs):
            return INVALID_ARGUMENT
        for out, value in zip(outs, values):
            _at(out, _uint)[0] = int(value)  # type: ignore[arg-type]  # checked not NULL above
        return SUCCESS

    def field_values(device: int | None, count: int, buffer: int | None) -> int:
        handle = library.model_handle(device)
        if not buffer or count < 0:
            return INVALID_ARGUMENT
        array = ctypes.cast(buffer, ctypes.POINTER(library._b.c_nvmlFieldValue_t))
        for index in range(count):
            entry = array[index]
            entry.valueType = VALUE_UNSIGNED_INT
            if entry.fieldId != FIELD_MEMORY_TEMP:
                entry.nvmlReturn = NOT_SUPPORTED
                continue
            try:
                entry.value.uiVal = library._call("memory_temperature", handle)
            except NVMLError as error:
                if error.value != NOT_SUPPORTED:
                    raise  # a fault of the call: the whole call fails
                entry.nvmlReturn = NOT_SUPPORTED
            else:
                entry.nvmlReturn = SUCCESS
        return SUCCESS

    def event_set_create(out: int | None) -> int:
        ident = library._call("nvmlEventSetCreate")
        if not out:
            return INVALID_ARGUMENT
        _at(out, _ptr)[0] = _EVENT_SET_BASE + ident
        return SUCCESS

    def register(device: int | None, types: int, event_set: int | None) -> int:
        library._call("nvmlDeviceRegisterEvents", library.model_handle(device), types, _set_id(event_set))
        return SUCCESS

    def wait(event_set: int | None, out: int | None, timeout_ms: int) -> int:
        gpu, kind, data = library._call("nvmlEventSetWait", _set_id(event_set), timeout_ms)
        if not out:
            return INVALID_ARGUMENT
        target = ctypes.cast(out, ctypes.POINTER(library._b.c_nvmlEventData_t))[0]
        target.device = ctypes.cast(library.handle_id(Handle(gpu)), library._b.c_nvmlDevice_t)
        target.eventType, target.eventData = kind, data
        target.gpuInstanceId = target.computeInstanceId = 0xFFFFFFFF
        return SUCCESS

    def free(event_set: int | None) -> int:
        library._call("nvmlEventSetFree", _set_id(event_set))
        return SUCCESS

    return {
        "nvmlDeviceGetTemperature": (_int, (h, _uint, _ptr), out_uint("nvmlDeviceGetTemperature")),
        "nvmlDeviceGetFieldValues": (_int, (h, ctypes.c_int32, _ptr), field_values),
        "nvmlDeviceGetPowerUsage": (_int, (h, _ptr), out_uint("nvmlDeviceGetPowerUsage")),
        "nvmlDeviceGetEnforcedPowerLimit": (_int, (h, _ptr), out_uint("nvmlDeviceGetEnforcedPowerLimit")),
        "nvmlDeviceGetTotalEnergyConsumption": (_int, (h, _ptr), out_ull("nvmlDeviceGetTotalEnergyConsumption")),
        "nvmlDeviceGetClockInfo": (_int, (h, _uint, _ptr), out_uint("nvmlDeviceGetClockInfo")),
        "nvmlDeviceGetCurrentClocksEventReasons": (
            _int, (h, _ptr), out_ull("nvmlDeviceGetCurrentClocksEventReasons")),
        "nvmlDeviceGetCurrentClocksThrottleReasons": (
            _int, (h, _ptr), out_ull("nvmlDeviceGetCurrentClocksThrottleReasons")),
        "nvmlDeviceGetPerformanceState": (_int, (h, _ptr), out_uint("nvmlDeviceGetPerformanceState")),
        "nvmlDeviceGetFanSpeed": (_int, (h, _ptr), out_uint("nvmlDeviceGetFanSpeed")),
        "nvmlDeviceGetTotalEccErrors": (_int, (h, _uint, _uint, _ptr), out_ull("nvmlDeviceGetTotalEccErrors")),
        "nvmlDeviceGetRemappedRows": (_int, (h, _ptr, _ptr, _ptr, _ptr), remapped),
        "nvmlDeviceGetPcieReplayCounter": (_int, (h, _ptr), out_uint("nvmlDeviceGetPcieReplayCounter")),
        "nvmlEventSetCreate": (_int, (_ptr,), event_set_create),
        "nvmlDeviceRegisterEvents": (_int, (h, _ull, _ptr), register),
        "nvmlDeviceGetSupportedEventTypes": (_int, (h, _ptr), out_ull("nvmlDeviceGetSupportedEventTypes")),
        "nvmlEventSetWait_v2": (_int, (_ptr, _ptr, _uint), wait),
        "nvmlEventSetFree": (_int, (_ptr,), free),
    }


def _set_id(event_set: int | None) -> int:
    """The model's event set behind the pointer value the library gave out."""
    value = event_set or 0
    if value <= _EVENT_SET_BASE:
        raise NVMLError(INVALID_ARGUMENT)
    return value - _EVENT_SET_BASE
