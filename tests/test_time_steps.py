"""The NVML reader across steps of the driver's sample clock (readers/nvml/stamps.py), on the simulator.

The simulated host's wall clock is set back or forward (``clock_steps``) or the
host sleeps (``suspends``), at moments inside and at the edge of a poll; the
reader's own clock (simulated time, the monotonic clock) runs on.  A constant
load must read the same in every poll, per GPU and per process, and the driver
must be asked with a stamp from before a step for one poll at most.
"""

from __future__ import annotations

import pytest
from scenarios import a10_card
from sim_readers import make_reader

from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml.stamps import AHEAD_US, HostClocks, StampMap

POLLS = 24


def _run(scenario: dict, polls: int = POLLS, watch: bool = True):
    clock = [0.0]
    reader, nvml = make_reader(scenario, clock)
    model = nvml._nvml.nvmlLib.model
    if watch:
        reader.host_offsets = HostClocks(model.host_offsets)  # the simulated host's clocks, as the daemon reads its own
    counters = Counters()
    busy, sm, asked, cums = [], [], [], []
    for i in range(1, polls + 1):
        clock[0] = float(i)
        start = len(nvml.args)
        snapshot, _ = reader.read(float(i))
        counters.fold(snapshot, float(i), float(i - 1))
        device = snapshot.devices[0]
        busy.append(device.gpu_busy)
        sm.append(device.processes[0].gpu_busy if device.processes else None)
        asked.append([args[2] for name, args in nvml.args[start:] if name == "nvmlDeviceGetSamples"])
        totals = counters.devices[0]
        process = next(iter(totals.processes.values()), None) if hasattr(totals, "processes") else None
        cums.append((totals.gpu_busy_cum, totals.mem_busy_cum, totals.samples,
                     None if process is None else process.gpu_busy_cum))
    return busy, sm, asked, cums, model


STEPS = [-1, -5.5, -60, -3600, -86400, 1, 7.25, 3600, 86400]
MOMENTS = [7.3, 8.0, 8.02]


@pytest.mark.quick_cases(6)
@pytest.mark.parametrize("mode", ["per-period", "per-call"])
@pytest.mark.parametrize("period", [1 / 6, 1.0])
@pytest.mark.parametrize("step", STEPS)
def test_a_constant_load_reads_the_same_across_a_wall_clock_step(mode, period, step):
    """40 % / 20 % read in every poll, whichever way and however far the wall clock is set,
    wherever in a poll; at most one poll's worth of one process's figure off (a step shorter
    than a poll, where a sample's side of it cannot be told)."""
    for at in MOMENTS:
        card = a10_card(process_utilization=mode, sample_period=period)
        busy, sm, _, cums, _ = _run({"gpus": [card], "clock_steps": [[at, step]]})
        assert busy[1:] == [40] * (POLLS - 1), (at, busy)
        assert abs(sum(sm[1:]) - 20 * (POLLS - 1)) <= 20, (at, sm)
        assert all(s is not None and 0 <= s <= 40 for s in sm[1:]), (at, sm)
        for before, after in zip(cums, cums[1:]):
            assert all(b is None or a >= b for a, b in zip(after, before)), (at, cums)


@pytest.mark.quick_cases(3)
@pytest.mark.parametrize("clock", ["epoch", "boottime"])
@pytest.mark.parametrize("asleep", [1, 45.5, 3600, 86400])
def test_time_asleep_is_neither_busy_nor_idle(clock, asleep):
    """Across a suspend (the wall and boot clocks go on, the monotonic one stands still)
    every poll reads the load: the time asleep is no dry spell."""
    for at in MOMENTS:
        card = a10_card(sample_clock=clock)
        busy, sm, _, _, _ = _run({"gpus": [card], "suspends": [[at, asleep]]})
        assert busy[1:] == [40] * (POLLS - 1), (at, busy)
        if clock == "epoch":
            assert sm[1:] == [20] * (POLLS - 1), (at, sm)
        else:  # process samples stay on the epoch (docs/simulator.md): placed by the boot clock's steps
            assert abs(sum(sm[1:]) - 20 * (POLLS - 1)) <= 20, (at, sm)


