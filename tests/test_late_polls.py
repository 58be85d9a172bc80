"""Late polls on a many-GPU host: the reader's thread and the reactor delayed at random.

Seven simulated GPUs, 52 processes on the last one, a poll every 0.2 s: the
reader's calls take a few ms each (now and then 30 times that, a thread held up
on a loaded host) and a third of the polls start up to 0.1 s late (a busy
reactor), all on simulated time from a seeded generator.  Every GPU's and
process's cumulative busy must equal the scenario's constant load times its
sample count, within one poll's worth.
"""

from __future__ import annotations

import random

import pytest
from sim_readers import make_reader

from atopgpud_tw.counters import Counters
from atopgpud_tw.readers.nvml.samples import UtilSample, fold_process_samples

INTERVAL = 0.2
POLLS = 120
GPU_BUSY = 60
SLOW = ("nvmlDeviceGetSamples", "nvmlDeviceGetProcessUtilization", "nvmlDeviceGetComputeRunningProcesses")


def host(gpus: int = 7, last: int = 52) -> dict:
    """`gpus` GPUs at 60 %, two processes on each and `last` on the last one, at 1 % to 9 %."""
    cards = []
    for index in range(gpus):
        count = last if index == gpus - 1 else 2
        cards.append({
            "busid": f"00000000:{16 + index:02x}:00.0", "gpu_util": GPU_BUSY, "mem_util": 20,
            "processes": [{"pid": 1000 + 100 * index + n, "memory_mib": 10, "sm_util": 1 + n % 9, "mem_util": 1}
                          for n in range(count)],
        })
    return {"gpus": cards}


def late_polls(seed: int) -> tuple[dict, Counters]:
    random_ = random.Random(seed)
    clock = [0.0]
    scenario = host()
    reader, nvml = make_reader(scenario, clock)
    model = nvml._nvml.nvmlLib.model
    reader._call_clock = lambda: clock[0]  # each call's time, as the daemon's reactor clock gives it
    for name in SLOW:
        answer = getattr(model, name)

        def delayed(*args, answer=answer):  # noqa: ANN002, ANN202 - the model's own signature
            clock[0] += random_.random() * 0.003 * (30 if random_.random() < 0.05 else 1)
            return answer(*args)

        setattr(model, name, delayed)
    counters = Counters()
    for poll in range(1, POLLS + 1):
        due = poll * INTERVAL
        clock[0] = max(clock[0], due + (random_.random() * 0.1 if random_.random() < 0.3 else 0))
        snapshot, _ = reader.read(clock[0])
        counters.fold(snapshot, due, due - INTERVAL)
    return scenario, counters


@pytest.mark.quick_cases(1)
@pytest.mark.parametrize("seed", [8, 13, 21])
def test_late_polls_lose_no_busy_on_the_last_gpu(seed):
    """Each counter is the load times its samples, within one poll's worth (was, seed 8: every
    process on the last GPU 6 polls' worth short, its sample counted and its busy not when a
    period ended between the poll's samples call and its process samples call)."""
    scenario, counters = late_polls(seed)
    for card, totals in zip(scenario["gpus"], counters.devices):
        assert abs(totals.gpu_busy_cum - GPU_BUSY * totals.samples) <= GPU_BUSY, (seed, card["busid"])
        for process in card["processes"]:
            counted = totals.processes[process["pid"]]
            assert counted.samples == totals.samples, (seed, process)
            assert abs(counted.gpu_busy_cum - process["sm_util"] * counted.samples) <= process["sm_util"], (
                seed, process, counted.gpu_busy_cum, counted.samples)


def test_a_few_slow_samples_calls_read_no_idle_spell():
    """The GPU samples call taking 0.9 s in two polls and 1 ms in the others, on a constant load:
    every poll reads the load (was: the driver's clock learnt from the slow calls' starts, whose
    answers held samples taken until they ended, ran ahead of it, and for the 16 polls that
    remembered them the time between its newest sample and that "now" was read as idle: 68 for 80)."""
    clock = [0.0]
    reader, nvml = make_reader({"gpus": [{"gpu_util": 80, "mem_util": 30}]}, clock)
    model = nvml._nvml.nvmlLib.model
    reader._call_clock = lambda: clock[0]
    answer = model.nvmlDeviceGetSamples
    slow_polls = {5, 7}
    poll = [0]

    def timed(handle, kind, since):  # noqa: ANN001, ANN202 - the model's own signature
        clock[0] += 0.9 if poll[0] in slow_polls else 0.001
        return answer(handle, kind, since)

    model.nvmlDeviceGetSamples = timed
    counters = Counters()
    figures = []
    for poll[0] in range(1, 31):
        due = poll[0] * 2.0
        clock[0] = max(clock[0], due)
        snapshot, _ = reader.read(clock[0])
        counters.fold(snapshot, due, due - 2.0)
        figures.append((snapshot.devices[0].gpu_busy, snapshot.devices[0].mem_busy))
    assert figures == [(80, 30)] * 30, figures


def test_a_process_that_ends_during_the_busy_call_keeps_its_start_time():
    """A process first listed, then ending while the slow process-utilization call runs, its pid taken by
    a new process before the next poll: two lives, the first reported once (was: its start time
    read after the busy call found no process, and the new one was taken for it: one life, no exit)."""
    clock = [0.0]
    processes = [{"pid": 100, "sm_util": 30, "start": 1.8, "stop": 2.3}, {"pid": 100, "sm_util": 50, "start": 2.6}]
    reader, nvml = make_reader({"gpus": [{"gpu_util": 60, "processes": processes}]}, clock)
    model = nvml._nvml.nvmlLib.model
    reader._call_clock = lambda: clock[0]
    answer = model.nvmlDeviceGetProcessUtilization

    def slow(handle, since):  # noqa: ANN001, ANN202 - the model's own signature
        clock[0] += 0.4
        return answer(handle, since)

    model.nvmlDeviceGetProcessUtilization = slow
    counters = Counters()
    exits = []
    for poll in range(1, 6):
        clock[0] = max(clock[0], poll * 1.0)
        exits += counters.fold(reader.read(clock[0])[0], poll * 1.0, poll - 1.0)
    assert [(e.totals.pid, e.totals.started) for e in exits] == [(100, 180)]
    assert [(p.pid, p.started) for p in counters.devices[0].processes.values()] == [(100, 260)]


def test_the_first_process_samples_of_a_late_poll_read_their_second():
    """The first read of the process samples takes the buffer's last second, over that second's
    periods, not over the poll's (was: a process at 79 % read 34 in a late poll of 14 periods)."""
    period = 166_667
    samples = [UtilSample(100, 10_000_000 + k * period, 79, 73) for k in range(14)]
    figures, _ = fold_process_samples(samples, 0, periods=14, period_us=period)
    assert figures == {100: (79, 73)}
