"""The NVML reader over the simulator, driven synchronously with `reader.read(now)`.

The simulator runs on an injected clock (``t[0]``), so every poll sees the
scenario at a known time; no thread or reactor is involved.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from scenarios import a10_card
from sim_readers import CountingNvml, SkewedNvml, make_reader, poll

from atopgpud_tw import codec
from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.readers.nvml.support import HOLD_POLLS, HOLD_SECONDS, RETRY_UNSUPPORTED
from atopgpud_tw.server.atop import render
from atopgpud_tw.sim import binding_over, parse_scenario
from atopgpud_tw.snapshot import UNSUPPORTED


def gpu(**fields: Any) -> dict:
    """A plain card with one compute process; each test changes what it needs."""
    return a10_card(**fields)


def test_whole_card_is_read_as_one_device():
    """A card out of MIG mode: its bus id, name, UUID key, rates, memory in KiB and processes."""
    clock = [0.0]
    reader, _ = make_reader({"gpus": [gpu(uuid="GPU-aaaa")]}, clock)
    snapshot, problems = poll(reader, clock, 0.0)
    (device,) = snapshot.devices
    assert problems == {}
    assert (device.key, device.busid, device.name) == ("GPU-aaaa", "00000000:65:00.0", "NVIDIA A10")
    assert (device.gpu_busy, device.mem_busy) == (40, 10)
    assert (device.memory_total_kib, device.memory_used_kib) == (24000 * 1024, 1000 * 1024)
    ((pid, kind, memory, busy),) = [(p.pid, p.kind, p.memory_kib, p.gpu_busy) for p in device.processes]
    assert (pid, kind, memory, busy) == (300, "C", 100 * 1024, 20)


def test_compute_and_graphics_lists_merge_by_pid():
    """A pid in both process lists is one process of kind C+G, counted once per poll."""
    clock = [0.0]
    processes = [
        {"pid": 5, "type": "C+G", "memory_mib": 64, "sm_util": 10},
        {"pid": 6, "type": "G", "memory_mib": 32, "sm_util": 10},
    ]
    reader, _ = make_reader({"gpus": [gpu(processes=processes)]}, clock)
    counters = Counters()
    for second in range(3):
        snapshot, _ = poll(reader, clock, float(second))
        counters.fold(snapshot)
    assert sorted((p.pid, p.kind) for p in snapshot.devices[0].processes) == [(5, "C+G"), (6, "G")]
    totals = counters.devices[0].processes[5]
    assert (totals.samples, totals.memory_cum_kib) == (3, 3 * 64 * 1024)


def test_not_supported_is_remembered_and_not_asked_again():
    """NOT_SUPPORTED utilization from the first call is -1 at once, with nothing logged; the
    call is made again at each poll until that has held for HOLD_SECONDS and HOLD_POLLS polls,
    and then only at its long backoff."""
    clock = [0.0]
    reader, nvml = make_reader({"gpus": [gpu(gpu_util=None)]}, clock)
    held = 1 + max(HOLD_POLLS, int(HOLD_SECONDS))
    for second in range(held + 1):
        snapshot, problems = poll(reader, clock, float(second))
        (device,) = snapshot.devices
        assert (device.gpu_busy, device.mem_busy) == (UNSUPPORTED, UNSUPPORTED)
        assert problems == {}
    before = nvml.calls["nvmlDeviceGetUtilizationRates"], nvml.calls["nvmlDeviceGetMigMode"]
    assert before[0] <= held + 1
    for second in range(held + 1, held + 1 + int(RETRY_UNSUPPORTED[0]) - 5):
        poll(reader, clock, float(second))
    # not MIG capable: held as well
    assert (nvml.calls["nvmlDeviceGetUtilizationRates"], nvml.calls["nvmlDeviceGetMigMode"]) == before


def test_process_busy_uses_a_last_seen_timestamp_per_gpu():
    """Each GPU asks for samples newer than its own last stamp, so no GPU's samples are skipped."""
    clock = [0.0]
    scenario = parse_scenario({"gpus": [gpu(), gpu(busid="00000000:66:00.0")]})
    nvml = CountingNvml(binding_over(SkewedNvml(scenario, clock=lambda: clock[0])))
    reader = NvmlReader(nvml, reactor=None)
    reader.open()
    busy = []
    for second in range(3):
        snapshot, _ = poll(reader, clock, float(second))
        busy.append([d.processes[0].gpu_busy for d in snapshot.devices])
    gpu_of = nvml.nvmlLib.model_handle
    calls = [(gpu_of(args[0]).gpu, args[1]) for name, args in nvml.args if name == "nvmlDeviceGetProcessUtilization"]
    # each GPU's first call in a poll (a second one, once, tests how the driver lists processes)
    asked = [call for i, call in enumerate(calls) if i == 0 or calls[i - 1][0] != call[0]]
    assert [g for g, _ in asked] == [0, 1, 0, 1, 0, 1]
    assert (asked[0][1], asked[1][1]) == (0, 0)
    # from the second poll on, each GPU passes back its own newest stamp
    later = zip(asked[2::2], asked[3::2])
    assert all(since0 - since1 == SkewedNvml.SKEW for (_, since0), (_, since1) in later)
    assert busy == [[20, 20]] * 3