@pytest.mark.parametrize("step", [-0.73, -61.37, 3599.11])
def test_the_driver_is_asked_with_a_stamp_from_before_a_step_for_one_poll_at_most(step):
    """From the poll after the step on, every samples call asks with 0 or with a stamp taken after it."""
    at = 7.3
    busy, _, asked, _, model = _run({"gpus": [a10_card()], "clock_steps": [[at, step]]})
    after = model._epoch_us + int(at * 1e6) + int(step * 1e6)  # the first stamp the stepped clock gives
    for poll, stamps in enumerate(asked[8:], start=9):
        assert all(stamp == 0 or after <= stamp for stamp in stamps), (poll, stamps, after)


def test_without_watching_the_host_clocks_a_step_loses_figures():
    """The same steps with no steps looked for: the figures the map keeps are lost (so the tests above
    measure the map, not the simulator)."""
    for step in (-60, 3600):
        busy, _, _, _, _ = _run({"gpus": [a10_card()], "clock_steps": [[7.3, step]]}, watch=False)
        assert sum(busy[1:]) < 40 * (POLLS - 1) - 40, (step, busy)


def test_a_stamp_seen_before_a_step_back_keeps_its_place():
    """A sample handed out again after the clock was set back is the same sample; the same
    stamp twice in one answer is the old sample and a new one; the old ones gone from the
    buffer free their stamps."""
    offsets = [0, 0]
    stamps = StampMap(host=lambda: tuple(offsets))
    first = stamps.steady("s", [8_000_000, 9_000_000, 10_000_000], 10_000_000)
    assert first == [8_000_000, 9_000_000, 10_000_000]
    offsets[0] = -2_000_000  # set back 2 s
    assert stamps.ask("s", 10_000_000, 11_000_000) == 0  # from before the step: the whole buffer
    again = stamps.steady("s", [8_000_000, 9_000_000, 10_000_000, 9_000_000], 11_000_000, 0)
    assert again == [8_000_000, 9_000_000, 10_000_000, 11_000_000]
    assert stamps.ask("s", 11_000_000, 12_000_000) == 9_000_000
    later = stamps.steady("s", [10_000_000], 12_000_000, 9_000_000)
    assert later == [10_000_000]  # the old sample of 10 s, still in the buffer
    gone = stamps.steady("s", [10_000_000], 12_100_000, 9_000_000)
    assert gone == [10_000_000]
    # the old 10 s sample no longer listed: a stamp of 10 s now is a new sample's
    stamps.steady("s", [], 12_500_000, 9_500_000)
    assert stamps.steady("s", [10_000_000], 12_600_000, 9_500_000) == [12_000_000]


def test_a_driver_on_a_clock_of_its_own_is_taken_as_it_is():
    """Stamps near neither host clock, for longer than a step just before the first answer
    would leave them so: nothing is looked for, stamps pass unchanged."""
    stamps = StampMap(host=lambda: (5_000_000_000_000, 0))
    assert stamps.steady("s", [123_000_000_000], 1_000_000) == [123_000_000_000]
    assert stamps.follows is None
    assert stamps.steady("s", [123_006_000_000], 7_000_000) == [123_006_000_000]
    assert stamps.follows == -1
    assert stamps.ask("s", 123_000_000_000, 2_000_000) == 123_000_000_000


def test_device_samples_on_a_clock_of_their_own_beside_process_samples_on_the_epoch():
    """The simulator's `sample_clock` as seconds: the device's samples on a clock near
    neither host clock, its processes' on the epoch.  The device's samples decide what
    the driver follows (a clock of its own), not the process samples matching the wall
    clock (which once made the GPU read 0 from the second poll on)."""
    busy, sm, _, cums, _ = _run({"gpus": [a10_card(sample_clock=98765.4321)]}, polls=12)
    assert busy == [40] * 12
    assert sm == [20] * 12
    assert cums[-1][:3] == (480, 120, 12)


