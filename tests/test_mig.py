"""MIG: a card in MIG mode is shown as its instances (or, with --mig card, as one device).

A mixed host (an A100 carved into three instances beside a whole A10) runs
through the NVML reader, the counters and the codec, driven synchronously on
the simulator's injected clock; one test runs the installed daemon on it.
"""

from __future__ import annotations

from typing import Any

import pytest
import render_oracle
from daemon import run_daemon
from scenarios import a10_card
from sim_readers import make_reader, poll

from atopgpud_tw import codec
from atopgpud_tw.counters import Counters
from atopgpud_tw.problems import ProblemLog
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.server.atop import render
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.sim import SimulatedNvml, binding_over, parse_scenario, simulated_binding
from atopgpud_tw.snapshot import UNSUPPORTED

CARD_UUID = "GPU-5111a7ed-0000-4000-8000-0000000000a1"
MIB = 1024


def instance(profile: str, gi: int, total: int, used: int, processes: list, **fields: Any) -> dict:
    spec = {
        "profile": profile,
        "gpu_instance": gi,
        "compute_instance": 0,
        "memory_total_mib": total,
        "memory_used_mib": used,
        "processes": [{"pid": pid, "memory_mib": memory} for pid, memory in processes],
    }
    spec.update(fields)
    return spec


def mixed(*instances: dict) -> dict:
    """An A100 in MIG mode (three instances unless given) and a whole A10."""
    carving = list(instances) or [
        instance("3g.40gb", 1, 40192, 1000, [(101, 500), (104, 100)]),
        instance("2g.20gb", 5, 19968, 300, [(102, 200)]),
        instance("1g.10gb", 13, 9728, 0, []),
    ]
    return {
        "gpus": [
            {
                "name": "NVIDIA A100-SXM4-80GB",
                "busid": "00000000:17:00.0",
                "uuid": CARD_UUID,
                "memory_total_mib": 81920,
                "mig": carving,
            },
            a10_card(processes=[{"pid": 201, "memory_mib": 100, "sm_util": 20, "mem_util": 4}]),
        ]
    }


def run(scenario: dict, seconds: int = 1, mig: str = "instances") -> tuple[Counters, list[dict[str, str]]]:
    """Poll once per simulated second into fresh counters; the problems of each poll."""
    clock = [0.0]
    reader, _ = make_reader(scenario, clock, mig=mig)
    counters = Counters()
    problems = []
    for second in range(seconds):
        snapshot, found = poll(reader, clock, float(second))
        counters.fold(snapshot)
        problems.append(found)
    return counters, problems


def types(counters: Counters) -> list[codec.DeviceType]:
    return codec.parse_types(render.render_types(counters.devices))


def stats(counters: Counters) -> list[codec.DeviceStats]:
    return codec.parse_stats(render_oracle.render_stats(counters.devices, 2).body, 2)


def test_types_list_each_instance_and_the_whole_card():
    """T lists 3 instances and the A10; atop's 12-character windows tell them apart."""
    counters, problems = run(mixed())
    listed = types(counters)
    assert [(t.busid, t.name, t.task_support) for t in listed] == [
        ("00000000:17:00.0/1.0", "3g.40gb", 3),
        ("00000000:17:00.0/5.0", "2g.20gb", 3),
        ("00000000:17:00.0/13.0", "1g.10gb", 3),
        ("00000000:65:00.0", "NVIDIA_A10", 3),
    ]
    windows = [t.busid[-codec.ATOP_ID_CHARS:] for t in listed]
    assert windows == [":17:00.0/1.0", ":17:00.0/5.0", "17:00.0/13.0", "0000:65:00.0"]
    assert len(set(windows)) == 4
    assert [d.key for d in counters.devices[:3]] == [f"{CARD_UUID}/{ids}" for ids in ("1.0", "5.0", "13.0")]
    assert problems == [{}]


def test_instances_have_their_own_memory_and_processes_and_no_utilization():
    """Each instance has its memory and only its processes; busy figures are -1, not 0."""
    counters, _ = run(mixed(), seconds=3)
    first, second, third, whole = stats(counters)
    assert [(s.memory_total_kib, s.memory_used_kib) for s in (first, second, third)] == [
        (40192 * MIB, 1000 * MIB),
        (19968 * MIB, 300 * MIB),
        (9728 * MIB, 0),
    ]
    assert [sorted(p.pid for p in s.processes) for s in (first, second, third, whole)] == [
        [101, 104], [102], [], [201]
    ]
    for device in (first, second, third):
        busy = (device.gpu_busy_now, device.mem_busy_now, device.gpu_busy_cum, device.mem_busy_cum)
        assert busy == (UNSUPPORTED,) * 4
        assert (device.samples, device.memory_used_cum_kib) == (3, 3 * device.memory_used_kib)
        assert all((p.gpu_busy, p.mem_busy, p.samples) == (-1, -1, 3) for p in device.processes)
    assert (whole.gpu_busy_now, whole.gpu_busy_cum, whole.processes[0].gpu_busy) == (40, 120, 60)


