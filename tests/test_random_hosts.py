"""A property test: random hosts, random delays, random clock steps; the scenario's own truth.

A random simulated host (one to three GPUs at constant loads, processes that
start, stop, run on two GPUs at once and give their pid to a later process),
read by the NVML reader on simulated time and folded into the counters, while
the reader's calls take random time (now and then a great deal) and polls
start late at random; polls are on the ticks of the interval, and a poll that
runs past a tick skips it, as the daemon's poller does.  `cases` can also step
the host's wall clock forward and back, between polls and inside calls, and
suspend the host (`STEPPED`); what that found is kept in `FOUND`.  The oracle
is the scenario:

- every GPU counts one sample per poll, and its busy and memory busy sums are
  the sums of its load over the time each poll's samples call covered (the
  simulator's `true_load`), within one poll's worth (and one more for each
  poll shorter than a sample period, whose load NVML cannot tell: docs/fidelity.md);
  its memory sum exactly;
- every process's life is counted once, under the start time the scenario
  gives it, with one sample per poll whose process list showed it (the time of
  that call, as the simulator answered it, decides), its busy sums within one
  poll's worth of its pid's load over those polls' time, its memory sum exactly;
- no sum ever goes down;
- every life that ended is reported as exited once, and no other.

The examples hypothesis found are kept (``@example``), with what each was.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture.providers import HypothesisProvider
from sim_readers import make_reader

from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml.stamps import HostClocks
from atopgpud_tw.sim.nvml import SimulatedNvml
from atopgpud_tw.sim.scenario import parse_scenario

#: the reader's calls that take (random) time: its sample buffers and the process list
SLOW = ("nvmlDeviceGetSamples", "nvmlDeviceGetProcessUtilization", "nvmlDeviceGetComputeRunningProcesses")
#: polls per example
POLLS = 30
#: pids the processes are given (few, so that they are reused)
PIDS = (4100, 4101, 4102, 4103)


@dataclass(frozen=True)
class Step:
    """The wall clock set `seconds` at `at` (seconds into the run); `inside`: during the
    first slow call made less than a poll before `at`, which is made to last until
    `tail` seconds after it."""

    at: float
    seconds: float
    inside: bool = False
    tail: float = 0.1


@dataclass(frozen=True)
class Case:
    interval: float
    #: per GPU: (GPU busy %, memory busy %, memory MiB)
    gpus: tuple[tuple[int, int, int], ...]
    #: per life: (pid's index, GPUs' indices, start, stop or None, SM %, memory busy %, MiB)
    lives: tuple[tuple[int, tuple[int, ...], float, float | None, int, int, int], ...]
    steps: tuple[Step, ...] = ()
    #: (when, seconds): the host sleeps
    suspends: tuple[tuple[float, float], ...] = ()
    #: the delays' and late polls' generator
    seed: int = 0
    #: a slow call's usual length, seconds (now and then 30 times that)
    delay: float = 0.003
    #: the share of polls that start late (by up to half an interval)
    late: float = 0.3
    #: the longest a call takes, seconds (None: an eighth of the interval)
    slowest: float | None = None

    def scenario(self) -> dict[str, Any]:
        cards = []
        for index, (gpu, mem, mib) in enumerate(self.gpus):
            processes = [
                {"pid": PIDS[pid], "sm_util": sm, "mem_util": busy, "memory_mib": life_mib, "start": start,
                 "stop": stop}
                for pid, on, start, stop, sm, busy, life_mib in self.lives if index in on
            ]
            cards.append({"busid": f"00000000:{0x17 + index:02X}:00.0", "gpu_util": gpu, "mem_util": mem,
                          "memory_used_mib": mib, "processes": processes})
        return {
            "gpus": cards,
            "clock_steps": [[step.at, step.seconds] for step in self.steps],
            "suspends": [list(suspend) for suspend in self.suspends],
        }


@dataclass
class Played:
    """What a run left: the counters after each poll, the exits, the list calls' times."""

    #: per poll, per device: (samples, GPU busy, memory busy, memory, {life: (pid, started, samples, busy,
    #: memory busy, memory)})
    history: list[list[tuple[int, int, int, int, dict[int, tuple[int, int | None, int, int, int, int]]]]]
    #: (device index, life) of every exit, in order
    exits: list[tuple[int, int]]
    #: per GPU, the simulated time of each poll's process list (its last call)
    listed_at: list[list[float]]
    #: per GPU, the simulated time each poll's GPU samples call answered (its last)
    sampled_at: list[list[float]]


def play(case: Case) -> Played:
    """Poll the case's host on simulated time, `POLLS` ticks of its interval (fewer polls after a long call)."""
    draw = random.Random(case.seed)
    clock = [0.0]
    data = case.scenario()
    reader, nvml = make_reader(data, clock)
    model = nvml._nvml.nvmlLib.model
    reader.host_offsets = HostClocks(model.host_offsets)  # the simulated host's clocks, as the daemon reads its own
    reader._call_clock = lambda: clock[0]  # each call's time, as the daemon's reactor clock gives it
    inside = sorted((step.at, step.tail) for step in case.steps if step.inside)
    listed: dict[int, float] = {}
    sampled: dict[int, float] = {}

    def slowed(name: str) -> None:
        answer = getattr(model, name)

        def delayed(handle: Any, *args: Any) -> Any:
            while inside and inside[0][0] - case.interval <= clock[0]:
                # the call in flight when the clock is set: it ends `tail` after the step
                at, tail = inside.pop(0)
                clock[0] = max(clock[0], at) + tail
            slowest = case.interval / 8 if case.slowest is None else case.slowest
            clock[0] += min(draw.random() * case.delay * (30 if draw.random() < 0.05 else 1), slowest)
            if name == "nvmlDeviceGetComputeRunningProcesses":
                listed[handle.gpu] = clock[0]
            elif name == "nvmlDeviceGetSamples" and args[0] == 1:  # the GPU's samples
                sampled[handle.gpu] = clock[0]
            return answer(handle, *args)

        setattr(model, name, delayed)

    for name in SLOW:
        slowed(name)
    counters = Counters()
    played = Played([], [], [[] for _ in case.gpus], [[] for _ in case.gpus])
    tick = 0
    while True:
        # the daemon's poller (a `LoopingCall`) skips the ticks a poll ran past: polls never stack
        # up at one moment after a long call; the next covers the intervals skipped
        since, tick = tick, max(tick + 1, math.ceil(round(clock[0] / case.interval, 6)))
        if tick > POLLS:
            break
        due = tick * case.interval
        late = draw.random() * case.interval / 2 if draw.random() < case.late else 0.0
        clock[0] = max(clock[0], due + late)
        snapshot, _ = reader.read(clock[0])
        played.exits += [(e.device_index, e.totals.life) for e in counters.fold(snapshot, due, since * case.interval)]
        for index in range(len(case.gpus)):
            played.listed_at[index].append(listed[index])
            played.sampled_at[index].append(sampled[index])
        played.history.append([
            (d.samples, d.gpu_busy_total, d.mem_busy_total, d.memory_used_cum_kib,
             {p.life: (p.pid, p.started, p.samples, p.gpu_busy_cum, p.mem_busy_cum, p.memory_cum_kib)
              for p in d.processes.values()})
            for d in counters.devices
        ])
    return played


