"""Fold NVML's buffered utilization samples into one figure per poll.

The driver measures utilization over its own sample period (1/6 s to 1 s by
product) and keeps every sample in a buffer; `nvmlDeviceGetUtilizationRates`
shows only the last period, so a poll once a second can miss most of each second
(NVML-FACTS.md sections 1 to 3).  These functions take everything the buffer holds
since the previous poll instead:

- device samples: the time-weighted mean over ``(since, newest]``, each sample
  weighing the time since the one before it;
- process samples: the driver lists a process only for periods in which it was
  busy, so a pid's figure is its busy time over the whole window, and a pid
  without samples was idle (0 %).

Samples no newer than `since`, or above 100 %, are dropped (both are seen from
real drivers).  On the first read (`since` 0) the buffer's whole past comes back:
only its newest sample is used then.  Only timestamps NVML returned are ever
handed back as the next `since`.  Pure functions, no NVML.
"""

from __future__ import annotations

from typing import Any, Iterable

from atopgpud_tw.snapshot import clamp_percent

#: on the first read, the share of the buffer's past that stands for the poll
FIRST_WINDOW_US = 1_000_000


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
    weighs the time since the one before it, at most the driver's sample `period`
    when that is known, so a gap in which the buffer ran dry (the GPU was idle)
    counts as idle.  The share starts at `begin`, where the previous poll's
    accounting ended (later than `since` after polls that found the buffer empty,
    or whose last periods were dry), and ends at the newest sample, or, when
    whole periods have passed since it by the driver's clock `now`, after them.
    """
    usable = sorted((stamp, value) for stamp, value in samples if stamp > since and 0 <= value <= 100)
    if not usable:
        return None, since, since if begin is None else begin
    newest = usable[-1][0]
    if since == 0:
        # the first read brings the buffer's whole past: take its last second
        since = max(0, newest - FIRST_WINDOW_US)
        usable = [(stamp, value) for stamp, value in usable if stamp > since] if len(usable) > 1 else usable
        if len(usable) == 1:
            return clamp_percent(usable[0][1]), newest, newest
        since = usable[0][0] - (period or (usable[1][0] - usable[0][0]))
        begin = None
    total = 0.0
    previous = since
    for stamp, value in usable:
        gap = stamp - previous
        total += value * (min(gap, period) if period else gap)
        previous = stamp
    start, end = since, newest
    if period:
        if begin is not None:
            start = max(since, min(begin, usable[0][0] - period))
        if now is not None and now - newest >= period:
            end = newest + (now - newest) // period * period
    return clamp_percent(total / (end - start)), newest, end


def fold_process_samples(
    samples: Iterable[Any], since: int, periods: int | None = None, period_us: int | None = None
) -> tuple[dict[int, tuple[int, int]], int]:
    """Per-pid (sm, mem) percentages since `since`, and the newest timestamp.

    `samples` have ``pid, timeStamp, smUtil, memUtil``.  `periods` is how many
    sample periods the poll covered, from the device's own samples in the same
    poll; without it, the time since `since` over the driver's sample period
    (`period_us`, when known) stands in, or at least the distinct timestamps
    among the process samples.  A pid's figure is the sum of its samples over
    the number of periods: busy in 2 periods of 6 at 90 % is 30 %.
    """
    # one sample per pid and timestamp; stale ones and impossible values left out
    latest: dict[tuple[int, int], tuple[int, int]] = {}
    newest = since
    for sample in samples:
        stamp = sample.timeStamp
        sm, mem = sample.smUtil, sample.memUtil
        if stamp > since and 0 <= sm <= 100 and 0 <= mem <= 100:
            latest[(sample.pid, stamp)] = (sm, mem)
            if stamp > newest:
                newest = stamp
    if not latest:
        return {}, since
    if since == 0:
        # the first read brings the buffer's whole past: take its last second
        since = newest - FIRST_WINDOW_US
        latest = {key: values for key, values in latest.items() if key[1] > since}
        if periods is None and period_us:
            periods = max(1, round(FIRST_WINDOW_US / period_us))
        elif periods is None:
            periods = len({stamp for _, stamp in latest})
    sums: dict[int, list[int]] = {}
    for (pid, _), (sm, mem) in latest.items():
        total = sums.get(pid)
        if total is None:
            sums[pid] = [sm, mem, 1]
        else:
            total[0] += sm
            total[1] += mem
            total[2] += 1
    count = periods or len({stamp for _, stamp in latest})
    if not periods and period_us:
        count = max(count, round((newest - since) / period_us))
    count = max(count, max(n for _, _, n in sums.values()))
    if count == 1:
        return {pid: (sm, mem) for pid, (sm, mem, _) in sums.items()}, newest
    # at least every pid's own sample count: the figures stay within 0..100
    return {pid: (round(sm / count), round(mem / count)) for pid, (sm, mem, _) in sums.items()}, newest


def smallest_gap(stamps: Iterable[int]) -> int | None:
    """The smallest gap between distinct timestamps (the driver's sample period, once seen)."""
    ordered = sorted(set(stamps))
    gaps = [b - a for a, b in zip(ordered, ordered[1:])]
    return min(gaps) if gaps else None
