"""The simulator: a libnvidia-ml beneath the real pynvml, and its scenario checks."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from atopgpud_tw.readers.nvml import device as nvml_device
from atopgpud_tw.readers.nvml import direct as nvml_direct
from atopgpud_tw.readers.nvml import mig as nvml_mig
from atopgpud_tw.readers.nvml import reader as nvml_reader
from atopgpud_tw.sim import (
    SHIM,
    ScenarioError,
    SimulatedNvml,
    demo_scenario,
    load_scenario,
    parse_scenario,
    pynvml_origin,
    simulated_binding,
)
from atopgpud_tw.sim.answers import NvmlFault
from atopgpud_tw.sim.library_symbols import GPM_SYMBOLS, LIBRARY_SYMBOLS
from atopgpud_tw.sim.scenario import NVML_ERRORS

pynvml = pytest.importorskip("pynvml")

#: the pynvml functions atop's own atopgpud calls (it runs on the shim)
REFERENCE_CALLS = {
    "nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetProcessUtilization", "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
}


def symbols_behind(name: str, seen: set[str] | None = None) -> set[str]:
    """The C symbols pynvml's function `name` looks up, following the wrappers it calls."""
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    source = inspect.getsource(inspect.unwrap(getattr(pynvml, name)))
    found = set(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', source))
    for called in set(re.findall(r"\b(nvml[A-Z]\w+)\(", source)) - {name}:
        if callable(getattr(pynvml, called, None)):
            found |= symbols_behind(called, seen)
    return found


def reader_functions() -> set[str]:
    source = "".join(inspect.getsource(m) for m in (nvml_reader, nvml_device, nvml_mig, nvml_direct))
    return {name for name in re.findall(r"\b(nvml[A-Z]\w+)\b", source) if callable(getattr(pynvml, name, None))}


def test_installed_pynvml_is_the_real_binding():
    """The binding beneath the reader is nvidia-ml-py's, not a stand-in."""
    assert hasattr(pynvml, "_nvmlGetFunctionPointer")
    assert pynvml_origin() == pynvml.__file__


def test_every_symbol_the_binding_needs_is_in_the_library():
    """Each C symbol behind a pynvml function the reader or atop's atopgpud calls is simulated."""
    used = reader_functions()
    assert {"nvmlDeviceGetMigMode", "nvmlDeviceGetMigDeviceHandleByIndex", "nvmlDeviceGetSamples"} <= used
    needed = set().union(*(symbols_behind(name) for name in used | REFERENCE_CALLS))
    assert {"nvmlInitWithFlags", "nvmlDeviceGetCount_v2", "nvmlDeviceGetComputeRunningProcesses_v3"} <= needed
    # NVMLError's text for a code pynvml does not know comes from the library
    assert needed | {"nvmlErrorString"} <= set(LIBRARY_SYMBOLS)
    library = simulated_binding(demo_scenario()).nvmlLib
    assert all(callable(getattr(library, symbol)) for symbol in LIBRARY_SYMBOLS)


def test_the_reader_calls_the_real_wrappers_down_to_the_c_symbols():
    """The reader's nvml is a copy of the installed pynvml; its calls reach the library's C functions."""
    from atopgpud_tw.readers.nvml.reader import NvmlReader

    reader = NvmlReader(simulated_binding(demo_scenario(), clock=lambda: 5.0), reactor=None)
    reader.open()
    reader.read(5.0)
    binding = reader.nvml
    assert binding is not pynvml and binding.__file__ == pynvml.__file__
    for name in ("nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetComputeRunningProcesses"):
        function = getattr(binding, name)
        assert function.__module__ == binding.__name__
        assert inspect.unwrap(function).__code__.co_filename == pynvml.__file__
    calls = binding.nvmlLib.calls
    for symbol in ("nvmlInitWithFlags", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
                   "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetMemoryInfo_v2",
                   "nvmlDeviceGetSamples", "nvmlDeviceGetProcessUtilization"):
        assert calls[symbol] >= 1, symbol
    # a size query and a fill per process list
    assert calls["nvmlDeviceGetComputeRunningProcesses_v3"] % 2 == 0
    assert binding.nvmlLib.errors == []


def test_each_simulated_host_has_its_own_binding():
    """Two hosts: two module copies, each with its own library, cache and refcount."""
    first, second = simulated_binding(demo_scenario()), simulated_binding(parse_scenario({"gpus": [{}]}))
    first.nvmlInit()
    second.nvmlInit()
    assert (first.nvmlDeviceGetCount(), second.nvmlDeviceGetCount()) == (2, 1)
    assert first.nvmlLib is not second.nvmlLib
    assert first._nvmlGetFunctionPointer_cache is not second._nvmlGetFunctionPointer_cache
    assert "nvmlLib" not in vars(pynvml) or pynvml.nvmlLib is None


def test_model_faults_reach_the_binding_as_its_own_error_classes():
    """A fault of every NVML code the scenario may name comes out of the real binding as the
    subclass pynvml raises for that code, under its name, with that code."""
    for name, value in NVML_ERRORS.items():
        assert getattr(pynvml, name) == value
        nvml = simulated_binding(parse_scenario(
            {"gpus": [{"faults": [{"call": "nvmlDeviceGetUUID", "error": name}]}]}))
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(nvml.NVMLError) as raised:
            nvml.nvmlDeviceGetUUID(handle)
        assert type(raised.value) is nvml.NVMLError._valClassMapping[value]
        assert type(raised.value).__name__.startswith("NVMLError_") and raised.value.value == value


# -- scenario errors ----------------------------------------------------------------

BAD_SCENARIOS = [
    ({"gpus": {}}, "gpus must be a list"),
    ({"gpu": []}, "gpu is not a known field"),
    ({"gpus": [{"memory_totl_mib": 1}]}, "gpus[0].memory_totl_mib is not a known field"),
    ({"gpus": [{"gpu_util": 120}]}, "gpus[0].gpu_util must be a number from 0 to 100"),
    ({"gpus": [{"memory_used_mib": []}]}, "gpus[0].memory_used_mib must not be an empty list"),
    ({"gpus": [{"compute_list": "yes"}]}, "gpus[0].compute_list must be true or false"),
    ({"gpus": [{"processes": [{"pid": 0}]}]}, "gpus[0].processes[0].pid must be a positive integer"),
    ({"gpus": [{"processes": [{"pid": 1, "type": "X"}]}]}, "gpus[0].processes[0].type must be one of"),
    ({"gpus": [{"processes": [{"pid": 1, "start": 5, "stop": 2}]}]}, "processes[0].stop must come after"),
    ({"gpus": [{"faults": [{"call": "x", "error": "NVML_ERROR_UNKNOWN"}]}]}, "faults[0].call must name"),
    ({"gpus": [{"faults": [{"call": "nvmlInit", "error": "NOPE"}]}]}, "gpus[0].faults[0].error 'NOPE'"),
    ({"gpus": [{}, {"busid": "00000000:17:00.0"}]}, "gpus: two GPUs have the same busid"),
    ({"gpus": [{"mig": [{"profile": "3g 40gb"}]}]}, "gpus[0].mig[0].profile must be a name"),
    ({"gpus": [{"mig": [{"profile": "1g.10gb", "slot": -1}]}]}, "gpus[0].mig[0].slot must be an integer"),
    ({"gpus": [{"mig": [{"profile": "1g.10gb", "gpu_instance": 1.5}]}]}, "mig[0].gpu_instance must be"),
    ({"gpus": [{"mig": [{"profile": "a", "processes": [{"pid": 1, "sm": 1}]}]}]},
     "gpus[0].mig[0].processes[0].sm is not a known field"),
    ({"gpus": [{"mig": [{"profile": "a", "gpu_instance": 1}, {"profile": "b", "gpu_instance": 1}]}]},
     "gpus[0].mig[1]: gpu_instance/compute_instance 1/0 is in use by mig[0] at the same time"),
    ({"gpus": [{"mig": [{"profile": "a", "slot": 3}, {"profile": "b", "slot": 3, "start": 1}]}]},
     "gpus[0].mig[1].slot 3 is in use by mig[0] at the same time"),
    ({"gpus": [{"mig_capable": False, "mig": []}]}, "gpus[0].mig_capable cannot be false"),
    ({"driver": 470}, "driver must be one of current, 470, 450"),
    ({"missing_symbols": "nvmlDeviceGetSamples"}, "missing_symbols must be a list"),
    ({"gpus": [{"memory_reserved_mib": -1}]}, "gpus[0].memory_reserved_mib must be at least 0"),
    ({"gpus": [{"process_list_capacity": 0}]}, "gpus[0].process_list_capacity must be a positive integer"),
    ({"gpus": [{"grow_between_calls": 1.5}]}, "gpus[0].grow_between_calls must be an integer"),
    ({"gpus": [{"grow_between_calls": {"lists": 1}}]}, "gpus[0].grow_between_calls.lists is not a known field"),
    ({"gpus": [{"grow_between_calls": {"samples": [1, -1]}}]}, "gpus[0].grow_between_calls.samples must be an"),
    ({"gpus": [{"processes": [{"pid": 1, "memory_mib": [1, None]}]}]}, "gpus[0].processes[0].memory_mib must be a"),
    ({"faults": [{"call": "*", "error": "RuntimeError"}]}, "faults[0]: a RuntimeError comes from a reply"),
]


@pytest.mark.parametrize(("data", "message"), BAD_SCENARIOS)
def test_a_bad_scenario_file_names_the_field_in_one_line(tmp_path, data, message):
    """load_scenario: ScenarioError, one line, the file and the field that is wrong."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ScenarioError) as raised:
        load_scenario(path)
    text = str(raised.value)
    assert text.startswith(f"{path}: ") and "\n" not in text
    assert message in text


def test_a_file_that_is_missing_or_not_json_is_a_one_line_error(tmp_path):
    """Neither a missing file nor broken JSON raises anything but a one-line ScenarioError."""
    broken = tmp_path / "broken.json"
    broken.write_text('{"gpus": [\n  {"name": }\n]}')
    messages = []
    for path in (tmp_path / "missing.json", broken):
        with pytest.raises(ScenarioError) as raised:
            load_scenario(path)
        messages.append(str(raised.value))
    assert messages[0].startswith(f"{tmp_path / 'missing.json'}: ")
    assert messages[1].startswith(f"{broken}: not JSON (") and messages[1].endswith("at line 2)")
    assert all("\n" not in text for text in messages)


def test_carving_may_reuse_ids_and_slots_over_time_and_take_comments():
    """A later instance may take a destroyed one's ids and slot; `_` keys are comments."""
    scenario = parse_scenario({
        "_comment": "an A100 carved again at 10 s",
        "gpus": [{"mig": [
            {"profile": "7g.80gb", "gpu_instance": 0, "stop": 10},
            {"profile": "3g.40gb", "gpu_instance": 0, "start": 10, "slot": 0, "_note": "same ids"},
        ]}],
    })
    assert [m.slot for m in scenario.gpus[0].mig] == [0, 0]
    assert scenario.gpus[0].mig_capable


# -- MIG behaviour ---------------------------------------------------------------------


def fails_with(name: str) -> Any:
    """The driver model fails the call with NVML_ERROR_<name>."""
    return pytest.raises(NvmlFault, match=f"^NVML_ERROR_{name}$")


def mig_host(clock: list[float]) -> SimulatedNvml:
    sim = SimulatedNvml(
        parse_scenario({"gpus": [
            {"name": "NVIDIA A100-SXM4-80GB", "memory_total_mib": 81920, "mig": [
                {"profile": "3g.40gb", "gpu_instance": 2, "memory_total_mib": 40192, "memory_used_mib": 100,
                 "processes": [{"pid": 11, "memory_mib": 60}], "slot": 1},
                {"profile": "4g.40gb", "gpu_instance": 1, "memory_total_mib": 40192, "memory_used_mib": 20,
                 "processes": [{"pid": 12, "memory_mib": 10}], "slot": 4, "stop": 5,
                 "faults": [{"call": "nvmlDeviceGetUUID", "error": "NVML_ERROR_UNKNOWN"}]},
            ]},
            {"busid": "00000000:65:00.0"},
            {"busid": "00000000:66:00.0", "mig_capable": True},
        ]}),
        clock=lambda: clock[0],
    )
    sim.nvmlInit()
    return sim


def test_mig_mode_and_sparse_slots_behave_like_nvml():
    """GetMigMode per card; empty slots NOT_FOUND, out of range INVALID_ARGUMENT."""
    sim = mig_host([0.0])
    card, plain, capable = (sim.nvmlDeviceGetHandleByIndex(i) for i in range(3))
    assert sim.nvmlDeviceGetMigMode(card) == [1, 1]
    assert sim.nvmlDeviceGetMigMode(capable) == [0, 0]
    with fails_with("NOT_SUPPORTED"):
        sim.nvmlDeviceGetMigMode(plain)
    assert [sim.nvmlDeviceGetMaxMigDeviceCount(h) for h in (card, plain, capable)] == [7, 0, 0]
    with fails_with("NOT_FOUND"):
        sim.nvmlDeviceGetMigDeviceHandleByIndex(card, 0)
    with fails_with("INVALID_ARGUMENT"):
        sim.nvmlDeviceGetMigDeviceHandleByIndex(card, 7)
    handle = sim.nvmlDeviceGetMigDeviceHandleByIndex(card, 1)
    assert bool(sim.nvmlDeviceIsMigDeviceHandle(handle)) and not bool(sim.nvmlDeviceIsMigDeviceHandle(card))
    assert sim.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle) == card
    assert sim.nvmlDeviceGetName(handle) == "NVIDIA A100-SXM4-80GB MIG 3g.40gb"
    assert (sim.nvmlDeviceGetGpuInstanceId(handle), sim.nvmlDeviceGetComputeInstanceId(handle)) == (2, 0)
    assert sim.nvmlDeviceGetUUID(handle).startswith("MIG-")


