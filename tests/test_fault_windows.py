"""A fault leaves nothing behind once it passes: every NVML call a poll makes, each error, one poll and ten.

The NVML reader over the real pynvml on the simulated library, polled once a
simulated second into a Board, on constant loads.  After the fault ends every
figure is exact again within two polls: each poll's figures, and atop's
arithmetic over the ten polls after those (differences of the cumulative
counters over differences of the sample counts), per GPU and per process.  No
process ends, except with the GPU lost (GPU_IS_LOST ends its processes; read
again, they are new ones).  A hypothesis property test plays random fault windows.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import pytest
from driver_behaviours import BEHAVIOURS
from driver_behaviours import expected as behaviour_loads
from driver_behaviours import host as behaviour_host
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from atopgpud_tw import codec
from atopgpud_tw.problems import ProblemLog
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.readers.nvml.support import HOLD_POLLS, HOLD_SECONDS, RETRY_UNSUPPORTED
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.sim import parse_scenario, simulated_binding

#: GPU busy, memory busy, and by pid: (kind, SM busy, memory busy, memory MiB)
LOADS = {
    0: (40, 10, {100: ("C", 30, 5, 512), 101: ("G", 20, 3, 256)}),
    1: (70, 20, {200: ("C", 65, 12, 1024)}),
}
#: every NVML call a poll of a whole card makes (GPU 1 has no sample buffer: its rates call is read)
POLL_CALLS = (
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetSamples",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetProcessUtilization",
)
ERRORS = ("NOT_SUPPORTED", "UNKNOWN", "TIMEOUT", "GPU_IS_LOST", "NOT_FOUND")
#: the fault's first poll
AT = 20
#: polls after the fault ends until every figure must be exact again, and the polls then checked
SETTLE = 2
CHECKED = 10


def scenario(faults: list[dict], **behaviour: Any) -> dict:
    gpus = []
    for index, (gpu_busy, mem_busy, processes) in LOADS.items():
        gpus.append({
            "busid": f"00000000:{0x17 + index:02X}:00.0",
            "gpu_util": gpu_busy,
            "mem_util": mem_busy,
            "memory_used_mib": 4096,
            "mig_capable": True,  # MIG mode off: its call answers at every poll
            "samples_supported": index == 0,
            "processes": [
                {"pid": pid, "type": kind, "memory_mib": mib, "sm_util": sm, "mem_util": mem}
                for pid, (kind, sm, mem, mib) in processes.items()
            ],
            "faults": copy.deepcopy(faults),
            **behaviour,
        })
    return {"gpus": gpus}


class Run:
    """Polls once a simulated second; a client asks for S at every poll (it hears of every exit)."""

    def __init__(self, data: dict, every: float = 1.0) -> None:
        self.now = 10.0
        self.every = every
        self.reader = NvmlReader(simulated_binding(parse_scenario(data), clock=lambda: self.now), reactor=None)
        self.board = Board(layout=self.reader.open())
        self.queue = self.board.attach()
        #: logs the reader's problems as the daemon does
        self.problems = ProblemLog("nvml")
        self.board.reply(codec.Request(codec.COMMAND_STATS, 2), self.queue)
        self.polls: list[dict] = []
        #: (device index, pid, the life's id) of every process that ended
        self.exits: list[tuple[int, int, int]] = []

    def poll(self) -> None:
        self.now += self.every
        snapshot, problems = self.reader.read(self.now)
        self.problems.report(problems)
        self.board.fold(snapshot)
        self.board.reply(codec.Request(codec.COMMAND_STATS, 2), self.queue)
        counters = self.board.counters
        self.polls.append({
            "time": self.now,
            "now": [
                (d.gpu_busy, d.mem_busy, d.task_support,
                 {p.pid: (p.gpu_busy, p.mem_busy, p.memory_kib) for p in d.processes or ()} if d.processes is not None
                 else None)
                for d in snapshot.devices
            ],
            "cum": [
                (d.samples, d.gpu_busy_cum, d.mem_busy_cum, d.memory_used_cum_kib,
                 {pid: (p.life, p.samples, p.gpu_busy_cum, p.mem_busy_cum, p.memory_cum_kib)
                  for pid, p in d.processes.items()})
                for d in counters.devices
            ],
        })


def play(faults: list[dict], until: float, every: float = 1.0, **behaviour: Any) -> Run:
    run = Run(scenario(faults, **behaviour), every)
    exited = []
    original = run.board.fold

    def fold(snapshot, taken=None, since=0.0):
        ended = original(snapshot, taken, since)
        exited.extend((e.device_index, e.totals.pid, e.totals.life) for e in ended)
        return ended

    run.board.fold = fold  # type: ignore[method-assign]
    while run.now < until:
        run.poll()
    run.exits = exited
    return run


def check_exact(run: Run, end: float, where: str) -> None:
    """Every figure exact from the second poll after `end` on, and over the ten after that."""
    first = next(i for i, p in enumerate(run.polls) if p["time"] >= end) + SETTLE - 1
    for poll in run.polls[first:]:
        for index, (gpu, mem, support, processes) in enumerate(poll["now"]):
            want_gpu, want_mem, want_processes = LOADS[index]
            at = f"{where}: poll at {poll['time']}, GPU {index}"
            assert (gpu, mem, support) == (want_gpu, want_mem, 3), at
            assert processes == {
                pid: (sm, busy, mib * 1024) for pid, (_, sm, busy, mib) in want_processes.items()
            }, at
    before, after = run.polls[first - 1]["cum"], run.polls[first - 1 + CHECKED]["cum"]
    for index, (old, new) in enumerate(zip(before, after)):
        want_gpu, want_mem, want_processes = LOADS[index]
        at = f"{where}: GPU {index}, the {CHECKED} polls from {run.polls[first]['time']}"
        samples = new[0] - old[0]
        assert samples == CHECKED, at
        assert ((new[1] - old[1]) / samples, (new[2] - old[2]) / samples) == (want_gpu, want_mem), at
        assert (new[3] - old[3]) / samples == 4096 * 1024, at
        for pid, (_, sm, busy, mib) in want_processes.items():
            life, n1, g1, m1, k1 = new[4][pid]
            assert old[4][pid][0] == life, f"{at}: pid {pid} ended"
            _, n0, g0, m0, k0 = old[4][pid]
            count = n1 - n0
            assert count == CHECKED, f"{at}: pid {pid}"
            assert ((g1 - g0) / count, (m1 - m0) / count, (k1 - k0) / count) == (sm, busy, mib * 1024), at


def check_nothing_lost(run: Run, start: float, where: str, processes: bool = True) -> None:
    """atop's arithmetic from before the fault to the end of the run: the loads, exactly
    (a failed reading counts no sample, and the next one covers its time)."""
    first = next(i for i, p in enumerate(run.polls) if p["time"] >= start) - 1
    before, after = run.polls[first]["cum"], run.polls[-1]["cum"]
    for index, (old, new) in enumerate(zip(before, after)):
        want_gpu, want_mem, want_processes = LOADS[index]
        at = f"{where}: GPU {index}, from {run.polls[first]['time']} to the end"
        samples = new[0] - old[0]
        assert ((new[1] - old[1]) / samples, (new[2] - old[2]) / samples) == (want_gpu, want_mem), at
        for pid, (_, sm, busy, mib) in want_processes.items() if processes else ():
            _, n1, g1, m1, k1 = new[4][pid]
            _, n0, g0, m0, k0 = old[4][pid]
            count = n1 - n0
            assert ((g1 - g0) / count, (m1 - m0) / count, (k1 - k0) / count) == (sm, busy, mib * 1024), (
                f"{at}: pid {pid}"
            )


def lossless(call: str, error: str) -> bool:
    """Whether a fault is one whose polls count nothing wrong: not the GPU lost (its processes
    end), not NOT_FOUND from a samples call (the driver's word for idle)."""
    return error != "GPU_IS_LOST" and not (
        error == "NOT_FOUND" and call in ("nvmlDeviceGetSamples", "nvmlDeviceGetProcessUtilization")
    )


def check_monotonic(run: Run) -> None:
    for before, after in zip(run.polls, run.polls[1:]):
        for old, new in zip(before["cum"], after["cum"]):
            assert all(b >= a for a, b in zip(old[:4], new[:4])), (before["time"], old[:4], new[:4])
            for pid, (life, *sums) in new[4].items():
                if pid in old[4] and old[4][pid][0] == life:
                    assert all(b >= a for a, b in zip(old[4][pid][1:], sums)), (pid, old[4][pid], sums)


def check_exits(run: Run, error: str, where: str) -> None:
    if error == "GPU_IS_LOST":
        # a lost GPU's processes end with it, each life once
        assert len(run.exits) == len(set(run.exits)), where
        assert {pid for _, pid, _ in run.exits} <= {100, 101, 200}, where
    else:
        assert run.exits == [], f"{where}: false exits {run.exits}"


@pytest.mark.quick_cases(8)
@pytest.mark.parametrize("polls", [1, 10])
@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("call", POLL_CALLS)
def test_fault_window_leaves_nothing_behind(call: str, error: str, polls: int) -> None:
    end = AT + polls
    fault = {"call": call, "error": f"NVML_ERROR_{error}", "from": AT - 0.5, "until": end - 0.5}
    run = play([fault], end + SETTLE + CHECKED + 1)
    where = f"{call} {error} for {polls} poll(s)"
    check_exits(run, error, where)
    check_monotonic(run)
    check_exact(run, end - 0.5, where)
    if lossless(call, error):
        check_nothing_lost(run, AT - 2, where)
    elif error == "GPU_IS_LOST":
        check_nothing_lost(run, AT - 2, where, processes=False)


@pytest.mark.quick_cases(5)
@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("call", ["nvmlDeviceGetSamples", "nvmlDeviceGetProcessUtilization"])
@pytest.mark.parametrize(
    "every,behaviour",
    [(0.5, {}), (0.25, {}), (1.0, {"process_utilization": "per-call"}), (1.0, {"sample_period": 0.5})],
    ids=["0.5 s polls", "0.25 s polls", "per-call", "period 0.5 s"],
)
def test_fault_window_on_other_drivers(call: str, error: str, every: float, behaviour: dict) -> None:
    """The calls of the sample buffers, failing for a second: with shorter polls, on drivers
    that list processes once per call, or sample every 0.5 s."""
    start, end = AT - every / 2, AT + 1 - every / 2
    fault = {"call": call, "error": f"NVML_ERROR_{error}", "from": start, "until": end}
    run = play([fault], end + (SETTLE + CHECKED + 1) * every, every, **behaviour)
    where = f"{call} {error} with {behaviour}, polls every {every} s"
    check_exits(run, error, where)
    check_exact(run, end, where)
    if lossless(call, error):
        check_nothing_lost(run, start - every, where)


@pytest.mark.parametrize("error", ["NOT_SUPPORTED", "UNKNOWN", "TIMEOUT"])
def test_fault_from_start_up(error: str) -> None:
    """Every poll call failing from before the reader opens (a GPU reset at boot): exact within two polls of its end."""
    faults = [
        {"call": call, "error": f"NVML_ERROR_{error}", "from": 0, "until": 15.5}
        for call in POLL_CALLS if call != "nvmlDeviceGetMigMode"
    ]
    run = play(faults, 15.5 + SETTLE + CHECKED + 1)
    check_exits(run, error, error)
    check_exact(run, 15.5, f"{error} from start-up")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(POLL_CALLS), st.sampled_from(ERRORS), st.integers(12, 40), st.integers(1, 12)),
        min_size=1,
        max_size=4,
    )
)
# the device's samples call failing for 16 polls on a GPU without a sample buffer: its processes,
# counted by time, are still read in those polls (the driver's buffer of their samples holds less)
@example(windows=[("nvmlDeviceGetSamples", "UNKNOWN", 12, 4), ("nvmlDeviceGetSamples", "UNKNOWN", 16, 12)])
def test_random_fault_windows(windows: list[tuple[str, str, int, int]]) -> None:
    """Random fault windows on random calls: counters monotonic, no false exit, and exact
    within two polls of the last window's end."""
    faults = [
        {"call": call, "error": f"NVML_ERROR_{error}", "from": start - 0.5, "until": start + length - 0.5}
        for call, error, start, length in windows
    ]
    end = max(start + length for _, _, start, length in windows) - 0.5
    run = play(faults, end + SETTLE + CHECKED + 1)
    lost = any(error == "GPU_IS_LOST" for _, error, _, _ in windows)
    check_exits(run, "GPU_IS_LOST" if lost else "", str(windows))
    check_monotonic(run)
    check_exact(run, end, str(windows))
    if all(lossless(call, error) for call, error, _, _ in windows):
        check_nothing_lost(run, 12, str(windows))


