"""A process's life: a pid reused, a GPU lost and read again; version 1's figures are each life's own."""

from __future__ import annotations

import os
import time

import pytest
from daemon import run_daemon
from snapshots import dev, snap

from atopgpud_tw import codec
from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.readers.starts import ProcStarts, proc_start_time, start_times, stat_start_time
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.sim import parse_scenario, simulated_binding
from atopgpud_tw.snapshot import ProcessSample

STATS_V1 = codec.Request(codec.COMMAND_STATS, 1)
STATS_V2 = codec.Request(codec.COMMAND_STATS, 2)


def v1_records(board: Board, queue) -> list[tuple[str, int, int, int, int]]:
    """(state, pid, gpu busy, memory busy, samples) of a version 1 reply's processes."""
    (device,) = codec.parse_stats(board.reply(STATS_V1, queue)[4:], 1)
    return [(p.state, p.pid, p.gpu_busy, p.mem_busy, p.samples) for p in device.processes]


class SimHost:
    """The NVML reader over a scenario, polled every `every` simulated seconds into a Board."""

    def __init__(self, scenario: dict, every: float = 0.25) -> None:
        self.now = 0.0
        self.every = every
        self.nvml = simulated_binding(parse_scenario(scenario), clock=lambda: self.now)
        self.reader = NvmlReader(self.nvml, reactor=None)
        self.board = Board(layout=self.reader.open())

    def until(self, seconds: float) -> None:
        while self.now < seconds - 1e-9:
            self.now = round(self.now + self.every, 6)
            snapshot, _ = self.reader.read(self.now)
            self.board.fold(snapshot)


def gpu(processes: list[dict], **extra) -> dict:
    return {"busid": "00000000:17:00.0", "gpu_util": 40, "mem_util": 10, "processes": processes, **extra}


def test_version_1_figures_of_a_reused_pid_are_the_new_process_own() -> None:
    """pid 5 at 20/60 % until 1.1 s, a new pid 5 at 50/90 % from 1.5 s: a version 1 client
    asking at 0.5 s and 2.3 s is told of the old one's exit and gets the new one's 50 90."""
    host = SimHost({"gpus": [gpu([
        {"pid": 5, "memory_mib": 8, "sm_util": 20, "mem_util": 60, "stop": 1.1},
        {"pid": 5, "memory_mib": 8, "sm_util": 50, "mem_util": 90, "start": 1.5},
    ], samples_supported=False)]})
    queue = host.board.attach()
    host.until(0.5)
    assert [r[:4] for r in v1_records(host.board, queue)] == [("A", 5, 20, 60)]
    host.until(2.3)
    records = v1_records(host.board, queue)
    assert sorted(r[:4] for r in records) == [("A", 5, 50, 90), ("E", 5, 20, 60)]


def test_pid_reused_between_two_polls_is_two_processes() -> None:
    """The old pid 5 ends at 1.1 s and the new one starts then, between the polls at 1.0 and
    1.25 s: told apart by their start times, the exit is told to every client once, the new
    one counts from zero."""
    host = SimHost({"gpus": [gpu([
        {"pid": 5, "memory_mib": 8, "sm_util": 20, "mem_util": 60, "stop": 1.1},
        {"pid": 5, "memory_mib": 16, "sm_util": 50, "mem_util": 90, "start": 1.1},
    ], samples_supported=False)]})
    v1, v2 = host.board.attach(), host.board.attach()
    host.until(0.5)
    v1_records(host.board, v1)
    host.board.reply(STATS_V2, v2)
    host.until(2.0)
    new = host.board.counters.devices[0].processes[5]
    assert new.samples == 4 and new.gpu_busy_cum == 200 and new.memory_cum_kib == 4 * 16 * 1024
    (device,) = codec.parse_stats(host.board.reply(STATS_V2, v2)[4:], 2)
    states = [(p.state, p.pid, p.gpu_busy, p.samples) for p in device.processes]
    assert sorted(states) == [("A", 5, 200, 4), ("E", 5, 20 * 4, 4)]
    assert sorted(r[:4] for r in v1_records(host.board, v1)) == [("A", 5, 50, 90), ("E", 5, 20, 60)]
    # each told once
    (device,) = codec.parse_stats(host.board.reply(STATS_V2, v2)[4:], 2)
    assert [p.state for p in device.processes] == ["A"]
    assert [r[0] for r in v1_records(host.board, v1)] == ["A"]


def test_one_process_on_two_gpus_is_one_life_per_gpu() -> None:
    """The same pid on two GPUs whose runs overlap is one process: no reuse is seen when
    the first GPU's run ends, and none on the second."""
    host = SimHost({"gpus": [
        gpu([{"pid": 9, "memory_mib": 8, "sm_util": 20, "stop": 1.0}], samples_supported=False),
        gpu([{"pid": 9, "memory_mib": 8, "sm_util": 30, "start": 0.5}], busid="00000000:18:00.0",
            samples_supported=False),
    ]})
    host.until(2.0)
    second = host.board.counters.devices[1].processes[9]
    assert second.samples == 7 and second.gpu_busy_cum == 7 * 30