def test_mig_handles_have_their_own_memory_and_processes_and_no_utilization():
    """Memory and processes per instance; utilization NOT_SUPPORTED on the card and the instances."""
    sim = mig_host([0.0])
    card = sim.nvmlDeviceGetHandleByIndex(0)
    first, second = (sim.nvmlDeviceGetMigDeviceHandleByIndex(card, slot) for slot in (1, 4))
    assert (sim.nvmlDeviceGetMemoryInfo(first).total, sim.nvmlDeviceGetMemoryInfo(first).used) == (
        40192 << 20, 100 << 20
    )
    assert (sim.nvmlDeviceGetMemoryInfo(card).total, sim.nvmlDeviceGetMemoryInfo(card).used) == (
        81920 << 20, 120 << 20
    )
    listed = sim.nvmlDeviceGetComputeRunningProcesses(first)
    assert [(p.pid, p.usedGpuMemory, p.gpuInstanceId) for p in listed] == [(11, 60 << 20, 2)]
    assert sorted(p.pid for p in sim.nvmlDeviceGetComputeRunningProcesses(card)) == [11, 12]
    for handle in (card, first, second):
        with fails_with("NOT_SUPPORTED"):
            sim.nvmlDeviceGetUtilizationRates(handle)
        with fails_with("NOT_SUPPORTED"):
            sim.nvmlDeviceGetProcessUtilization(handle, 0)
    with fails_with("UNKNOWN"):
        sim.nvmlDeviceGetUUID(second)  # a fault of that instance only
    assert sim.nvmlDeviceGetUUID(first).startswith("MIG-")


