"""GPM's cumulative counters per device, folded from each poll's `GpmFigures` (docs/metrics.md).

Each poll's GPM figures are exact averages over the seconds between two GPM
samples, so summing each figure times those seconds gives counters whose
increase over any span of polls is exact: ``rate()`` of a ``*_percent_seconds``
counter is the average percentage, of a ``*_bytes`` counter the bytes per
second.  `seconds` is the time the sums cover (a poll whose GPM failed is
covered by the next one's figures, whose span reaches back to the last good
sample).  Pure, no I/O and no clock, like `counters.py`; every counter only grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from atopgpud_tw.snapshot import GpmFigures


@cache
def rates() -> frozenset[str]:
    """The figures given in MiB/s, summed as bytes; every other figure is a percentage (the
    table's units).  The table (figures.py) is loaded at the first GPM figures: a host
    without GPM never needs it."""
    from atopgpud_tw.figures import GPM_FIGURES

    return frozenset(f.gpm.name for f in GPM_FIGURES if f.gpm is not None and f.gpm.rate)


@cache
def _weights() -> dict[str, int]:
    """What each figure is multiplied by besides its seconds: a rate's MiB, in bytes."""
    from atopgpud_tw.figures import MIB

    return dict.fromkeys(rates(), MIB)


@dataclass(slots=True)
class GpmTotals:
    """One device's GPM sums: seconds covered, and per figure its percent-seconds or bytes."""

    seconds: float = 0.0
    polls: int = 0
    sums: dict[str, float] = field(default_factory=dict)

    def add(self, figures: GpmFigures) -> None:
        """Count one poll's figures over the seconds they cover."""
        span = figures.seconds
        if span <= 0:
            return
        self.seconds += span
        self.polls += 1
        sums = self.sums
        weights = _weights()
        for name, value in figures.values:
            weighted = value * span * weights.get(name, 1)
            sums[name] = sums.get(name, 0.0) + weighted


def fold_gpm(totals: GpmTotals | None, figures: GpmFigures | None) -> GpmTotals | None:
    """`totals` with one poll's figures counted (made at the first figures a device has).
    Figures that cover no time (a poll too soon after the last GPM sample carries the
    last figures on, over 0 seconds) add nothing."""
    if figures is None:
        return totals
    if totals is None:
        totals = GpmTotals()
    totals.add(figures)
    return totals
