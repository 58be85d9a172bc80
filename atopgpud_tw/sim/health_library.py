"""The simulated libnvidia-ml's health and event functions (a part of `SimulatedLibrary`).

``nvmlDeviceGetFieldValues`` answers per field in each entry's ``nvmlReturn``; the call succeeds.
"""

from __future__ import annotations

import ctypes
from functools import partial
from typing import Any, Callable

from atopgpud_tw.nvml_codes import INVALID_ARGUMENT, NO_INSTANCE, NOT_SUPPORTED, SUCCESS
from atopgpud_tw.sim.answers import NvmlFault
from atopgpud_tw.sim.health_model import ENGINES, PLAIN
from atopgpud_tw.sim.nvml import Handle

_int = ctypes.c_int
_uint = ctypes.c_uint
_ull = ctypes.c_ulonglong
_ptr = ctypes.c_void_p
#: nvmlValueType_t -> the member of c_nvmlValue_t written
VALUE_MEMBERS = {1: "uiVal", 3: "ullVal"}
_EVENT_SET_BASE = 0x5200_0000


def _at(address: int | None, ctype: Any) -> Any:
    """The C value of type `ctype` at `address` (checked not NULL), read and written as ``[0]``."""
    return (ctype * 1).from_address(address)


def health_table(library: Any) -> dict[str, tuple[Any, tuple[Any, ...], Callable[..., int]]]:
    """The C symbols of the health figures and events, for `SimulatedLibrary._table`."""
    h = _ptr

    def field_values(device: int | None, count: int, buffer: int | None) -> int:
        handle = library.model_handle(device)
        if not buffer or count < 0:
            return INVALID_ARGUMENT
        array = ctypes.cast(buffer, ctypes.POINTER(library._b.c_nvmlFieldValue_t))
        for index in range(count):
            entry = array[index]
            entry.valueType = 1
            try:
                kind, value = library._call("field_value", handle, int(entry.fieldId), int(entry.scopeId))
            except NvmlFault as error:
                if error.code != NOT_SUPPORTED:
                    raise  # a fault of the call: the whole call fails
                entry.nvmlReturn = NOT_SUPPORTED
            else:
                entry.valueType = kind
                setattr(entry.value, VALUE_MEMBERS[kind], value)
                entry.nvmlReturn = SUCCESS
        return SUCCESS

    def violation(device: int | None, policy: int, out: int | None) -> int:
        reference, held = library._call("nvmlDeviceGetViolationStatus", library.model_handle(device), policy)
        if not out:
            return INVALID_ARGUMENT
        _at(out, _ull)[0] = int(reference)  # c_nvmlViolationTime_t: referenceTime, then violationTime
        _at(out + ctypes.sizeof(_ull), _ull)[0] = int(held)
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
        target.gpuInstanceId = target.computeInstanceId = NO_INSTANCE
        return SUCCESS

    def free(event_set: int | None) -> int:
        library._call("nvmlEventSetFree", _set_id(event_set))
        return SUCCESS

    table: dict[str, tuple[Any, tuple[Any, ...], Callable[..., int]]] = {
        "nvmlDeviceGetFieldValues": (_int, (h, ctypes.c_int32, _ptr), field_values),
        "nvmlDeviceGetRemappedRows": (
            _int, (h, _ptr, _ptr, _ptr, _ptr), library.out("nvmlDeviceGetRemappedRows", _uint, outs=4)),
        "nvmlEventSetCreate": (
            _int, (_ptr,), library.out("nvmlEventSetCreate", _ptr, False, write=lambda ident: _EVENT_SET_BASE + ident)),
        "nvmlDeviceRegisterEvents": (_int, (h, _ull, _ptr), register),
        "nvmlEventSetWait_v2": (_int, (_ptr, _ptr, _uint), wait),
        "nvmlEventSetFree": (_int, (_ptr,), free),
        "nvmlDeviceGetViolationStatus": (_int, (h, _uint, _ptr), violation),
    }
    # the calls that answer one number: (symbol, its arguments after the handle, what it writes)
    for symbol, args, ctype in (
        ("nvmlDeviceGetTemperature", (_uint,), _uint),
        ("nvmlDeviceGetTotalEnergyConsumption", (), _ull),
        ("nvmlDeviceGetCurrentClocksEventReasons", (), _ull),
        ("nvmlDeviceGetCurrentClocksThrottleReasons", (), _ull),
        ("nvmlDeviceGetPerformanceState", (), _uint),
        ("nvmlDeviceGetTotalEccErrors", (_uint, _uint), _ull),
        ("nvmlDeviceGetSupportedEventTypes", (), _ull),
        ("nvmlDeviceGetNvLinkState", (_uint,), _uint),
        ("nvmlDeviceGetNvLinkErrorCounter", (_uint, _uint), _ull),
    ):
        table[symbol] = (_int, (h, *args, _ptr), library.out(symbol, ctype))
    for function in ENGINES:
        # (percent, sampling period in µs)
        table[function] = (_int, (h, _ptr, _ptr), library.out("engine_utilization", _uint, True, function, outs=2))
    for function, rows in PLAIN.items():
        if function not in table:
            arity = len(next(iter(rows)))
            table[function] = (_int, (h, *[_uint] * arity, _ptr), library.out("plain", _uint, True, function))
    return table


def _ident(pointer: int | None, base: int, step: int = 1) -> int:
    """The model's id behind an opaque pointer value the library gave out (`base` + id * `step`)."""
    value = pointer or 0
    if value <= base or (value - base) % step:
        raise NvmlFault(INVALID_ARGUMENT)
    return (value - base) // step


#: the model's event set behind the pointer value the library gave out
_set_id = partial(_ident, base=_EVENT_SET_BASE)
