"""Counter semantics (docs/design.md): what atop subtracts must be exact and monotonic."""

from __future__ import annotations

import pytest
from snapshots import dev, proc, snap

from atopgpud_tw.counters import Counters
from atopgpud_tw.snapshot import UNSUPPORTED


def fold_all(*snapshots):
    counters = Counters()
    exited = [counters.fold(s) for s in snapshots]
    return counters, exited


@pytest.mark.parametrize(
    "readings,samples,gpu_cum,mem_cum",
    [
        ([(40, 10)] * 5, 5, 200, 50),
        ([(40, 10), (None, 10), (60, 20)], 2, 100, 30),  # a failed read skips the poll
        ([(UNSUPPORTED, UNSUPPORTED)] * 3, 3, -1, -1),  # unsupported: -1 for ever
        ([(UNSUPPORTED, 10), (UNSUPPORTED, 20)], 2, -1, 30),
        ([(40, 10), (UNSUPPORTED, 10), (50, 10)], 2, 90, 20),  # "unsupported" later is a failure
        ([(UNSUPPORTED, 5), (40, 5)], 2, 40, 10),  # reported after -1: the sum starts again from 0
        ([(UNSUPPORTED, 5), (40, 5), (UNSUPPORTED, 5), (30, 5)], 3, 70, 15),  # and -1 after that is a failure
    ],
)
def test_device_sums(readings, samples, gpu_cum, mem_cum):
    """gpusamples counts fully read polls; sums skip failed reads; -1 stays while readings are -1,
    and is never summed from."""
    counters, _ = fold_all(*(snap(dev(gpu=g, mem=m)) for g, m in readings))
    device = counters.devices[0]
    assert (device.samples, device.gpu_busy_total, device.mem_busy_total) == (samples, gpu_cum, mem_cum)


def test_memory_failure_skips_the_whole_sample():
    """A failed memory read leaves every sum of that poll out, so averages stay exact."""
    counters, _ = fold_all(snap(dev(used=100)), snap(dev(used=None)), snap(dev(used=300)))
    device = counters.devices[0]
    assert (device.samples, device.memory_used_cum_kib, device.gpu_busy_total) == (2, 400, 80)
    assert device.memory_used_kib == 300


def test_now_values_show_minus_one_after_a_failed_read():
    """A percentage that failed this poll is shown as -1 now, its sum untouched."""
    counters, _ = fold_all(snap(dev(gpu=40)), snap(dev(gpu=None)))
    device = counters.devices[0]
    assert (device.gpu_busy_now, device.gpu_busy_total) == (-1, 40)


def test_process_sums_start_at_zero():
    """The first sample of a process is counted whole (no -1 start)."""
    counters, _ = fold_all(snap(dev(processes=(proc(7, gpu=30, mem=4),))))
    totals = counters.devices[0].processes[7]
    assert (totals.samples, totals.gpu_busy_cum, totals.mem_busy_cum) == (1, 30, 4)


def test_process_counted_once_per_poll_whatever_lists_name_it():
    """The same pid twice in one device's list counts one sample, kind C+G."""
    counters, _ = fold_all(
        snap(dev(processes=(proc(7, "C", memory=100), proc(7, "G", memory=100)))),
        snap(dev(processes=(proc(7, "C", memory=100),))),
    )
    totals = counters.devices[0].processes[7]
    assert (totals.samples, totals.memory_cum_kib) == (2, 200)


def test_process_unsupported_busy_is_minus_one():
    """Per-process busy is -1 only when the device cannot report it."""
    counters, _ = fold_all(*(snap(dev(processes=(proc(7, gpu=UNSUPPORTED, mem=UNSUPPORTED),))),) * 3)
    totals = counters.devices[0].processes[7]
    assert (totals.samples, totals.gpu_busy_cum, totals.mem_busy_cum) == (3, -1, -1)


def test_process_failed_reading_skips_its_sample():
    """A process whose busy figure failed this poll counts no sample for it."""
    counters, _ = fold_all(
        snap(dev(processes=(proc(7, gpu=10),))),
        snap(dev(processes=(proc(7, gpu=None),))),
        snap(dev(processes=(proc(7, gpu=20),))),
    )
    totals = counters.devices[0].processes[7]
    assert (totals.samples, totals.gpu_busy_cum, totals.memory_cum_kib) == (2, 30, 2048)


def test_exited_process_reported_once_under_its_device():
    """A process that leaves device 1 comes back once, with device index 1."""
    a = dev("a", processes=(proc(1),))
    b_with = dev("b", processes=(proc(2, gpu=50),))
    b_without = dev("b", processes=())
    counters, exited = fold_all(snap(a, b_with), snap(a, b_with), snap(a, b_without), snap(a, b_without))
    assert [len(e) for e in exited] == [0, 0, 1, 0]
    gone = exited[2][0]
    assert (gone.device_index, gone.totals.pid, gone.totals.samples, gone.totals.gpu_busy_cum) == (1, 2, 2, 100)


def test_failed_process_list_neither_counts_nor_ends_processes():
    """processes=None (list unreadable this poll): no sample, no exit."""
    counters, exited = fold_all(
        snap(dev(processes=(proc(7),))), snap(dev(processes=None)), snap(dev(processes=(proc(7),)))
    )
    assert exited == [[], [], []]
    assert counters.devices[0].processes[7].samples == 2


def test_absent_device_ends_processes_and_keeps_counters():
    """A device that is gone shows -1 now; its processes end; it comes back monotonic."""
    first = snap(dev("a", processes=(proc(1),)))
    gone = snap(dev("a", present=False))
    counters, exited = fold_all(first, gone, gone, first)
    device = counters.devices[0]
    assert [len(e) for e in exited] == [0, 1, 0, 0]
    assert (device.samples, device.gpu_busy_total, device.present) == (2, 80, True)


def test_device_missing_from_snapshot_is_absent_and_keeps_its_place():
    """A device not in a snapshot stays in T order, marked absent, -1 now."""
    counters, exited = fold_all(snap(dev("a"), dev("b", processes=(proc(3),))), snap(dev("a")))
    assert [d.key for d in counters.devices] == ["a", "b"]
    assert counters.devices[1].gpu_busy_now == -1 and not counters.devices[1].present
    assert [e.totals.pid for e in exited[1]] == [3]


def test_every_counter_is_monotonic_over_a_messy_run():
    """Failures, unsupported readings and absences never make a counter go down."""
    readings = [40, None, 70, UNSUPPORTED, 10, 0, None, 100]
    counters = Counters()
    previous = None
    for i, value in enumerate(readings):
        present = i != 5
        counters.fold(snap(dev(gpu=value, used=None if i == 2 else 100, present=present)))
        d = counters.devices[0]
        now = (d.samples, d.gpu_busy_total, d.mem_busy_total, d.memory_used_cum_kib)
        if previous:
            assert all(b >= a for a, b in zip(previous, now)), (previous, now)
        previous = now


def test_layout_generation_changes_only_with_identity():
    """T is rendered again only when devices or their names change."""
    counters = Counters()
    counters.fold(snap(dev("a")))
    first = counters.layout_generation
    counters.fold(snap(dev("a")))
    assert counters.layout_generation == first
    counters.fold(snap(dev("a", name="Renamed")))
    assert counters.layout_generation == first + 1