#: what the whole-percent figures of a life's first two polls may lose or gain together (under half a
#: percent each): hosts over one poll's worth by no more were exact with unrounded figures
ROUNDING = 1


def check(case: Case, played: Played) -> None:
    history = played.history
    last = history[-1]
    assert len(last) == len(case.gpus)
    # never down
    for before, after in zip(history, history[1:]):
        for old, new in zip(before, after):
            assert all(b >= a for a, b in zip(old[:4], new[:4])), (old[:4], new[:4])
            for life, sums in new[4].items():
                if life in old[4]:
                    assert all(b >= a for a, b in zip(old[4][life][2:], sums[2:])), (life, old[4][life], sums)
    # the truth, by the simulator's own rules: each poll's load over the time its samples call
    # covered (the first: the second before it), when each process ran, and the start time it has
    scenario = parse_scenario(case.scenario())
    at = [0.0]
    host = SimulatedNvml(scenario, clock=lambda: at[0])
    for index, gpu in enumerate(scenario.gpus):
        times = played.sampled_at[index]
        loads = [host.true_load(index, start, end) for start, end in zip([times[0] - 1.0, *times], times)]
        samples, gpu_sum, mem_sum, memory, _ = last[index]
        where = f"GPU {index}"
        assert samples == len(history), where
        # polls shorter than a sample period (after a long call): the driver's samples cannot tell
        # the load in them (docs/fidelity.md, "Random hosts against their scenario"), one poll's worth more each
        short = {n for n in range(1, len(times)) if times[n] - times[n - 1] < gpu.sample_period}
        # one poll's worth: the most one poll reads (the load, constant here)
        truth = sum(load.gpu for load in loads)
        assert abs(gpu_sum - truth) <= max(gpu.gpu_util, 1) * (1 + len(short)), (where, "busy", gpu_sum, truth)
        truth = sum(load.mem for load in loads)
        assert abs(mem_sum - truth) <= max(gpu.mem_util, 1) * (1 + len(short)), (where, "memory busy", mem_sum, truth)
        assert memory == gpu.memory_used_mib * 1024 * samples, where
        # every life: counted once, under its start time, for the polls that listed it
        counted: dict[tuple[int, int | None], list[tuple[int, tuple[int, ...]]]] = {}
        for life, sums in {life: sums for poll in history for life, sums in poll[index][4].items()}.items():
            counted.setdefault((sums[0], sums[1]), []).append((life, sums))
        expected = {}
        for process in gpu.processes:
            polls = [n for n, t in enumerate(played.listed_at[index]) if process.alive(t)]
            if polls:
                at[0] = process.start
                # one poll's worth: the most one poll of its pid reads (another life of the pid
                # may end in the period this one starts in: the driver lists both under the pid);
                # and the rounding of the polls a life begins in: each poll's figure is a whole
                # percent (the protocol's), and a life's first two, partial, round by under half
                # a percent each (docs/fidelity.md, "Random hosts against their scenario")
                worth = [max(p.sm_util, 1) for p in gpu.processes if p.pid == process.pid], [
                    max(p.mem_util, 1) for p in gpu.processes if p.pid == process.pid]
                expected[(process.pid, host.process_start_time(process.pid))] = (
                    polls, process, sum(loads[n].processes[process.pid][0] for n in polls),
                    sum(loads[n].processes[process.pid][1] for n in polls),
                    *(max(kind) * (1 + len(short.intersection(polls))) + ROUNDING for kind in worth))
        assert set(counted) == set(expected), (where, sorted(counted), sorted(expected))
        for key, (polls, process, sm, busy, sm_worth, busy_worth) in expected.items():
            found = counted[key]
            where = f"GPU {index} pid {key[0]} started {key[1]}"
            assert len(found) == 1, (where, "counted as more than one process", found)
            _, (_, _, samples, sm_sum, busy_sum, memory) = found[0]
            assert samples == len(polls), (where, samples, len(polls))
            assert abs(sm_sum - sm) <= sm_worth, (where, "SM busy", sm_sum, sm)
            assert abs(busy_sum - busy) <= busy_worth, (where, "memory busy", busy_sum, busy)
            assert memory == process.memory_mib * 1024 * samples, (where, memory)
    # every life that ended reported once, no other
    assert len(played.exits) == len(set(played.exits)), played.exits
    lives = {(index, life) for poll in history for index, device in enumerate(poll) for life in device[4]}
    still = {(index, life) for index, device in enumerate(last) for life in device[4]}
    assert set(played.exits) == lives - still, played.exits


# -- the strategy --

INTERVALS = (0.5, 1.0, 2.0)
percent = st.integers(0, 100)


