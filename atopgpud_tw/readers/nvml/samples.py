"""Fold NVML's buffered utilization samples into one figure per poll.

The driver measures utilization over its own sample period (1/6 s to 1 s by
product) and keeps every sample in a buffer; `nvmlDeviceGetUtilizationRates`
shows only the last period, so a poll once a second can miss most of each second
(docs/fidelity.md).  The reader takes everything the buffer holds
instead, and copes with what real drivers do to it (docs/fidelity.md):

- `SampleStream`: one device's buffer of one kind (GPU or memory busy): the
  driver's period and clock as its samples show them, and each poll's figure as
  the mean over a window of the driver's time; the windows tile that time;
- `ProcessStream`: one device's per-process samples, listed per busy period or
  once per call, whichever the driver does;
- the pure functions they use (`fold_first_read` for the first read, and
  the time weighting it shares, `weigh_samples` and `weighted_percent`;
  `fold_process_samples`, `windowed_process_figures`, ...).

Samples no newer than the timestamp asked with, or above 100 %, are dropped
(both are seen from real drivers); only timestamps NVML returned are ever
handed back.  No NVML here.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Iterator, NamedTuple, TypeAlias, TypeGuard

from atopgpud_tw.snapshot import clamp_percent

#: on the first read, the share of the buffer's past that stands for the poll
FIRST_WINDOW_US = 1_000_000
#: a gap between samples longer than this many periods was a dry spell (idle);
#: a shorter one is a sample the driver skipped, or jitter
DRY_GAP = 2.5
#: this many periods without a new sample, by the driver's clock, and the
#: buffer has run dry (the GPU went idle) rather than the next sample being late
DRY_TAIL = DRY_GAP
#: the same, for a buffer known to run dry: one that never held a sample of 0 %
#: and showed `KNOWN_DRY` gaps longer than `DRY_GAP_KNOWN` periods (a skipped
#: or late sample is a one-off; a buffer that runs dry does it at every idle spell)
DRY_GAP_KNOWN = 1.5
KNOWN_DRY = 3


def fold_first_read(samples: Iterable[tuple[int, float]], period: int | None = None) -> tuple[int | None, int]:
    """(percent or None when nothing usable, the newest timestamp) of the first read of a
    buffer, from (stamp, value) pairs: its whole past, of which the last second
    (`FIRST_WINDOW_US`) stands for the poll.

    The time-weighted mean over that second: each sample weighs the time since
    the one before it, so jittered or late stamps move weight between samples
    but never lose any.  Once the driver's sample `period` is known, a gap
    longer than `DRY_GAP` periods is a spell in which the buffer ran dry (the
    GPU was idle): the sample after it weighs one period and the rest of the
    gap counts as idle; a shorter gap (a sample the driver skipped) is weighed
    whole.  Samples above 100 % are dropped.
    """
    usable = sorted((stamp, value) for stamp, value in samples if stamp > 0 and 0 <= value <= 100)
    if not usable:
        return None, 0
    newest = usable[-1][0]
    since = max(0, newest - FIRST_WINDOW_US)
    usable = [(stamp, value) for stamp, value in usable if stamp > since] if len(usable) > 1 else usable
    if len(usable) == 1:
        return clamp_percent(usable[0][1]), newest
    previous = usable[0][0] - (period or (usable[1][0] - usable[0][0]))
    total, weight, idle = weigh_samples(usable, previous, period)
    return weighted_percent(usable, total, weight + idle), newest


def weigh_samples(usable: list[tuple[int, float]], previous: int, period: int | None) -> tuple[float, float, float]:
    """(the sum of value times weight, the sum of weights, the idle time) of time-ordered
    (stamp, value) pairs, the first weighing the time since `previous`.

    Each sample weighs the time since the one before it.  Once the driver's
    sample `period` is known, a gap longer than `DRY_GAP` periods is a dry
    spell: the sample after it weighs one period and the rest of the gap is idle.
    """
    total = weight = idle = 0.0
    for stamp, value in usable:
        gap = max(0, stamp - previous)
        if period and gap > DRY_GAP * period:
            idle += gap - period
            gap = period
        total += value * gap
        weight += gap
        previous = max(previous, stamp)
    return total, weight, idle


def weighted_percent(usable: list[tuple[int, float]], total: float, span: float) -> int | None:
    """The mean `total` over `span` (weighed time and idle time) as a percentage; the plain mean
    of the samples where they all stand at one instant (no span)."""
    if span <= 0:
        return clamp_percent(sum(value for _, value in usable) / len(usable))
    return clamp_percent(total / span)


def fold_process_samples(
    samples: Iterable[Any],
    since: int,
    periods: int | None = None,
    period_us: int | None = None,
    elapsed_us: int | None = None,
) -> tuple[dict[int, tuple[int, int]], int]:
    """Per-pid (sm, mem) percentages since `since` from a driver that lists a
    process once per busy sample period, and the newest timestamp.

    `samples` have ``pid, timeStamp, smUtil, memUtil``.  A pid's figure is the
    sum of its samples over the number of periods the poll covered: busy in 2
    periods of 6 at 90 % is 30 %.  That number is `periods` (from the device's
    own samples in the same poll: dry periods count, skipped ones do not),
    else the time since the previous poll (`elapsed_us`) over the driver's
    sample period (`period_us`), less gaps of about two periods in which no
    process was listed (taken for skipped samples; and a pid listed in all but
    one of them was busy in all: the poll fell a moment before a period
    ended), else the samples' span over
    the period, else the distinct timestamps among the samples; never fewer
    than any pid's own samples, so the figures stay within 0..100.
    """
    latest, newest = _fresh(samples, since)
    if not latest:
        return {}, since
    if since == 0:
        # the first read brings the buffer's whole past: take its last second
        since = newest - FIRST_WINDOW_US
        latest = {key: values for key, values in latest.items() if key[1] > since}
        # (its periods, not the poll's: a poll late or slow has more)
        periods = max(1, round(FIRST_WINDOW_US / period_us)) if period_us else None
        elapsed_us = None
    sums: dict[int, list[int]] = {}
    for (pid, _), (sm, mem) in latest.items():
        total = sums.get(pid)
        if total is None:
            sums[pid] = [sm, mem, 1]
        else:
            total[0] += sm
            total[1] += mem
            total[2] += 1
    if periods is not None:
        count = periods
    elif period_us and elapsed_us is not None:
        # by time, less the periods no process was listed in that look skipped
        stamps = sorted({stamp for _, stamp in latest})
        count = round(elapsed_us / period_us) - skipped_periods([since, *stamps], period_us)
        if most_samples(sums.values()) >= count - 1:
            # a poll a moment before or after a period ended: a period less or more
            count = most_samples(sums.values())
    elif period_us:
        count = round((newest - since) / period_us)
    else:
        count = len({stamp for _, stamp in latest})
    count = max(count, most_samples(sums.values()), 1)
    if count == 1:
        return {pid: (sm, mem) for pid, (sm, mem, _) in sums.items()}, newest
    return {pid: (round(sm / count), round(mem / count)) for pid, (sm, mem, _) in sums.items()}, newest


def most_samples(sums: Iterable[list[int]]) -> int:
    return max((n for _, _, n in sums), default=0)


def samples_per_pid(samples: Iterable[Any], since: int) -> int:
    """The most samples any one pid has after `since` (distinct timestamps)."""
    counts: dict[int, int] = {}
    for pid, _ in _fresh(samples, since)[0]:
        counts[pid] = counts.get(pid, 0) + 1
    return max(counts.values(), default=0)


def windowed_process_figures(
    pending: dict[int, dict[int, tuple[int, int]]], shown: list[tuple[int, int]], pids: Iterable[int]
) -> dict[int, tuple[int, int]]:
    """Per-pid (sm, mem) over the device's window: each part of it (µs, the
    device sample stamp that covered it) at the pid's figure in the process
    sample of that stamp, 0 where it has none (idle)."""
    weight = sum(part for part, _ in shown)
    if weight <= 0:
        return {}
    figures = {}
    for pid in pids:
        sm = mem = 0.0
        for part, stamp in shown:
            found = pending.get(stamp, {}).get(pid)
            if found is not None:
                sm += found[0] * part
                mem += found[1] * part
        figures[pid] = (round(sm / weight), round(mem / weight))
    return figures


def fresh_process_samples(samples: Iterable[Any], since: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(pid, stamp) -> (sm, mem), newer than `since`, within 0..100, once each."""
    return _fresh(samples, since)[0]


