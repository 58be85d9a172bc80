"""The poller on task.Clock: cadence, no overlap, failures contained and logged once."""

from __future__ import annotations

from snapshots import dev, snap
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock
from twisted.logger import capturedLogs

from atopgpud_tw.readers.base import PollError
from atopgpud_tw.server.atop.board import Board
from atopgpud_tw.server.atop.poller import PollerService
from atopgpud_tw.snapshot import Snapshot


class FakeReader:
    name = "fake"

    def __init__(self, outcomes=None) -> None:
        self.calls = 0
        self.closed = False
        self.outcomes = list(outcomes or [])
        self.pending: Deferred | None = None

    def poll(self):
        self.calls += 1
        if self.outcomes:
            outcome = self.outcomes.pop(0)
            if outcome == "hang":
                self.pending = Deferred()
                return self.pending
            if isinstance(outcome, Exception):
                return fail(outcome)
            if outcome == "raise":
                raise RuntimeError("reader bug")
            if isinstance(outcome, Snapshot):
                return succeed(outcome)
        return succeed(snap(dev()))

    def close(self) -> None:
        self.closed = True


def start(reader, interval=1.0):
    clock = Clock()
    board = Board()
    service = PollerService(reader, board, interval, clock)
    service.startService()
    return service, clock, board


def test_polls_once_at_start_then_every_interval():
    """One poll now, then one per interval."""
    reader = FakeReader()
    service, clock, board = start(reader, interval=2.0)
    assert reader.calls == 1
    clock.advance(2.0)
    clock.advance(2.0)
    assert reader.calls == 3 and board.counters.devices[0].samples == 3
    service.stopService()


def test_polls_never_overlap():
    """A poll still running when the next is due delays it instead of overlapping."""
    reader = FakeReader(["hang"])
    service, clock, _ = start(reader)
    for _ in range(5):
        clock.advance(1.0)
    assert reader.calls == 1
    reader.pending.callback(snap(dev()))
    clock.advance(1.0)
    assert reader.calls == 2
    service.stopService()


def test_failed_poll_does_not_stop_polling_and_is_logged_once():
    """Failures are counted, logged once per cause, recovery logged once; the loop goes on."""
    with capturedLogs() as events:
        reader = FakeReader([ValueError("boom"), ValueError("boom"), "raise", ValueError("boom")])
        service, clock, board = start(reader)
        for _ in range(5):
            clock.advance(1.0)
    assert reader.calls == 6
    assert service.failed_polls == {"ValueError: boom": 3, "RuntimeError: reader bug": 1}
    assert board.counters.devices[0].samples == 2
    texts = [e.get("log_format", "") for e in events if e.get("log_namespace", "").startswith("atopgpud_tw.poller")]
    assert texts.count("poll failed: {cause}") == 3  # boom, reader bug, boom again
    assert texts.count("polls work again (they failed with {cause})") == 1
    service.stopService()


def test_stop_leaves_no_delayed_calls_and_closes_the_reader():
    """After stopService nothing is scheduled and the reader is closed."""
    reader = FakeReader()
    service, clock, _ = start(reader)
    clock.advance(1.0)
    service.stopService()
    assert clock.getDelayedCalls() == [] and reader.closed


def test_status_names_the_reader_the_gpus_and_a_failing_cause():
    """The systemctl status line: GPUs counted, lost ones and a failing poll's cause named, recovery clears it."""
    reader = FakeReader([snap(dev(), dev("b")), snap(dev(), dev("b", present=False)), ValueError("boom")])
    service, clock, board = start(reader)
    assert service.status() == "fake: 2 GPUs"
    clock.advance(1.0)
    assert service.status() == "fake: 1 GPU, 1 lost"
    clock.advance(1.0)
    assert service.status() == "fake: 1 GPU, 1 lost; polls failing: ValueError: boom"
    clock.advance(1.0)
    assert service.status() == "fake: 1 GPU, 1 lost"
    service.stopService()


def _poller_lines(events) -> list[dict]:
    return [e for e in events if e.get("log_namespace", "").startswith("atopgpud_tw.poller")]


def test_a_poll_failure_that_keeps_coming_back_is_damped():
    """Failing every other poll for 20 min: two failures and recoveries said, then one count per growing window."""
    minutes = 20
    outcomes = [PollError("nvidia-smi timed out") if n % 2 == 0 else "ok" for n in range(60 * minutes)]
    with capturedLogs() as events:
        reader = FakeReader(outcomes)
        service, clock, _ = start(reader)
        for _ in range(60 * minutes):
            clock.advance(1.0)
    lines = _poller_lines(events)
    texts = [e["log_format"] for e in lines]
    assert texts[:4] == ["poll failed: {cause}", "polls work again (they failed with {cause})"] * 2
    assert "again: {count} times in {span}" in texts[4] and lines[4]["count"] == 3
    counts = lines[5:]
    # windows of 1 min from the third failure (at 4 s), then 10 min: at 64 s and at 664 s, within 20 min
    assert [e["every"] for e in counts] == ["10 min", "1 h"], texts
    assert [e["span"] for e in counts] == ["1 min", "10 min"]
    # every failure and recovery after the third failure is counted once, none lost
    assert counts[0]["failed"] + counts[0]["recovered"] == 60
    assert counts[1]["failed"] + counts[1]["recovered"] == 600
    assert all(e["log_format"].startswith("poll failed: {cause}: {failed} more failures") for e in counts)
    assert service.failed_polls == {"PollError: nvidia-smi timed out": 30 * minutes}
    service.stopService()


def test_a_rare_poll_failure_is_said_every_time():
    """A failure more than an hour after the last change, four times: each failure and recovery is said."""
    outcomes = ["ok"] * (4 * 370)
    for number in range(4):
        outcomes[number * 370 + 1] = PollError("nvidia-smi timed out")  # every 3700 s
    with capturedLogs() as events:
        reader = FakeReader(outcomes)
        service, clock, _ = start(reader, interval=10.0)
        clock.pump([10.0] * (4 * 370))
    texts = [e["log_format"] for e in _poller_lines(events)]
    assert texts == ["poll failed: {cause}", "polls work again (they failed with {cause})"] * 4
    service.stopService()


def test_a_reader_that_answers_without_a_deferred_is_polled_as_one_that_does():
    """A poll's answer taken as it comes: a Snapshot (or a coroutine's) as a Deferred's, a raise as a failed poll."""

    class PlainReader(FakeReader):
        def poll(self):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("reader bug")
            if self.calls == 3:
                async def later() -> Snapshot:
                    return snap(dev())

                return later()
            return snap(dev())

    reader = PlainReader()
    with capturedLogs():
        service, clock, board = start(reader)
        clock.advance(1.0)
        assert service.failing == "RuntimeError: reader bug"
        clock.advance(1.0)
        clock.advance(1.0)
    assert reader.calls == 4 and board.counters.devices[0].samples == 3 and service.failing is None
    service.stopService()