@st.composite
def cases(draw: st.DrawFn, steps_: int = 3, back: bool = True, suspends_: int = 2, delays: bool = True,
          inside: bool = True) -> Case:
    interval = draw(st.sampled_from(INTERVALS))
    length = POLLS * interval
    gpus = tuple(draw(st.lists(st.tuples(percent, percent, st.integers(0, 4096)), min_size=1, max_size=3)))
    lives = []
    for pid in range(len(PIDS)):
        at = 0.0
        for _ in range(draw(st.integers(0, 3))):
            # a life from `at` on: from the start (0: running before the reader), or later; for ever, or not
            start = at if at == 0 and draw(st.booleans()) else round(at + draw(st.floats(0.01, length / 2)), 2)
            stop = None if draw(st.integers(0, 3)) == 0 else round(start + draw(st.floats(0.05, length / 2)), 2)
            on = tuple(sorted(draw(st.sets(st.integers(0, len(gpus) - 1), min_size=1, max_size=2))))
            lives.append((pid, on, start, stop, draw(percent), draw(percent), draw(st.integers(0, 2048))))
            if stop is None:
                break
            at = stop
    steps = []
    for _ in range(draw(st.integers(0, steps_))):
        # (after the first poll, its calls stretched by a step inside one included: steps forward
        # before the reader's first look at the host clocks are not exact, docs/fidelity.md)
        at = round(draw(st.floats(3 * interval, length - 2 * interval)), 3)
        seconds = round(draw(st.one_of(st.floats(0.2, 120), st.floats(-120, -0.2)) if back else st.floats(0.2, 120)), 3)
        steps.append(Step(at, seconds, inside and draw(st.booleans()), round(draw(st.floats(0.0, 1.5)), 3)))
    suspends = tuple(
        (round(draw(st.floats(3 * interval, length - interval)), 3), round(draw(st.floats(1, 600)), 1))
        for _ in range(draw(st.integers(0, suspends_)))
    )
    return Case(
        interval, gpus, tuple(lives), tuple(steps), suspends, draw(st.integers(0, 2**16)),
        draw(st.sampled_from((0.0, 0.003, 0.03) if delays else (0.0,))),
        draw(st.sampled_from((0.0, 0.3) if delays else (0.0,))),
    )


