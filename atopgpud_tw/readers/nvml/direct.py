"""The calls every poll makes per GPU, straight through nvidia-ml-py's function table.

`DirectCalls` makes the samples, process utilization, process lists, memory and MIG calls of
one device: each C function from the binding's table (``pynvml._nvmlGetFunctionPointer``),
arrays of the binding's own structures, and the binding's ``NVMLError`` for a return code
that is not NVML_SUCCESS, so that the device's choke point maps its errors as the wrappers'.

Why: the wrappers are most of a poll's cost.  Each asks the size with a NULL buffer first,
allocates an array per call and turns every entry into Python objects field by field.  Here
an array is kept from poll to poll, the call is made once with its capacity as the count,
and the fields are read as slices of ``c_uint32``/``c_uint64`` views of its memory; a MIG
slot's handle comes back as its pointer value, so a handle seen before needs no new object.

What the wrappers did that is kept: INSUFFICIENT_SIZE grows the array (``2 * n + 5``, as
the binding sizes process lists) and goes up for the caller's retry (`calls.call_sized`);
a full samples array is taken as a buffer that may hold more ("fetches the number of entries
which can be accommodated in the provided samples array", NVIDIA's reference for
nvmlDeviceGetSamples, https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html);
``usedGpuMemory`` as NVML_VALUE_NOT_AVAILABLE (WDDM, vGPU guests) is ``None``; a count past
the array raises IndexError for a process list (the binding's copy loop) and reads the
array's entries for samples (its slice).
"""

from __future__ import annotations

import ctypes
from functools import partial
from typing import Any, Callable

from atopgpud_tw.nvml_codes import INSUFFICIENT_SIZE, SUCCESS, VALUE_NOT_AVAILABLE

SAMPLES = "nvmlDeviceGetSamples"
PROCESS_UTILIZATION = "nvmlDeviceGetProcessUtilization"
MEMORY = "nvmlDeviceGetMemoryInfo"
MEMORY_V2 = "nvmlDeviceGetMemoryInfo_v2"
#: the process lists, by the reader's name (the binding's unversioned name is its _v3 function): C symbol
LISTS = {
    "nvmlDeviceGetComputeRunningProcesses": "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2": "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses": "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v2": "nvmlDeviceGetGraphicsRunningProcesses_v2",
}
MIG_MODE = "nvmlDeviceGetMigMode"
MIG_HANDLE = "nvmlDeviceGetMigDeviceHandleByIndex"
UUID = "nvmlDeviceGetUUID"
MIG_NAMES = frozenset({MIG_MODE, MIG_HANDLE, UUID})
#: every function `DirectCalls` makes, by the reader's name
NAMES = frozenset({SAMPLES, PROCESS_UTILIZATION, MEMORY, *LISTS, *MIG_NAMES})
#: NVML_DEVICE_UUID_V2_BUFFER_SIZE, the buffer the binding gives nvmlDeviceGetUUID
UUID_BUFFER = 96
#: entries an array starts with: twice a second of samples at the shortest period (1/6 s), a few processes
FIRST = {SAMPLES: 16, PROCESS_UTILIZATION: 32, "lists": 16}
#: calls after which an array more than four times as large as any of them needed is shrunk
SHRINK_AFTER = 60


