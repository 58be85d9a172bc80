"""The simulated host's clocks, as a driver stamps its samples with them.

Simulated time is the host's monotonic clock.  A driver stamps samples on the wall clock
(``sample_clock: epoch``) or on one that goes on across a suspend (``boottime`` or seconds);
each sample keeps its stamp, so after the wall clock is set back the buffer holds old samples
stamped later than new ones, as a real driver's does.  The clocks move by the scenario's
``clock_steps`` and ``suspends`` and, on the real clock, by what the host's clocks did.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from typing import Sequence

#: a change of the host's clocks against the monotonic one smaller than this is not a step
LIVE_STEP_US = 1_000
#: the wall clock (epoch) and the clocks that go on across a suspend
WALL, BOOT = 0, 1


def live_offsets() -> tuple[int, int]:
    """The host's (CLOCK_REALTIME, CLOCK_BOOTTIME) less CLOCK_MONOTONIC, µs."""
    mono = time.monotonic_ns()
    try:
        boot = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    except OSError:  # some LD_PRELOAD time shifters fail it: taken as not moved
        boot = mono
    return (time.time_ns() - mono) // 1000, (boot - mono) // 1000


class HostClocks:
    """How far the wall clock and the boot clock are from simulated time, by simulated time."""

    def __init__(
        self, steps: Sequence[tuple[float, float]] = (), suspends: Sequence[tuple[float, float]] = (),
        live: bool = False,
    ) -> None:
        #: (simulated time, wall shift µs, boot shift µs), in order: the shifts from then on
        self._changes: list[tuple[float, int, int]] = [(float("-inf"), 0, 0)]
        moments = sorted([(when, int(seconds * 1e6), 0) for when, seconds in steps]
                         + [(when, int(seconds * 1e6), int(seconds * 1e6)) for when, seconds in suspends])
        wall = boot = 0
        for when, by_wall, by_boot in moments:
            wall += by_wall
            boot += by_boot
            self._changes.append((when, wall, boot))
        self._times = [when for when, _, _ in self._changes]
        self._live = live_offsets() if live else None
        self._live_shift = (0, 0)

    @property
    def steady(self) -> bool:
        """Whether no clock has moved yet (nor is scripted to)."""
        return len(self._changes) == 1

    def shift_us(self, when: float, which: int) -> int:
        """How far clock `which` (WALL, BOOT) is ahead of simulated time at `when`, µs."""
        change = self._changes[bisect_right(self._times, when) - 1]
        return int(change[1 + which])

    def observe(self, now: float) -> None:
        """On the real clock: note a step of the host's clocks as of simulated time `now`."""
        if self._live is None:
            return
        real, boot = live_offsets()
        shift = (real - self._live[0], boot - self._live[1])
        if abs(shift[0] - self._live_shift[0]) < LIVE_STEP_US and abs(shift[1] - self._live_shift[1]) < LIVE_STEP_US:
            return
        moved = (shift[0] - self._live_shift[0], shift[1] - self._live_shift[1])
        self._live_shift = shift
        # from now on (scripted changes after now move by it too)
        position = bisect_right(self._times, now)
        before = self._changes[position - 1]
        later = [(when, wall + moved[0], boot + moved[1]) for when, wall, boot in self._changes[position:]]
        self._changes[position:] = [(now, before[1] + moved[0], before[2] + moved[1]), *later]
        self._times = [when for when, _, _ in self._changes]

    def offsets_us(self, now: float, epoch_us: int, boot_us: int) -> tuple[int, int]:
        """What a reader on simulated time sees of the host clocks at `now`: (wall - monotonic,
        boot - monotonic), µs, given what they read at simulated time 0."""
        return epoch_us + self.shift_us(now, WALL), boot_us + self.shift_us(now, BOOT)