#: what was found: each passes now (its fix and its own test named)
FOUND = (
    # a few slow GPU samples calls among fast ones set the driver's clock ahead of itself: 62 for
    # 80 for 16 polls (test_late_polls.py::test_a_few_slow_samples_calls_read_no_idle_spell)
    Case(interval=2.0, gpus=((63, 49, 120), (80, 84, 3358)), lives=(
        (1, (0, 1), 0.0, 3.79, 2, 13, 1910), (2, (1,), 0.0, None, 26, 35, 2)), seed=67, delay=0.03, slowest=1.0),
    # a process first listed ended while the busy call ran: no start time, and the next process of
    # its pid was taken for it (test_late_polls.py::test_a_process_that_ends_during_the_busy_call_...)
    Case(interval=0.5, gpus=((3, 91, 172), (4, 58, 202)), lives=(
        (0, (1,), 0.0, 0.55, 91, 21, 488), (0, (0, 1), 0.75, 4.37, 1, 47, 438), (0, (1,), 11.51, 18.5, 33, 27, 1146),
        (1, (0, 1), 0.0, 6.22, 62, 12, 8), (1, (1,), 13.72, 14.09, 5, 73, 1622), (3, (0, 1), 0.0, 0.2, 97, 15, 400),
        (3, (1,), 1.75, 1.95, 18, 56, 1530), (3, (0, 1), 8.36, None, 40, 25, 200)), seed=208, delay=0.03, late=0.0),
    # a forward step inside a device's first call, ending at the step's very moment (and one at
    # the start of another device's first call): what its stamps follow was not learnt, and no
    # step was taken out after: GPU 0 at 51 % summed 1302 for 1530 over 30 polls, GPU 1 at 22 %
    # 553 for 660 (test_time_steps.py::test_a_step_inside_or_before_the_first_call_is_taken_out)
    Case(interval=2.0, gpus=((51, 16, 362), (22, 28, 417)), lives=(
        (1, (0,), 0.0, 0.5, 36, 5, 638), (1, (0, 1), 3.92, 7.6, 65, 96, 70), (1, (0, 1), 9.5, 9.55, 55, 83, 1218)),
        steps=(Step(34.776, 97.853, inside=True, tail=0.0), Step(3.173, 61.003, inside=True, tail=0.0)),
        seed=3, delay=0.0, late=0.0),
    # two forward steps 0.8 s apart between polls: the samples stamped on the clock between them
    # fitted neither the clock before nor the one after, and were placed a step away: a process
    # at 40 % summed 246 for 286.7 (test_time_steps.py::test_two_steps_between_two_looks)
    Case(interval=1.0, gpus=((91, 88, 167),), lives=(
        (0, (0,), 0.0, None, 39, 34, 1094), (1, (0,), 6.95, 14.46, 40, 72, 366), (2, (0,), 0.21, 14.48, 63, 24, 33),
        (2, (0,), 25.95, 27.95, 96, 19, 254), (2, (0,), 28.95, 40.76, 85, 59, 142),
        (3, (0,), 0.0, 4.0, 23, 82, 790), (3, (0,), 8.43, 21.2, 56, 66, 371), (3, (0,), 34.38, 47.35, 67, 13, 366)),
        steps=(Step(13.842, 78.987), Step(2.72, 32.94), Step(13.062, 42.505)), seed=810, delay=0.0, late=0.0),
    # two suspends of 1 s, 62 ms apart, before a device's first call: its stamps followed no clock
    # as it read then, and were never placed: GPU 1 at 6 % summed 173 for 180
    Case(interval=1.0, gpus=((0, 0, 0), (6, 0, 0)), lives=(
        (1, (0,), 0.0, None, 0, 0, 0), (2, (0,), 1.0, 2.0, 0, 0, 0), (2, (0,), 3.0, 4.0, 0, 0, 0),
        (2, (0,), 5.0, None, 0, 0, 0)), suspends=((1.062, 1.0), (1.0, 1.0)), seed=0, delay=0.03, late=0.0),
    # calls of up to 0.9 s at 1 s polls: the first read of the process samples (the processes
    # started since) took its last second over all the periods of its late poll: a new process at
    # 79 % read 34 in its first two polls, 1964 for 2054
    # (test_late_polls.py::test_the_first_process_samples_of_a_late_poll_read_their_second)
    Case(interval=1.0, gpus=((40, 54, 115),), lives=(
        (0, (0,), 4.05, None, 79, 73, 366), (1, (0,), 5.5, 9.85, 21, 37, 1034), (3, (0,), 4.05, None, 93, 49, 1)),
        seed=357, delay=0.03, late=0.3, slowest=1.0),
    # a step back of 1 s inside a call of 1.5 s: the samples of before it, first seen after it,
    # could not be told from those of after it, and were placed a step off: GPU 1 at 2 % summed 56
    # for 60 (test_step_in_call.py::test_a_step_back_shorter_than_a_call_is_told_by_the_buffers_order)
    Case(interval=0.5, gpus=((0, 0, 0), (2, 0, 0)), lives=(
        (0, (0,), 0.0, 1.0, 0, 0, 0), (0, (0,), 2.0, None, 0, 0, 0), (1, (0,), 0.0, 1.0, 0, 0, 0),
        (1, (0,), 2.0, 3.0, 0, 0, 0), (1, (0,), 4.0, None, 0, 0, 0), (3, (0,), 0.0, None, 0, 0, 0)),
        steps=(Step(at=2.0, seconds=-1.0, inside=True, tail=1.0),), delay=0.0, late=0.0),
    # a process first read in a poll whose device window ended before the device's newest sample:
    # the samples between were shown in neither poll: a process at 1 % read 0 in its first two
    # polls, 27 for 28.7
    Case(interval=0.5, gpus=((0, 0, 0),), lives=((0, (0,), 0.0, 0.5, 0, 0, 0), (0, (0,), 0.75, None, 1, 0, 0)),
         seed=3, delay=0.0, late=0.3),
    # a forward step inside a call that lasts two polls, a process starting at the step: its first
    # samples, the only ones of three polls, never decided whether they carry the device's stamps,
    # and were shown in no window: 1 % read 0 for three polls, 25 for 27.6
    Case(interval=0.5, gpus=((0, 0, 0),), lives=((2, (0,), 0.0, None, 0, 0, 0), (3, (0,), 2.0, None, 1, 0, 0)),
         steps=(Step(at=2.0, seconds=1.0, inside=True, tail=1.0),), delay=0.0, late=0.0),
    # a step back of 1 s inside a call of 1.5 s: a process's samples of before it placed where the
    # device's samples of the same stamps after it were, and the device's sample of the step's
    # moment, not in its answer yet, taken for proof that the process samples are on a clock of
    # their own: 26 for 28.3
    Case(interval=0.5, gpus=((0, 0, 0),), lives=((0, (0,), 1.0, None, 0, 1, 0),),
         steps=(Step(at=2.0, seconds=-1.0, inside=True, tail=1.0),), delay=0.0, late=0.0),
    # a forward step of 1.25 s at a poll's moment, 2 s polls: samples taken before it, less than
    # the step before the look, fitted the new clock too and were placed there, half a period
    # from the others (taken for the period): GPU 1 at 40 % read 20 for five polls, 1100 for 1200
    Case(interval=2.0, gpus=((0, 0, 0), (40, 30, 0)), lives=((1, (1,), 1.0, None, 20, 10, 0),),
         steps=(Step(at=6.0, seconds=1.25),), delay=0.0, late=0.0),
    # two forward steps 0.375 s apart between 0.5 s polls: the samples of the clock between them,
    # placed 0.5 s late, were taken for proof that the next ones were of the clock before, 1 s
    # ahead: GPU 1 at 1 % summed 28 for 30
    Case(interval=0.5, gpus=((0, 0, 0), (1, 0, 0)), lives=(
        (1, (0,), 1.0, 2.0, 0, 0, 0), (1, (0,), 3.0, None, 0, 0, 0), (2, (0,), 0.0, 1.0, 0, 0, 0),
        (2, (0,), 2.0, None, 0, 0, 0), (3, (0,), 0.0, 1.0, 0, 0, 0), (3, (0,), 2.0, None, 0, 0, 0)),
        steps=(Step(at=2.0, seconds=0.5), Step(at=1.625, seconds=1.0)), delay=0.0, late=0.0),
    # the same inside one call: +0.2 s, then +107 s 1.1 s later: the samples after the second were
    # placed on the clock before it, 107 s ahead, and read as a dry spell: GPU 0 at 98 % memory busy
    # summed 2533 for 2744
    Case(interval=1.0, gpus=((1, 98, 541),), lives=(), steps=(
        Step(at=22.31, seconds=0.2, inside=True, tail=0.53), Step(at=23.442, seconds=107.248, inside=True, tail=0.851)),
        seed=1393, delay=0.0, late=0.3),
    # three steps (+50 s, -37 s, -85 s) between two looks of GPU 1: the samples of the two clocks
    # that held only between them were placed with one offset, one run 18 s ahead: GPU 1 read 0
    # from then on, 324 for 1296
    Case(interval=0.5, gpus=((78, 43, 2081), (48, 33, 2609)), lives=(), steps=(
        Step(at=4.064, seconds=-85.436, inside=True, tail=1.071),
        Step(at=3.689, seconds=-37.101, inside=True, tail=0.258), Step(at=3.288, seconds=49.84)),
        seed=65139, delay=0.0, late=0.0),
    # +48 s between polls, then -109 s and a suspend inside the next call: two samples of the clock
    # between, 61 s below the first, fitted the first stretch (which has no beginning), and the
    # buffer's order put the samples of +48 s there too, 48 s ahead: GPU 0 at 67 % read 0 from
    # then on, 292 for 1943
    Case(interval=1.0, gpus=((67, 74, 1235),), lives=(), steps=(
        Step(at=4.583, seconds=-108.923, inside=True, tail=1.011), Step(at=4.0, seconds=47.7)),
        suspends=((5.0, 2.0),), seed=693, delay=0.03, late=0.0),
    # two forward steps of 0.585 s inside one call of 3.5 s: the samples of the clock between them
    # fitted the clock before (0.585 s late), and the buffer's order moved those of the clock after
    # onto it, 1.17 s ahead: GPU 0 at 20 % read 0 from then on, 21 for 480
    Case(interval=0.5, gpus=((20, 100, 1798),), lives=(), steps=(
        Step(at=2.328, seconds=0.585, inside=True, tail=1.5), Step(at=1.5, seconds=0.585, inside=True, tail=1.5)),
        delay=0.0, late=0.0),
    # a forward step inside a call of 1.9 s at 0.5 s polls: the test played three more polls at the
    # call's end, which the daemon's poller skips (the next poll covers them): a process at 1 % for
    # 1 s summed 1 for 2.3
    Case(interval=0.5, gpus=((74, 42, 300), (74, 42, 300), (59, 15, 93)), lives=(
        (0, (0,), 0.0, None, 77, 97, 900), (1, (0, 1), 7.5, 11.08, 23, 14, 0), (1, (0,), 17.45, None, 35, 14, 2048),
        (2, (0,), 1.9, 5.35, 96, 91, 2048), (3, (0,), 2.25, 3.25, 1, 58, 302), (3, (1,), 4.35, 5.11, 59, 33, 304)),
        steps=(Step(at=1.5, seconds=1.0, inside=True, tail=1.397),), suspends=((7.427, 453.1), (5.782, 62.2)),
        seed=65536, delay=0.03),
    # a poll 0.15 s after a call of 0.85 s (shorter than a sample period), a process that started
    # 6 ms before that call returned at 45 %: 0 in that poll, 43 for 90; and one 45 ms after a call
    # of 2 s, a process at 62 % that started 0.33 s before it returned: 1431 for 1496.  Not exact:
    # within the bound the oracle allows for polls shorter than a period (one poll's worth each)
    Case(interval=0.5, gpus=((96, 100, 1332), (93, 100, 1332)), lives=(
        (0, (0, 1), 6.34, 8.0, 46, 93, 1579), (0, (0, 1), 14.34, None, 45, 21, 794),
        (2, (0, 1), 6.74, 10.83, 22, 56, 159), (2, (0, 1), 11.83, 18.17, 93, 11, 2003)),
        steps=(Step(at=1.9, seconds=105.117, inside=True, tail=1.32),
               Step(at=13.639, seconds=-99.749, inside=True, tail=0.707)), seed=1939, delay=0.0, late=0.0),
    Case(interval=0.5, gpus=((34, 90, 951), (53, 29, 112)), lives=(
        (0, (1,), 0.0, 1.24, 78, 80, 419), (0, (0,), 6.67, None, 49, 77, 1865), (1, (0, 1), 0.0, 3.31, 42, 5, 207),
        (1, (0, 1), 3.83, 5.42, 91, 58, 1156), (1, (0, 1), 12.07, 17.75, 81, 70, 1432),
        (3, (0,), 2.67, None, 62, 62, 1385)),
        steps=(Step(at=10.573, seconds=84.962, inside=True, tail=0.5), Step(at=1.5, seconds=13.672, inside=True,
                                                                            tail=1.5)),
        suspends=((10.567, 272.3), (10.568, 203.1)), seed=40807, delay=0.0, late=0.3),
    # a step back of 18.7 s, then a suspend of 200 s, inside one call: its net step forward, the
    # next call asked past the samples taken between the two (stamped below the one asked with),
    # and their time read as a dry spell: a process at 100 % summed 2208 for 2325 (64 in that
    # poll); the call after a step found inside one asks for the whole buffer now, and the stream
    # takes samples into time it took for a dry spell and has not shown yet
    Case(interval=1.0, gpus=((6, 6, 85),), lives=(
        (0, (0,), 0.0, None, 93, 90, 1224), (1, (0,), 5.8, 19.67, 72, 46, 89), (1, (0,), 24.3, 35.87, 29, 9, 389),
        (1, (0,), 44.33, 44.83, 86, 16, 1715), (2, (0,), 5.31, 9.12, 88, 52, 527), (3, (0,), 0.0, 0.5, 17, 42, 451),
        (3, (0,), 5.04, None, 100, 32, 152)),
        steps=(Step(at=4.762, seconds=-24.782, inside=True, tail=0.913), Step(at=19.692, seconds=-60.185),
               Step(at=21.831, seconds=-18.701, inside=True, tail=1.497)),
        suspends=((22.67, 199.9), (3.441, 66.1)), seed=3849, delay=0.0, late=0.3),
    # a step back of 1 s (6 periods) at a poll, 0.5 s polls, a process starting 0.5 s later at
    # 40 % beside one that ran before: its new samples carried the stamps of the other's from before
    # the step, were placed by stamp alone where those were, and dropped as old: 1038 for 1093;
    # the map remembers which processes each stamp listed when it was first seen now
    Case(interval=0.5, gpus=((0, 0, 0),), lives=(
        (2, (0,), 0.0, 1.0, 0, 0, 0), (2, (0,), 1.5, None, 40, 0, 0), (3, (0,), 0.0, None, 0, 40, 0)),
        steps=(Step(at=1.0, seconds=-1.0),), delay=0.0, late=0.0),
    # two forward steps of 1 s before GPU 1's first look, inside and at the end of GPU 0's first
    # call: GPU 1's first answer holds samples on three clocks, which its own looks cannot tell
    # from a dry spell: its 2nd and 3rd polls read 0 and 16 for 40, 1056 for 1120; each device's
    # map learns from the looks of the others now (`HostClocks`)
    Case(interval=0.5, gpus=((0, 0, 0), (40, 30, 0)), lives=((0, (1,), 0.0, None, 20, 10, 0),),
         steps=(Step(at=1.75, seconds=1.0), Step(at=0.5, seconds=1.0, inside=True, tail=1.25)),
         delay=0.0, late=0.0),
    # a step back of 2.7 s (and one of 1.1 s) inside a call, then a suspend: the samples between
    # the two, stamped above the stamp asked with, came in the same answer and were placed among
    # those before the step, 12 ms from them, and 12 ms was taken for the sample period: every gap
    # read as a dry spell, a GPU at 50 % read 9 3 4 4 for four polls, 1269 for 1450 (45 %: 1227
    # for 1305); a new sample stamped below the one before it, by more than any step back found,
    # is of a clock between two looks now
    Case(interval=2.0, gpus=((50, 40, 100),), lives=(
        (0, (0,), 0.0, None, 100, 30, 10), (1, (0,), 0.0, None, 30, 10, 10)),
        steps=(Step(at=8.828, seconds=-2.679, inside=True, tail=1.455),),
        suspends=((9.685, 152.8),), seed=42205, delay=0.003, late=0.3),
    Case(interval=2.0, gpus=((45, 96, 1972),), lives=(
        (1, (0,), 0.0, None, 31, 5, 1310), (2, (0,), 10.97, None, 17, 91, 9), (3, (0,), 0.0, 0.11, 93, 100, 1315),
        (3, (0,), 2.11, 30.96, 46, 39, 300), (3, (0,), 51.32, 58.65, 84, 48, 405)),
        steps=(Step(at=53.001, seconds=-1.1, inside=True, tail=1.473),),
        suspends=((54.307, 50.8),), seed=3214, delay=0.03, late=0.3),
    # a suspend of 563 s, then a step of +1.9 s, between two looks of GPUs 1 and 2 (inside GPU 0's
    # call): the samples of the clock between fitted the newest clock 1.9 s early, before the samples
    # of the clock before them, which the buffer's order sent between, where they had no room: GPU 1
    # at 30 % read `10 9 9` in three polls, 778 for 840; GPU 2 at 1 % read 0 three times.  (Each map
    # takes in the other devices' looks now, which saw both steps here: the same steps between two
    # looks of a single GPU are pinned by test_time_steps.py::test_two_forward_steps_between_two_looks_in_either_order)
    Case(interval=2.0, gpus=((30, 82, 661), (30, 82, 661), (1, 87, 139)), lives=(
        (0, (0, 2), 0.0, None, 67, 35, 549), (2, (0, 2), 0.0, 0.21, 75, 62, 38),
        (2, (0, 2), 13.25, 14.25, 45, 100, 1227), (3, (0, 2), 18.81, None, 65, 89, 159)),
        steps=(Step(at=8.0, seconds=1.9, inside=True, tail=0.443), Step(at=16.0, seconds=1.9, inside=True, tail=1.306)),
        suspends=((6.0, 563.4), (8.683, 440.6)), seed=39851, delay=0.03, late=0.0),
    # +56.8 s, then a suspend of 1.1 s 0.76 s later, inside one call: the samples of the clock between
    # fitted the newest clock 1.1 s early, before the samples of the clock before them, which were sent
    # between, where they had no room: GPU 0 at 92 % read `33 37 27 28`, 2333 for 2576, GPU 1 at 60 %
    # `24 18 19 18` (test_time_steps.py::test_two_forward_steps_between_two_looks_in_either_order)
    Case(interval=2.0, gpus=((92, 100, 146), (60, 71, 488)), lives=(
        (1, (0, 1), 15.18, None, 74, 79, 145), (2, (0, 1), 0.0, 2.78, 74, 34, 997),
        (2, (0, 1), 29.14, 31.14, 100, 20, 357)),
        steps=(Step(at=11.607, seconds=56.837, inside=True, tail=1.444), Step(at=16.0, seconds=104.451, inside=True,
                                                                            tail=1.378)),
        suspends=((12.371, 1.1), (51.08, 213.6)), seed=241, delay=0.03, late=0.3),
    # +1.284 s, then -46.665 s 2.9 s later, inside one poll's calls: the run of samples of the clock
    # between, of which the first fitted the stretch before (it ended at the call's end), was placed there
    # a step ahead, and the samples after it followed it: GPU 1 at 80 % read 12 to 15 for six polls, 1835
    # for 2240; a run of samples a period apart is of one clock now, the newest that holds them all, or of none
    Case(interval=2.0, gpus=((9, 42, 541), (80, 69, 828), (87, 93, 257)), lives=(
        (1, (1,), 5.29, 31.16, 3, 16, 25), (3, (1,), 0.0, None, 46, 11, 407)),
        steps=(Step(at=24.093, seconds=-46.665, inside=True, tail=0.347), Step(at=21.191, seconds=1.284, inside=True,
                                                                             tail=1.313)),
        suspends=((16.803, 600.0),), seed=43, delay=0.0, late=0.0),
    # three samples placed 1.08 s off among the others (two suspends and three steps in 10 s) left gaps of
    # half a period between them, which were taken for the sample period: every gap then read as half idle,
    # GPU 0 at 66 % read 33 for eight polls, 1507 for 1848; the period is learnt from samples next to one
    # another in the buffer now
    Case(interval=1.0, gpus=((66, 55, 561),), lives=(
        (2, (0,), 0.0, 4.47, 75, 42, 1810), (2, (0,), 10.73, 22.98, 65, 44, 1319), (2, (0,), 36.98, 51.26, 19, 29, 19),
        (3, (0,), 5.77, 6.56, 44, 68, 170), (3, (0,), 15.7, 29.39, 89, 5, 261), (3, (0,), 38.84, 42.16, 50, 9, 87)),
        steps=(Step(at=24.15, seconds=-90.005), Step(at=16.008, seconds=31.703, inside=True, tail=1.087),
               Step(at=13.999, seconds=-69.803, inside=True, tail=0.0)),
        suspends=((14.667, 396.9), (15.209, 108.7)), seed=2914, delay=0.0, late=0.3),
    # (the same, on three GPUs: a step back of 1.2 s, then +73.6 s a second later inside a call: 1944 for 2117)
    Case(interval=2.0, gpus=((73, 58, 14), (8, 89, 2130), (21, 77, 689)), lives=(
        (1, (1, 2), 0.0, 2.85, 18, 33, 154), (1, (0, 1), 28.89, 38.58, 84, 2, 509),
        (1, (1, 2), 46.51, 47.56, 35, 23, 775), (2, (2,), 0.0, 3.7, 26, 17, 553), (2, (0, 1), 33.5, 56.82, 10, 53, 247),
        (3, (2,), 7.9, 27.42, 94, 0, 451),
        (3, (2,), 33.25, None, 53, 82, 219)),
        steps=(Step(at=23.067, seconds=-1.2, tail=0.207), Step(at=56.0, seconds=73.575, inside=True, tail=0.582),
               Step(at=55.0, seconds=-1.2, inside=True, tail=0.0)),
        suspends=((29.328, 2.0),), seed=3229, delay=0.0, late=0.3),
    # +40.2 s, then -20.1 s 0.9 s later, inside one call: the new samples of the clock between fitted the
    # first stretch of the clock (which has no beginning) 96 s back, and so did the rest of the GPU samples
    # of the same run; the device's windows went back with them, and a process at 38 % on its stamps read
    # 6 and 10 in two polls, 176 for 239; a new sample stamped above the stamp the call before asked with
    # was taken after that call began (else it would have been in its answer)
    Case(interval=1.0, gpus=((0, 49, 4096),), lives=(
        (0, (0,), 12.14, 20.28, 3, 21, 568), (0, (0,), 31.19, 33.3, 64, 25, 123), (1, (0,), 0.0, 12.07, 31, 90, 770),
        (1, (0,), 14.89, 22.87, 38, 94, 124), (1, (0,), 36.46, 44.03, 5, 73, 744), (3, (0,), 0.0, 2.46, 71, 29, 878)),
        steps=(Step(at=20.652, seconds=40.241, inside=True, tail=1.135), Step(at=3.169, seconds=-99.396),
               Step(at=21.555, seconds=-20.058)),
        suspends=((3.0, 3.2),), seed=63256, delay=0.03, late=0.3),
    # two suspends 0.1 s apart, then +39.2 s, between two looks: one sample on each clock between, taken for one
    # run 590 s long (their own spacing) and placed midway, one of them 294 s ahead of now; the GPU waited for
    # a sample after it, and read 0 from then on, 2121 for 2370.  The answer's period tells their runs apart
    # now, and no device sample is placed ahead of the reader's now
    Case(interval=2.0, gpus=((79, 60, 0),), lives=(
        (1, (0,), 29.7, 58.7, 47, 9, 1175), (3, (0,), 20.97, 44.91, 7, 30, 192)),
         steps=(Step(at=53.104, seconds=0.2, inside=True, tail=0.521), Step(at=47.246, seconds=39.223, tail=1.133)),
         suspends=((46.923, 488.7), (47.023, 590.1)), seed=603, delay=0.003, late=0.3),
    # -46.5 s between polls, then -3.25 s and a suspend of 438 s inside one later call: the samples of the
    # clock between, 3.1 s below the one before them, fitted the stretch before the suspend, and the fall
    # was taken for the first step; the buffer's order then put the samples before them (of that stretch)
    # on the stretch before the first step, 46.5 s back: GPU 0 at 41 % read 20 and 17 in two polls, 1144 for
    # 1189.  A step back explains a fall now only where the sample before it can have been taken before
    # the step
    Case(interval=2.0, gpus=((41, 60, 1017), (14, 37, 1621)), lives=(
        (2, (0,), 0.0, 6.74, 83, 85, 1534), (3, (0, 1), 16.27, 41.41, 1, 79, 279),
        (3, (0, 1), 56.09, None, 57, 25, 1221)),
        steps=(Step(at=19.103, seconds=-46.494, inside=True, tail=0.447), Step(at=43.034, seconds=-3.251, inside=True,
                                                                               tail=1.301)),
        suspends=((44.232, 438.2),), seed=2389, delay=0.003, late=0.3),
    # (and where it can: a step back of 1.6 s inside a call of 1.3 s, the samples before it placed on the
    # stretch after it; the first version of that rule looked at their place there, not before the step,
    # and read GPU 0 at 91 % as 21 from then on, 1179 for 2366)
    Case(interval=0.5, gpus=((91, 3, 1974), (20, 61, 741), (83, 61, 1815)), lives=(
        (0, (0, 1), 0.0, 4.69, 55, 94, 129), (1, (0, 1), 0.0, 1.1, 92, 25, 602), (2, (1,), 2.45, 4.33, 15, 11, 963),
        (2, (1, 2), 11.7, None, 76, 81, 1506), (3, (2,), 4.61, 5.51, 47, 75, 357),
        (3, (1,), 12.68, 13.15, 88, 65, 531)),
        steps=(Step(at=10.917, seconds=31.885, inside=True, tail=0.5), Step(at=5.061, seconds=-1.628, inside=True,
                                                                             tail=1.338)),
        suspends=((14.49, 163.6),), seed=48548, delay=0.003, late=0.3),
    # -107.8 s, -38.8 s 30 ms later and a suspend of 19.5 s 0.4 s after, inside one call of 1.6 s, then
    # -107.8 s between polls: the memory samples of the clock between were placed right, and the GPU's,
    # stamped below the one its call asked with, came in the next answer, after the next step, and were
    # placed again, 0.9 s late (the runs placed between are kept per step): a process at 43 % starting
    # among them read 0, 16 and 34 in its first three polls, 910 for 972.  A run placed between before a
    # later step is every kind's now
    Case(interval=0.5, gpus=((79, 96, 0),), lives=(
        (0, (0,), 3.27, None, 43, 83, 208), (1, (0,), 0.0, None, 26, 6, 434), (2, (0,), 7.35, 13.32, 74, 30, 2048),
        (2, (0,), 16.67, None, 86, 13, 84), (3, (0,), 0.0, 1.34, 42, 22, 1705), (3, (0,), 2.16, None, 52, 62, 321)),
        steps=(Step(at=3.256, seconds=-38.801, inside=True, tail=0.751), Step(at=3.226, seconds=-107.806, inside=True,
                                                                              tail=0.344),
               Step(at=4.421, seconds=-107.806, tail=0.312)),
        suspends=((3.672, 19.5),), seed=14, delay=0.003, late=0.3),
    # a process at 1 % memory busy starting inside a call of 2.2 s (a step back of 0.331 s inside it, after
    # +103 s inside another and -44.3 s between polls): 15 for 16.2, whole percents: its first two polls,
    # partial, read 0 and 0 for 0.23 and 1 (exact with unrounded figures, within `ROUNDING` of the bound)
    Case(interval=0.5, gpus=((98, 2, 107), (32, 47, 540)), lives=(
        (1, (1,), 0.0, 1.05, 64, 65, 156), (1, (0, 1), 6.78, None, 6, 1, 254), (2, (0, 1), 7.5, 8.11, 100, 16, 1160),
        (2, (0, 1), 13.68, 13.99, 60, 3, 221)),
        steps=(Step(at=5.793, seconds=-0.331, inside=True, tail=1.376), Step(at=2.752, seconds=-44.299, tail=0.987),
               Step(at=3.909, seconds=103.062, inside=True, tail=0.925)),
        suspends=((13.257, 149.8),), seed=139, delay=0.03, late=0.0),
    # (the same, no step: a pid's life of 50 ms, then another of the pid 10 ms later, at 1 %: 27 for 28.3)
    Case(interval=0.5, gpus=((1, 0, 91),), lives=(
        (2, (0,), 1.16, 1.21, 1, 0, 76), (2, (0,), 1.22, None, 1, 0, 0), (3, (0,), 0.01, None, 0, 0, 3)),
        seed=0, delay=0.0, late=0.3),
)