@pytest.mark.quick_cases(4)
@pytest.mark.parametrize("driver", [
    {"sample_jitter_ms": 20},
    {"sample_jitter_ms": 30, "process_utilization": "per-call"},
    {"duplicate_process_samples": True},
    {"idle_samples": False},
], ids=["jitter", "jitter-per-call", "duplicates", "no-idle-samples"])
@pytest.mark.parametrize("step", [-1, -60, 3600])
def test_a_rough_driver_with_two_processes_reads_the_same_across_a_step(driver, step):
    """Jittered stamps, duplicated process samples, a buffer without idle samples: each
    process's figures, and the GPU's, read the load in every poll across the step."""
    for at in (7.3, 8.0):
        card = a10_card(**driver)
        card["processes"].append({"pid": 301, "memory_mib": 50, "sm_util": 10, "mem_util": 2})
        clock = [0.0]
        reader, nvml = make_reader({"gpus": [card], "clock_steps": [[at, step]]}, clock)
        reader.host_offsets = HostClocks(nvml._nvml.nvmlLib.model.host_offsets)
        for i in range(1, POLLS + 1):
            clock[0] = float(i)
            device = reader.read(float(i))[0].devices[0]
            if i > 1:
                figures = {p.pid: p.gpu_busy for p in device.processes}
                assert (device.gpu_busy, figures) == (40, {300: 20, 301: 10}), (at, i, device)


def test_a_boot_clock_that_cannot_be_read_is_no_step():
    """A host clock reading that fails (None) neither decides what the driver follows nor is a step."""
    offsets = [1_000_000_000, None]
    stamps = StampMap(host=lambda: tuple(offsets))
    assert stamps.steady("s", [1_005_000_000], 5_000_000) == [1_005_000_000]
    assert stamps.follows == 0
    offsets[0] = None
    assert stamps.steady("s", [1_006_000_000], 6_000_000) == [1_006_000_000]
    assert len(stamps.segments) == 1


def test_a_step_inside_or_before_the_first_call_is_taken_out():
    """What the driver follows is learnt as the call began, or from a later answer: stamps of
    before a step of 60 s just before the first look, then of after it, lie one period apart
    (was: the first answer matched no clock, and no step was ever taken out)."""
    offsets = [60_000_000, 5_000_000_000_000]  # the wall clock set 60 s forward just before the first look
    stamps = StampMap(host=lambda: tuple(offsets))
    assert stamps.steady("s", [8_000_000, 9_000_000, 10_000_000], 10_000_000) == [8_000_000, 9_000_000, 10_000_000]
    assert stamps.follows is None
    assert stamps.steady("s", [71_000_000], 11_000_000, 10_000_000) == [11_000_000]
    assert stamps.follows == 0
    # inside the first call: the clocks as it began, then as it ended
    offsets[0] = 0
    stamps = StampMap(host=lambda: tuple(offsets))
    assert stamps.ask("s", 0, 10_000_000) == 0
    offsets[0] = 60_000_000
    assert stamps.steady("s", [9_000_000, 10_000_000, 70_500_000], 10_600_000) == [9_000_000, 10_000_000, 10_500_000]