def test_not_found_process_utilization_means_idle():
    """NOT_FOUND from process utilization is 0 % busy, not a failure: the process counts."""
    clock = [0.0]
    processes = [{"pid": 7, "memory_mib": 10, "sm_util": 0, "mem_util": 0}]
    reader, nvml = make_reader({"gpus": [gpu(processes=processes)]}, clock)
    counters = Counters()
    for second in range(3):
        snapshot, problems = poll(reader, clock, float(second))
        counters.fold(snapshot)
        assert problems == {}
    (proc,) = snapshot.devices[0].processes
    assert (proc.gpu_busy, proc.mem_busy) == (0, 0)
    totals = counters.devices[0].processes[7]
    assert (totals.samples, totals.gpu_busy_cum) == (3, 0)
    assert nvml.calls["nvmlDeviceGetProcessUtilization"] == 3


def test_names_are_str_whether_the_binding_gives_bytes_or_str():
    """Names and bus ids come out as str from bytes (old bindings) and from str (today's)."""
    clock = [0.0]
    as_bytes = {
        "nvmlDeviceGetName": lambda name, handle: name.encode() + b"\0",
        "nvmlDeviceGetUUID": lambda uuid, handle: uuid.encode(),
        "nvmlDeviceGetPciInfo": lambda info, handle: SimpleNamespace(busId=info.busId.encode()),
    }
    as_str: dict[str, Any] = {}  # the installed binding's own results
    seen = []
    for rewrite in (as_bytes, as_str):
        reader, _ = make_reader({"gpus": [gpu(uuid="GPU-bbbb")]}, clock, rewrite=rewrite)
        snapshot, _ = poll(reader, clock, 0.0)
        (device,) = snapshot.devices
        seen.append((device.key, device.busid, device.name))
    assert seen == [("GPU-bbbb", "00000000:65:00.0", "NVIDIA A10")] * 2
    assert all(isinstance(field, str) for row in seen for field in row)


def test_task_support_digit_follows_the_process_lists():
    """T's task-support digit: 1 compute, 2 graphics, 3 both, 0 neither."""
    clock = [0.0]
    cards = [
        gpu(busid="00000000:01:00.0"),
        gpu(busid="00000000:02:00.0", graphics_list=False),
        gpu(busid="00000000:03:00.0", compute_list=False),
        gpu(busid="00000000:04:00.0", compute_list=False, graphics_list=False),
    ]
    reader, _ = make_reader({"gpus": cards}, clock)
    counters = Counters()
    counters.fold(poll(reader, clock, 0.0)[0])
    types = codec.parse_types(render.render_types(counters.devices))
    assert [t.task_support for t in types] == [3, 1, 2, 0]


def test_a_failed_read_is_a_problem_for_that_poll_only():
    """A passing error skips the value for one poll and names the cause; the next poll counts."""
    clock = [0.0]
    fault = {"call": "nvmlDeviceGetMemoryInfo", "error": "NVML_ERROR_UNKNOWN", "from": 1, "until": 2}
    reader, _ = make_reader({"gpus": [gpu(faults=[fault])]}, clock)
    counters = Counters()
    outcomes = []
    for second in range(3):
        snapshot, problems = poll(reader, clock, float(second))
        counters.fold(snapshot)
        outcomes.append((snapshot.devices[0].memory_used_kib, sorted(problems.values())))
    assert outcomes == [
        (1000 * 1024, []),
        (None, ["GPU 00000000:65:00.0: nvmlDeviceGetMemoryInfo: NVML_ERROR_UNKNOWN"]),
        (1000 * 1024, []),
    ]
    assert counters.devices[0].samples == 2


def test_a_lost_gpu_is_absent_and_the_other_is_read():
    """GPU_IS_LOST on one card makes it absent for that poll; the other card is unaffected."""
    clock = [0.0]
    fault = {"call": "nvmlDeviceGetMemoryInfo", "error": "NVML_ERROR_GPU_IS_LOST", "from": 1}
    scenario = {"gpus": [gpu(faults=[fault]), gpu(busid="00000000:66:00.0")]}
    reader, _ = make_reader(scenario, clock)
    poll(reader, clock, 0.0)
    snapshot, problems = poll(reader, clock, 1.0)
    assert [d.present for d in snapshot.devices] == [False, True]
    assert list(problems) == ["GPU-5111a7ed-0000-4000-8000-000000000000 lost"]
