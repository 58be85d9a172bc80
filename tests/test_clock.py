"""The reactor's clock is CLOCK_MONOTONIC (atopgpud_tw/tap.py): a wall clock that steps moves no timer."""

from __future__ import annotations

import time

from twisted.internet import task
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.pollreactor import PollReactor

from atopgpud_tw.tap import use_monotonic_clock


def _reactor(kind=EPollReactor):
    reactor = kind()
    reactor._handleSignals = lambda: None
    return reactor


def _stepped(monkeypatch, seconds: float) -> None:
    """The wall clock set `seconds` away from where it is (time.time only: monotonic runs on)."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


def test_pending_calls_keep_their_delay_on_the_new_clock():
    """A call scheduled before the switch is due as far from now as it was."""
    reactor = _reactor()
    call = reactor.callLater(5, lambda: None)
    reactor.runUntilCurrent()  # moves it into the heap
    late = reactor.callLater(7, lambda: None)  # still among the new calls
    assert use_monotonic_clock(reactor)
    assert reactor.seconds is time.monotonic
    assert 4.9 < call.getTime() - time.monotonic() <= 5
    assert 6.9 < late.getTime() - time.monotonic() <= 7
    assert call.seconds is time.monotonic
    assert 4.9 < reactor.timeout() <= 5
    assert not use_monotonic_clock(reactor)  # once is enough


def test_a_wall_clock_step_moves_no_deadline(monkeypatch):
    """Set back an hour or forward a day, the reactor sleeps as long as before and runs nothing early."""
    for kind in (EPollReactor, PollReactor):
        reactor = _reactor(kind)
        use_monotonic_clock(reactor)
        ran = []
        reactor.callLater(2, ran.append, "due")
        for step in (-3600, 86400):
            _stepped(monkeypatch, step)
            assert 1.9 < reactor.timeout() <= 2
            reactor.runUntilCurrent()
            assert ran == []
            monkeypatch.undo()


def test_reset_and_delay_read_the_same_clock():
    """`DelayedCall.reset` (TimeoutMixin's) counts from the monotonic now."""
    reactor = _reactor()
    use_monotonic_clock(reactor)
    call = reactor.callLater(100, lambda: None)
    call.reset(3)
    assert 2.9 < call.getTime() - time.monotonic() <= 3
    reactor.runUntilCurrent()
    call.delay(1)
    reactor.runUntilCurrent()
    assert 3.9 < call.getTime() - time.monotonic() <= 4


def test_a_looping_call_counts_one_tick_across_a_step_forward(monkeypatch):
    """A LoopingCall on the reactor counts intervals of monotonic time, not of a wall clock set forward."""
    reactor = _reactor()
    use_monotonic_clock(reactor)
    counts = []
    loop = task.LoopingCall.withCount(counts.append)
    loop.clock = reactor
    loop.start(0.01, now=True)
    _stepped(monkeypatch, 3600)
    deadline = time.monotonic() + 5
    while len(counts) < 3 and time.monotonic() < deadline:
        time.sleep(reactor.timeout() or 0)
        reactor.runUntilCurrent()
    loop.stop()
    assert len(counts) == 3 and max(counts) <= 2


def test_a_test_clock_is_left_alone():
    """task.Clock has the time its test gives it."""
    clock = task.Clock()
    assert not use_monotonic_clock(clock)
    assert clock.seconds() == 0
