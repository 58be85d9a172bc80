"""The daemon's time: the reactor's clock made monotonic.

Twisted's reactors tell the time with `time.time`, the wall clock: every
`callLater`, every `LoopingCall` and every timeout is a deadline on it, and
`ReactorBase.timeout()` sleeps until that deadline comes round again.  When the
wall clock is set back an hour (chrony or ntpd stepping it at boot, `date -s`, a
virtual machine restored), nothing runs for an hour; set forward, every timer
is due at once and a `LoopingCall` counts an hour of skipped ticks.

`use_monotonic_clock` gives the installed reactor `time.monotonic` as its
`seconds`.  Everything that schedules on the reactor reads the time through
that one attribute: `callLater` (and the `DelayedCall`s it makes, whose
`reset` and `delay` read it too), `timeout()`, `runUntilCurrent()` and
`LoopingCall`, so deadlines and the clock they are compared with stay on one
clock.  Calls already scheduled are moved onto it.  CLOCK_MONOTONIC stops while
the host is suspended, as the kernel's own timeouts (`epoll_wait`) do, so a
timer's remaining time is kept across a suspend.  Wall-clock time is left to
what a person reads (log stamps, which `twisted.logger` takes from `time.time`)
and to NVML's sample stamps (the driver's clock, `readers/nvml/stamps.py`).

A reactor that is not a `ReactorBase` (`task.Clock`, `MemoryReactor` in tests)
is left as it is: it has the time its test gives it.
"""

from __future__ import annotations

import time
from typing import Any

from twisted.internet.base import ReactorBase


def use_monotonic_clock(reactor: Any) -> bool:
    """Make `reactor` tell the time on CLOCK_MONOTONIC; whether it was changed."""
    if not isinstance(reactor, ReactorBase) or reactor.seconds is time.monotonic:
        return False
    shift = time.monotonic() - reactor.seconds()
    for call in [*reactor._pendingTimedCalls, *reactor._newTimedCalls]:
        # the same delay from now, on the new clock (the heap's order is unchanged)
        call.time += shift
        call.seconds = time.monotonic
    reactor.seconds = time.monotonic  # an instance attribute: ReactorBase reads self.seconds
    return True
