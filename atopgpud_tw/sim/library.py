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
    SUCCESS,
    UNKNOWN,
    VALUE_NOT_AVAILABLE,
)
from atopgpud_tw.sim.answers import NvmlFault, ProcessSample, RunningProcess, SymbolMismatch
from atopgpud_tw.sim.gpm_library import gpm_table
from atopgpud_tw.sim.health_library import _at, _int, _ptr, _uint, _ull, health_table  # the C types, named once
from atopgpud_tw.sim.library_symbols import LIBRARY_SYMBOLS
from atopgpud_tw.sim.nvml import Handle, SimulatedNvml

#: pids of the processes a list gains between its size query and its fill
GROWN_PID = 4_000_000
#: what a reply the binding cannot decode looks like: not UTF-8
NOT_UTF8 = b"\xff\xfesimulated reply that is not UTF-8"
_HANDLE_BASE = 0x5100_0000
_HANDLE_STEP = 0x40
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
        for symbol, (restype, argtypes, function) in self._table().items():
            if symbol not in absent:
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

    def _table(self) -> dict[str, tuple[Any, tuple[Any, ...], Callable[..., int]]]:
        h = _ptr
        table: dict[str, tuple[Any, tuple[Any, ...], Callable[..., int]]] = {
            "nvmlInit_v2": (_int, (), self.done("nvmlInit")),
            "nvmlInitWithFlags": (_int, (_uint,), self.done("nvmlInitWithFlags")),
            "nvmlShutdown": (_int, (), self.done("nvmlShutdown")),
            "nvmlErrorString": (_ptr, (_int,), self._error_string),
            "nvmlSystemGetDriverVersion": (_int, (_ptr, _uint), self._text("nvmlSystemGetDriverVersion")),
            "nvmlDeviceGetCount_v2": (_int, (_ptr,), self.out("nvmlDeviceGetCount", _uint, False)),
            "nvmlDeviceGetHandleByIndex_v2": (
                _int, (_uint, _ptr), self.out("nvmlDeviceGetHandleByIndex", _ptr, False, write=self.handle_id)),
            "nvmlDeviceGetName": (_int, (h, _ptr, _uint), self._text("nvmlDeviceGetName")),
            "nvmlDeviceGetUUID": (_int, (h, _ptr, _uint), self._text("nvmlDeviceGetUUID")),
            "nvmlDeviceGetSerial": (_int, (h, _ptr, _uint), self._text("nvmlDeviceGetSerial")),
            "nvmlDeviceGetVbiosVersion": (_int, (h, _ptr, _uint), self._text("nvmlDeviceGetVbiosVersion")),
            "nvmlSystemGetCudaDriverVersion": (_int, (_ptr,), self.out("nvmlSystemGetCudaDriverVersion", _int, False)),
            "nvmlSystemGetCudaDriverVersion_v2": (
                _int, (_ptr,), self.out("nvmlSystemGetCudaDriverVersion_v2", _int, False)),
            "nvmlDeviceGetPciInfo_v3": (_int, (h, _ptr), self._pci_info),
            "nvmlDeviceGetMemoryInfo": (_int, (h, _ptr), self._memory_v1),
            "nvmlDeviceGetMemoryInfo_v2": (_int, (h, _ptr), self._memory_v2),
            "nvmlDeviceGetUtilizationRates": (_int, (h, _ptr), self._rates),
            "nvmlDeviceGetSamples": (_int, (h, _uint, _ull, _ptr, _ptr, _ptr), self._samples),
            "nvmlDeviceGetProcessUtilization": (_int, (h, _ptr, _ptr, _ull), self._process_utilization),
            "nvmlDeviceGetMigMode": (_int, (h, _ptr, _ptr), self.out("nvmlDeviceGetMigMode", _uint, outs=2)),
            "nvmlDeviceGetMaxMigDeviceCount": (_int, (h, _ptr), self.out("nvmlDeviceGetMaxMigDeviceCount", _uint)),
            "nvmlDeviceGetMigDeviceHandleByIndex": (
                _int, (h, _uint, _ptr), self.out("nvmlDeviceGetMigDeviceHandleByIndex", _ptr, write=self.handle_id)),
            "nvmlDeviceIsMigDeviceHandle": (_int, (h, _ptr), self.out("nvmlDeviceIsMigDeviceHandle", _uint)),
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": (
                _int, (h, _ptr), self.out("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", _ptr, write=self.handle_id)),
            "nvmlDeviceGetGpuInstanceId": (_int, (h, _ptr), self.out("nvmlDeviceGetGpuInstanceId", _uint)),
            "nvmlDeviceGetComputeInstanceId": (_int, (h, _ptr), self.out("nvmlDeviceGetComputeInstanceId", _uint)),
        }
        for kind in ("Compute", "Graphics"):
            for version in ("_v3", "_v2"):
                symbol = f"nvmlDeviceGet{kind}RunningProcesses{version}"
                table[symbol] = (_int, (h, _ptr, _ptr), self._processes(symbol, f"nvmlDeviceGet{kind}RunningProcesses"))
        table.update(health_table(self))
        table.update(gpm_table(self))
        assert set(table) == set(LIBRARY_SYMBOLS), set(table) ^ set(LIBRARY_SYMBOLS)
        return table

    def done(self, method: str) -> Callable[..., int]:
        """A C function that only calls the model's `method`."""

        def call(*args: Any) -> int:
            self._call(method, *args)
            return SUCCESS

        return call

    def out(self, method: str, ctype: Any, device: bool = True, *lead: Any,
            write: Callable[[Any], int] = int, outs: int = 1) -> Callable[..., int]:
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

    def _struct(self, out: int | None, name: str) -> Any:
        if not out:
            raise NvmlFault(INVALID_ARGUMENT)
        return self._array(out, name)[0]

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
        target = self._struct(out, "c_nvmlMemory_v2_t")
        if target.version != self._b.nvmlMemory_v2:
            return ARGUMENT_VERSION_MISMATCH
        memory = self._call("nvmlDeviceGetMemoryInfo", self.model_handle(device), target.version)
        target.total, target.reserved = int(memory.total), int(memory.reserved)
        target.used, target.free = int(memory.used), int(memory.free)
        return SUCCESS

    def _rates(self, device: int | None, out: int | None) -> int:
        rates = self._call("nvmlDeviceGetUtilizationRates", self.model_handle(device))
        target = self._struct(out, "c_nvmlUtilization_t")
        target.gpu, target.memory = int(rates.gpu), int(rates.memory)
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