def test_an_old_step_back_does_not_explain_a_fall_inside_a_later_call():
    """A step back of 5 s between polls, then, inside one call 10 s later, -0.8 s and +100 s: the fall
    of 0.3 s from the samples before the call's first step to those of the clock between is no proof
    that they were taken before the old step (they were taken after the call before began), and they
    keep their stretch; the sample of the clock between goes between (was: the fall was taken for the
    old step, and the samples before it were put 5 s back)."""
    offsets = [0, 0]
    stamps = StampMap(host=lambda: tuple(offsets))
    stamps.steady("s", [9_000_000, 9_500_000, 10_000_000], 10_000_000)
    offsets[0] = -5_000_000
    asked = stamps.ask("s", 10_000_000, 11_000_000)
    stamps.steady("s", [9_000_000, 9_500_000, 10_000_000, 5_500_000, 6_000_000], 11_000_000, asked)
    for second in range(12, 21):
        asked = stamps.ask("s", (second - 1) * 1_000_000, second * 1_000_000)
        stamps.steady("s", [(second - 5) * 1_000_000 - 500_000, (second - 5) * 1_000_000], second * 1_000_000, asked)
    asked = stamps.ask("s", 20_000_000, 20_000_000)
    assert asked == 15_000_000
    offsets[0] = -5_000_000 - 800_000 + 100_000_000  # -0.8 s at 21.1 s, +100 s at 21.7 s, inside the call
    # taken at 20.5 and 21 s (before the call's steps), 21.5 s (between them), 22 s (after)
    placed = stamps.steady("s", [15_500_000, 16_000_000, 15_700_000, 116_200_000], 22_000_000, asked)
    assert placed == [20_500_000, 21_000_000, 21_500_000, 22_000_000]


def test_a_failed_call_bounds_no_sample():
    """+50 s between polls, and the call after it fails: a sample taken before the step, listed after one
    seen before, was taken after the last call that answered began, not after the one that failed, and
    keeps its place on the clock before the step (was: 0.1 s off, placed between as a clock no look saw)."""
    offsets = [0, 0]
    stamps = StampMap(host=lambda: tuple(offsets))
    stamps.ask("s", 0, 10_000_000)
    stamps.steady("s", [9_000_000, 10_000_000], 10_000_000)
    offsets[0] = 50_000_000
    stamps.ask("s", 10_000_000, 11_000_000)  # no answer
    asked = stamps.ask("s", 10_000_000, 12_000_000)
    placed = stamps.steady("s", [9_000_000, 10_000_000, 10_400_000, 61_000_000, 62_000_000], 12_000_000, asked)
    assert placed == [9_000_000, 10_000_000, 10_400_000, 11_000_000, 12_000_000]


def test_a_run_placed_between_is_every_kinds_after_a_later_step():
    """-50 s, then +45 s, inside one call: kind "b", asked for its whole buffer, places the sample of the
    clock between them between its neighbours; kind "a", asked with a stamp above it, first gets it after a
    later step (-30 s between polls), and places it where "b" did, not between the samples around it now
    (was: 1.25 s late, the runs placed between were kept per step)."""
    offsets = [0, 0]
    stamps = StampMap(host=lambda: tuple(offsets))
    for kind in "ab":
        stamps.ask(kind, 0, 10_000_000)
        stamps.steady(kind, [9_000_000, 9_500_000, 10_000_000], 10_000_000)
    asked = stamps.ask("a", 10_000_000, 11_000_000)
    offsets[0] = -5_000_000
    assert stamps.steady("a", [10_500_000, 11_000_000], 12_000_000, asked) == [10_500_000, 11_000_000]
    answer = [9_000_000, 9_500_000, 10_000_000, 10_500_000, 11_000_000, -38_500_000, 7_000_000]
    whole = [9_000_000, 9_500_000, 10_000_000, 10_500_000, 11_000_000, 11_500_000, 12_000_000]
    assert stamps.steady("b", answer, 12_000_000, stamps.ask("b", 0, 12_000_000)) == whole
    offsets[0] = -35_000_000
    asked = stamps.ask("a", 11_000_000, 13_000_000)
    assert stamps.steady("a", [*answer, 7_500_000, -22_000_000], 13_000_000, asked) == [*whole, 12_500_000, 13_000_000]


