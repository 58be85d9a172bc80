"""A simulated libnvidia-ml: C functions beneath the real `pynvml` module (docs/simulator.md).

`SimulatedLibrary` takes the place of the binding's ``nvmlLib``: each attribute is a real ctypes
function pointer, so the binding's own wrappers run unchanged, as on a real driver; each asks the
driver model (`nvml.SimulatedNvml`) and writes its answer into the caller's structures, playing
what the binding depends on: size queries, growing lists, NUL-terminated strings, absent symbols,
replies it fails on.  No Python exception leaves a callback (ctypes would print it and return 0):
one returns NVML_ERROR_UNKNOWN and is kept in `errors`.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import Counter
from types import ModuleType
from typing import Any, Callable, Sequence

from atopgpud_tw.nvml_codes import (
    ARGUMENT_VERSION_MISMATCH,
    FUNCTION_NOT_FOUND,
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    NAMES,
    NO_INSTANCE,
    NOT_SUPPORTED,
    SUCCESS,
    UNKNOWN,
    VALUE_NOT_AVAILABLE,
)
from atopgpud_tw.sim.answers import NvmlFault, ProcessSample, RunningProcess, SymbolMismatch
from atopgpud_tw.sim.library_symbols import LIBRARY_SYMBOLS
from atopgpud_tw.sim.nvml import ENGINES, PLAIN, Handle, SimulatedNvml

_int, _uint, _ull, _ptr = ctypes.c_int, ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_void_p
#: pids of the processes a list gains between its size query and its fill
GROWN_PID = 4_000_000
#: what a reply the binding cannot decode looks like: not UTF-8
NOT_UTF8 = b"\xff\xfesimulated reply that is not UTF-8"
#: where the opaque pointers the library gives out start: device handles, event sets, GPM samples
_HANDLE_BASE, _HANDLE_STEP = 0x5100_0000, 0x40
_EVENT_SET_BASE = 0x5200_0000
_SAMPLE_BASE, _SAMPLE_STEP = 0x5300_0000, 0x100
#: the one-number calls of the figures table (`PLAIN`) whose C output is 64 bits wide (a count of
#: errors, a mask of reasons); the others write 32 bits
WIDE = frozenset({"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetCurrentClocksEventReasons",
                  "nvmlDeviceGetCurrentClocksThrottleReasons"})
#: nvmlValueType_t -> the member of c_nvmlValue_t written
VALUE_MEMBERS = {1: "uiVal", 3: "ullVal"}
#: a pending reply the binding's conversion code will fail on (fault RuntimeError)
_CORRUPT = object()


class SimulatedLibrary:
    """libnvidia-ml over a driver model, installed as `binding`'s ``nvmlLib`` (whose structure
    types the callbacks fill); `calls` counts the C calls by symbol."""

    def __init__(self, model: SimulatedNvml, binding: ModuleType) -> None:
        self.model = model
        self.calls: Counter[str] = Counter()
        #: unexpected exceptions met inside callbacks (each returned NVML_ERROR_UNKNOWN)
        self.errors: list[str] = []
        self._b = binding
        self._lock = threading.Lock()
        self._handles: dict[int, Handle] = {}
        self._ids: dict[Handle, int] = {}
        self._pending: dict[tuple[Any, ...], Any] = {}
        self._strings: dict[int, ctypes.Array[ctypes.c_char]] = {}
        absent = model.scenario.absent_symbols
        for symbol, (argtypes, function) in self._table().items():
            if symbol not in absent:
                restype = _ptr if symbol == "nvmlErrorString" else _int
                setattr(self, symbol, self._export(symbol, restype, argtypes, function))
        self.symbols = frozenset(s for s in LIBRARY_SYMBOLS if s not in absent)

    # -- handles --

    def handle_id(self, handle: Handle) -> int:
        """The opaque pointer value a model handle is given out as."""
        with self._lock:
            ident = self._ids.get(handle)
            if ident is None:
                ident = _HANDLE_BASE + len(self._ids) * _HANDLE_STEP
                self._ids[handle] = ident
                self._handles[ident] = handle
            return ident

    def model_handle(self, device: Any) -> Handle:
        """The model's `Handle` behind a handle the binding holds (a ``c_nvmlDevice_t``) or its value."""
        value = device if isinstance(device, int) else ctypes.cast(device, _ptr).value
        handle = self._handles.get(value or 0)
        if handle is None:
            raise NvmlFault(INVALID_ARGUMENT)
        return handle

    # -- plumbing --

    def _export(self, symbol: str, restype: Any, argtypes: Sequence[Any], function: Callable[..., int]) -> Any:
        def callback(*args: Any) -> Any:
            try:
                self.calls[symbol] += 1
                return function(*args)
            except NvmlFault as fault:
                return fault.code
            except SymbolMismatch:
                return FUNCTION_NOT_FOUND
            except BaseException as error:  # noqa: BLE001 - nothing may leave a C callback
                self.errors.append(f"{symbol}: {type(error).__name__}: {error}")
                return UNKNOWN

        return ctypes.CFUNCTYPE(restype, *argtypes)(callback)

    def _call(self, method: str, *args: Any) -> Any:
        """One model call, looked up at call time (tests may wrap the model's methods)."""
        return getattr(self.model, method)(*args)

    def _grown(self, device: int | None, symbol: str, which: str) -> int:
        """How many entries the list `which` gains before this size query's fill."""
        handle = self.model_handle(device)
        count = self.model.scenario.gpus[handle.gpu].grow_between_calls.get(which, 0)
        return int(self.model._next((handle.gpu, "grow", symbol), count) or 0)

    # -- the library --

    def _table(self) -> dict[str, tuple[tuple[Any, ...], Callable[..., int]]]:
        """Each C symbol's argument types and function (each returns an int, but nvmlErrorString)."""
        h, out, done, handle = _ptr, self.out, self.done, self.model_handle
        table: dict[str, tuple[tuple[Any, ...], Callable[..., int]]] = {
            "nvmlInit_v2": ((), done("nvmlInit")),
            "nvmlInitWithFlags": ((_uint,), done("nvmlInit")),  # no flag changes what the simulator plays
            "nvmlShutdown": ((), done("nvmlShutdown")),
            "nvmlErrorString": ((_int,), self._error_string),
            "nvmlSystemGetDriverVersion": ((_ptr, _uint), self._text("nvmlSystemGetDriverVersion")),
            "nvmlDeviceGetCount_v2": ((_ptr,), out("nvmlDeviceGetCount", _uint, False)),
            "nvmlDeviceGetHandleByIndex_v2": (
                (_uint, _ptr), out("nvmlDeviceGetHandleByIndex", _ptr, False, write=self.handle_id)),
            "nvmlDeviceGetPciInfo_v3": ((h, _ptr), self._pci_info),
            "nvmlDeviceGetMemoryInfo": ((h, _ptr), self._memory_v1),
            "nvmlDeviceGetMemoryInfo_v2": ((h, _ptr), self._memory_v2),
            "nvmlDeviceGetUtilizationRates": ((h, _ptr), self._rates),
            "nvmlDeviceGetSamples": ((h, _uint, _ull, _ptr, _ptr, _ptr), self._samples),
            "nvmlDeviceGetProcessUtilization": ((h, _ptr, _ptr, _ull), self._process_utilization),
            "nvmlDeviceGetMigMode": ((h, _ptr, _ptr), out("nvmlDeviceGetMigMode", _uint, outs=2)),
            "nvmlDeviceGetMigDeviceHandleByIndex": (
                (h, _uint, _ptr), out("nvmlDeviceGetMigDeviceHandleByIndex", _ptr, write=self.handle_id)),
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": (
                (h, _ptr), out("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", _ptr, write=self.handle_id)),
            "nvmlDeviceGetFieldValues": ((h, ctypes.c_int32, _ptr), self._field_values),
            "nvmlDeviceGetRemappedRows": ((h, _ptr, _ptr, _ptr, _ptr), out("nvmlDeviceGetRemappedRows", _uint, outs=4)),
            # c_nvmlViolationTime_t: referenceTime, then violationTime
            "nvmlDeviceGetViolationStatus": (
                (h, _uint, _ptr), out("nvmlDeviceGetViolationStatus", _ull * 2, write=lambda two: (_ull * 2)(*two))),
            "nvmlEventSetCreate": (
                (_ptr,), out("nvmlEventSetCreate", _ptr, False, write=lambda ident: _EVENT_SET_BASE + ident)),
            "nvmlDeviceRegisterEvents": ((h, _ull, _ptr), done("nvmlDeviceRegisterEvents", handle, int, _set_id)),
            "nvmlEventSetWait_v2": ((_ptr, _ptr, _uint), self._event_wait),
            "nvmlEventSetFree": ((_ptr,), done("nvmlEventSetFree", _set_id)),
            "nvmlGpmQueryDeviceSupport": ((h, _ptr), self._gpm_support),
            "nvmlGpmSampleAlloc": ((_ptr,), self._gpm_alloc),
            "nvmlGpmSampleFree": ((_ptr,), done("gpm_free", _sample_id)),
            "nvmlGpmSampleGet": ((h, _ptr), done("nvmlGpmSampleGet", handle, _sample_id)),
            "nvmlGpmMigSampleGet": ((h, _uint, _ptr), done("nvmlGpmMigSampleGet", handle, int, _sample_id)),
            "nvmlGpmMetricsGet": ((_ptr,), self._gpm_metrics),
        }
        for symbol in ("nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetSerial", "nvmlDeviceGetVbiosVersion"):
            table[symbol] = ((h, _ptr, _uint), self._text(symbol))
        for symbol in ("nvmlSystemGetCudaDriverVersion", "nvmlSystemGetCudaDriverVersion_v2"):
            table[symbol] = ((_ptr,), out("cuda_version", _int, False, symbol))
        for kind in ("Compute", "Graphics"):
            for version in ("_v3", "_v2"):
                symbol = f"nvmlDeviceGet{kind}RunningProcesses{version}"
                table[symbol] = ((h, _ptr, _ptr), self._processes(symbol, f"nvmlDeviceGet{kind}RunningProcesses"))
        # the calls that answer one number: (symbol, its arguments after the handle, what it writes)
        for symbol, args, ctype in (
            ("nvmlDeviceGetMaxMigDeviceCount", (), _uint),
            ("nvmlDeviceIsMigDeviceHandle", (), _uint),
            ("nvmlDeviceGetGpuInstanceId", (), _uint),
            ("nvmlDeviceGetComputeInstanceId", (), _uint),
            ("nvmlDeviceGetTotalEnergyConsumption", (), _ull),
            ("nvmlDeviceGetSupportedEventTypes", (), _ull),
            ("nvmlDeviceGetNvLinkState", (_uint,), _uint),
            ("nvmlDeviceGetNvLinkErrorCounter", (_uint, _uint), _ull),
        ):
            table[symbol] = ((h, *args, _ptr), out(symbol, ctype))
        for function in ENGINES:
            # (percent, sampling period in µs)
            table[function] = ((h, _ptr, _ptr), out("engine_utilization", _uint, True, function, outs=2))
        for function, rows in PLAIN.items():
            if function not in table:
                ctype = _ull if function in WIDE else _uint
                table[function] = ((h, *[_uint] * len(next(iter(rows))), _ptr), out("plain", ctype, True, function))
        assert set(table) == set(LIBRARY_SYMBOLS), set(table) ^ set(LIBRARY_SYMBOLS)
        assert WIDE <= set(PLAIN), WIDE - set(PLAIN)
        return table

    def done(self, method: str, *convert: Callable[[Any], Any]) -> Callable[..., int]:
        """A C function that only calls the model's `method`, with its arguments each passed through
        `convert` (those past them left out)."""

        def call(*args: Any) -> int:
            self._call(method, *(f(arg) for f, arg in zip(convert, args)))
            return SUCCESS

        return call

    def out(self, method: str, ctype: Any, device: bool = True, *lead: Any,
            write: Callable[[Any], Any] = int, outs: int = 1) -> Callable[..., int]:
        """A C function that writes the model's answer through its last argument (a `ctype`; the
        last `outs`, one part of the answer each): its `method` asked with `lead` and the other
        arguments, the first a device handle if `device`."""

        def answer(*args: Any) -> int:
            values, targets = list(args[:-outs]), args[-outs:]
            if device:
                values[0] = self.model_handle(values[0])
            result = self._call(method, *lead, *values)
            if not all(targets):
                return INVALID_ARGUMENT
            for target, part in zip(targets, result if outs > 1 else (result,)):
                _at(target, ctype)[0] = write(part)
            return SUCCESS

        return answer

    def _gpm_alloc(self, target: int | None) -> int:
        """nvmlGpmSampleAlloc: the argument checked before the model allocates (`out` asks the model
        first), so that a NULL one leaves no buffer that nothing can free."""
        if not target:
            return INVALID_ARGUMENT
        _at(target, _ptr)[0] = _SAMPLE_BASE + self._call("gpm_alloc") * _SAMPLE_STEP
        return SUCCESS

    def _error_string(self, code: int) -> int:
        """A static string, as the C library returns (the binding sets restype c_char_p)."""
        with self._lock:
            text = self._strings.get(code)
            if text is None:
                # its name as words ("Not Supported")
                words = "Success" if code == SUCCESS else NAMES.get(code, "UNKNOWN_ERROR").replace("_", " ").title()
                text = self._strings[code] = ctypes.create_string_buffer(words.encode("ascii"))
        return ctypes.addressof(text)

    def _text(self, method: str) -> Callable[..., int]:
        def text(*args: Any) -> int:
            *device, buffer, length = args  # no device: the driver version
            try:
                value = self._call(method, *map(self.model_handle, device))
            except RuntimeError:
                value = NOT_UTF8
            data = value if isinstance(value, bytes) else str(value).encode("utf-8")
            if not buffer:
                return INVALID_ARGUMENT
            if len(data) + 1 > length:
                return INSUFFICIENT_SIZE
            ctypes.memmove(buffer, data + b"\0", len(data) + 1)
            return SUCCESS

        return text

    def _array(self, out: int | None, name: str) -> Any:
        """The caller's memory at `out` as an array of the binding's structure `name`, to write as C does."""
        return ctypes.cast(out, _raw(getattr(self._b, name)))  # type: ignore[arg-type]  # NULL only when unused

    def _struct(self, out: int | None, name: str, version: str | None = None) -> Any:
        """The caller's structure `name` at `out`; with `version`, checked to be of the binding's."""
        if not out:
            raise NvmlFault(INVALID_ARGUMENT)
        target = self._array(out, name)[0]
        if version is not None and target.version != getattr(self._b, version):
            raise NvmlFault(ARGUMENT_VERSION_MISMATCH)
        return target

    def _pci_info(self, device: int | None, out: int | None) -> int:
        info = self._call("nvmlDeviceGetPciInfo", self.model_handle(device))
        target = self._struct(out, "nvmlPciInfo_t")
        bus_id = info.busId if isinstance(info.busId, bytes) else str(info.busId).encode("ascii")
        target.busId = bus_id[:31]
        target.busIdLegacy = info.busIdLegacy[:15]
        try:
            domain, bus, rest = bus_id.decode("ascii").split(":")
            target.domain, target.bus, target.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
        except ValueError:
            pass  # a bus id not in the usual form: the numbers stay 0
        return SUCCESS

    def _memory_v1(self, device: int | None, out: int | None) -> int:
        memory = self._call("nvmlDeviceGetMemoryInfo", self.model_handle(device))
        target = self._struct(out, "c_nvmlMemory_t")
        target.total, target.used, target.free = int(memory.total), int(memory.used), int(memory.free)
        return SUCCESS

    def _memory_v2(self, device: int | None, out: int | None) -> int:
        target = self._struct(out, "c_nvmlMemory_v2_t", "nvmlMemory_v2")
        memory = self._call("nvmlDeviceGetMemoryInfo", self.model_handle(device), target.version)
        target.total, target.reserved = int(memory.total), int(memory.reserved)
        target.used, target.free = int(memory.used), int(memory.free)
        return SUCCESS

    def _rates(self, device: int | None, out: int | None) -> int:
        rates = self._call("nvmlDeviceGetUtilizationRates", self.model_handle(device))
        target = self._struct(out, "c_nvmlUtilization_t")
        target.gpu, target.memory = int(rates.gpu), int(rates.memory)
        return SUCCESS

    # -- health, events, GPM --

    def _field_values(self, device: int | None, count: int, buffer: int | None) -> int:
        """Each entry answered in its own ``nvmlReturn``; the call succeeds."""
        handle = self.model_handle(device)
        if not buffer or count < 0:
            return INVALID_ARGUMENT
        array = self._array(buffer, "c_nvmlFieldValue_t")
        for index in range(count):
            entry = array[index]
            entry.valueType = 1
            try:
                kind, value = self._call("field_value", handle, int(entry.fieldId), int(entry.scopeId))
            except NvmlFault as error:
                if error.code != NOT_SUPPORTED:
                    raise  # a fault of the call: the whole call fails
                entry.nvmlReturn = NOT_SUPPORTED
            else:
                entry.valueType, entry.nvmlReturn = kind, SUCCESS
                setattr(entry.value, VALUE_MEMBERS[kind], value)
        return SUCCESS

    def _event_wait(self, event_set: int | None, out: int | None, timeout_ms: int) -> int:
        gpu, kind, data = self._call("nvmlEventSetWait", _set_id(event_set), timeout_ms)
        target = self._struct(out, "c_nvmlEventData_t")
        target.device = ctypes.cast(self.handle_id(Handle(gpu)), self._b.c_nvmlDevice_t)
        target.eventType, target.eventData = kind, data
        target.gpuInstanceId = target.computeInstanceId = NO_INSTANCE
        return SUCCESS

    def _gpm_support(self, device: int | None, out: int | None) -> int:
        handle = self.model_handle(device)
        target = self._struct(out, "c_nvmlGpmSupport_t", "NVML_GPM_SUPPORT_VERSION")
        target.isSupportedDevice = int(self._call("nvmlGpmQueryDeviceSupport", handle))
        return SUCCESS

    def _gpm_metrics(self, out: int | None) -> int:
        """Each metric asked answered in its entry, between the request's two samples."""
        target = self._struct(out, "c_nvmlGpmMetricsGet_t", "NVML_GPM_METRICS_GET_VERSION")
        count = int(target.numMetrics)
        if count > self._b.NVML_GPM_METRIC_MAX:
            return INVALID_ARGUMENT
        first, second = (_sample_id(ctypes.cast(pointer, _ptr).value) for pointer in (target.sample1, target.sample2))
        entries = [target.metrics[i] for i in range(count)]
        answers = self._call("gpm_metrics", first, second, [int(e.metricId) for e in entries])
        for entry, (code, value) in zip(entries, answers):
            entry.nvmlReturn, entry.value = code, value
        return SUCCESS

    # -- lists: a size query with a NULL buffer, then the fill --

    def _list_call(self, symbol: str, device: int | None, count_out: int | None, *outs: int | None
                   ) -> tuple[Handle, Any, tuple[Any, ...]]:
        """A list call's handle, the caller's count (read and written) and the key of what a size query keeps."""
        handle = self.model_handle(device)
        if not (count_out and all(outs)):
            raise NvmlFault(INVALID_ARGUMENT)
        return handle, _at(count_out, _uint), (symbol, device, threading.get_ident())

    def _fill(self, items: list[Any], count: Any, buffer: int | None, struct: str, write: Callable[[Any, Any], None],
              key: tuple[Any, ...], grow: Callable[[list[Any]], Any]) -> int:
        """Write `items` into the caller's array of `count` entries, or say how many are
        needed: then what the next call fills is kept, `grow`n as the scenario says (a list
        that grows between the answer that sized the caller's array and the fill)."""
        if len(items) > count[0]:
            count[0] = len(items)
            self._pending[key] = grow(items)
            return INSUFFICIENT_SIZE
        # NULL only with nothing to write (no items, or a count of them that fits)
        array = self._array(buffer, struct)
        for index, item in enumerate(items):
            write(array[index], item)
        count[0] = len(items)
        return SUCCESS

    def _processes(self, symbol: str, method: str) -> Callable[..., int]:
        def processes(device: int | None, count_out: int | None, buffer: int | None) -> int:
            handle, count, key = self._list_call(symbol, device, count_out)

            def ask() -> Any:
                try:
                    return list(self._call(method, handle))
                except RuntimeError:
                    return _CORRUPT

            def grow(listed: list[Any]) -> list[Any]:
                return listed + [_grown_process(i) for i in range(self._grown(device, symbol, "process_lists"))]

            if not buffer:
                listed = ask()
                self._pending[key] = listed if listed is _CORRUPT else grow(listed)
                count[0] = 1 if listed is _CORRUPT else len(listed)
                return INSUFFICIENT_SIZE if listed else SUCCESS
            pending = self._pending.pop(key, None)
            pending = ask() if pending is None else pending
            if pending is _CORRUPT:
                count[0] = count[0] + 1  # more than the buffer holds: the caller's copy loop fails
                return SUCCESS
            return self._fill(pending, count, buffer, f"c_nvmlProcessInfo{symbol[-3:]}_t", _write_process, key, grow)

        return processes

    def _process_utilization(self, device: int | None, buffer: int | None, count_out: int | None, since: int) -> int:
        symbol = "nvmlDeviceGetProcessUtilization"
        handle, count, key = self._list_call(symbol, device, count_out)
        capacity = self.model.scenario.gpus[handle.gpu].process_list_capacity

        def ask() -> list[Any]:
            samples = list(self._call(symbol, handle, since))
            # the driver keeps that many entries at most: the newest
            return samples if capacity is None else sorted(samples, key=lambda s: int(s.timeStamp))[-capacity:]

        def grow(items: list[Any]) -> list[Any]:
            newest = max((int(s.timeStamp) for s in items), default=0)
            return items + [_grown_sample(i, newest) for i in range(self._grown(device, symbol, "process_utilization"))]

        if not buffer:
            samples = ask()
            self._pending[key] = grow(samples)
            # some drivers answer the size query with their buffer's capacity, not the count
            count[0] = capacity if capacity is not None else len(samples)
            return INSUFFICIENT_SIZE
        items = self._pending.pop(key, None)
        items = ask() if items is None else items
        return self._fill(items, count, buffer, "c_nvmlProcessUtilizationSample_t", _write_process_sample, key, grow)

    def _samples(self, device: int | None, kind: int, since: int, value_type: int | None, count_out: int | None,
                 buffer: int | None) -> int:
        symbol = "nvmlDeviceGetSamples"
        handle, count, key = self._list_call(symbol, device, count_out, value_type)
        pending = None if not buffer else self._pending.pop(key, None)
        kind_out, items = pending if pending is not None else self._call(symbol, handle, kind, since)
        _at(value_type, _int)[0] = int(kind_out)
        items = list(items)

        def grow(items: list[Any]) -> tuple[int, list[Any]]:
            return kind_out, items + items[-1:] * self._grown(device, symbol, "samples")

        if not buffer:
            self._pending[key] = grow(items)
            count[0] = len(items)
            return SUCCESS
        return self._fill(items, count, buffer, "c_nvmlSample_t", _write_sample, key, grow)


