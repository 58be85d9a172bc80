"""The calls of every poll through the binding's function table (readers/nvml/direct.py):
the same answers as nvidia-ml-py's own wrappers, one C call where they make two, arrays
kept, grown and shrunk back."""

from __future__ import annotations

from typing import Any

import pytest
from scenarios import a10_card

from atopgpud_tw.readers.nvml import direct
from atopgpud_tw.readers.nvml.direct import Array, DirectCalls
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.sim import parse_scenario, simulated_binding

PROCESSES = [
    {"pid": 300 + i, "type": "G" if i % 4 == 3 else "C", "memory_mib": None if i == 5 else 64 + i, "sm_util": 2 * i}
    for i in range(40)
]


def binding(**top: Any) -> Any:
    """An initialised binding over one card with the 40 processes, at simulated time 30 s."""
    scenario = parse_scenario({"gpus": [a10_card(processes=PROCESSES)], **top})
    nvml = simulated_binding(scenario, clock=lambda: 30.0)
    nvml.nvmlInit()
    return nvml


def fitted(nvml: Any, calls: dict[str, Any], function: str, *args: Any) -> Any:
    """A direct call asked again while its array grows (as the reader's `call_sized` does)."""
    for _ in range(4):
        try:
            return calls[function](*args)
        except nvml.NVMLError_InsufficientSize:
            continue
    raise AssertionError(f"{function} never fitted")


def test_the_answers_are_the_wrappers_answers():
    """Samples, process samples and both lists, read from the C structures: what the binding's
    wrappers return, field for field (unavailable memory as None), from arrays too small at first."""
    wrapped = table = binding()
    calls = DirectCalls(table).functions()
    handle_w = handle_t = wrapped.nvmlDeviceGetHandleByIndex(0)

    def grown(function: str, *args: Any) -> Any:
        return fitted(table, calls, function, handle_t, *args)

    for kind in (1, 2):
        _, samples = wrapped.nvmlDeviceGetSamples(handle_w, kind, 0)
        assert grown("nvmlDeviceGetSamples", kind, 0) == (
            [s.timeStamp for s in samples], [s.sampleValue.uiVal for s in samples]
        )
    utilization = wrapped.nvmlDeviceGetProcessUtilization(handle_w, 0)
    assert len(utilization) > direct.FIRST["nvmlDeviceGetProcessUtilization"]
    assert grown("nvmlDeviceGetProcessUtilization", 0) == (
        [s.pid for s in utilization], [s.timeStamp for s in utilization],
        [s.smUtil for s in utilization], [s.memUtil for s in utilization],
    )
    for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses_v2"):
        listed = getattr(wrapped, name)(handle_w)
        assert grown(name) == ([p.pid for p in listed], [p.usedGpuMemory for p in listed])
    assert (300 + 5, None) in zip(*calls["nvmlDeviceGetComputeRunningProcesses"](handle_t))


def test_a_poll_makes_one_c_call_per_hot_function():
    """Once the arrays fit, each poll calls each hot C function once per GPU (the wrappers: twice)."""
    clock = [30.0]
    scenario = parse_scenario({"gpus": [a10_card(processes=PROCESSES)]})
    nvml = simulated_binding(scenario, clock=lambda: clock[0])
    reader = NvmlReader(nvml, reactor=None)
    reader.open()
    for second in range(3):
        clock[0] = 31.0 + second
        reader.read(clock[0])
    calls = nvml.nvmlLib.calls
    before = dict(calls)
    for second in range(5):
        clock[0] = 34.0 + second
        reader.read(clock[0])
    made = {symbol: calls[symbol] - before.get(symbol, 0) for symbol in calls}
    assert made["nvmlDeviceGetSamples"] == 5 * 2
    assert made["nvmlDeviceGetProcessUtilization"] == 5
    assert made["nvmlDeviceGetComputeRunningProcesses_v3"] == 5
    assert made["nvmlDeviceGetGraphicsRunningProcesses_v3"] == 5


