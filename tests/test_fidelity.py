"""Counting the whole second: utilization from the driver's sample buffer, not a point sample."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from clocked import ClockedReader
from sample_folds import fold_device_samples
from twisted.internet.task import Clock

from atopgpud_tw.readers.nvml.samples import fold_process_samples
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.poller import PollerService

BURSTS = {"period": 1.0, "busy": [[0.0, 0.1]]}  # 100 ms of work every second: 10 %


def proc_sample(pid: int, stamp: int, sm: int, mem: int = 0) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, timeStamp=stamp, smUtil=sm, memUtil=mem)


def test_device_samples_are_time_weighted():
    """Each sample weighs the time since the one before it."""
    value, newest, end = fold_device_samples([(1100, 100), (1400, 0), (1500, 50)], since=1000)
    assert (value, newest, end) == (round((100 * 100 + 0 * 300 + 50 * 100) / 500), 1500, 1500)


def test_dry_gaps_count_as_idle_once_the_period_is_known():
    """With a 100 µs period, a 300 µs gap before a sample is 200 µs of idle time."""
    value, newest, end = fold_device_samples([(1100, 100), (1400, 100)], since=1000, period=100)
    assert (value, newest, end) == (50, 1400, 1400)


def test_dry_tail_is_accounted_to_this_poll():
    """Whole periods after the newest sample, by the driver's clock, end this poll's share as idle."""
    value, newest, end = fold_device_samples([(1100, 100)], since=1000, period=100, now=1450)
    assert (value, newest, end) == (25, 1100, 1400)


def test_device_samples_drop_stale_and_bogus_values():
    """Samples not newer than `since`, or above 100 %, are left out."""
    value, newest, _ = fold_device_samples([(900, 100), (1000, 100), (1200, 30), (1300, 250)], since=1000)
    assert (value, newest) == (30, 1200)
    assert fold_device_samples([(1300, 250)], since=1000)[:2] == (None, 1000)


def test_first_read_uses_the_last_second_of_the_buffer():
    """With no timestamp yet, the whole buffer comes back: only its last second counts."""
    buffer = [(stamp, 100 if stamp <= 2_500_000 else 0) for stamp in range(100_000, 3_000_001, 100_000)]
    assert fold_device_samples(buffer, since=0)[:2] == (50, 3_000_000)
    assert fold_device_samples([(30, 7)], since=0)[:2] == (7, 30)


def test_process_figure_is_busy_time_over_the_periods_of_the_poll():
    """Busy in 2 of 6 periods at 90 % is 30 %; several samples per pid; absent pids are idle."""
    samples = [proc_sample(7, 110, 90, 30), proc_sample(7, 140, 90, 30), proc_sample(8, 140, 60)]
    busy, newest = fold_process_samples(samples, since=100, periods=6)
    assert busy == {7: (30, 10), 8: (10, 0)} and newest == 140


def test_process_samples_older_or_over_100_are_dropped():
    """A sample at or before `since`, or above 100 %, does not count."""
    samples = [proc_sample(7, 100, 90), proc_sample(7, 120, 101), proc_sample(8, 130, 40)]
    busy, newest = fold_process_samples(samples, since=100, periods=2)
    assert busy == {8: (20, 0)} and newest == 130


def test_process_periods_from_the_sample_period_when_the_device_gives_none():
    """Without device samples, time over the known driver period counts the periods."""
    samples = [proc_sample(7, 1600, 100)]
    busy, _ = fold_process_samples(samples, since=1000, periods=None, period_us=100)
    assert busy == {7: (round(100 / 6), 0)}


def timeline_scenario(samples_supported: bool = True) -> dict:
    return {
        "gpus": [
            {
                "gpu_timeline": BURSTS,
                "mem_timeline": {"period": 1.0, "busy": [[0.0, 0.1]], "level": 50},
                "sample_period": 1 / 6,
                "samples_supported": samples_supported,
                "processes": [{"pid": 42, "memory_mib": 10, "sm_timeline": BURSTS}],
            }
        ]
    }


def run_minute(scenario: dict, phase: float = 0.55) -> Board:
    """60 polls a second apart, at a phase where point sampling never sees a burst."""
    clock = Clock()
    clock.advance(phase)
    board = Board()
    poller = PollerService(ClockedReader(scenario, clock), board, 1.0, clock)
    poller.startService()
    for _ in range(60):
        clock.advance(1.0)
    poller.stopService()
    return board


@pytest.mark.parametrize("phase", [0.05, 0.3, 0.55, 0.9])
def test_bursty_gpu_average_is_right_at_any_phase(phase):
    """10 % of bursts is counted as 10 %, wherever the polls fall in the second."""
    device = run_minute(timeline_scenario(), phase).counters.devices[0]
    assert abs(device.gpu_busy_total / device.samples - 10) <= 1
    assert abs(device.mem_busy_total / device.samples - 5) <= 1
    process = device.processes[42]
    assert abs(process.gpu_busy_cum / process.samples - 10) <= 1


def test_point_sampling_misses_the_bursts():
    """The rates call (the reference's method) sees only its last 1/6 s: 0 % here."""
    device = run_minute(timeline_scenario(samples_supported=False), 0.55).counters.devices[0]
    assert device.gpu_busy_total / device.samples < 2


def test_only_timestamps_nvml_returned_are_passed_back():
    """Every timestamp the reader asks with is 0 or one NVML handed out before."""
    clock = Clock()
    reader = ClockedReader(timeline_scenario(), clock)
    asked, returned = [], {0}
    model = reader.nvml.nvmlLib.model  # the simulated driver beneath the library's C functions
    real_samples = model.nvmlDeviceGetSamples
    real_process = model.nvmlDeviceGetProcessUtilization

    def samples(device, kind, since):
        asked.append(since)
        value_type, out = real_samples(device, kind, since)
        returned.update(s.timeStamp for s in out)
        return value_type, out

    def process(device, since):
        asked.append(since)
        out = real_process(device, since)
        returned.update(s.timeStamp for s in out)
        return out

    model.nvmlDeviceGetSamples = samples
    model.nvmlDeviceGetProcessUtilization = process
    for _ in range(10):
        clock.advance(0.7)
        reader.poll()
    assert asked and set(asked) <= returned


def test_idle_buffer_counts_zero():
    """NOT_FOUND from the samples call (nothing new: idle) is 0 % for that poll, and counted."""
    scenario = timeline_scenario()
    gpu = scenario["gpus"][0]
    gpu["idle_samples"] = False
    gpu["gpu_timeline"] = {"period": 3.0, "busy": [[0.0, 1.0]]}  # one busy second in three
    device = run_minute(scenario, phase=0.5).counters.devices[0]
    assert device.samples == 61
    assert abs(device.gpu_busy_total / device.samples - 100 / 3) <= 2


@pytest.mark.e2e
@pytest.mark.parametrize("mode", [[], ["--gpm"]], ids=["fold", "gpm"])
def test_the_fidelity_bench_runs(mode: list[str]) -> None:
    """bench/fidelity.py, run by hand, still runs on the simulator as it is now: a short run prints every
    timeline's row (exit status 1 is its own: a target missed, which a 3 s run does)."""
    bench = Path(__file__).resolve().parent.parent / "bench" / "fidelity.py"
    done = subprocess.run([sys.executable, str(bench), "--seconds", "3", "--seeds", "1", "--periods", "0.167", *mode],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (0, 1), (done.returncode, done.stderr)
    assert "irregular bursts" in done.stdout, done.stdout