def examples(found: tuple[Case, ...]) -> Any:
    def kept(test: Any) -> Any:
        for case in reversed(found):
            test = example(case)(test)
        return test

    return kept


#: hosts the stepped draw found not exact yet (docs/fidelity.md, "Random hosts against their scenario"):
#: each runs as a strict xfail below, and the draw passes over it
NOT_EXACT = (
    # two steps back 86 ms apart (-93.7 s between polls, then -82.1 s inside a call), a process at 42 %
    # starting 0.11 s after that call ended, and a poll 0.2 s after the one before it, about as long as the
    # device's windows lag its newest sample (a period and jitter): the process's first sample, placed right, was
    # after that poll's window, 0 then 38 in its first two polls, 206 for 252 (1.1 polls' worth).  Not
    # the clock's doing: every sample is placed within 50 ms of when it was taken
    Case(interval=0.5, gpus=((91, 15, 144), (14, 26, 474), (34, 32, 0)), lives=(
        (0, (0, 2), 0.01, 0.57, 26, 59, 101), (0, (0, 2), 1.49, 2.7, 71, 27, 123), (1, (0, 2), 0.0, 0.19, 14, 42, 1108),
        (1, (0, 2), 4.4, 11.63, 76, 100, 319), (1, (0, 1), 11.69, 17.57, 43, 55, 1141),
        (2, (0, 2), 2.84, 5.8, 42, 14, 289)),
        steps=(Step(at=2.5, seconds=-82.135, inside=True, tail=0.226), Step(at=2.414, seconds=-93.719, tail=0.339)),
        seed=47136, delay=0.03, late=0.0),
    # -32.6 s, -3.9 s 0.27 s later, a suspend of 69.8 s and -28.8 s, all inside one call of 3.8 s: the
    # samples of the clocks between, which no look saw, go midway between their neighbours (1.17 s early
    # here; the rest of that clock's samples, stamped below the one asked with, came in the next answer):
    # a process at 64 % memory busy sums 996 for 1065 (1.08 polls' worth)
    Case(interval=1.0, gpus=((8, 60, 3642), (8, 60, 3642)), lives=(
        (0, (0, 1), 0.0, 5.88, 48, 63, 1149), (0, (1,), 19.58, 28.18, 28, 62, 165), (1, (1,), 0.0, 5.72, 17, 99, 1431),
        (1, (0, 1), 9.08, 11.8, 80, 0, 0), (1, (0, 1), 11.81, None, 64, 64, 185), (3, (1,), 10.78, 17.9, 0, 21, 222)),
        steps=(Step(at=11.673, seconds=-3.892, inside=True, tail=0.977), Step(at=14.608, seconds=-28.825, inside=True,
                                                                              tail=0.169),
               Step(at=11.404, seconds=-32.585, inside=True, tail=1.244)),
        suspends=((13.695, 69.8),), seed=183, delay=0.0, late=0.3),
)
#: hosts with churn, slow calls and late polls
HOSTS = cases(steps_=0, suspends_=0)
#: the same with steps of the wall clock (forward and back, between polls and inside calls) and suspends
STEPPED = cases().filter(lambda case: case not in NOT_EXACT)
#: hypothesis's settings: the same hosts in every run (`derandomize`), no shrinking (a stepped host
#: takes minutes to shrink: a case found is played with `tests/` helpers and kept in `FOUND` by hand)
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow], "derandomize": True,
            "database": None, "phases": [Phase.explicit, Phase.reuse, Phase.generate]}