def test_mig_card_mode_sums_the_instances_into_one_device():
    """--mig card: two devices; the A100 holds its instances' memory and processes."""
    counters, _ = run(mixed(), seconds=2, mig="card")
    assert [(t.busid, t.name) for t in types(counters)] == [
        ("00000000:17:00.0", "NVIDIA_A100-SXM4-80GB"),
        ("00000000:65:00.0", "NVIDIA_A10"),
    ]
    assert counters.devices[0].key == CARD_UUID
    card, whole = stats(counters)
    assert (card.memory_total_kib, card.memory_used_kib) == ((40192 + 19968 + 9728) * MIB, 1300 * MIB)
    assert (card.gpu_busy_now, card.gpu_busy_cum, card.samples) == (-1, -1, 2)
    assert sorted((p.pid, p.memory_now_kib, p.gpu_busy) for p in card.processes) == [
        (101, 500 * MIB, -1), (102, 200 * MIB, -1), (104, 100 * MIB, -1)
    ]
    assert [p.pid for p in whole.processes] == [201]


def test_mig_card_mode_adds_the_memory_of_a_pid_on_two_instances():
    """A pid listed on two instances is one process holding memory on both."""
    carving = [instance("3g.40gb", 1, 40192, 10, [(7, 30)]), instance("3g.40gb", 2, 40192, 10, [(7, 12)])]
    counters, _ = run(mixed(*carving), mig="card")
    (proc,) = stats(counters)[0].processes
    assert (proc.pid, proc.memory_now_kib, proc.samples) == (7, 42 * MIB, 1)


def test_reconfiguration_is_picked_up_while_running():
    """An instance destroyed at 3 s: its process exits once; one created at 3 s appears; the rest count on."""
    carving = [
        instance("3g.40gb", 1, 40192, 1000, [(101, 500)]),
        instance("2g.20gb", 5, 19968, 300, [(102, 200)], stop=3),
        instance("1g.10gb", 13, 9728, 0, []),
        instance("1g.10gb", 9, 9728, 50, [(105, 40)], start=3),
    ]
    clock = [0.0]
    reader, _ = make_reader(mixed(*carving), clock)
    board = Board()
    client = board.attach()
    board.stats_body(2, client)
    exited, history = [], []
    for second in range(6):
        board.fold(poll(reader, clock, float(second))[0])
        replied = codec.parse_stats(board.stats_body(2, client), 2)
        exited += [(index, p.pid) for index, s in enumerate(replied) for p in s.processes if p.state == "E"]
        history.append([(s.samples, s.memory_used_cum_kib) for s in replied])
    assert exited == [(1, 102)]
    busids = [t.busid for t in codec.parse_types(board.types_body())]
    assert busids[-1] == "00000000:17:00.0/9.0" and len(busids) == 5
    assert [d.present for d in board.counters.devices] == [True, False, True, True, True]
    for before, after in zip(history, history[1:]):
        assert all(b[0] <= a[0] and b[1] <= a[1] for b, a in zip(before, after))
    assert [row[0][0] for row in history] == [1, 2, 3, 4, 5, 6]
    assert history[-1][1][0] == 3 and history[-1][4][0] == 3


def test_an_empty_mig_card_is_shown_as_the_card_and_logged_once():
    """MIG mode and no instances: the card with its memory, -1 busy, one warning; then instances."""
    later = instance("7g.80gb", 0, 81920, 10, [(9, 5)], start=3)
    clock = [0.0]
    reader, _ = make_reader(mixed(later), clock)
    events: list[dict] = []
    problem_log = ProblemLog("nvml")
    problem_log.log = type(problem_log.log)(observer=events.append)
    counters = Counters()
    for second in range(5):
        snapshot, problems = poll(reader, clock, float(second))
        problem_log.report(problems)
        counters.fold(snapshot)
        if second == 0:
            card = snapshot.devices[0]
            assert (card.key, card.busid) == (CARD_UUID, "00000000:17:00.0")
            assert card.name == "NVIDIA A100-SXM4-80GB"
            assert (card.gpu_busy, card.mem_busy) == (UNSUPPORTED, UNSUPPORTED)
            assert (card.memory_total_kib, card.processes) == (81920 * MIB, ())
    texts = [event["problem"] for event in events]
    assert texts == ["GPU 00000000:17:00.0 is in MIG mode with no instances: nothing can run on it"] * 2
    assert [event["log_format"].startswith("{subject}: recovered") for event in events] == [False, True]
    assert [(d.busid, d.present) for d in counters.devices] == [
        ("00000000:17:00.0", False), ("00000000:65:00.0", True), ("00000000:17:00.0/0.0", True)
    ]