def test_a_list_given_up_and_back_is_said_once_each_way_and_t_follows(logged: Sequence[str]) -> None:
    """The graphics list NOT_SUPPORTED from 20 s to 120 s: a failed reading (no exit) until it has held
    for HOLD_SECONDS and HOLD_POLLS polls; then given up, said once, the task-support digit 1 and its
    process ended; asked again at the long backoff, and back when it answers, said once, digit 3."""
    fault = {"call": "nvmlDeviceGetGraphicsRunningProcesses", "error": "NVML_ERROR_NOT_SUPPORTED",
             "from": 19.5, "until": 119.5}
    run = play([fault], 19.0)
    graphics = run.reader._devices[0].session.nvml.nvmlLib.calls
    digits, asked = [], []
    while run.now < 300:
        run.poll()
        digits.append((run.now, run.board.counters.devices[0].task_support))
        asked.append(graphics["nvmlDeviceGetGraphicsRunningProcesses_v3"])
    given_up = [now for now, digit in digits if digit == 1]
    assert given_up[0] == 20 + max(HOLD_SECONDS, HOLD_POLLS - 1), given_up[:3]
    # back at the first retry after the fault ended (1, then 2 minutes after giving up)
    assert given_up[-1] == given_up[0] + RETRY_UNSUPPORTED[0] + RETRY_UNSUPPORTED[1] - 1
    assert digits[-1][1] == 3 and run.board.types_body(2).count(b" 3") == 2
    # no exit before it was given up, the graphics process once when it was
    assert [(index, pid) for index, pid, _ in run.exits] == [(0, 101)]
    # once each way for each GPU (the fault is on both)
    warned = [line for line in logged if "taken as not supported" in line]
    back = [line for line in logged if "recovered" in line]
    assert len(warned) == 2 and all("nvmlDeviceGetGraphicsRunningProcesses" in line for line in warned), warned
    assert len(back) == 2 and all("nvmlDeviceGetGraphicsRunningProcesses" in line for line in back), back
    # while given up, the list was asked only at the backoff's times: twice per GPU, two C calls each
    # (the size query and the fill)
    times = [now for now, _ in digits]
    assert asked[times.index(given_up[-1])] - asked[times.index(given_up[0])] <= 2 * 2 * 2
    check_exact(run, given_up[-1] + 1, "graphics list back")