@pytest.fixture(autouse=True)
def same_hosts_in_every_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Now and then hypothesis draws a number from the constants of the project's modules loaded so far
    (and caches them), so a derandomized draw depends on which tests ran before in the same process: a full
    run's worker drew other hosts than the file alone.  Without those constants the draw is the same
    everywhere (hypothesis 6.170's `HypothesisProvider._maybe_draw_constant`; a newer hypothesis without
    it fails here, loudly)."""
    monkeypatch.setattr(HypothesisProvider, "_maybe_draw_constant", lambda *args, **kwargs: None)


@pytest.mark.slow
@settings(max_examples=200, **SETTINGS)
@given(HOSTS)
def test_random_hosts_equal_their_scenario(case: Case) -> None:
    """200 random hosts without steps (the slow set: `slow`, left out of the quick loop with `e2e`)."""
    check(case, play(case))


@pytest.mark.slow
@settings(max_examples=200, **SETTINGS)
@given(STEPPED)
@examples(FOUND)
def test_random_stepped_hosts_equal_their_scenario(case: Case) -> None:
    """200 random hosts whose clocks step and sleep, and the cases found."""
    check(case, play(case))


@settings(max_examples=4, **SETTINGS)
@given(HOSTS)
def test_a_few_random_hosts_equal_their_scenario(case: Case) -> None:
    """The same, a handful of hosts: for the quick loop."""
    check(case, play(case))


@settings(max_examples=6, **SETTINGS)
@given(STEPPED)
@examples(FOUND)
def test_a_few_random_stepped_hosts_equal_their_scenario(case: Case) -> None:
    """A handful of stepped hosts, and the cases found: for the quick loop."""
    check(case, play(case))


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.xfail(strict=True, reason="not exact yet"))
                                  for case in NOT_EXACT])
def test_what_is_not_exact_yet(case: Case) -> None:
    check(case, play(case))
