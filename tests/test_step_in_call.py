"""A step of the host's wall clock while a slow NVML call is in flight (readers/nvml/stamps.py).

The reader looks at the host clocks as each call begins and again as it ends: a
step between the two is a step inside the call, and the stamps of its answer are
placed on either side of it.  Here the GPU samples call takes 0.3 s or 1.5 s of
simulated time and the wall clock is set forward or back half-way through it; a
constant load (40 % GPU, a process at 20 %) must read the same in every 2 s
interval, as atop computes it from the counters (the change of a sum over the
change of the samples).
"""

from __future__ import annotations

import pytest
from scenarios import a10_card
from sim_readers import make_reader

from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml.stamps import HostClocks

INTERVAL = 2.0
POLLS = 24
#: the poll whose GPU samples call the step falls in
STEPPED_POLL = 6


def intervals(step: float, delay: float, at: float | None = None, polls: int = POLLS) -> list[tuple[int, int, int]]:
    """(poll time, GPU %, the process's %) of each interval as atop shows it, the GPU samples
    call taking `delay` seconds and the wall clock set `step` seconds at simulated time `at`
    (half-way through the call of `STEPPED_POLL` unless given)."""
    if at is None:
        at = STEPPED_POLL * INTERVAL + delay / 2
    clock = [0.0]
    reader, nvml = make_reader({"gpus": [a10_card()], "clock_steps": [[at, step]]}, clock)
    model = nvml._nvml.nvmlLib.model
    reader.host_offsets = HostClocks(model.host_offsets)  # the simulated host's clocks, as the daemon reads its own
    reader._call_clock = lambda: clock[0]  # each call's time, as the daemon's reactor clock gives it
    answer = model.nvmlDeviceGetSamples

    def slow(handle, kind, since):  # noqa: ANN001, ANN202 - the model's own signature
        if kind == 1:  # the GPU's samples: the call takes `delay` of the host's time
            clock[0] += delay
        return answer(handle, kind, since)

    model.nvmlDeviceGetSamples = slow
    counters = Counters()
    out, before = [], None
    for i in range(1, polls + 1):
        now = i * INTERVAL
        clock[0] = max(clock[0], now)
        snapshot, _ = reader.read(now)
        counters.fold(snapshot, now, now - INTERVAL)
        device = counters.devices[0]
        process = next(iter(device.processes.values()))
        sums = (device.gpu_busy_cum, device.samples, process.gpu_busy_cum, process.samples)
        if before is not None:
            gpu = round((sums[0] - before[0]) / (sums[1] - before[1]))
            out.append((int(now), gpu, round((sums[2] - before[2]) / (sums[3] - before[3]))))
        before = sums
    return out


@pytest.mark.parametrize("delay", [0.3, 1.5])
@pytest.mark.parametrize("step", [20, 45])
def test_a_forward_step_inside_a_slow_call_is_no_idle_spell(step, delay):
    """Set forward inside the call: every interval reads the load (was: 0 % for as long as
    the step, the stamps taken after it placed `step` seconds in the future)."""
    found = intervals(step, delay)
    assert [(gpu, process) for _, gpu, process in found] == [(40, 20)] * (POLLS - 1), found


@pytest.mark.parametrize("delay", [0.3, 1.5])
@pytest.mark.parametrize("step", [-20, -20.05, -45.01])
def test_a_step_back_inside_a_slow_call_loses_nothing(step, delay):
    """Set back inside the call: the samples taken after the step are stamped below the one
    the call asked with and are not in its answer, which is no dry spell (was: the rest of
    the window idle, then the samples of the next polls a sample off for 20 s, 10 % read
    for 40 % on the 1.5 s call); a step of a whole number of sample periods (-20 s at 1/6 s)
    gives new samples the stamps of old ones the buffer no longer holds (was: 0 % for a poll)."""
    found = intervals(step, delay)
    assert [(gpu, process) for _, gpu, process in found] == [(40, 20)] * (POLLS - 1), found


def test_a_step_back_of_whole_periods_between_polls_loses_nothing():
    """The same stamps again, the step between two polls (was: 20 % for 40 % in the poll after it)."""
    found = intervals(-20, 0.0, at=STEPPED_POLL * INTERVAL + 1)
    assert [(gpu, process) for _, gpu, process in found] == [(40, 20)] * (POLLS - 1), found


@pytest.mark.parametrize(("step", "delay", "at"), [(-0.5, 0.3, None), (-0.5, 1.5, None), (-1.01, 1.5, None),
                                                  (-1.01, 0.0, STEPPED_POLL * INTERVAL)])
def test_a_step_back_shorter_than_a_call_is_told_by_the_buffers_order(step, delay, at):
    """Set back by less than the time between two looks at the host clocks: which side of the step
    a sample fell on is told by the buffer's order (a sample stamped above the one after it was
    taken before the step), and the device's stamps place its processes': the GPU reads the load in
    every interval, the process within a poll's worth in all (was: -0.5 s, one interval at 30 for
    40; -1.01 s, the misplaced stamps a few ms from the others taken for the sample period, and
    about 10 s of intervals near 0)."""
    found = intervals(step, delay, at)
    assert [gpu for _, gpu, _ in found] == [40] * (POLLS - 1), found
    assert abs(sum(process for _, _, process in found) - 20 * (POLLS - 1)) <= 20, found