def test_sparse_slots_are_skipped_and_the_count_is_asked_once():
    """Empty slots (NOT_FOUND) between instances are skipped without a problem."""
    carving = [instance("3g.40gb", 1, 40192, 0, [], slot=2), instance("3g.40gb", 2, 40192, 0, [], slot=5)]
    clock = [0.0]
    reader, nvml = make_reader(mixed(*carving), clock)
    for second in range(3):
        snapshot, problems = poll(reader, clock, float(second))
        assert problems == {}
    assert [d.busid for d in snapshot.devices[:2]] == ["00000000:17:00.0/1.0", "00000000:17:00.0/2.0"]
    assert nvml.calls["nvmlDeviceGetMaxMigDeviceCount"] == 1
    # every slot once at start-up (the devices T lists before the first poll), then once per poll
    assert nvml.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == (1 + 3) * 7
    # the A10 only (GPU and memory samples each poll): never asked of a MIG handle
    assert nvml.calls["nvmlDeviceGetSamples"] == 3 * 2
    assert nvml.calls["nvmlDeviceGetProcessUtilization"] == 3


def test_a_failing_instance_does_not_break_the_card_or_the_others():
    """An error on one MIG handle is that instance's problem for that poll; a lost one is absent."""
    failing = {"call": "nvmlDeviceGetMemoryInfo", "error": "NVML_ERROR_UNKNOWN"}
    lost = {"call": "nvmlDeviceGetComputeRunningProcesses", "error": "NVML_ERROR_GPU_IS_LOST", "from": 1}
    carving = [
        instance("3g.40gb", 1, 40192, 1000, [(101, 500)], faults=[failing]),
        instance("2g.20gb", 5, 19968, 300, [(102, 200)], faults=[lost]),
        instance("1g.10gb", 13, 9728, 0, [(103, 10)]),
    ]
    counters, problems = run(mixed(*carving), seconds=2)
    assert [d.present for d in counters.devices] == [True, False, True, True]
    first, second, third, whole = stats(counters)
    assert (first.samples, [p.samples for p in first.processes]) == (0, [2])
    assert (second.samples, third.samples, whole.samples) == (1, 2, 2)
    assert problems[1] == {
        f"{CARD_UUID}/1.0 nvmlDeviceGetMemoryInfo: NVML_ERROR_UNKNOWN":
            "GPU 00000000:17:00.0/1.0: nvmlDeviceGetMemoryInfo: NVML_ERROR_UNKNOWN",
        f"{CARD_UUID}/5.0 lost":
            "MIG instance 00000000:17:00.0/5.0: nvmlDeviceGetComputeRunningProcesses: NVML_ERROR_GPU_IS_LOST",
    }


class DestroyingNvml(SimulatedNvml):
    """Once armed, moves the clock on after the instances are found, as if one were destroyed mid-poll."""

    def __init__(self, scenario: Any, clock: list[float]) -> None:
        super().__init__(scenario, clock=lambda: clock[0])
        self.clock = clock
        self.jump_to: float | None = None

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        if handle.instance is not None and self.jump_to is not None:
            self.clock[0], self.jump_to = self.jump_to, None
        return super().nvmlDeviceGetMemoryInfo(handle, version)