def test_a_missing_symbol_is_the_binding_s_function_not_found():
    """A driver without the _v3 lists: the table's own FUNCTION_NOT_FOUND (the reader falls back to _v2)."""
    nvml = binding(driver="470")
    calls = DirectCalls(nvml).functions()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nvml.NVMLError_FunctionNotFound):
        calls["nvmlDeviceGetComputeRunningProcesses"](handle)
    assert 300 in fitted(nvml, calls, "nvmlDeviceGetComputeRunningProcesses_v2", handle)[0]


def test_an_array_grown_for_a_burst_is_shrunk_back():
    """Grown past what a burst needed, then `SHRINK_AFTER` calls needing little: small again."""
    nvml = binding()
    array = Array(nvml.c_nvmlProcessInfo_v2_t, 16)
    array.grow(500)
    assert array.capacity == 1005
    for _ in range(direct.SHRINK_AFTER):
        array.shrink_if_due()
        array.used(40)
    assert array.capacity == 1005  # what the last call filled is still there to be read
    array.shrink_if_due()
    assert array.capacity == 2 * 40 + 5
    for _ in range(direct.SHRINK_AFTER):
        array.shrink_if_due()
        array.used(3)
    array.shrink_if_due()
    assert array.capacity == 16  # never below what it started with


@pytest.mark.parametrize("function", ["nvmlDeviceGetSamples", "nvmlDeviceGetProcessUtilization",
                                      "nvmlDeviceGetComputeRunningProcesses"])
def test_the_call_after_which_an_array_shrinks_is_read_whole(monkeypatch, function):
    """The call whose `used` makes the array small again answers what it filled, not the new
    array's zeros (a constant load once read a fifth of its busy figure at each shrink)."""
    monkeypatch.setattr(direct, "SHRINK_AFTER", 2)
    nvml = binding()
    source = DirectCalls(nvml)
    calls = source.functions()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    args = {"nvmlDeviceGetSamples": (1, 0), "nvmlDeviceGetProcessUtilization": (0,)}.get(function, ())
    fitted(nvml, calls, function, handle, *args)
    array = source._arrays[function]
    array.grow(50_000)  # as after a burst
    burst = array.capacity
    expected = fitted(nvml, calls, function, handle, *args)
    assert expected[0]
    for _ in range(3):  # one of these makes the array small again
        assert calls[function](handle, *args) == expected
    assert array.capacity < burst


def test_a_full_sample_array_is_asked_again_larger(monkeypatch):
    """nvmlDeviceGetSamples fills what fits: a full array may have left samples out, so it grows
    and the call is made again (as for INSUFFICIENT_SIZE)."""
    monkeypatch.setitem(direct.FIRST, "nvmlDeviceGetSamples", 4)
    nvml = binding()
    calls = DirectCalls(nvml).functions()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(nvml.NVMLError_InsufficientSize):
        calls["nvmlDeviceGetSamples"](handle, 1, 0)
    assert len(calls["nvmlDeviceGetSamples"](handle, 1, 0)[0]) > 4


def test_memory_is_the_wrapper_s_in_both_versions():
    """Total, used, free and reserved bytes from one kept structure per version: v2's used leaves the reserved
    memory out, as the binding's v2 answer does; v1's counts it; a driver without the v2 symbol
    raises the table's FUNCTION_NOT_FOUND (the reader then reads v1)."""
    for driver in ("current", "470"):
        nvml = binding(driver=driver)
        memory = DirectCalls(nvml).functions()["nvmlDeviceGetMemoryInfo"]
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        v1 = nvml.nvmlDeviceGetMemoryInfo(handle)
        for _ in range(2):  # the structures are kept: asked again, the same answers
            # (v1 has no reserved field: its used counts it)
            assert memory(handle) == (v1.total, v1.used, v1.free, None)
        if driver == "470":
            with pytest.raises(nvml.NVMLError_FunctionNotFound):
                memory(handle, nvml.nvmlMemory_v2)
            continue
        v2 = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
        assert memory(handle, nvml.nvmlMemory_v2) == (v2.total, v2.used, v2.free, v2.reserved)
        assert v2.total == v2.used + v2.free + v2.reserved
        with pytest.raises(nvml.NVMLError):
            memory(handle, 1)  # a structure version the driver does not know