def test_utilization_given_up_then_back_counts_again() -> None:
    """The rates call of a GPU without a sample buffer NOT_SUPPORTED for 100 s: failed readings
    first (no sample counted, the average exact), then given up, then served again."""
    fault = {"call": "nvmlDeviceGetUtilizationRates", "error": "NVML_ERROR_NOT_SUPPORTED", "from": 19.5, "until": 119.5}
    run = play([fault], 300)
    gpu1 = [poll["now"][1][0] for poll in run.polls]
    # 70, then failed readings (None), then given up (-1), then 70 again
    spells = [value for n, value in enumerate(gpu1) if n == 0 or gpu1[n - 1] != value]
    assert spells == [70, None, -1, 70], spells
    assert run.polls[gpu1.index(None)]["time"] == 20
    assert run.polls[gpu1.index(-1)]["time"] == 20 + max(HOLD_SECONDS, HOLD_POLLS - 1)
    check_monotonic(run)
    before, after = run.polls[0]["cum"][1], run.polls[-1]["cum"][1]
    assert (after[1] - before[1]) / (after[0] - before[0]) == 70
    check_exact(run, 240, "rates back")


#: the calls a poll of a card in MIG mode makes besides the whole card's
MIG_CALLS = (
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
    "nvmlDeviceGetName",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetComputeRunningProcesses",
)
#: by MIG instance: its memory used, and its processes' (pid, memory) in MiB
INSTANCES = {"3g.40gb": (1000, [(101, 500), (104, 100)]), "2g.20gb": (300, [(102, 200)])}