def test_an_instance_destroyed_while_being_read_is_gone_at_the_next_poll():
    """Its stale handle fails (INVALID_ARGUMENT) for one poll only; then its process exits once."""
    carving = [
        instance("3g.40gb", 1, 40192, 1000, [(101, 500)]),
        instance("2g.20gb", 5, 19968, 300, [(102, 200)], stop=1.5),
    ]
    clock = [0.0]
    nvml = DestroyingNvml(parse_scenario(mixed(*carving)), clock)
    reader = NvmlReader(binding_over(nvml), reactor=None)
    reader.open()
    counters = Counters()
    counters.fold(poll(reader, clock, 0.0)[0])
    nvml.jump_to = 1.5
    snapshot, problems = poll(reader, clock, 1.0)
    assert counters.fold(snapshot) == []
    assert [(d.key[-3:], d.present, d.processes is None) for d in snapshot.devices[:2]] == [
        ("1.0", True, False), ("5.0", True, True)
    ]
    assert set(problems.values()) == {
        "GPU 00000000:17:00.0/5.0: nvmlDeviceGetMemoryInfo: NVML_ERROR_INVALID_ARGUMENT",
        "GPU 00000000:17:00.0/5.0: nvmlDeviceGetComputeRunningProcesses: NVML_ERROR_INVALID_ARGUMENT",
    }
    snapshot, problems = poll(reader, clock, 2.0)
    assert [(e.device_index, e.totals.pid) for e in counters.fold(snapshot)] == [(1, 102)]
    assert problems == {}
    assert counters.devices[0].samples == 3


@pytest.mark.parametrize(("mig", "shown"), [("instances", 3), ("card", 1)])
def test_a_passing_enumeration_failure_keeps_the_instances(mig, shown):
    """A failed slot lookup is no reason to think an instance gone: no exits, no sample that poll."""
    card = mixed()
    card["gpus"][0]["faults"] = [
        {"call": "nvmlDeviceGetMigDeviceHandleByIndex", "error": "NVML_ERROR_UNKNOWN", "from": 1, "until": 2}
    ]
    clock = [0.0]
    reader, _ = make_reader(card, clock, mig=mig)
    counters = Counters()
    exits = []
    for second in range(3):
        snapshot, problems = poll(reader, clock, float(second))
        exits += counters.fold(snapshot)
        if second == 1:
            assert [d.processes for d in snapshot.devices[:shown]] == [None] * shown
            assert len(problems) == 7
    assert exits == []
    assert [d.samples for d in counters.devices] == [2] * shown + [3]
    assert [d.present for d in counters.devices] == [True] * (shown + 1)


def test_a_mig_capable_card_out_of_mig_mode_is_a_whole_card():
    """MIG capable but off: read as a card, with its utilization; no instance is looked for."""
    scenario = mixed()
    scenario["gpus"][0].pop("mig")
    scenario["gpus"][0].update(mig_capable=True, gpu_util=12, mem_util=3)
    clock = [0.0]
    reader, nvml = make_reader(scenario, clock)
    for second in range(2):
        snapshot, _ = poll(reader, clock, float(second))
    card = snapshot.devices[0]
    assert (card.busid, card.gpu_busy, card.mem_busy) == ("00000000:17:00.0", 12, 3)
    # at start-up and every poll on the A100; on the A10 at start-up and at each poll until
    # NOT_SUPPORTED has held (readers/nvml/device.py Support)
    assert nvml.calls["nvmlDeviceGetMigMode"] == 1 + 2 + 1 + 2
    assert nvml.calls["nvmlDeviceGetMaxMigDeviceCount"] == 0


def test_many_instances_all_have_distinct_windows():
    """Seven instances of each of two cards: every 12-character window is distinct."""
    carving = [instance("1g.10gb", gi, 9728, 0, []) for gi in range(7, 14)]
    scenario = mixed(*carving)
    scenario["gpus"][1] = {"name": "NVIDIA A100-SXM4-80GB", "busid": "00000000:27:00.0", "mig": carving}
    counters, _ = run(scenario)
    windows = [t.busid[-codec.ATOP_ID_CHARS:] for t in types(counters)]
    assert len(windows) == 14 and len(set(windows)) == 14


@pytest.fixture
def mig_daemon(tmp_path):
    with run_daemon(tmp_path, ["--interval", "0.2"], scenario=mixed()) as daemon:
        yield daemon


@pytest.mark.e2e
def test_daemon_serves_instances_over_a_real_socket(mig_daemon):
    """The installed daemon on the mixed host: T names the instances, S gives their figures."""
    client = mig_daemon.client()
    try:
        listed = client.types()
        assert [(t.busid, t.name) for t in listed] == [
            ("00000000:17:00.0/1.0", "3g.40gb"),
            ("00000000:17:00.0/5.0", "2g.20gb"),
            ("00000000:17:00.0/13.0", "1g.10gb"),
            ("00000000:65:00.0", "NVIDIA_A10"),
        ]
    finally:
        client.close()
    first, second, third, whole = mig_daemon.wait_samples(2)
    assert (first.gpu_busy_now, first.gpu_busy_cum) == (UNSUPPORTED, UNSUPPORTED)
    assert first.memory_total_kib == 40192 * MIB
    assert sorted(p.pid for p in first.processes) == [101, 104]
    assert [p.pid for p in second.processes] == [102] and third.processes == ()
    assert all(p.gpu_busy == UNSUPPORTED for p in first.processes + second.processes)
    assert whole.gpu_busy_now == 40 and whole.processes[0].pid == 201


