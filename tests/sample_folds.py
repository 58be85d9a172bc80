"""`fold_device_samples`: the time-weighted fold of a buffer's samples over any share of the
driver's time, which tests/test_fidelity.py checks the weighting rules on.

The reader folds its polls through `SampleStream` (readers/nvml/samples.py), and its
first read through `fold_first_read`; this is the general form of both, kept here
where the rules are tested on their own, weighing samples as `fold_first_read` does
(`weigh_samples`, `weighted_percent`).
"""

from __future__ import annotations

from typing import Iterable

from atopgpud_tw.readers.nvml.samples import DRY_TAIL, fold_first_read, weigh_samples, weighted_percent


def fold_device_samples(
    samples: Iterable[tuple[int, float]],
    since: int,
    begin: int | None = None,
    period: int | None = None,
    now: int | None = None,
) -> tuple[int | None, int, int]:
    """(percent or None when nothing usable, the newest timestamp, where this poll's
    accounting ends) from (stamp, value) pairs.

    The time-weighted mean over the poll's share of the driver's time: each sample
    weighs the time since the one before it, so jittered or late stamps move
    weight between samples but never lose any.  Once the driver's sample
    `period` is known, a gap longer than `DRY_GAP` periods is a spell in which
    the buffer ran dry (the GPU was idle): the sample after it weighs one
    period and the rest of the gap counts as idle; a shorter gap (a sample the
    driver skipped) is weighed whole.  The share starts at `begin`, where the
    previous poll's accounting ended (later than `since` after a poll whose
    tail was dry), and ends at the newest sample, or, when at least
    `DRY_TAIL` periods have passed since it by the driver's clock `now`, after
    the whole periods since it: those were dry too.
    """
    usable = sorted((stamp, value) for stamp, value in samples if stamp > since and 0 <= value <= 100)
    if not usable:
        return None, since, since if begin is None else begin
    newest = usable[-1][0]
    if since == 0:
        # the first read brings the buffer's whole past: take its last second
        value, newest = fold_first_read(usable, period)
        return value, newest, newest
    previous = since if begin is None else max(since, begin)
    total, weight, idle = weigh_samples(usable, previous, period)
    end = newest
    if period and now is not None and now - newest >= DRY_TAIL * period:
        # whole periods (the driver's period is known to a microsecond or so)
        tail = (now - newest + period // 8) // period * period
        idle += tail
        end = newest + tail
    return weighted_percent(usable, total, weight + idle), newest, end