@functools.cache
def _raw(struct: type) -> Any:
    """A pointer to the layout of `struct` without pynvml's attribute hooks (which only convert
    str and bytes): the library writes the caller's memory as plain C fields, at C speed."""
    plain = type(
        struct.__name__, (struct,), {"__setattr__": object.__setattr__, "__getattribute__": object.__getattribute__}
    )
    assert ctypes.sizeof(plain) == ctypes.sizeof(struct)
    return ctypes.POINTER(plain)


def _grown_process(index: int) -> RunningProcess:
    """A process that started between a list's size query and its fill."""
    return RunningProcess(GROWN_PID + index, 0)


def _grown_sample(index: int, stamp: int) -> ProcessSample:
    """An idle sample of such a process."""
    return ProcessSample(GROWN_PID + index, stamp, 0, 0)


def _write_process(target: Any, proc: Any) -> None:
    memory = proc.usedGpuMemory
    target.pid = int(proc.pid)
    target.usedGpuMemory = VALUE_NOT_AVAILABLE if memory is None else int(memory)
    target.gpuInstanceId = int(proc.gpuInstanceId)
    target.computeInstanceId = int(proc.computeInstanceId)


def _write_process_sample(target: Any, sample: Any) -> None:
    target.pid, target.timeStamp = int(sample.pid), int(sample.timeStamp)
    target.smUtil, target.memUtil = int(sample.smUtil), int(sample.memUtil)
    target.encUtil, target.decUtil = int(sample.encUtil), int(sample.decUtil)


def _write_sample(target: Any, sample: Any) -> None:
    target.timeStamp = int(sample.timeStamp)
    target.sampleValue.uiVal = int(sample.value)


def _at(address: int | None, ctype: Any) -> Any:
    """The C value of type `ctype` at `address` (checked not NULL), read and written as ``[0]``."""
    return (ctype * 1).from_address(address)


def _ident(pointer: int | None, base: int, step: int = 1) -> int:
    """The model's id behind an opaque pointer value the library gave out (`base` + id * `step`)."""
    value = pointer or 0
    if value <= base or (value - base) % step:
        raise NvmlFault(INVALID_ARGUMENT)
    return (value - base) // step


#: the model's event set, or GPM sample buffer, behind a pointer value the library gave out
_set_id = functools.partial(_ident, base=_EVENT_SET_BASE)
_sample_id = functools.partial(_ident, base=_SAMPLE_BASE, step=_SAMPLE_STEP)