def test_no_device_sample_is_placed_ahead_of_now():
    """+100 s, then -100.5 s, inside one call, whose answer holds only a sample of the clock between:
    near neither the clock before nor the one after, it is placed at the reader's now, not where the
    newest clock would put it, 100 s ahead (a stream would wait that long for its next sample)."""
    offsets = [0, 0]
    stamps = StampMap(host=lambda: tuple(offsets))
    stamps.steady("s", [9_000_000, 10_000_000], 10_000_000)
    asked = stamps.ask("s", 10_000_000, 11_000_000)
    offsets[0] = -500_000
    assert stamps.steady("s", [111_500_000], 12_000_000, asked) == [12_000_000 + AHEAD_US]


def test_two_steps_between_two_looks():
    """Samples stamped on a clock that held between two looks only (set +40 s, then +60 s more):
    placed between those before and after, their spacing kept, for every kind of sample alike
    (was: placed on the newest clock, 100 s in the past, and lost)."""
    offsets = [0, 0]
    stamps = StampMap(host=lambda: tuple(offsets))
    stamps.steady("s", [9_000_000, 10_000_000], 10_000_000)
    offsets[0] = 100_000_000
    assert stamps.ask("s", 10_000_000, 11_000_000) == 0
    placed = stamps.steady("s", [9_000_000, 10_000_000, 50_300_000, 50_500_000, 50_700_000, 111_000_000], 11_000_000)
    assert placed == [9_000_000, 10_000_000, 10_300_000, 10_500_000, 10_700_000, 11_000_000]
    assert stamps.steady("p", [50_500_000, 111_000_000], 11_000_000) == [10_500_000, 11_000_000]


@pytest.mark.parametrize("step", [-1, -6.3, -30])
def test_a_step_back_before_the_first_look_is_told_by_the_first_answer(step):
    """Set back at the very moment of the first poll, its samples of before stamped ahead of the
    clock's now: the first answer's order tells the step (was: the next polls asked for samples
    newer than those and got none until the clock passed them: 0 % for 14 polls at -6.3 s)."""
    busy, sm, _, _, _ = _run({"gpus": [a10_card()], "clock_steps": [[1.0, step]]})
    assert busy == [40] * POLLS, busy
    assert sm == [20] * POLLS, sm


@pytest.mark.parametrize("kind", ["steps", "suspend"])
@pytest.mark.parametrize("first, second", [
    ((7.5, 563.4), (7.75, 0.5)), ((7.1, 60), (7.6, 0.4)), ((7.3, 0.3), (7.55, 60)), ((7.1, 563.0), (7.9, 0.6)),
], ids=["long-then-short", "long-then-short-first-look", "short-then-long", "long-then-short-run-part-fits"])
def test_two_forward_steps_between_two_looks_in_either_order(kind, first, second):
    """Two forward steps between two polls (the long one a suspend, or a step): the samples of the
    clock between go between, the others stay where they were taken.  Was, in the poll after the
    steps, 40 % / 20 % read `20/10` (long then short: the clock between's samples fitted the newest
    clock, before the samples of the clock before them, which the buffer's order sent between, where
    they had no room), `24/12` (the sample before them one seen before) and `28/14` (short then
    long: the first samples of the clock between, placed before the first of the newest clock,
    stayed on the clock before, a step late); and `17/8` (563 s, then 0.6 s 0.8 s later: the first
    samples of the clock between fitted the newest clock, the rest none, and only the rest went
    between; a run of samples a period apart is placed whole now)."""
    scenario = {"gpus": [a10_card()], "clock_steps": [list(first), list(second)]}
    if kind == "suspend":  # (the long one)
        scenario["suspends"] = [scenario["clock_steps"].pop(0 if first[1] > second[1] else 1)]
    busy, sm, _, cums, _ = _run(scenario)
    assert busy == [40] * POLLS, busy
    assert sm == [20] * POLLS, sm
    assert cums[-1] == (40 * POLLS, 10 * POLLS, POLLS, 20 * POLLS), cums[-1]