def test_a_destroyed_instance_handle_is_invalid():
    """After an instance's stop its slot is empty and its old handle fails with INVALID_ARGUMENT."""
    clock = [0.0]
    sim = mig_host(clock)
    card = sim.nvmlDeviceGetHandleByIndex(0)
    handle = sim.nvmlDeviceGetMigDeviceHandleByIndex(card, 4)
    clock[0] = 5.0
    for call in ("nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses"):
        with fails_with("INVALID_ARGUMENT"):
            getattr(sim, call)(handle)
    with fails_with("NOT_FOUND"):
        sim.nvmlDeviceGetMigDeviceHandleByIndex(card, 4)
    assert [p.pid for p in sim.nvmlDeviceGetComputeRunningProcesses(card)] == [11]


@pytest.mark.e2e
def test_the_shim_is_the_real_pynvml_over_the_simulated_library(tmp_path):
    """With the shim first on PYTHONPATH and ATOPGPUD_SCENARIO set, `import pynvml` is the
    installed nvidia-ml-py, its nvmlLib the simulated library."""
    scenario = tmp_path / "one.json"
    scenario.write_text(json.dumps({"gpus": [{"name": "NVIDIA Shim Test"}]}))
    code = (
        "import pynvml as p; p.nvmlInit(); h = p.nvmlDeviceGetHandleByIndex(0); "
        "print(p.nvmlDeviceGetName(h)); print(p.__file__); print(type(p.nvmlLib).__name__); "
        "print(p.nvmlDeviceGetComputeRunningProcesses(h))"
    )
    path = os.pathsep.join([str(SHIM), *sys.path])
    env = dict(os.environ, PYTHONPATH=path, ATOPGPUD_SCENARIO=str(scenario))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["NVIDIA Shim Test", pynvml.__file__, "SimulatedLibrary", "[]"]


