"""GPM's cumulative counters per device, folded from each poll's `GpmFigures` (docs/metrics.md).

Each poll's GPM figures are exact averages over the seconds between two GPM samples,
so each figure times those seconds, summed, is a counter whose ``rate()`` is exact (a
poll whose GPM failed is covered by the next one's span).  Pure, like `counters.py`.
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
        """Count one poll's figures over the seconds they cover (none: a poll too soon after the
        last GPM sample carries the last figures on, over 0 seconds, and adds nothing)."""
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

