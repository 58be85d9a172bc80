"""The *_seconds series grow by each sample's real span, so rate() is right when polls
run slower than --interval or fail; atop's wire counters are untouched."""

from __future__ import annotations

import pytest
from metrics_text import samples_of, series
from prometheus_client.exposition import generate_latest
from snapshots import dev, proc, snap
from twisted.internet.defer import Deferred, fail
from twisted.internet.task import Clock

from atopgpud_tw.counters import Counters
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.poller import PollerService
from atopgpud_tw.server.web.metrics import BoardCollector

INTERVAL = 1.0


class SlowReader:
    """Every poll takes `seconds` on the clock; GPU 13 % busy, its process 30 %;
    every `failing`-th poll fails."""

    name = "slow"

    def __init__(self, clock: Clock, seconds: float, failing: int = 0) -> None:
        self.clock = clock
        self.seconds = seconds
        self.failing = failing
        self.calls = 0

    def poll(self) -> Deferred:
        self.calls += 1
        if self.failing and self.calls % self.failing == 0:
            return fail(RuntimeError("nvidia-smi timed out"))
        done: Deferred = Deferred()
        self.clock.callLater(self.seconds, done.callback, snap(dev(gpu=13, mem=7, processes=(proc(42, gpu=30),))))
        return done

    def close(self) -> None:
        pass


def run(seconds_per_poll: float, failing: int = 0) -> tuple[Board, list[tuple[float, dict]]]:
    """A poller on a clock for 120 s; the page at every whole second."""
    clock = Clock()
    board = Board(Counters(weigh_processes=True))
    poller = PollerService(SlowReader(clock, seconds_per_poll, failing), board, INTERVAL, clock)
    registry = BoardCollector(board, poller, INTERVAL, processes=True)
    poller.startService()
    pages = []
    for _ in range(120):
        for _tenth in range(10):
            clock.advance(0.1)
        pages.append((clock.seconds(), samples_of(generate_latest(registry).decode())))
    poller.stopService()
    return board, pages


def rate(pages: list[tuple[float, dict]], name: str, start: int, end: int, **labels: str) -> float:
    """increase / seconds between two scrapes, as rate() sees it without extrapolation."""
    (first,), (last,) = series(pages[start][1], name, **labels), series(pages[end][1], name, **labels)
    return (last - first) / (pages[end][0] - pages[start][0])


@pytest.mark.parametrize("seconds_per_poll, failing", [(0.2, 0), (2.5, 0), (0.4, 3), (1.3, 2)])
def test_rate_is_the_true_busy_figure_whatever_the_polls_take(seconds_per_poll, failing):
    """rate() over 90 s of 13 %, 7 % and 30 % busy is 13, 7 and 30, with polls slower
    than the interval (2.5 s: one in three ticks) or failing; atop's sums stay per sample."""
    board, pages = run(seconds_per_poll, failing)
    # 90 s is 30 samples or more: one sample's span (3 s at most) is within 4 %
    assert rate(pages, "atopgpud_gpu_busy_percent_seconds_total", 20, 110) == pytest.approx(13, rel=0.04)
    assert rate(pages, "atopgpud_gpu_memory_busy_percent_seconds_total", 20, 110) == pytest.approx(7, rel=0.04)
    assert rate(pages, "atopgpud_process_busy_percent_seconds_total", 20, 110, pid="42") == pytest.approx(
        30, rel=0.04
    )
    device = board.counters.devices[0]
    assert device.gpu_busy_cum == 13 * device.samples  # what atop divides by its sample count
    assert device.processes[42].gpu_busy_cum == 30 * device.processes[42].samples


def test_polls_on_time_give_sum_times_interval():
    """With every poll on time the series are exactly atop's sums times the interval."""
    board, pages = run(0.2)
    device = board.counters.devices[0]
    (busy,) = series(pages[-1][1], "atopgpud_gpu_busy_percent_seconds_total")
    assert busy == pytest.approx(device.gpu_busy_cum * INTERVAL)


def test_a_skipped_sample_is_covered_by_the_next():
    """A sample skipped (a value failed to read) or a device gone: the next counted one
    covers the time since the last counted one; after an absence, one poll only."""
    counters = Counters()
    counters.fold(snap(dev(gpu=50)), taken=1.0, since=0.0)
    counters.fold(snap(dev(gpu=None)), taken=2.0, since=1.0)  # read failed: not counted
    counters.fold(snap(dev(gpu=50)), taken=3.0, since=2.0)
    device = counters.devices[0]
    assert (device.samples, device.gpu_busy_cum, device.gpu_busy_seconds) == (2, 100, 150.0)
    counters.fold(snap(dev(present=False)), taken=4.0, since=3.0)
    counters.fold(snap(dev(gpu=50)), taken=104.0, since=103.0)
    assert device.gpu_busy_seconds == 200.0