def test_driver_library_and_size_query_fields_parse():
    """driver, missing_symbols and the per-GPU size-query fields; a bare count of growth is for every list."""
    scenario = parse_scenario({
        "driver": "470",
        "missing_symbols": ["nvmlDeviceGetSamples"],
        "gpus": [{
            "memory_reserved_mib": 469,
            "process_list_capacity": 100,
            "grow_between_calls": [2, 0],
            "processes": [{"pid": 1, "memory_mib": None}],
        }],
    })
    assert scenario.absent_symbols == {
        "nvmlDeviceGetSamples", "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses_v3",
    } | set(GPM_SYMBOLS)
    (gpu,) = scenario.gpus
    assert (gpu.memory_reserved_mib, gpu.process_list_capacity, gpu.processes[0].memory_mib) == (469, 100, None)
    assert gpu.grow_between_calls == {"process_lists": (2, 0), "samples": (2, 0), "process_utilization": (2, 0)}
    assert parse_scenario({"gpus": [{}]}).gpus[0].grow_between_calls == {
        "process_lists": 0, "samples": 0, "process_utilization": 0
    }


@pytest.mark.parametrize("utilization", ["per-period", "per-call"])
def test_every_round_of_a_repeated_scenario_has_its_process_samples(utilization):
    """With `repeat`, a process that runs part of each round is busy in every round, not in the
    first alone: the periods of later rounds are weighed in the round's scenario time (a
    process's start and stop, and timelines, are scenario time)."""
    from clocked import ClockedReader
    from scenarios import a10_card
    from twisted.internet.task import Clock

    from atopgpud_tw.server.atop.board import Board
    from atopgpud_tw.server.atop.poller import PollerService

    clock = Clock()
    clock.advance(0.5)
    card = a10_card(
        processes=[{"pid": 300, "memory_mib": 100, "sm_util": 30, "mem_util": 4, "start": 1, "stop": 9},
                   {"pid": 301, "memory_mib": 100, "sm_util": 10, "mem_util": 2}],
        process_utilization=utilization,
    )
    board = Board()
    poller = PollerService(ClockedReader({"repeat": 10, "gpus": [card]}, clock), board, 1.0, clock)
    poller.startService()
    seen = {}
    while clock.seconds() < 40:
        device = board.counters.devices[0]
        seen[round(clock.seconds(), 1)] = (
            device.gpu_busy_total, device.samples,
            {pid: (p.gpu_busy_cum, p.samples) for pid, p in device.processes.items()},
        )
        clock.advance(1.0)
    poller.stopService()
    for round_ in range(3):
        (gpu_a, n_a, procs_a), (gpu_b, n_b, procs_b) = seen[10 * round_ + 2.5], seen[10 * round_ + 8.5]
        assert (gpu_b - gpu_a) / (n_b - n_a) == 40, round_
        for pid, busy in ((300, 30), (301, 10)):
            before = procs_a.get(pid, (0, 0))
            assert (procs_b[pid][0] - before[0]) / (procs_b[pid][1] - before[1]) == busy, (round_, pid)
