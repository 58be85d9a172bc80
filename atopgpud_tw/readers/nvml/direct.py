"""The calls every poll makes per GPU, straight through nvidia-ml-py's function table.

`DirectCalls` makes ``nvmlDeviceGetSamples``, ``nvmlDeviceGetProcessUtilization``
and the running-process lists (compute and graphics, ``_v3`` and ``_v2``) for one
device.  It takes each C function from the binding's own table
(``pynvml._nvmlGetFunctionPointer``: the library nvidia-ml-py loaded, its
symbol lookup and its cache), fills arrays of the binding's own structure types
(``c_nvmlSample_t``, ``c_nvmlProcessUtilizationSample_t``,
``c_nvmlProcessInfo_v2_t``, which ``_v3`` shares) and raises the binding's own
``NVMLError`` for a return code that is not NVML_SUCCESS, so the device's choke
point (`device.NvmlDevice.call`) maps its errors as it maps the wrappers'.
``nvmlDeviceGetMemoryInfo`` too: into one kept ``c_nvmlMemory_v2_t`` (its
``version`` set to the binding's ``nvmlMemory_v2``, through the
``nvmlDeviceGetMemoryInfo_v2`` symbol) or ``c_nvmlMemory_t`` (v1), as the
binding's wrapper chooses by its ``version`` argument, so that the v2-to-v1
fallback of `device.read_memory` (FUNCTION_NOT_FOUND on a driver before 510)
is the same; the wrapper makes a structure per call, whose fields are then read
through ``_PrintableStructure.__getattribute__``, in Python.

Why not the binding's wrappers for these: they are most of a poll's cost, for
things that need not be done per call.  Each wrapper asks the size with a NULL
buffer first (two C calls where one does), allocates a new array per call,
slices it into Python copies of the structures, and turns every process entry
into an object field by field through ``_PrintableStructure.__getattribute__``.
Here an array is kept from poll to poll per call and device: the call is made
once, with the array's capacity as the count, and the fields are read straight
from the C memory (one slice of a ``c_uint32`` or ``c_uint64`` view of the
array per field).

What the wrappers did that is kept:

- INSUFFICIENT_SIZE (the list or buffer grew past the array): the array grows
  to the count the driver says it needs, with room to spare (``2 * n + 5``, as
  the binding sizes process lists), and the error goes up, so that the caller's
  retry (`device.call_sized`) asks again; after a burst (a run of calls that
  needed less than a quarter of it) the array is shrunk back.
  ``nvmlDeviceGetSamples`` "fetches the number of entries which can be
  accommodated in the provided samples array" (NVIDIA's reference for
  nvmlDeviceGetSamples, https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html),
  so a full array is taken as a buffer that may hold more, and asked again
  larger in the same way;
- a function the library lacks: the table raises FUNCTION_NOT_FOUND (the
  versioned fallbacks of `device.list_processes` go on from there);
  UNINITIALIZED while the library is not loaded;
- ``usedGpuMemory`` as NVML_VALUE_NOT_AVAILABLE (WDDM, vGPU guests) is ``None``;
- a count larger than the array the driver was given (a reply that cannot be
  true) raises IndexError for a process list, as the binding's copy loop does,
  and reads the array's entries for the process samples, as its slice does.

Calls made once at start-up, or when the metrics page is read, keep the
binding's wrappers.  Everything here runs in the reader's worker thread.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

from atopgpud_tw.nvml_codes import INSUFFICIENT_SIZE, SUCCESS, VALUE_NOT_AVAILABLE

#: nvmlDeviceGetSamples and nvmlDeviceGetProcessUtilization, by the names the reader calls them
SAMPLES = "nvmlDeviceGetSamples"
PROCESS_UTILIZATION = "nvmlDeviceGetProcessUtilization"
#: nvmlDeviceGetMemoryInfo, asked for the v2 structure (by the binding's version number) or v1
MEMORY = "nvmlDeviceGetMemoryInfo"
MEMORY_V2 = "nvmlDeviceGetMemoryInfo_v2"
#: the process lists, by the reader's name (the binding's unversioned name is its _v3 function): C symbol
LISTS = {
    "nvmlDeviceGetComputeRunningProcesses": "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2": "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses": "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v2": "nvmlDeviceGetGraphicsRunningProcesses_v2",
}
#: every function `DirectCalls` makes, by the reader's name
NAMES = frozenset({SAMPLES, PROCESS_UTILIZATION, MEMORY, *LISTS})
#: entries an array starts with: a second of samples at the shortest period (1/6 s) twice
#: over, and a few processes
FIRST = {SAMPLES: 16, PROCESS_UTILIZATION: 32, "lists": 16}
#: calls after which an array more than four times as large as any of them needed is shrunk
SHRINK_AFTER = 60


class Array:
    """An array of one of the binding's structures, kept from call to call, with
    views of its memory as 32- and 64-bit words to read fields from."""

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
        """A call filled `count` entries: after a burst, the array is to be made small again,
        before the next call (`shrink_if_due`): what this call filled is still to be read."""
        if count > self.peak:
            self.peak = count
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
    """One memory structure of the binding's, kept from call to call, read as 64-bit words
    (the structure's own fields go through the binding's Python ``__getattribute__``)."""

    __slots__ = ("struct", "ref", "u64", "total", "used", "free", "reserved")

    def __init__(self, struct_type: Any) -> None:
        self.struct: Any = None
        self.ref: Any = None
        self.u64: Any = None
        self.total = self.used = self.free = 0
        #: v1 has no reserved field (its "used" counts the reserved memory)
        self.reserved: int | None = None
        if struct_type is None:
            return
        self.struct = struct_type()
        self.ref = ctypes.byref(self.struct)
        self.u64 = (ctypes.c_uint64 * (ctypes.sizeof(struct_type) // 8)).from_buffer(self.struct)
        self.total = _words(struct_type, "total", 8)[0]
        self.used = _words(struct_type, "used", 8)[0]
        self.free = _words(struct_type, "free", 8)[0]
        if hasattr(struct_type, "reserved"):
            self.reserved = _words(struct_type, "reserved", 8)[0]


class DirectCalls:
    """One device's hot calls, each as the reader calls it: ``functions()[name](handle, *args)``.

    - ``nvmlDeviceGetSamples(handle, kind, since)``: ``[(stamp, value), ...]``
      (the value as ``uiVal``: utilization samples are unsigned ints);
    - ``nvmlDeviceGetProcessUtilization(handle, since)``: ``(pids, stamps,
      sm, mem)``, four lists of one length;
    - a process list: ``(pids, used bytes or None)``, two lists of one length (columns,
      as the reader merges them: no tuple per entry).
    """

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
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

    def functions(self) -> dict[str, Callable[..., Any]]:
        """The hot functions by the names the reader calls them."""
        found: dict[str, Callable[..., Any]] = {SAMPLES: self.samples, PROCESS_UTILIZATION: self.process_utilization}
        for name in LISTS:
            found[name] = lambda handle, name=name: self.processes(name, handle)
        found[MEMORY] = self.memory
        found.update(MigCalls(self._nvml, self._pointer).functions())
        return found

    def _pointer(self, symbol: str) -> Any:
        pointer = self._pointers.get(symbol)
        if pointer is None:
            # raises the binding's NVMLError: FUNCTION_NOT_FOUND, or UNINITIALIZED
            pointer = self._pointers[symbol] = self._table(symbol)
        return pointer

    def _array(self, name: str) -> Array:
        """The array a call of `name` fills, made small again first if a burst is over."""
        array = self._arrays.get(name)
        if array is None:
            first = FIRST.get(name, FIRST["lists"])
            array = self._arrays[name] = Array(self._structs[name], first)
        elif array.due:
            array.shrink_if_due()
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
        self._count.value = array.capacity
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
        """(total, used, free, reserved) bytes, as the binding's ``nvmlDeviceGetMemoryInfo(handle,
        version)`` reads them: the v2 structure and symbol for a version, v1's without one (reserved
        None: v1 has no such field)."""
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
        reserved = None if memory.reserved is None else words[memory.reserved]
        return words[memory.total], words[memory.used], words[memory.free], reserved

    def process_utilization(self, handle: Any, since: int) -> tuple[list[int], list[int], list[int], list[int]]:
        array = self._array(PROCESS_UTILIZATION)
        self._count.value = array.capacity
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
        self._count.value = array.capacity
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


# --- the calls that find a MIG card's instances at every poll ------------------------------------------
#
# A card in MIG mode is asked at every poll for its mode, for the handle in each of its
# slots, and each instance known again for its UUID (`mig._known`): 15 calls a poll for a
# card of seven instances, more than its instances' readings.  The binding's wrappers make
# new ctypes objects for each (a handle, two mode words, a 96-byte string buffer, the
# arguments), take its table's lock-guarded lookup, and decode the UUID.  Here each device
# keeps what its calls fill, and a slot's handle comes back as its pointer value: a slot
# that gives the handle it gave before needs no new handle object, and the handle an
# instance was found with is never written over (a later poll may give that slot's next
# instance another pointer, and the instance's own calls must stay on its own).

#: the MIG calls made here, by the reader's names (the binding's, and the C symbols')
MIG_MODE = "nvmlDeviceGetMigMode"
MIG_HANDLE = "nvmlDeviceGetMigDeviceHandleByIndex"
UUID = "nvmlDeviceGetUUID"
MIG_NAMES = frozenset({MIG_MODE, MIG_HANDLE, UUID})
#: NVML_DEVICE_UUID_V2_BUFFER_SIZE, the buffer the binding gives nvmlDeviceGetUUID
UUID_BUFFER = 96
# the choke point (`device.NvmlDevice.call`) takes these from `DirectCalls.functions` too
NAMES = NAMES | MIG_NAMES


class MigCalls:
    """One device's MIG calls, each as the reader calls it: ``functions()[name](handle, *args)``.

    - ``nvmlDeviceGetMigMode(handle)``: the current mode (an int; the pending one is not read);
    - ``nvmlDeviceGetMigDeviceHandleByIndex(card, slot)``: the slot's handle as its pointer
      value (``None`` for a NULL one), to be made a handle by `mig_handle` where it is new;
    - ``nvmlDeviceGetUUID(handle)``: the UUID as the binding gives it (what the driver wrote
      up to the first NUL, decoded as UTF-8, a decoding error raised as the binding's is).

    What each call fills is cleared first, so that a call that answers without writing reads
    as the binding's fresh objects would (0, NULL, ``""``), never as the last call's answer.
    Each C function is looked up by `pointer` at each call (`DirectCalls._pointer`, which
    takes it from the binding's table at its first call, FUNCTION_NOT_FOUND or
    UNINITIALIZED raised from there as the wrappers' lookup raises them, and keeps it).
    """

    __slots__ = ("_error", "_pointer", "_current", "_current_ref", "_pending",
                 "_pending_ref", "_out", "_out_value", "_out_ref", "_slots", "_buffer", "_buffer_size")

    def __init__(self, nvml: Any, pointer: Callable[[str], Any]) -> None:
        self._error = nvml.NVMLError
        self._pointer = pointer
        self._current = ctypes.c_uint(0)
        self._current_ref = ctypes.byref(self._current)
        self._pending = ctypes.c_uint(0)
        self._pending_ref = ctypes.byref(self._pending)
        self._out = nvml.c_nvmlDevice_t()
        self._out_value = ctypes.c_void_p.from_buffer(self._out)
        self._out_ref = ctypes.byref(self._out)
        #: the slot numbers as the binding passes them (c_uint), made once
        self._slots: list[Any] = []
        self._buffer = ctypes.create_string_buffer(UUID_BUFFER)
        self._buffer_size = ctypes.c_uint(UUID_BUFFER)

    def functions(self) -> dict[str, Callable[..., Any]]:
        return {MIG_MODE: self.mig_mode, MIG_HANDLE: self.mig_handle, UUID: self.uuid}

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
