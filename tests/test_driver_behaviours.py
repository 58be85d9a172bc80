"""Exact on constant loads whatever the driver does: every behaviour, and every two of them.

Each host runs on a simulated clock (no waiting): polls a second apart, a few
milliseconds late or early as real polls are, and atop's arithmetic over
5-second intervals (the difference of two cumulative counters over the
difference of their sample counts).
"""

from __future__ import annotations

import random

import pytest
from driver_behaviours import BEHAVIOURS, compatible_pairs, expected, host

from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml.reader import NvmlReader
from atopgpud_tw.sim import parse_scenario, simulated_binding

POLLS = 30
INTERVAL = 5


def run(
    scenario: dict, seed: int = 0, call_s: float = 0.0, every: float = 1.0
) -> tuple[list[list[tuple]], list[list[tuple]]]:
    """(every poll's "now" figures, every interval's averages), per GPU:
    (gpu busy, memory busy, {pid: busy}); each NVML call takes `call_s`
    seconds of simulated time, polls come `every` seconds."""
    rng = random.Random(seed)
    clock = [0.0]
    calls = [0]

    def now() -> float:
        calls[0] += 1
        return clock[0] + calls[0] * call_s

    reader = NvmlReader(simulated_binding(parse_scenario(scenario), clock=now), reactor=None)
    start = 30.0 + rng.uniform(0, 0.01)
    clock[0] = start
    reader.open()
    counters = Counters()
    nows, marks = [], []
    for poll in range(POLLS):
        calls[0] = 0
        clock[0] = start + (1.0 + poll) * every + rng.uniform(-0.004, 0.004)
        snapshot, _ = reader.read(clock[0])
        counters.fold(snapshot)
        nows.append([(d.gpu_busy, d.mem_busy, {p.pid: p.gpu_busy for p in d.processes}) for d in snapshot.devices])
        if poll % INTERVAL == 0:
            marks.append(
                [
                    (
                        d.gpu_busy_total,
                        d.mem_busy_total,
                        d.samples,
                        {pid: (p.gpu_busy_cum, p.samples) for pid, p in d.processes.items()},
                    )
                    for d in counters.devices
                ]
            )
    intervals = []
    for before, after in zip(marks, marks[1:]):
        per_gpu = []
        for (g0, m0, n0, p0), (g1, m1, n1, p1) in zip(before, after):
            samples = n1 - n0
            procs = {pid: (p1[pid][0] - p0[pid][0]) / (p1[pid][1] - p0[pid][1]) for pid in p1 if pid in p0}
            per_gpu.append(((g1 - g0) / samples, (m1 - m0) / samples, procs))
        intervals.append(per_gpu)
    return nows, intervals


def check(scenario: dict, seed: int = 0, call_s: float = 0.0, every: float = 1.0) -> None:
    nows, intervals = run(scenario, seed, call_s, every)
    truth = expected()
    for label, figures, bound in (("interval", intervals, 1.0), ("now", nows[1:], 2.0)):
        for n, per_gpu in enumerate(figures):
            for index, (gpu_busy, mem_busy, procs) in enumerate(per_gpu):
                want_gpu, want_mem, want_procs = truth[index]
                where = f"{label} {n}, GPU {index}"
                assert abs(gpu_busy - want_gpu) <= bound, f"{where}: GPU busy {gpu_busy}, not {want_gpu}"
                assert abs(mem_busy - want_mem) <= bound, f"{where}: memory busy {mem_busy}, not {want_mem}"
                assert set(procs) == set(want_procs), f"{where}: processes {sorted(procs)}"
                for pid, busy in procs.items():
                    want = want_procs[pid]
                    assert abs(busy - want) <= bound, f"{where}: pid {pid} busy {busy}, not {want}"


@pytest.mark.quick_cases(5)
@pytest.mark.parametrize("behaviour", sorted(BEHAVIOURS))
def test_each_behaviour(behaviour):
    """Interval averages within 1 point of the load, every poll's figure within 2."""
    for seed in range(3):
        check(host(behaviour), seed)


@pytest.mark.quick_cases(6)
@pytest.mark.parametrize("pair", compatible_pairs(), ids=" + ".join)
def test_every_two_behaviours(pair):
    check(host(*pair))


@pytest.mark.quick_cases(3)
@pytest.mark.parametrize("every", [1.0, 0.25])
@pytest.mark.parametrize("behaviour", ["plain", "jitter 5 ms", "process utilization once per call", "period 1/2 s"])
def test_calls_that_take_time(behaviour, every):
    """A poll's calls spread over several milliseconds: a period may end between
    a GPU's samples call and its process call, and nothing is counted twice."""
    for seed in range(3):
        check(host(behaviour), seed, call_s=0.003, every=every)


def test_point_sampling_is_not_what_is_checked():
    """The check can fail: a driver whose samples the reader misread shows up."""
    nows, _ = run(host("plain"))
    assert nows[-1][0][0] == 40
    with pytest.raises(AssertionError):
        scenario = host("plain")
        scenario["gpus"][0]["gpu_util"] = 45
        check(scenario)


def test_polls_whose_calls_wait_in_the_worker():
    """Every other poll's calls run 600 ms after the poll began (a busy worker):
    the driver's clock is learnt from the calls' own time, so no prompt poll
    after a late one takes the buffer for dry."""
    clock = [0.0]

    class Reactor:
        @staticmethod
        def seconds() -> float:
            return clock[0]

    reader = NvmlReader(simulated_binding(parse_scenario(host("plain")), clock=lambda: clock[0]), reactor=Reactor())
    reader.open()
    figures = []
    for poll in range(30):
        began = 30.0 + poll
        clock[0] = began + (0.6 if poll % 2 else 0.0)
        snapshot, _ = reader.read(began)
        figures.append([(d.gpu_busy, d.mem_busy) for d in snapshot.devices])
    assert all(f == [(40, 10), (70, 20)] for f in figures[1:]), figures


def test_what_the_reader_keeps_per_device_stays_bounded():
    """Over many polls the sample streams keep a bounded past, whatever the driver does."""
    for behaviour in ("plain", "boottime clock", "process utilization once per call"):
        clock = [30.0]
        binding = simulated_binding(parse_scenario(host(behaviour)), clock=lambda now=clock: now[0])
        reader = NvmlReader(binding, reactor=None)
        reader.open()
        for poll in range(300):
            clock[0] = 31.0 + poll
            reader.read(clock[0])
        for device in reader._devices:
            stream = device.process_stream
            assert len(stream.stamps_seen) < 10 and len(stream.pending) < 20, behaviour
            assert all(len(s.cover) < 20 for s in device.streams.values()), behaviour