def latest_process_figures(samples: Iterable[Any], since: int) -> tuple[dict[int, tuple[int, int]], int]:
    """Per-pid (sm, mem) from a driver that lists each process once per call,
    its figure already an average over the window asked for; the newest timestamp.

    Where a pid is listed more than once, its newest entry counts (the larger
    figure between entries of one timestamp).
    """
    if _one_per_pid(samples, since):
        # each pid once, every entry fresh and in range: its entry is its figure
        return dict(zip(samples.pids, zip(samples.sm, samples.mem))), samples.newest()
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
    if _one_per_pid(samples, since):
        return False  # each pid listed once
    stamps: dict[int, int] = {}
    for (pid, stamp) in _fresh(samples, since)[0]:
        first = stamps.setdefault(pid, stamp)
        if first != stamp:
            return True
    return False


def _one_per_pid(samples: Iterable[Any], since: int) -> TypeGuard[ProcessSamples]:
    """Whether `samples` are columns whose every entry is fresh, within 0..100, and of a pid
    listed once: then the folds take the columns whole."""
    return type(samples) is ProcessSamples and samples.clean(since) and samples.pids_unique()


def _fresh(samples: Iterable[Any], since: int) -> tuple[dict[tuple[int, int], tuple[int, int]], int]:
    """One (sm, mem) per pid and timestamp, newer than `since` and within 0..100
    (the larger where a pid and timestamp come twice); and the newest timestamp."""
    if type(samples) is ProcessSamples:
        return samples.fresh(since)
    return _fresh_rows(samples, since)