def test_version_1_figures_after_a_gpu_lost_and_read_again() -> None:
    """A GPU lost for one poll ends its processes; read again, they are new ones, and a
    version 1 client's figures are theirs alone (not the ended ones' sums, nor their old figures)."""
    board = Board()
    queue = board.attach()

    def at(a: tuple[int, int], b: tuple[int, int]) -> None:
        board.fold(snap(dev(processes=(
            ProcessSample(7, "C", 1024, *a), ProcessSample(8, "C", 1024, *b),
        ))))

    for _ in range(3):
        at((60, 10), (25, 15))
    assert [r[:4] for r in v1_records(board, queue)] == [("A", 7, 60, 10), ("A", 8, 25, 15)]
    board.fold(snap(dev(present=False)))
    at((40, 30), (55, 45))
    records = v1_records(board, queue)
    assert sorted(r[:4] for r in records) == [
        ("A", 7, 40, 30), ("A", 8, 55, 45), ("E", 7, 60, 10), ("E", 8, 25, 15)
    ]
    # the next interval: one more sample of each new life
    at((20, 10), (55, 45))
    assert sorted(r[:4] for r in v1_records(board, queue)) == [("A", 7, 20, 10), ("A", 8, 55, 45)]


def test_a_start_time_not_known_leaves_the_pid_one_process() -> None:
    """Where /proc cannot tell (None), a pid listed at every poll is one process; a start
    time first known later is taken as the same process's; one that changes ends it."""
    counters = Counters()
    for started in (None, None, 500, 500, None, 500):
        assert counters.fold(snap(dev(processes=(ProcessSample(3, "C", 10, 5, 5, started),)))) == []
    assert counters.devices[0].processes[3].samples == 6
    (ended,) = counters.fold(snap(dev(processes=(ProcessSample(3, "C", 10, 5, 5, 900),))))
    assert ended.totals.samples == 6 and counters.devices[0].processes[3].samples == 1


def test_start_time_from_proc() -> None:
    """Field 22 of /proc/PID/stat, the command name holding spaces and parentheses; None
    for a pid that is not there."""
    with open(f"/proc/{os.getpid()}/stat", "rb") as stat:
        expected = int(stat.read().rsplit(b")", 1)[1].split()[19])
    assert proc_start_time(os.getpid()) == expected
    assert proc_start_time(2**22 + 1) is None
    line = b"42 (a) (b c) S " + b" ".join(str(n).encode() for n in range(4, 22)) + b" 123456 7 8"
    assert stat_start_time(line) == 123456
    assert stat_start_time(b"garbage") is None


def test_simulated_host_gives_its_own_start_times() -> None:
    """A reader over the simulator asks the simulated host, not this machine's /proc."""
    binding = simulated_binding(parse_scenario({"gpus": [gpu([{"pid": 1, "start": 2.5}])]}), clock=lambda: 3.0)
    assert start_times(binding)(1) == 250 and start_times(binding)(2) is None
    import pynvml

    assert isinstance(start_times(pynvml), ProcStarts)


@pytest.mark.e2e
def test_daemon_tells_a_reused_pid_apart(tmp_path) -> None:
    """Through the installed daemon on the simulator: pid 5 ends at 2 s and a new pid 5 starts
    then, between two polls; version 1 and version 2 clients are told of the old one's exit
    once, and the new one's figures are its own."""
    scenario = {"gpus": [gpu([
        {"pid": 5, "memory_mib": 8, "sm_util": 20, "mem_util": 60, "stop": 2.0},
        {"pid": 5, "memory_mib": 8, "sm_util": 50, "mem_util": 90, "start": 2.0},
    ], samples_supported=False)]}
    with run_daemon(tmp_path, ["--interval", "0.25"], scenario=scenario) as daemon:
        v1, v2 = daemon.client(), daemon.client()
        daemon.wait_samples(2)
        first = v1.stats(1)[0].processes
        v2.stats(2)
        assert [(p.state, p.pid, p.gpu_busy, p.mem_busy) for p in first] == [("A", 5, 20, 60)]
        time.sleep(3.5)
        one = {p.state: p for p in v1.stats(1)[0].processes}
        two = {p.state: p for p in v2.stats(2)[0].processes}
        again = [p.state for p in v2.stats(2)[0].processes]
        v1.close()
        v2.close()
    assert set(one) == set(two) == {"A", "E"}
    assert (one["E"].pid, one["E"].gpu_busy, one["E"].mem_busy) == (5, 20, 60)
    # the new process's own figures: its first poll may hold the old one's last samples
    assert abs(one["A"].gpu_busy - 50) <= 4 and abs(one["A"].mem_busy - 90) <= 4, one["A"]
    assert two["E"].gpu_busy == 20 * two["E"].samples
    assert abs(two["A"].gpu_busy / two["A"].samples - 50) <= 4 and again == ["A"]