def mig_host(faults: list[dict]) -> dict:
    return {"gpus": [{
        "busid": "00000000:17:00.0",
        "memory_total_mib": 81920,
        "faults": faults,
        "mig": [
            {"profile": profile, "gpu_instance": 1 + 4 * n, "memory_total_mib": 20000, "memory_used_mib": used,
             "processes": [{"pid": pid, "memory_mib": mib} for pid, mib in processes]}
            for n, (profile, (used, processes)) in enumerate(INSTANCES.items())
        ],
    }]}


@pytest.mark.quick_cases(8)
@pytest.mark.parametrize("mig", ["instances", "card"])
@pytest.mark.parametrize("polls", [1, 10])
@pytest.mark.parametrize("error", ERRORS)
@pytest.mark.parametrize("call", MIG_CALLS)
def test_fault_window_on_a_mig_card(call: str, error: str, polls: int, mig: str) -> None:
    """A card in MIG mode: the same instances (and T) again within two polls of the fault's end,
    their memory and processes exact, and no process ended but with the card lost."""
    fault = {"call": call, "error": f"NVML_ERROR_{error}", "from": AT - 0.5, "until": AT + polls - 0.5}
    now = [10.0]
    reader = NvmlReader(simulated_binding(parse_scenario(mig_host([fault])), clock=lambda: now[0]), reactor=None,
                        mig=mig)
    board = Board(layout=reader.open())
    exits = []
    cums = []
    while now[0] < AT + polls + SETTLE + CHECKED:
        now[0] += 1.0
        exits += board.fold(reader.read(now[0])[0])
        cums.append([(d.key, d.samples, d.memory_used_cum_kib,
                      {pid: (p.life, p.samples, p.memory_cum_kib) for pid, p in d.processes.items()})
                     for d in board.counters.devices])
    where = f"{call} {error} for {polls} poll(s), --mig {mig}"
    if error != "GPU_IS_LOST":
        assert exits == [], f"{where}: false exits {[(e.device_index, e.totals.pid) for e in exits]}"
    expected = {profile: (used, dict(processes)) for profile, (used, processes) in INSTANCES.items()}
    if mig == "card":
        expected = {"card": (sum(u for u, _ in expected.values()), {p: m for _, ps in expected.values()
                                                                   for p, m in ps.items()})}
    before, after = cums[-1 - CHECKED], cums[-1]
    assert len(after) == len(expected), where
    for (key, n0, used0, procs0), (_, n1, used1, procs1), (used, processes) in zip(before, after, expected.values()):
        assert n1 - n0 == CHECKED and (used1 - used0) / CHECKED == used * 1024, f"{where}: {key}"
        assert set(procs1) == set(processes), f"{where}: {key}"
        for pid, mib in processes.items():
            assert procs0[pid][0] == procs1[pid][0], f"{where}: {key} pid {pid} ended"
            assert (procs1[pid][1] - procs0[pid][1], procs1[pid][2] - procs0[pid][2]) == (CHECKED, CHECKED * mib * 1024)


