"""The daemon's time: the reactor's clock made monotonic.

Twisted's reactors tell the time with `time.time`: when the wall clock is set back
an hour (chrony stepping it at boot, `date -s`), nothing runs for an hour; set
forward, every timer is due at once.  Everything that schedules on the reactor
(`callLater`, its `DelayedCall`s, `timeout()`, `LoopingCall`) reads the time through
its `seconds`, which `use_monotonic_clock` makes `time.monotonic`; calls already
scheduled are moved onto it.  Log stamps stay on the wall clock (docs/design.md, "Time").
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