def _fresh_rows(samples: Iterable[Any], since: int) -> tuple[dict[tuple[int, int], tuple[int, int]], int]:
    """`_fresh`, entry by entry (any samples with the structure's field names)."""
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


@dataclass(eq=False)
class SampleStream:
    """What the reader knows of one device's sample buffer of one kind, and
    the figure of each poll from it.

    Each sample tells how busy the GPU was from the sample before it to its own
    timestamp (from one period before it after a dry spell, the rest of which
    was idle).  Each poll's figure is the time-weighted mean over a window of
    the driver's time that starts where the previous poll's ended and ends a
    period and a little (`lag_us`) before the driver's "now", by when every
    sample covering it is in the buffer: the windows tile the driver's time and
    are as long as the time between the polls, however the samples fall
    against them, so atop's equal weighting of every poll is right.  While the
    buffer has not shown whether it ran dry (less than `DRY_TAIL` periods
    without a sample) the window ends at the newest sample instead, and a poll
    with no new time to show carries the last figure on: "no new sample yet" is
    not idleness.

    The driver stamps its samples on a clock of its own (the Unix epoch in
    microseconds on most drivers, CLOCK_BOOTTIME on some): only timestamps it
    returned are passed back, and its "now" is the reader's time less an offset
    learnt from recent polls: the second smallest of the recent lags between
    the reader's time and the newest sample, so one sample stamped late moves
    it for no poll, and it follows the driver's clock if that jumps.
    """

    #: the newest timestamp NVML returned (0: none yet, ask for the whole buffer)
    since: int = 0
    #: `since` as it was before this poll
    before: int = 0
    #: the driver's sample period in microseconds, once samples showed it
    period_us: int | None = None
    #: recent (reader's time - newest sample), one per poll that brought samples
    lags: deque[int] = field(default_factory=lambda: deque(maxlen=LAG_WINDOW))
    #: recent gaps between consecutive samples
    gaps: deque[int] = field(default_factory=lambda: deque(maxlen=GAP_WINDOW))
    #: samples the driver skipped among this poll's (gaps of about two periods)
    skipped: int = 0
    #: (start, end, percent, the sample stamp or 0 for a dry spell) of the
    #: driver's time known and not yet shown
    cover: list[tuple[int, int, float, int]] = field(default_factory=list)
    #: where the known time ends (past `since` after a dry tail)
    covered_to: int = 0
    #: where the last poll's window ended
    window_end: int | None = None
    #: the last poll's figure
    last: int | None = None
    #: the stamps of recent samples
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=GAP_WINDOW * 4))
    #: the last window's parts: (µs, the sample stamp that covered them, 0 for dry)
    shown: list[tuple[int, int]] = field(default_factory=list)
    #: gaps longer than `DRY_GAP_KNOWN` periods seen, and whether a sample of 0 % was
    dry_spells: int = 0
    zero_seen: bool = False

    def driver_now(self, now_us: int) -> int | None:
        """The reader's time `now_us` on the driver's sample clock, once known."""
        if not self.lags:
            return None
        ordered = sorted(self.lags)
        return now_us - ordered[1 if len(ordered) > 2 else 0]

    @property
    def lag_us(self) -> int:
        """How far behind the driver's now a window ends: a period, and jitter."""
        period = self.period_us or 0
        return period + max(20_000, period // 10)

    def fold(self, pairs: list[tuple[int, float]], now_us: int, whole: bool = True,
             answered_us: int | None = None) -> tuple[int | None, int]:
        """This poll's figure from the (stamp, value) pairs the driver returned
        (none: NOT_FOUND), and how many sample periods came to an end since the
        previous poll, dry ones too; None when the buffer never had a sample.
        Not `whole`: the answer may lack the newest samples (the clock was set back
        while the call ran, and the samples taken since were stamped below the one
        asked with), so no time after its newest sample is taken for a dry spell.

        `now_us` is when the call was made and `answered_us` when it returned (the
        same when not given): the driver answered somewhere between, so the lag of
        its newest sample is taken at the end (a slow call's answer may hold samples
        taken until then) and its "now" at the start (it may have answered at once):
        the driver's clock is never placed ahead of itself, which would read the time
        between its newest sample and that "now" as idle."""
        answered = now_us if answered_us is None else max(now_us, answered_us)
        since = self.before = self.since
        listed = [pair for pair in pairs if pair[0] > since and 0 <= pair[1] <= 100]  # (the buffer's order)
        fresh = sorted(listed)
        stamps = [stamp for stamp, _ in fresh]
        self.recent.extend(stamps)
        if len(stamps) > 1:
            # (between samples next to one another in the buffer: a few placed a step off, among
            # others, leave no short gaps to be taken for the period)
            gaps = [b[0] - a[0] for a, b in zip(listed, listed[1:]) if b[0] > a[0]]
            if gaps:
                # (learnt again only when the gaps it is learnt from change)
                self.gaps.extend(gaps)
                self.period_us = period_from_gaps(self.gaps)
        period = self.period_us
        # (a buffer known to run dry skips nothing: its gaps are idle)
        known_dry = self.dry_gap() == DRY_GAP_KNOWN
        # (and without a period none is known skipped: no list made to find none)
        self.skipped = 0 if known_dry or not period else skipped_periods(([since] if since else []) + stamps, period)
        # (the driver's now places the window's end, which without a period is where the samples end)
        driver_now = self.driver_now(now_us) if period else None
        if not fresh and not self.lags:
            return None, 0
        if since == 0:
            # the first read brings the buffer's whole past: its last second stands for the poll
            value, newest = fold_first_read(fresh, period)
            self.since = self.covered_to = newest
            self.window_end = newest
            self.lags.append(answered - newest)
            self.last = value
            return value, sum(1 for stamp in stamps if stamp > newest - FIRST_WINDOW_US)
        if period and self.window_end is not None:
            # samples first seen after newer ones (a step back hidden inside a call by a later step
            # forward), where their time was taken for a dry spell and not shown yet: busy as they say
            for stamp, level in pairs:
                if self.window_end < stamp <= since and 0 <= level <= 100:
                    self._dry_was(stamp, level, period)
        if not self.zero_seen and any(value == 0 for _, value in fresh):
            self.zero_seen = True
        dry_gap = self.dry_gap()
        previous: Any = since
        for stamp, level in fresh:
            low = max(previous, self.covered_to)
            if period and stamp - previous > DRY_GAP_KNOWN * period:
                self.dry_spells += 1
            if period and stamp - previous > dry_gap * period:
                # the buffer ran dry: idle, but for the sample's own period
                self._known(low, stamp - period, 0.0)
                low = max(low, stamp - period)
            self._known(low, stamp, level, stamp)
            previous = stamp
        periods = 0
        if fresh:
            newest = fresh[-1][0]
            self.lags.append(answered - newest)
            self.since = newest
            periods = round((newest - since) / period) if period else len(fresh)
        if driver_now is None or not period or self.window_end is None:
            end = self.covered_to
        else:
            end = driver_now - self.lag_us
            if not whole:
                end = min(end, self.covered_to)  # the rest comes in the next answer
            elif driver_now - self.since >= dry_gap * period:
                tail = self.covered_to
                self._known(tail, end, 0.0)  # the buffer ran dry: idle
                if not fresh:
                    periods = max(0, round((end - max(tail, self.window_end)) / period))
            elif end > self.covered_to:
                end = self.covered_to  # the next sample is not in yet: wait for it
        return self._show(end), periods

    def dry_gap(self) -> float:
        """Periods without a sample after which the buffer ran dry: fewer once it
        is known to run dry (dry spells seen, never a sample of 0 %), when a gap
        of two periods is an idle one rather than a sample the driver skipped."""
        if self.dry_spells >= KNOWN_DRY and not self.zero_seen:
            return DRY_GAP_KNOWN
        return DRY_GAP

    def _known(self, start: int, end: int, value: float, stamp: int = 0) -> None:
        """Time known to have been busy at `value` %: up to sample `stamp` (0: a dry spell)."""
        if end > start:
            self.cover.append((start, end, value, stamp))
            self.covered_to = max(self.covered_to, end)

    def _dry_was(self, stamp: int, level: float, period: int) -> None:
        """The period up to sample `stamp`, where it was taken for a dry spell, busy at `level` %."""
        for at, (low, high, _, mark) in enumerate(self.cover):
            if not mark and low < stamp and stamp - period < high:
                start, end = max(low, stamp - period), min(high, stamp)
                self.cover[at:at + 1] = [part for part in ((low, start, 0.0, 0), (start, end, level, stamp),
                                                           (end, high, 0.0, 0)) if part[1] > part[0]]
                return

    def _show(self, end: int) -> int | None:
        """The mean over the window from the last one's end to `end`."""
        start = self.window_end if self.window_end is not None else end
        self.shown = []
        if end <= start:
            return self.last  # no new time to show
        total = weight = 0.0
        for low, high, value, stamp in self.cover:
            overlap = min(high, end) - max(low, start)
            if overlap > 0:
                total += value * overlap
                weight += overlap
                self.shown.append((overlap, stamp))
        self.cover = [part for part in self.cover if part[1] > end]
        self.window_end = end
        if weight <= 0:
            return self.last
        self.last = clamp_percent(total / weight)
        return self.last


def period_from_gaps(gaps: Iterable[int]) -> int:
    """The driver's sample period from gaps between its samples: the shortest
    gap that recurs (within 20 %, in a tenth of the gaps or two), so that gaps
    of dry spells or skipped samples, and one late stamp, do not count.  (A
    buffer that runs dry between bursts each of one sample shows no period at
    all: its gaps are the bursts'.)"""
    ordered = sorted(gaps)
    need = max(2, len(ordered) // 10)
    found = ordered[len(ordered) // 2]
    for index, gap in enumerate(ordered):
        # the gaps from this one to 1.2 times it, found by bisection (the list is in order)
        end = bisect_right(ordered, gap * 1.2, index)
        if end - index >= need:
            found = ordered[index + (end - index) // 2]
            break
    return found


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


class UtilSample(NamedTuple):
    """One entry of ``nvmlDeviceGetProcessUtilization``, its stamp on the steady clock."""

    pid: int
    timeStamp: int  # noqa: N815 - the structure's own names, which the folds read
    smUtil: int  # noqa: N815
    memUtil: int  # noqa: N815


#: a `UtilSample` from a (pid, stamp, sm, mem) row, made in C (the class's own constructor is
#: Python, and it would run for every entry)
_util_sample = partial(tuple.__new__, UtilSample)


class ProcessSamples:
    """One answer of ``nvmlDeviceGetProcessUtilization`` as four columns of one
    length (pid, stamp on the steady clock, sm, mem: Python ints), as the driver's
    array is read.  Iterated, it gives `UtilSample` rows, as any answer does; the
    folds read the columns instead where every entry can be taken at once (a pass
    of C over each column, not a Python step per entry), and go entry by entry
    where some cannot (stale, above 100 %, or listed twice)."""

    __slots__ = ("pids", "stamps", "sm", "mem", "_clean", "_unique", "_fresh")

    def __init__(self, pids: list[int], stamps: list[int], sm: list[int], mem: list[int]) -> None:
        self.pids, self.stamps, self.sm, self.mem = pids, stamps, sm, mem
        #: (since, whether every entry is newer than it and within 0..100), of the last asked
        self._clean: tuple[int, bool] | None = None
        self._unique: bool | None = None
        self._fresh: tuple[int, tuple[dict[tuple[int, int], tuple[int, int]], int]] | None = None

    def __len__(self) -> int:
        return len(self.pids)

    def __iter__(self) -> Iterator[UtilSample]:
        return map(_util_sample, zip(self.pids, self.stamps, self.sm, self.mem))

    def __repr__(self) -> str:
        return f"ProcessSamples({list(self)!r})"

    def clean(self, since: int) -> bool:
        """Whether every entry is newer than `since` and within 0..100 (none: False)."""
        known = self._clean
        if known is not None and known[0] == since:
            return known[1]
        sm, mem = self.sm, self.mem
        found = bool(self.stamps) and min(self.stamps) > since and (
            0 <= min(sm) and max(sm) <= 100 and 0 <= min(mem) and max(mem) <= 100
        )
        self._clean = (since, found)
        return found

    def pids_unique(self) -> bool:
        """Whether no pid is listed twice."""
        if self._unique is None:
            self._unique = len(set(self.pids)) == len(self.pids)
        return self._unique

    def newest(self) -> int:
        return max(self.stamps)

    def fresh(self, since: int) -> tuple[dict[tuple[int, int], tuple[int, int]], int]:
        """`_fresh` of these samples (kept for the next fold that asks with the same
        `since`: the folds read what it gives, and change none of it)."""
        known = self._fresh
        if known is not None and known[0] == since:
            return known[1]
        found = None
        if self.clean(since):
            keys = list(zip(self.pids, self.stamps))
            latest = dict(zip(keys, zip(self.sm, self.mem)))
            if len(latest) == len(keys):  # no pid and timestamp twice
                found = latest, self.newest()
        if found is None:
            found = _fresh_rows(self, since)
        self._fresh = (since, found)
        return found


#: an answer of the process samples call: its columns, or its entries
Answer: TypeAlias = "ProcessSamples | list[UtilSample]"


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
    #: per-period process samples not yet shown, by stamp, when they are stamped
    #: as the device's samples are: then they are shown over the device's windows
    pending: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    #: whether process samples carry the device samples' stamps (None: not known
    #: yet), and the stamps it is being decided on
    same_stamps: bool | None = None
    stamps_seen: set[int] = field(default_factory=set)
    #: periods counted for processes ahead of the device's samples (a period
    #: that ended between the two calls of a poll), taken off the next poll
    credit: int = 0
    #: recent gaps between one pid's consecutive samples (per-period drivers)
    gaps: deque[int] = field(default_factory=lambda: deque(maxlen=GAP_WINDOW))
    #: the figures of the last poll that brought samples, by pid
    figures: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: the reader's time of the previous poll, µs
    polled_us: int | None = None

    def busy(
        self,
        gpu: SampleStream | None,
        fetch: Callable[[int], Answer],
        probe: Callable[[int], Answer],
        *,
        now_us: int,
        periods: int | None,
        busy: int | None,
        samples_failed: bool,
    ) -> dict[int, tuple[int, int]] | None:
        """Per-pid busy percentages of this poll, from the samples newer than `since`.

        `gpu` is the device's own GPU sample stream; `fetch(since)` reads the process
        samples of this poll (on the steady clock), `probe(since)` reads them again to
        learn the driver's way (`learn_mode`); `periods` is how many GPU samples the
        poll brought and `busy` its GPU figure (None: not known); `samples_failed`,
        whether the device's own samples call failed in this poll.  ``None``: not
        asked in this poll.

        A poll that brings no new process sample while the device's own buffer had
        no new period either, yet the GPU is busy, carries the last figures on: the
        next sample is not due yet, which is not idleness.
        """
        if (
            samples_failed and self.mode != PER_CALL and self.same_stamps is not False
            and gpu is not None and gpu.recent
        ):
            # the device's own samples failed: no window of the device's in this poll, which
            # process samples on its stamps are shown over.  Not asked now, the processes count
            # no sample in this poll, as the device does not; the next poll's window and
            # process samples cover this poll's time too.  (Where the device has never had a
            # sample, no buffer or none yet, its processes are counted by time, on no window of
            # the device's: read as in any poll, lest a long spell outlast the driver's buffer
            # of process samples and its lost time be counted as idle.)
            return None
        since = self.since
        if self.mode == PER_CALL and since and gpu is not None and abs(gpu.before - since) < SAME_CLOCK_US:
            # a driver that averages over the window asked for: ask for this poll's,
            # from the device's newest sample of the previous poll, on the same clock
            # (polls that listed nobody would leave `since` behind)
            since = max(since, gpu.before)
        elapsed = None if self.polled_us is None else now_us - self.polled_us
        self.polled_us = now_us
        samples = fetch(since)
        # (periods of this poll counted in the last one, and those left to count)
        credited, counted = 0, None
        if samples:
            self.learn_mode(samples, probe)
        if self.mode == PER_CALL:
            figures, newest = latest_process_figures(samples, since)
        elif since and gpu is not None and self._on_device_stamps(gpu, samples, since):
            # stamped as the device's samples: shown over the device's own windows
            newest = max([since, *self.pending])
            if gpu.shown:
                self.figures = windowed_process_figures(self.pending, gpu.shown, {
                    pid for stamp in self.pending for pid in self.pending[stamp]
                })
                end = gpu.window_end or 0  # set whenever figures are shown
                self.pending = {stamp: found for stamp, found in self.pending.items() if stamp > end}
            self.previous_since, self.since = since, newest
            self.listed = set(self.figures)
            return self.figures
        else:
            learnt = self.learn_period(samples, since)
            period = (gpu.period_us if gpu else None) or learnt
            counted = periods
            if gpu is not None and gpu.before == 0 and since:
                # the device's first samples (after its calls failed): their periods are of the
                # buffer's past, not of this poll's process samples, which are counted by time
                counted = None
            if counted is not None and since:
                # a skipped sample is a period nobody knows of: not an idle one
                known = max(0, counted - (gpu.skipped if gpu else 0))
                credited = min(known, self.credit)
                counted = known - credited
                self.credit = max(0, samples_per_pid(samples, since) - counted)
            figures, newest = fold_process_samples(samples, since, counted or None, period, elapsed)
            if not since and gpu is not None:
                # the first read: what comes after the device's window of this poll is shown in the next
                # (if these samples turn out to carry the device's stamps)
                for (pid, stamp), found in fresh_process_samples(samples, gpu.window_end or gpu.since).items():
                    self.pending.setdefault(stamp, {})[pid] = found
                    self.stamps_seen.add(stamp)  # (which tell whether they do)
                if period and abs(newest - gpu.since) < SAME_CLOCK_US:
                    # periods that ended between the device's call and this one
                    self.credit = max(0, round((newest - gpu.since) / period))
        if newest <= since:
            if periods == 0 and busy:
                return self.figures  # no new period yet: the load goes on
            if credited and not counted:
                # every period of this poll was listed in the last one (it ended between that
                # poll's two calls) and shown in its figure, an average over the periods listed:
                # that figure is this poll's too (not 0: a poll's busy lost, when a late call
                # straddled a period's end)
                return self.figures
            self.figures = {}
            return {}
        self.previous_since, self.since = since, newest
        self.figures = figures
        self.listed = set(figures)
        return figures

    def _on_device_stamps(self, gpu: SampleStream, samples: Answer, since: int) -> bool:
        """Whether the driver stamps its process samples as its device samples
        (decided on the first few, then kept); the samples are kept by stamp
        until the device's windows have shown them."""
        if self.same_stamps is False or not gpu.recent:
            return False  # (a device whose own samples never came, so far: nothing to tell by)
        for (pid, stamp), figures in fresh_process_samples(samples, since).items():
            self.pending.setdefault(stamp, {})[pid] = figures
            if self.same_stamps is None:
                self.stamps_seen.add(stamp)
        if self.same_stamps is None and len(self.stamps_seen) >= 3:
            # (most, not all: a device sample not answered yet, after a step back inside its call)
            self.same_stamps = 2 * len(self.stamps_seen - set(gpu.recent)) < len(self.stamps_seen)
            self.stamps_seen = set()  # decided: kept no longer
            if not self.same_stamps:
                self.pending = {}  # on a clock of their own: never shown over the device's windows
        return bool(self.same_stamps)

    def learn_mode(self, samples: Answer, probe: Callable[[int], Answer]) -> None:
        """Which way the driver reports process utilization (`mode`).

        The first answer that lists a process decides for now, asked with 0 (the
        whole buffer, read by `probe`): a pid at two timestamps means periods,
        else calls.  "Calls" is then put to the test once a pid is listed in two
        polls running: asked for both polls' window, a driver that lists periods
        lists that pid twice.
        """
        if self.mode == PER_PERIOD:
            return  # settled for good: nothing below would change it
        since = self.since
        if self.mode is None:
            found = samples if since == 0 else probe(0)
            self.mode = PER_PERIOD if lists_busy_periods(found) else PER_CALL
            self.settled = self.mode == PER_PERIOD
        elif lists_busy_periods(samples, since):
            self.mode, self.settled = PER_PERIOD, True
        elif not self.settled and self.listed & {s.pid for s in samples if s.timeStamp > since}:
            found = probe(self.previous_since)
            self.mode = PER_PERIOD if lists_busy_periods(found, self.previous_since) else PER_CALL
            self.settled = True

    def learn_period(self, samples: Iterable[Any], since: int) -> int | None:
        """The driver's sample period as the process samples show it (`period_from_gaps`)."""
        by_pid: dict[int, set[int]] = {}
        for sample in samples:
            stamp = int(sample.timeStamp)
            if stamp > since:
                by_pid.setdefault(int(sample.pid), set()).add(stamp)
        for stamps in by_pid.values():
            ordered = sorted(stamps)
            self.gaps.extend(b - a for a, b in zip(ordered, ordered[1:]))
        return period_from_gaps(self.gaps) if self.gaps else None


PER_PERIOD = "per-period"
PER_CALL = "per-call"
#: process and device samples stamped this close are on one clock
SAME_CLOCK_US = 5_000_000
#: polls whose lags the driver's clock offset is learnt from
LAG_WINDOW = 16
#: recent gaps the sample period is learnt from
GAP_WINDOW = 64