@pytest.mark.quick_cases(5)
@pytest.mark.parametrize("error", ["UNKNOWN", "NOT_SUPPORTED"])
@pytest.mark.parametrize("behaviour", sorted(BEHAVIOURS))
def test_samples_fault_with_every_driver_behaviour(behaviour: str, error: str) -> None:
    """The device's samples call failing for three polls, on a driver that does each of the
    behaviours of tests/driver_behaviours.py: no exit, and within two polls every figure
    within 2 points of the load and atop's arithmetic over ten polls within 1."""
    data = behaviour_host(behaviour, at=AT + 10)
    for card in data["gpus"]:
        card["faults"] = [{"call": "nvmlDeviceGetSamples", "error": f"NVML_ERROR_{error}",
                           "from": AT - 0.5, "until": AT + 2.5}]
    run = Run(data)
    ended = []
    while run.now < AT + 3 + SETTLE + CHECKED:
        run.now += 1.0
        snapshot, _ = run.reader.read(run.now)
        ended += run.board.fold(snapshot)
        run.polls.append({"time": run.now, "now": snapshot, "cum": [
            (d.samples, d.gpu_busy_cum, d.mem_busy_cum,
             {pid: (p.samples, p.gpu_busy_cum) for pid, p in d.processes.items()})
            for d in run.board.counters.devices
        ]})
    assert ended == [], behaviour
    truth = behaviour_loads()
    first = next(i for i, p in enumerate(run.polls) if p["time"] >= AT + 2.5) + SETTLE - 1
    for poll in run.polls[first:]:
        for index, device in enumerate(poll["now"].devices):
            gpu_busy, mem_busy, procs = truth[index]
            where = f"{behaviour}: poll at {poll['time']}, GPU {index}"
            assert abs(device.gpu_busy - gpu_busy) <= 2 and abs(device.mem_busy - mem_busy) <= 2, where
            for proc in device.processes:
                assert abs(proc.gpu_busy - procs[proc.pid]) <= 2, f"{where}: pid {proc.pid} {proc.gpu_busy}"
    before, after = run.polls[first - 1]["cum"], run.polls[-1]["cum"]
    for index, (old, new) in enumerate(zip(before, after)):
        gpu_busy, mem_busy, procs = truth[index]
        samples = new[0] - old[0]
        where = f"{behaviour}: GPU {index}"
        assert abs((new[1] - old[1]) / samples - gpu_busy) <= 1 and abs((new[2] - old[2]) / samples - mem_busy) <= 1
        for pid, busy in procs.items():
            count = new[3][pid][0] - old[3][pid][0]
            assert abs((new[3][pid][1] - old[3][pid][1]) / count - busy) <= 1, f"{where}: pid {pid}"