@pytest.fixture
def mig_card_daemon(tmp_path):
    with run_daemon(tmp_path, ["--interval", "0.2", "--mig", "card"], scenario=mixed()) as daemon:
        yield daemon


@pytest.mark.e2e
def test_daemon_with_mig_card_serves_one_device_per_card(mig_card_daemon):
    """--mig card on the command line: the A100 is one device holding its instances' processes."""
    client = mig_card_daemon.client()
    try:
        assert [t.busid for t in client.types()] == ["00000000:17:00.0", "00000000:65:00.0"]
    finally:
        client.close()
    card, whole = mig_card_daemon.wait_samples(1)
    assert sorted(p.pid for p in card.processes) == [101, 102, 104]
    assert card.memory_used_kib == 1300 * MIB and card.gpu_busy_now == UNSUPPORTED


def test_an_instance_is_identified_once_then_known_by_its_handle_and_uuid():
    """After the first poll a MIG handle's ids and name are not asked again; its UUID is, once a poll."""
    clock = [0.0]
    reader, nvml = make_reader(mixed(), clock)
    poll(reader, clock, 0.0)
    first = dict(nvml.calls)
    for second in range(1, 4):
        poll(reader, clock, float(second))
    asked = {name: nvml.calls[name] - first.get(name, 0) for name in nvml.calls}
    for name in ("nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId"):
        assert asked.get(name, 0) == 0
    # the A10 asks its name of nobody at poll time either; the three instances their UUIDs
    assert asked.get("nvmlDeviceGetName", 0) == 0
    assert asked["nvmlDeviceGetUUID"] == 3 * 3
    assert asked["nvmlDeviceGetMigDeviceHandleByIndex"] == 3 * 7


def _reuse_handles_by_slot(nvml: Any) -> None:
    """A driver that gives a slot's next instance the pointer its last one had."""
    library = nvml.nvmlLib
    by_slot: dict[Any, int] = {}
    given = library.handle_id

    def handle_id(handle: Any) -> int:
        if handle.instance is None:
            return given(handle)
        ident = by_slot.setdefault((handle.gpu, handle.instance.slot), 0x7F00_0000 + 0x100 * len(by_slot))
        library._handles[ident] = handle
        return ident

    library.handle_id = handle_id


@pytest.mark.parametrize("memory", [40192, 19968], ids=["same-memory", "other-memory"])
def test_a_reused_handle_of_a_new_instance_is_noticed(memory):
    """Slot 0 carved again between two polls, its handle the same pointer: the new instance is seen."""
    carving = [
        instance("3g.40gb", 1, 40192, 1000, [(101, 500)], stop=2.5, slot=0),
        instance("4g.40gb" if memory == 40192 else "2g.20gb", 2, memory, 10, [(103, 5)], start=2.5, slot=0),
        instance("1g.10gb", 13, 9728, 0, [], slot=1),
    ]
    clock = [0.0]
    nvml = simulated_binding(parse_scenario(mixed(*carving)), clock=lambda: clock[0])
    _reuse_handles_by_slot(nvml)
    reader = NvmlReader(nvml, reactor=None, mig="instances")
    reader.open()
    board = Board()
    for second in range(5):
        snapshot, problems = poll(reader, clock, float(second))
        board.fold(snapshot)
        devices = {d.key.rsplit("/", 1)[-1]: d for d in snapshot.devices if "/" in d.key and d.present}
        if second < 3:
            assert sorted(devices) == ["1.0", "13.0"]
        else:
            assert sorted(devices) == ["13.0", "2.0"], second
            assert devices["2.0"].name == ("4g.40gb" if memory == 40192 else "2g.20gb")
            assert [p.pid for p in devices["2.0"].processes] == [103]
            assert devices["2.0"].info.uuid.endswith("002000")
    busids = [t.busid for t in codec.parse_types(board.types_body())]
    assert busids[:3] == ["00000000:17:00.0/1.0", "00000000:17:00.0/13.0", "00000000:65:00.0"]
    assert busids[3:] == ["00000000:17:00.0/2.0"]