class Array:
    """An array of one of the binding's structures, kept from call to call, with 32- and 64-bit views."""

    __slots__ = ("struct", "first", "capacity", "data", "u32", "u64", "peak", "calls", "due")

    def __init__(self, struct: Any, first: int) -> None:
        self.struct = struct
        self.first = first
        self.peak = 0
        self.calls = 0
        #: the capacity to shrink to before the next call (0: none due)
        self.due = 0
        self.allocate(first)

    def allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.data = (self.struct * capacity)()
        size = ctypes.sizeof(self.data)
        self.u32 = (ctypes.c_uint32 * (size // 4)).from_buffer(self.data)
        self.u64 = (ctypes.c_uint64 * (size // 8)).from_buffer(self.data)

    def grow(self, needed: int) -> None:
        """Room for `needed` entries and more (the list may grow again before the next call)."""
        self.allocate(max(2 * self.capacity, 2 * needed + 5))
        self.peak, self.calls, self.due = 0, 0, 0

    def used(self, count: int) -> None:
        """A call filled `count` entries: after a burst, the array is made small again before
        the next call (what this call filled is still to be read)."""
        self.peak = max(self.peak, count)
        self.calls += 1
        if self.calls >= SHRINK_AFTER:
            if self.capacity > max(self.first, 4 * self.peak):
                self.due = max(self.first, 2 * self.peak + 5)
            self.peak, self.calls = 0, 0

    def shrink_if_due(self) -> None:
        """Before a call: the smaller array `used` asked for, if it did."""
        if self.due:
            self.allocate(self.due)
            self.due = 0


def _words(struct: Any, name: str, size: int) -> tuple[int, int]:
    """Where field `name` of `struct` is, as (first index, stride) in words of `size` bytes."""
    offset = getattr(struct, name).offset
    assert offset % size == 0 and ctypes.sizeof(struct) % size == 0, (struct, name)
    return offset // size, ctypes.sizeof(struct) // size


class _Memory:
    """One memory structure of the binding's, kept from call to call, read as 64-bit words."""

    __slots__ = ("struct", "ref", "u64", "words")

    def __init__(self, struct_type: Any) -> None:
        self.struct: Any = None
        self.ref: Any = None
        self.u64: Any = None
        #: the words of total, used, free and reserved (v1 has no reserved: its "used" counts it)
        self.words: tuple[int, int, int, int | None] = (0, 0, 0, None)
        if struct_type is None:
            return
        self.struct = struct_type()
        self.ref = ctypes.byref(self.struct)
        self.u64 = (ctypes.c_uint64 * (ctypes.sizeof(struct_type) // 8)).from_buffer(self.struct)
        total, used, free = (_words(struct_type, name, 8)[0] for name in ("total", "used", "free"))
        reserved = _words(struct_type, "reserved", 8)[0] if hasattr(struct_type, "reserved") else None
        self.words = (total, used, free, reserved)


class DirectCalls:
    """One device's hot calls, ``functions()[name](handle, *args)``, answering in columns: samples
    ``(stamps, values)`` (values as ``uiVal``), process utilization ``(pids, stamps, sm, mem)``,
    a process list ``(pids, used bytes or None)``; and the MIG calls: the current MIG mode (an
    int), a slot's handle as its pointer value (``None`` for NULL; `mig_handle` makes it a
    handle), the UUID decoded as the binding's is."""

    def __init__(self, nvml: Any) -> None:
        self._error = nvml.NVMLError
        self._table: Callable[[str], Any] = nvml._nvmlGetFunctionPointer
        self._pointers: dict[str, Any] = {}
        self._count = ctypes.c_uint(0)
        self._count_ref = ctypes.byref(self._count)
        self._value_type = ctypes.c_uint(0)
        self._value_type_ref = ctypes.byref(self._value_type)
        self._arrays: dict[str, Array] = {}
        sample, utilization = nvml.c_nvmlSample_t, nvml.c_nvmlProcessUtilizationSample_t
        process = nvml.c_nvmlProcessInfo_v2_t
        self._structs = {SAMPLES: sample, PROCESS_UTILIZATION: utilization} | {name: process for name in LISTS}
        self._stamp64 = _words(sample, "timeStamp", 8)
        self._value32 = (sample.sampleValue.offset // 4, ctypes.sizeof(sample) // 4)
        self._util = (
            _words(utilization, "pid", 4), _words(utilization, "timeStamp", 8),
            _words(utilization, "smUtil", 4), _words(utilization, "memUtil", 4),
        )
        self._process = (_words(process, "pid", 4), _words(process, "usedGpuMemory", 8))
        self._sample_kinds: dict[int, Any] = {}
        self._since = ctypes.c_ulonglong(0)
        self._memory_v1 = _Memory(nvml.c_nvmlMemory_t)
        self._memory_v2 = _Memory(getattr(nvml, "c_nvmlMemory_v2_t", None))
        # the MIG calls' (what each fills is cleared first, so that a call that answers without
        # writing reads as the binding's fresh objects would: 0, NULL, "")
        self._current = ctypes.c_uint(0)
        self._current_ref = ctypes.byref(self._current)
        self._pending_ref = ctypes.byref(ctypes.c_uint(0))
        self._out = nvml.c_nvmlDevice_t()
        self._out_value = ctypes.c_void_p.from_buffer(self._out)
        self._out_ref = ctypes.byref(self._out)
        #: the slot numbers as the binding passes them (c_uint), made once
        self._slots: list[Any] = []
        self._buffer = ctypes.create_string_buffer(UUID_BUFFER)
        self._buffer_size = ctypes.c_uint(UUID_BUFFER)

    def functions(self) -> dict[str, Callable[..., Any]]:
        """The hot functions by the names the reader calls them."""
        found: dict[str, Callable[..., Any]] = {name: partial(self.processes, name) for name in LISTS}
        return found | {SAMPLES: self.samples, PROCESS_UTILIZATION: self.process_utilization, MEMORY: self.memory,
                        MIG_MODE: self.mig_mode, MIG_HANDLE: self.mig_handle, UUID: self.uuid}

    def _pointer(self, symbol: str) -> Any:
        pointer = self._pointers.get(symbol)
        if pointer is None:
            # raises the binding's NVMLError: FUNCTION_NOT_FOUND, or UNINITIALIZED
            pointer = self._pointers[symbol] = self._table(symbol)
        return pointer

    def _array(self, name: str) -> Array:
        """The array a call of `name` fills (shrunk first after a burst), the count set to its capacity."""
        array = self._arrays.get(name)
        if array is None:
            first = FIRST.get(name, FIRST["lists"])
            array = self._arrays[name] = Array(self._structs[name], first)
        elif array.due:
            array.shrink_if_due()
        self._count.value = array.capacity
        return array

    def _filled(self, array: Array, ret: int, full_is_short: bool = False, lists: bool = False) -> int:
        """The entries a call filled, or the binding's NVMLError (the array grown first where it was short)."""
        count = self._count.value
        if ret == INSUFFICIENT_SIZE or (full_is_short and ret == SUCCESS and count >= array.capacity):
            array.grow(count)
            raise self._error(INSUFFICIENT_SIZE)
        if ret != SUCCESS:
            raise self._error(ret)
        if count > array.capacity:
            if lists:
                raise IndexError("invalid index")  # as the binding's copy loop would, past its array
            count = array.capacity  # as the binding's slice of its array would
        array.used(count)
        return count

    def samples(self, handle: Any, kind: int, since: int) -> tuple[list[int], list[int]]:
        array = self._array(SAMPLES)
        kinds = self._sample_kinds
        sample_kind = kinds.get(kind)
        if sample_kind is None:
            sample_kind = kinds[kind] = ctypes.c_uint(kind)
        # (the arguments passed by value are kept too: set, not made, at each call)
        self._since.value = since
        ret = self._pointer(SAMPLES)(
            handle, sample_kind, self._since, self._value_type_ref, self._count_ref, array.data
        )
        count = self._filled(array, ret, full_is_short=True)
        if not count:
            return [], []
        (stamp, step), (value, vstep) = self._stamp64, self._value32
        return array.u64[stamp:stamp + count * step:step], array.u32[value:value + count * vstep:vstep]

    def memory(self, handle: Any, version: int | None = None) -> tuple[int, int, int, int | None]:
        """(total, used, free, reserved) bytes, as the binding's wrapper reads them (reserved None from v1)."""
        if version:
            memory = self._memory_v2
            if memory.struct is None:
                raise AttributeError("the binding has no c_nvmlMemory_v2_t")  # as its wrapper would
            memory.struct.version = version
            ret = self._pointer(MEMORY_V2)(handle, memory.ref)
        else:
            memory = self._memory_v1
            ret = self._pointer(MEMORY)(handle, memory.ref)
        if ret != SUCCESS:
            raise self._error(ret)
        words = memory.u64
        total, used, free, reserved = memory.words
        return words[total], words[used], words[free], None if reserved is None else words[reserved]

    def process_utilization(self, handle: Any, since: int) -> tuple[list[int], list[int], list[int], list[int]]:
        array = self._array(PROCESS_UTILIZATION)
        ret = self._pointer(PROCESS_UTILIZATION)(handle, array.data, self._count_ref, ctypes.c_ulonglong(since))
        count = self._filled(array, ret)
        if not count:
            return [], [], [], []
        u32, u64 = array.u32, array.u64
        (pid, ps), (stamp, ss), (sm, ms), (mem, es) = self._util
        return (
            u32[pid:pid + count * ps:ps], u64[stamp:stamp + count * ss:ss],
            u32[sm:sm + count * ms:ms], u32[mem:mem + count * es:es],
        )

    def processes(self, name: str, handle: Any) -> tuple[list[int], list[int | None]]:
        array = self._array(name)
        ret = self._pointer(LISTS[name])(handle, self._count_ref, array.data)
        count = self._filled(array, ret, lists=True)
        if not count:
            return [], []
        (pid, ps), (memory, ms) = self._process
        pids = array.u32[pid:pid + count * ps:ps]
        used: list[Any] = array.u64[memory:memory + count * ms:ms]
        if VALUE_NOT_AVAILABLE in used:  # (a scan in C: most drivers always tell)
            used = [None if m == VALUE_NOT_AVAILABLE else m for m in used]
        return pids, used

    def mig_mode(self, handle: Any) -> int:
        self._current.value = 0
        ret = self._pointer(MIG_MODE)(handle, self._current_ref, self._pending_ref)
        if ret != SUCCESS:
            raise self._error(ret)
        return self._current.value

    def mig_handle(self, card: Any, slot: int) -> int | None:
        slots = self._slots
        if slot >= len(slots):
            slots.extend(ctypes.c_uint(index) for index in range(len(slots), slot + 1))
        self._out_value.value = None
        ret = self._pointer(MIG_HANDLE)(card, slots[slot], self._out_ref)
        if ret != SUCCESS:
            raise self._error(ret)
        return self._out_value.value

    def uuid(self, handle: Any) -> str:
        buffer = self._buffer
        buffer.value = b""
        ret = self._pointer(UUID)(handle, buffer, self._buffer_size)
        if ret != SUCCESS:
            raise self._error(ret)
        return buffer.value.decode()


def mig_handle(nvml: Any, value: int | None) -> Any:
    """A handle (the binding's ``c_nvmlDevice_t``) of its own for a slot's pointer value."""
    if value is None:
        return nvml.c_nvmlDevice_t()  # NULL, as the binding's would be
    return ctypes.cast(value, nvml.c_nvmlDevice_t)


def handle_value(handle: Any, default: Any = None) -> Any:
    """A handle's pointer value (None for NULL); `default` for one that is no pointer."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return default
