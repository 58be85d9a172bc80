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

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from atopgpud_tw.snapshot import clamp_percent

#: on the first read, the share of the buffer's past that stands for the poll
FIRST_WINDOW_US = 1_000_000
#: a gap between samples longer than this many periods was a dry spell (idle);
#: a shorter one is a sample the driver skipped, or jitter
DRY_GAP = 2.5
#: this many periods without a new sample, by the driver's clock, and the
#: buffer has run dry (the GPU went idle) rather than the next sample being late
DRY_TAIL = 1.5


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
        since = max(0, newest - FIRST_WINDOW_US)
        usable = [(stamp, value) for stamp, value in usable if stamp > since] if len(usable) > 1 else usable
        if len(usable) == 1:
            return clamp_percent(usable[0][1]), newest, newest
        since = usable[0][0] - (period or (usable[1][0] - usable[0][0]))
        begin = None
    previous = since if begin is None else max(since, begin)
    total = weight = idle = 0.0
    for stamp, value in usable:
        gap = max(0, stamp - previous)
        if period and gap > DRY_GAP * period:
            idle += gap - period
            gap = period
        total += value * gap
        weight += gap
        previous = max(previous, stamp)
    end = newest
    if period and now is not None and now - newest >= DRY_TAIL * period:
        # whole periods (the driver's period is known to a microsecond or so)
        tail = (now - newest + period // 8) // period * period
        idle += tail
        end = newest + tail
    if weight + idle <= 0:
        # every sample at one instant: their plain mean
        return clamp_percent(sum(value for _, value in usable) / len(usable)), newest, end
    return clamp_percent(total / (weight + idle)), newest, end


def fold_process_samples(
    samples: Iterable[Any],
    since: int,
    periods: int | None = None,
    period_us: int | None = None,
    elapsed_us: int | None = None,
    skipped: int | None = 0,
) -> tuple[dict[int, tuple[int, int]], int]:
    """Per-pid (sm, mem) percentages since `since` from a driver that lists a
    process once per busy sample period, and the newest timestamp.

    `samples` have ``pid, timeStamp, smUtil, memUtil``.  A pid's figure is the
    sum of its samples over the number of periods the poll covered: busy in 2
    periods of 6 at 90 % is 30 %.  That number comes from the process samples'
    own span over the driver's sample period (`period_us`, when known), at most
    the time since the previous poll (`elapsed_us`) and a period; without a
    period, from `periods` (the device samples of the same poll) or the
    distinct timestamps among the process samples; less the periods the driver
    `skipped` (no sample at all, as its device samples show; None when they
    cannot tell: then a gap of about two periods in which no process is listed
    is taken for a skipped sample); never fewer than
    any pid's own samples, so the figures stay within 0..100.  A span is
    rounded down unless within 0.3 periods of the next whole one, so a sample
    stamped late at the end of the span does not add a period.
    """
    latest, newest = _fresh(samples, since)
    if not latest:
        return {}, since
    if since == 0:
        # the first read brings the buffer's whole past: take its last second
        since = newest - FIRST_WINDOW_US
        latest = {key: values for key, values in latest.items() if key[1] > since}
        if period_us:
            periods = max(1, round(FIRST_WINDOW_US / period_us))
        elif periods is None:
            periods = len({stamp for _, stamp in latest})
        period_us = None
    sums: dict[int, list[int]] = {}
    for (pid, _), (sm, mem) in latest.items():
        total = sums.get(pid)
        if total is None:
            sums[pid] = [sm, mem, 1]
        else:
            total[0] += sm
            total[1] += mem
            total[2] += 1
    if period_us:
        span = newest - since
        if elapsed_us is not None:
            span = min(span, elapsed_us + period_us)
        if skipped is None:
            skipped = skipped_periods([since, *sorted({stamp for _, stamp in latest})], period_us)
        count = max(1, int(span / period_us + 0.3) - skipped)
    else:
        count = periods or len({stamp for _, stamp in latest})
    count = max(count, max(n for _, _, n in sums.values()))
    if count == 1:
        return {pid: (sm, mem) for pid, (sm, mem, _) in sums.items()}, newest
    return {pid: (round(sm / count), round(mem / count)) for pid, (sm, mem, _) in sums.items()}, newest


def latest_process_figures(samples: Iterable[Any], since: int) -> tuple[dict[int, tuple[int, int]], int]:
    """Per-pid (sm, mem) from a driver that lists each process once per call,
    its figure already an average over the window asked for; the newest timestamp.

    Where a pid is listed more than once, its newest entry counts (the larger
    figure between entries of one timestamp).
    """
    latest, newest = _fresh(samples, since)
    figures: dict[int, tuple[int, int, int]] = {}
    for (pid, stamp), (sm, mem) in latest.items():
        seen = figures.get(pid)
        if seen is None or stamp > seen[0]:
            figures[pid] = (stamp, sm, mem)
    return {pid: (sm, mem) for pid, (_, sm, mem) in figures.items()}, newest


def lists_busy_periods(samples: Iterable[Any], since: int = 0) -> bool:
    """Whether the driver lists a process once per busy period: some pid has
    samples of two different timestamps in one answer."""
    stamps: dict[int, int] = {}
    for (pid, stamp) in _fresh(samples, since)[0]:
        first = stamps.setdefault(pid, stamp)
        if first != stamp:
            return True
    return False


def _fresh(samples: Iterable[Any], since: int) -> tuple[dict[tuple[int, int], tuple[int, int]], int]:
    """One (sm, mem) per pid and timestamp, newer than `since` and within 0..100
    (the larger where a pid and timestamp come twice); and the newest timestamp."""
    latest: dict[tuple[int, int], tuple[int, int]] = {}
    newest = since
    for sample in samples:
        stamp = int(sample.timeStamp)
        sm, mem = int(sample.smUtil), int(sample.memUtil)
        if stamp > since and 0 <= sm <= 100 and 0 <= mem <= 100:
            key = (int(sample.pid), stamp)
            seen = latest.get(key)
            latest[key] = (sm, mem) if seen is None else (max(sm, seen[0]), max(mem, seen[1]))
            if stamp > newest:
                newest = stamp
    return latest, newest


def smallest_gap(stamps: Iterable[int]) -> int | None:
    """The smallest gap between distinct timestamps (the driver's sample period, once seen)."""
    ordered = sorted(set(stamps))
    gaps = [b - a for a, b in zip(ordered, ordered[1:])]
    return min(gaps) if gaps else None


@dataclass(eq=False)
class SampleStream:
    """What the reader knows of one device's sample buffer of one kind.

    The driver stamps its samples on a clock of its own (the Unix epoch in
    microseconds on most drivers, CLOCK_BOOTTIME on some): only timestamps it
    returned are passed back, and its "now" is the reader's time less an offset
    learnt from recent polls.  The offset is the second smallest of the recent
    lags between the reader's time and the newest sample, so one sample stamped
    late moves it for no poll, and it follows the driver's clock if that jumps.
    """

    #: the newest timestamp NVML returned (0: none yet, ask for the whole buffer)
    since: int = 0
    #: where the accounting of the driver's time got to (past `since` after a dry tail)
    accounted: int | None = None
    #: the driver's sample period in microseconds, once samples showed it
    period_us: int | None = None
    #: recent (reader's time - newest sample), one per poll that brought samples
    lags: deque[int] = field(default_factory=lambda: deque(maxlen=LAG_WINDOW))
    #: recent gaps between consecutive samples
    gaps: deque[int] = field(default_factory=lambda: deque(maxlen=GAP_WINDOW))
    #: periods the driver skipped (no sample) among this poll's
    skipped: int = 0

    def driver_now(self, now_us: int) -> int | None:
        """The reader's time `now_us` on the driver's sample clock, once known."""
        if not self.lags:
            return None
        ordered = sorted(self.lags)
        return now_us - ordered[1 if len(ordered) > 2 else 0]

    def fold(self, pairs: list[tuple[int, float]], now_us: int) -> tuple[int | None, int]:
        """This poll's figure from the (stamp, value) pairs the driver returned,
        and how many of them were new; None when none was usable."""
        since = self.since
        fresh = sorted(stamp for stamp, _ in pairs if stamp > since)
        self.gaps.extend(b - a for a, b in zip(fresh, fresh[1:]) if b > a)
        if self.gaps:
            self.period_us = median_gap_of(self.gaps)
        self.skipped = skipped_periods(([since] if since else []) + fresh, self.period_us)
        value, newest, end = fold_device_samples(
            pairs, since, self.accounted, self.period_us, self.driver_now(now_us)
        )
        if value is None:
            return None, 0
        if newest > since:
            self.lags.append(now_us - newest)
        self.since = newest
        self.accounted = end
        first = since or newest - FIRST_WINDOW_US
        return value, sum(1 for stamp in fresh if stamp > first)

    def dry(self, now_us: int) -> None:
        """A poll that found nothing new: if periods have passed since the newest
        sample, that time is idle, and the next samples do not claim it."""
        driver_now = self.driver_now(now_us)
        if self.since and driver_now is not None:
            self.accounted = max(self.accounted or self.since, driver_now)


def skipped_periods(stamps: list[int], period: int | None) -> int:
    """How many samples the driver skipped among these consecutive stamps: gaps
    of about two periods (longer ones are dry spells)."""
    if not period:
        return 0
    skipped = 0
    for a, b in zip(stamps, stamps[1:]):
        gap = b - a
        if 1.5 * period < gap <= DRY_GAP * period:
            skipped += round(gap / period) - 1
    return skipped


def median_gap_of(gaps: Iterable[int]) -> int:
    ordered = sorted(gaps)
    return ordered[len(ordered) // 2]


@dataclass(eq=False)
class ProcessStream:
    """What the reader knows of one device's per-process utilization samples.

    Drivers answer in one of two ways, and the reader finds out which from the
    first answer that lists a process, asked with timestamp 0 (the whole
    buffer): one sample per process per busy sample period (`PER_PERIOD`,
    summed over the poll's periods), or one sample per process per call whose
    figure is already an average over the window asked for (`PER_CALL`, taken
    as it is).  A driver once seen listing a pid at two timestamps in one
    answer lists periods.
    """

    since: int = 0
    #: the `since` of the previous poll that brought samples
    previous_since: int = 0
    mode: str | None = None
    #: whether `mode` is known for sure
    settled: bool = False
    #: the pids the previous poll that brought samples listed
    listed: set[int] = field(default_factory=set)
    #: recent gaps between one pid's consecutive samples (per-period drivers)
    gaps: deque[int] = field(default_factory=lambda: deque(maxlen=GAP_WINDOW))

    def learn_period(self, samples: Iterable[Any], since: int) -> int | None:
        """The driver's sample period as the process samples show it (median gap)."""
        by_pid: dict[int, set[int]] = {}
        for sample in samples:
            stamp = int(sample.timeStamp)
            if stamp > since:
                by_pid.setdefault(int(sample.pid), set()).add(stamp)
        for stamps in by_pid.values():
            ordered = sorted(stamps)
            self.gaps.extend(b - a for a, b in zip(ordered, ordered[1:]))
        return median_gap_of(self.gaps) if self.gaps else None
    #: the figures of the last poll that brought samples, by pid
    figures: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: the reader's time of the previous poll, µs
    polled_us: int | None = None


PER_PERIOD = "per-period"
PER_CALL = "per-call"
#: polls whose lags the driver's clock offset is learnt from
LAG_WINDOW = 16
#: recent gaps the sample period is learnt from
GAP_WINDOW = 64
