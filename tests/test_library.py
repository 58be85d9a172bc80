"""The simulated libnvidia-ml beneath the real pynvml: C calls, size queries, old drivers, faults.

Each test drives nvidia-ml-py's own wrappers (or the reader on them) over a
scenario; what is asserted is what the binding makes of the library's answers.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
from scenarios import a10_card
from twisted.logger import globalLogPublisher

from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml import calls as nvml_calls
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.sim import SimulatedNvml, binding_over, parse_scenario, simulated_binding
from atopgpud_tw.sim.library import GROWN_PID
from atopgpud_tw.sim.scenario import ScenarioError

MIB = 1 << 20


def card(**fields: Any) -> dict:
    """A plain card with one compute process; each test changes what it needs."""
    return a10_card(**fields)


def host(clock: list[float] | None = None, **top: Any) -> Any:
    """An initialised binding over a one-card host (fields of the card under ``gpu``)."""
    gpu = top.pop("gpu", {})
    now = clock or [0.0]
    binding = simulated_binding(parse_scenario({"gpus": [card(**gpu)], **top}), clock=lambda: now[0])
    binding.nvmlInit()
    return binding


def reader_on(clock: list[float], **top: Any) -> NvmlReader:
    gpu = top.pop("gpu", {})
    binding = simulated_binding(parse_scenario({"gpus": [card(**gpu)], **top}), clock=lambda: clock[0])
    reader = NvmlReader(binding, reactor=None)
    reader.open()
    return reader


def logged() -> tuple[list[str], Any]:
    events: list[dict] = []
    globalLogPublisher.addObserver(events.append)

    def stop() -> list[str]:
        globalLogPublisher.removeObserver(events.append)
        return [e["log_format"].format(**e) for e in events if e.get("log_namespace", "").startswith("atopgpud_tw")]

    return events, stop


def three_polls_logged(**top: Any) -> tuple[Any, NvmlReader, list[str]]:
    """A reader on the host, read at 0, 1 and 2 s with no problem: the last
    snapshot, the reader, and what it logged."""
    clock = [0.0]
    _, stop = logged()
    try:
        reader = reader_on(clock, **top)
        for second in range(3):
            clock[0] = float(second)
            snapshot, problems = reader.read(clock[0])
            assert problems == {}
    finally:
        lines = stop()
    return snapshot, reader, lines


# -- the C functions --------------------------------------------------------------------


def test_handles_are_opaque_pointers_the_library_maps_back():
    binding = host()
    handle = binding.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(handle, binding.c_nvmlDevice_t)
    assert binding.nvmlLib.model_handle(handle).gpu == 0
    with pytest.raises(binding.NVMLError_InvalidArgument):
        binding.nvmlDeviceGetName(binding.c_nvmlDevice_t())  # NULL: not a handle it gave out


def test_error_text_of_codes_the_binding_does_not_know_comes_from_the_library():
    binding = host()
    assert str(binding.NVMLError(0)) == "Success"
    assert binding.nvmlErrorString(28) == "Gpu Not Found"
    assert binding.nvmlLib.calls["nvmlErrorString"] == 2


def test_an_exception_in_the_model_never_leaves_a_callback(capfd):
    """A bug beneath the library is NVML_ERROR_UNKNOWN to the binding, kept in `errors`, not printed."""

    class Broken(SimulatedNvml):
        def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
            return 1 / 0

    binding = binding_over(Broken(parse_scenario({"gpus": [card()]})))
    binding.nvmlInit()
    with pytest.raises(binding.NVMLError_Unknown):
        binding.nvmlDeviceGetUtilizationRates(binding.nvmlDeviceGetHandleByIndex(0))
    assert binding.nvmlLib.errors == ["nvmlDeviceGetUtilizationRates: ZeroDivisionError: division by zero"]
    assert "Traceback" not in capfd.readouterr().err


def test_unavailable_process_memory_is_none_from_the_binding_and_not_available_in_the_reader():
    """memory_mib null: the C struct holds NVML_VALUE_NOT_AVAILABLE_ulonglong, which pynvml makes None;
    the reader sends it as -1, "not available"."""
    processes = [{"pid": 7, "memory_mib": None}, {"pid": 8, "memory_mib": 5}]
    binding = host(gpu={"processes": processes})
    listed = binding.nvmlDeviceGetComputeRunningProcesses(binding.nvmlDeviceGetHandleByIndex(0))
    assert [(p.pid, p.usedGpuMemory) for p in listed] == [(7, None), (8, 5 * MIB)]
    clock = [0.0]
    snapshot, problems = reader_on(clock, gpu={"processes": processes}).read(0.0)
    assert problems == {}
    assert sorted((p.pid, p.memory_kib) for p in snapshot.devices[0].processes) == [(7, -1), (8, 5 * 1024)]


# -- memory: v1 and v2 ---------------------------------------------------------------------


def test_v2_memory_leaves_reserved_out_of_used_and_v1_counts_it():
    binding = host(gpu={"memory_reserved_mib": 469})
    handle = binding.nvmlDeviceGetHandleByIndex(0)
    v1 = binding.nvmlDeviceGetMemoryInfo(handle)
    v2 = binding.nvmlDeviceGetMemoryInfo(handle, version=binding.nvmlMemory_v2)
    assert (v2.total, v2.used, v2.reserved, v2.free) == (24000 * MIB, 1000 * MIB, 469 * MIB, 22531 * MIB)
    assert (v1.total, v1.used, v1.free) == (24000 * MIB, 1469 * MIB, 22531 * MIB)
    with pytest.raises(binding.NVMLError):
        binding.nvmlDeviceGetMemoryInfo(handle, version=1)  # a structure version the driver does not know


@pytest.mark.parametrize(("driver", "used_mib", "symbol"), [
    ("current", 1000, "nvmlDeviceGetMemoryInfo_v2"),
    ("470", 1469, "nvmlDeviceGetMemoryInfo"),
])
def test_the_reader_reads_v2_memory_where_the_driver_has_it(driver, used_mib, symbol):
    clock = [0.0]
    reader = reader_on(clock, driver=driver, gpu={"memory_reserved_mib": 469})
    snapshot, problems = reader.read(0.0)
    assert problems == {}
    assert snapshot.devices[0].memory_used_kib == used_mib * 1024
    assert reader.nvml.nvmlLib.calls[symbol] == 1


# -- old drivers and missing symbols -------------------------------------------------------


def test_a_symbol_the_library_lacks_is_function_not_found_to_the_binding():
    binding = host(missing_symbols=["nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetSamples"])
    handle = binding.nvmlDeviceGetHandleByIndex(0)
    assert not hasattr(binding.nvmlLib, "nvmlDeviceGetSamples")
    with pytest.raises(binding.NVMLError_FunctionNotFound):
        binding.nvmlDeviceGetSamples(handle, 1, 0)
    with pytest.raises(binding.NVMLLibraryMismatchError):
        binding.nvmlDeviceGetComputeRunningProcesses(handle)  # the unversioned wrapper wants _v3
    assert [p.pid for p in binding.nvmlDeviceGetComputeRunningProcesses_v2(handle)] == [300]


def test_driver_470_lists_processes_through_the_v2_functions_said_once():
    snapshot, reader, lines = three_polls_logged(driver="470")
    (device,) = snapshot.devices
    assert [(p.pid, p.memory_kib, p.gpu_busy) for p in device.processes] == [(300, 100 * 1024, 20)]
    assert device.task_support == 3
    calls = reader.nvml.nvmlLib.calls
    assert calls["nvmlDeviceGetComputeRunningProcesses_v2"] > 0
    assert calls["nvmlDeviceGetGraphicsRunningProcesses_v2"] > 0
    assert reader.nvml.nvmlSystemGetDriverVersion() == "470.256.02"
    said = [line for line in lines if "_v2" in line]
    assert said == [
        "nvml: the driver has no nvmlDeviceGetComputeRunningProcesses_v3: process lists through "
        "nvmlDeviceGetComputeRunningProcesses_v2 (drivers 450.66 to 510)",
        "nvml: the driver has no nvmlDeviceGetGraphicsRunningProcesses_v3: process lists through "
        "nvmlDeviceGetGraphicsRunningProcesses_v2 (drivers 450.66 to 510)",
    ]


def test_driver_450_lists_no_processes_and_says_why_once():
    snapshot, reader, lines = three_polls_logged(driver="450")
    (device,) = snapshot.devices
    assert (device.processes, device.task_support, device.gpu_busy) == ((), 0, 40)
    said = [line for line in lines if "not listed" in line]
    assert len(said) == 2 and said[0] == (
        "nvml: compute processes are not listed: the driver has neither "
        "nvmlDeviceGetComputeRunningProcesses_v3 nor _v2 (older than 450.66)"
    )
    # remembered as missing: not looked for again at every poll
    assert {"nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"} <= (
        reader._devices[0].missing
    )


def test_unknown_driver_and_symbol_names_are_scenario_errors():
    with pytest.raises(ScenarioError, match="driver must be one of current, 470, 450"):
        parse_scenario({"driver": "999"})
    with pytest.raises(ScenarioError, match=r"missing_symbols\[0\] 'nvmlDeviceGetFoo'"):
        parse_scenario({"missing_symbols": ["nvmlDeviceGetFoo"]})


# -- size queries --------------------------------------------------------------------------


def test_process_utilization_size_query_may_report_a_constant_capacity():
    """As go-nvml issue 11 saw: the NULL-buffer query says 100; the fill returns the real count."""
    binding = host(gpu={"process_list_capacity": 100, "process_utilization": "per-call"})
    handle = binding.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    ret = binding.nvmlLib.nvmlDeviceGetProcessUtilization(handle, None, ctypes.byref(count), ctypes.c_ulonglong(0))
    assert (ret, count.value) == (binding.NVML_ERROR_INSUFFICIENT_SIZE, 100)
    samples = binding.nvmlDeviceGetProcessUtilization(handle, 0)
    assert [(s.pid, s.smUtil) for s in samples] == [(300, 20)]


def test_lists_that_grow_between_size_query_and_fill():
    """The fill finds more entries than the size query said: INSUFFICIENT_SIZE if they do not fit."""
    growth = {"process_lists": [3, 9], "samples": 1, "process_utilization": 1}
    binding = host(gpu={"grow_between_calls": growth})
    handle = binding.nvmlDeviceGetHandleByIndex(0)
    # pynvml sizes process lists count * 2 + 5: three new processes fit, nine do not
    listed = binding.nvmlDeviceGetComputeRunningProcesses(handle)
    assert [p.pid for p in listed] == [300, GROWN_PID, GROWN_PID + 1, GROWN_PID + 2]
    with pytest.raises(binding.NVMLError_InsufficientSize):
        binding.nvmlDeviceGetComputeRunningProcesses(handle)
    with pytest.raises(binding.NVMLError_InsufficientSize):
        binding.nvmlDeviceGetSamples(handle, 1, 0)
    with pytest.raises(binding.NVMLError_InsufficientSize):
        binding.nvmlDeviceGetProcessUtilization(handle, 0)


def test_the_reader_asks_again_when_a_buffer_was_too_small():
    """A list longer than the array kept for it: the driver says INSUFFICIENT_SIZE and how many,
    the array grows and the poll asks again (the processes that came meanwhile with it); nothing
    is a problem, and later polls fill the grown arrays with one call each."""
    clock = [0.0]
    processes = [{"pid": 300 + i, "memory_mib": 64, "sm_util": 20} for i in range(40)]
    # entries come between the answer that sized the array and the fill
    growth = {"samples": [1, 0], "process_utilization": [1, 0], "process_lists": [3, 0]}
    reader = reader_on(clock, gpu={"processes": processes, "grow_between_calls": growth})
    for second in range(3):
        clock[0] = float(second)
        snapshot, problems = reader.read(clock[0])
        assert problems == {}
    (device,) = snapshot.devices
    listed = {p.pid: p.gpu_busy for p in device.processes}
    assert device.gpu_busy == 40 and {listed[300 + i] for i in range(40)} == {20}
    assert set(listed) == set(range(300, 340))  # (those that came at start-up's probe were gone again)
    calls = reader.nvml.nvmlLib.calls
    # each too small once (the list at start-up, the samples at the first poll), then one call each time
    assert calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 2 + 3
    assert calls["nvmlDeviceGetProcessUtilization"] == 2 + 1 + 1


def test_a_size_query_that_reports_a_capacity_reads_as_usual():
    clock = [0.0]
    reader = reader_on(clock, gpu={"process_list_capacity": 100})
    snapshot, problems = reader.read(0.0)
    assert problems == {}
    assert [(p.pid, p.gpu_busy) for p in snapshot.devices[0].processes] == [(300, 20)]


def test_a_list_that_keeps_growing_is_given_up_on_and_memory_still_counts(monkeypatch):
    """Too small at every try of a poll: a bounded number of tries, one problem; the processes
    keep their memory; the next poll fills the array grown meanwhile."""
    monkeypatch.setattr(nvml_calls, "SIZE_RETRIES", 1)
    clock = [0.0]
    # one figure per compute-list call: at start-up, then polls 0, 1, 2
    processes = [{"pid": 300, "memory_mib": [100, 200, 300, 400], "sm_util": 20}]
    # the first read brings the driver's whole buffer, more than the first array holds; grown
    # to twice that, the list has grown more by the second try
    growth = {"process_utilization": [5000, 0]}
    reader = reader_on(clock, gpu={"processes": processes, "grow_between_calls": growth})
    counters = Counters()
    seen = []
    for second in range(3):
        clock[0] = float(second)
        snapshot, problems = reader.read(clock[0])
        counters.fold(snapshot)
        seen.append(dict(problems))
    assert seen[0] == {
        "GPU-5111a7ed-0000-4000-8000-000000000000 nvmlDeviceGetProcessUtilization: NVML_ERROR_INSUFFICIENT_SIZE":
            "GPU 00000000:65:00.0: nvmlDeviceGetProcessUtilization: NVML_ERROR_INSUFFICIENT_SIZE",
    }
    assert seen[1:] == [{}, {}]
    proc = next(p for p in snapshot.devices[0].processes if p.pid == 300)
    assert proc.memory_kib == 400 * 1024
    totals = counters.devices[0].processes[300]
    # not counted in the poll its busy figures failed, but its memory is what is reported now
    assert (totals.samples, totals.memory_now_kib) == (2, 400 * 1024)


def test_a_failed_utilization_read_keeps_the_memory_on_the_board():
    """One poll's process utilization fails: that poll still reports the processes' memory."""
    from atopgpud_tw.server.atop.board import Board

    clock = [0.0]
    fault = {"call": "nvmlDeviceGetProcessUtilization", "error": "NVML_ERROR_UNKNOWN", "from": 1, "until": 2}
    # one figure per compute-list call: at start-up, then polls 0, 1, 2
    processes = [{"pid": 300, "memory_mib": [100, 150, 250, 350], "sm_util": 20}]
    reader = reader_on(clock, gpu={"processes": processes, "faults": [fault]})
    board = Board()
    memory = []
    for second in range(3):
        clock[0] = float(second)
        board.fold(reader.read(clock[0])[0])
        memory.append(board.counters.devices[0].processes[300].memory_now_kib)
    assert memory == [150 * 1024, 250 * 1024, 350 * 1024]
    assert board.counters.devices[0].processes[300].samples == 2


# -- faults --------------------------------------------------------------------------------


def test_library_mismatch_fault_is_the_binding_s_own_exception():
    fault = {"call": "nvmlDeviceGetComputeRunningProcesses", "error": "NVMLLibraryMismatchError"}
    binding = host(gpu={"faults": [fault]})
    handle = binding.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(binding.NVMLLibraryMismatchError):
        binding.nvmlDeviceGetComputeRunningProcesses(handle)
    with pytest.raises(binding.NVMLError_FunctionNotFound):
        binding.nvmlDeviceGetComputeRunningProcesses_v2(handle)


def test_runtime_error_fault_is_a_reply_the_binding_cannot_convert():
    """A name that is not UTF-8, a process list longer than its buffer: the binding's own code raises."""
    faults = [
        {"call": "nvmlDeviceGetName", "error": "RuntimeError"},
        {"call": "nvmlDeviceGetComputeRunningProcesses", "error": "RuntimeError"},
    ]
    binding = host(gpu={"faults": faults})
    handle = binding.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(UnicodeDecodeError):
        binding.nvmlDeviceGetName(handle)
    with pytest.raises(IndexError):
        binding.nvmlDeviceGetComputeRunningProcesses(handle)
    assert binding.nvmlLib.errors == []


def test_runtime_error_only_where_the_binding_decodes_the_reply():
    fault = {"call": "nvmlDeviceGetMemoryInfo", "error": "RuntimeError"}
    with pytest.raises(ScenarioError, match=r"gpus\[0\]\.faults\[0\]: a RuntimeError comes from a reply"):
        parse_scenario({"gpus": [card(faults=[fault])]})


def test_a_card_whose_name_the_binding_cannot_decode_is_left_out_not_fatal():
    """The reader starts with the other cards; the odd one is said to be unusable."""
    clock = [0.0]
    cards = [card(faults=[{"call": "nvmlDeviceGetName", "error": "RuntimeError"}]), card(busid="00000000:66:00.0")]
    binding = simulated_binding(parse_scenario({"gpus": cards}), clock=lambda: clock[0])
    reader = NvmlReader(binding, reactor=None)
    layout = reader.open()
    assert [d.busid for d in layout.devices] == ["00000000:66:00.0"]
