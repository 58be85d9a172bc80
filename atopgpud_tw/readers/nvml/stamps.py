"""NVML's sample timestamps on a timeline that does not step.

The driver stamps its samples on a clock of its own: the host's wall clock
(CLOCK_REALTIME, in microseconds of the Unix epoch) on most drivers,
CLOCK_BOOTTIME on some.  Both step against the reader's monotonic clock: the
wall clock when it is set (chrony or ntpd at boot, ``date -s``, a virtual
machine restored), both of them across a suspend (CLOCK_MONOTONIC stops while
the host sleeps).  Samples already in the buffer keep the stamps they were
given, the new ones are stamped on the stepped clock, and the driver hands out
only samples stamped after the one it is asked with: after a step back, asking
with the newest stamp seen would hide every new sample until the clock caught
up again.

`StampMap`, one per device (its sample buffers and process samples share the
clock), puts every stamp the driver returns on a steady timeline, the driver's
clock with its steps taken out, and says what raw stamp to ask the driver with
for a steady one.  The sample streams (`samples.py`) see steady stamps only.

How a step is known: the reader watches the host's CLOCK_REALTIME and
CLOCK_BOOTTIME against CLOCK_MONOTONIC as every call that brings stamps begins
(`ask`) and as it ends (`steady`, given the call's end time); each device's
map takes in the looks the other devices' maps took too (`HostClocks`), so a
step their calls saw before this device's first look is known.  It
learns from the first samples which of them the driver's stamps follow (its
newest stamp within `FOLLOW_US` of that clock's now at a look before the call
ended; stamps near neither are given `LEARN_US` of answers before the driver
is taken to stamp on a clock of its own).  A change of that
clock's offset by more than `STEP_US` between two looks is a step; it ends one
segment of the driver's clock and begins the next.  A step found as a call
ends happened while it ran (a slow call, a loaded host): the new segment begins
as the call began, so its answer's stamps taken after the step are placed on
the new clock, not a step's length away.  A driver on a clock of
neither kind has no steps taken out (its stamps are used as they are).

Which segment a stamp belongs to:

- a stamp the driver returned before keeps the place it was given (`seen`,
  per kind of sample, pruned of the samples the buffer no longer holds), so a
  sample stamped before a step back and handed out again is not counted twice;
  the same stamp twice in one answer, after a step back of a whole number of
  sample periods, is the old sample and a new one, in that order; process
  samples are told apart by process too (`who`): a process listed at a stamp
  seen before without it is a new sample;
- a new stamp belongs to the newest segment in which it would have been taken
  while that segment held (between the call before its step, less `SLACK_US`,
  and the call after its end, or now, plus `AHEAD_US`): a sample taken before a step and first
  seen after it is neither dropped nor moved; a new sample stamped above the stamp the call
  before asked with was taken after that call began (else it would have been in its answer);
  a run of new samples stamped a period or two apart was taken on one clock, and goes to the
  newest segment that holds every one of them, or to none (a clock between two looks, of
  which a part fits a segment seen); where the step back was shorter
  than the time between the two calls, the buffer's order tells the side (a
  sample stamped above the one after it, by no more than the step, was taken
  before it), and process samples, listed by process, take the places of the
  device's samples of the same stamp; the first segment has no beginning, but a
  new sample listed after one seen before was taken after the last call of its
  kind that answered began (one that failed answered nothing);
- a new stamp of no segment was taken on a clock that held only between two
  looks (two steps or more between them): it goes between the samples before
  and after it, each run of such stamps on one clock its spacing kept; so do
  new samples placed on an older segment after a newer segment's that the
  buffer lists after them, where that one cannot be of theirs (two steps
  inside one call), or the newer segment's where they have no room, or where
  a sample seen before comes first (a step, then a shorter one, between two
  looks);
- the first answer tells a step back just before the first look: samples
  stamped ahead of the clock's now, before one stamped below them;
- no sample of the device's is placed ahead of the reader's now (a stream would
  wait that long for its next sample): one that would be is placed at now.

What to ask with: the raw stamp of a steady one from the current segment; for
a stamp from before the latest step, 0 (the whole buffer, whose samples the
map then places), so the driver is never asked for samples newer than a
stamp from before a step for more than one poll; and 0 for the call after one
in which a step was found (`stepped`): a step back hidden by a later step
forward left samples stamped below the stamp that call asked with.  No NVML here, and no clock
but the one handed in.
"""

from __future__ import annotations

import time
from bisect import bisect_left, bisect_right, insort
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

#: a change of the followed clock's offset from the monotonic clock beyond this is a step
STEP_US = 100_000
#: how long before its segment began a stamp may be, and still be of it (a sample written late)
SLACK_US = 250_000
#: how far after its segment ended (or after now) a stamp may be: a sample is stamped when
#: it is taken, so only the clocks' reading apart
AHEAD_US = 20_000
#: the driver's newest stamp this close to a host clock's now: its stamps follow that clock
FOLLOW_US = 10_000_000
#: answers whose stamps follow neither host clock for this long (reader's time): a driver on a
#: clock of its own (sooner, they were stamped before a step of the one they follow)
LEARN_US = 5_000_000
#: stamps remembered per kind of sample while a step is recent (a driver's buffer holds some 100 to 1000)
SEEN = 4096
#: answers remembered per kind of sample while no step is: the stamps seen before the next one
HISTORY = 256
#: a step this long ago (reader's time) no longer matters: every buffer has moved on
FORGET_US = 900_000_000
#: looks at the host clocks kept for the maps of other devices (`HostClocks`)
LOOKS = 64
#: the host clocks a driver's stamps may follow
REALTIME, BOOTTIME = 0, 1
HostOffsets = Callable[[], Sequence["int | None"]]


class HostClocks:
    """A `HostOffsets` with the looks every device's map took through it, (reader's time, the
    offsets): each map learns from them all, not from its own alone (steps another device's
    calls saw before this device's first look).  Two per run of looks that saw no step."""

    def __init__(self, read: HostOffsets) -> None:
        self.read = read
        self.looks: deque[tuple[int, Sequence[int | None]]] = deque(maxlen=LOOKS)

    def __call__(self) -> Sequence[int | None]:
        return self.read()

    def took(self, at: int, offsets: Sequence[int | None]) -> None:
        """Keep a look at the reader's time `at` (the latest of a run replaces the one before)."""
        looks = self.looks
        if len(looks) > 1 and _same(looks[-2][1], offsets) and _same(looks[-1][1], offsets):
            looks.pop()
        looks.append((at, offsets))


def _same(one: Sequence[int | None], other: Sequence[int | None]) -> bool:
    return all(a is None or b is None or abs(a - b) <= STEP_US for a, b in zip(one, other))


def _read_host_offsets() -> tuple[int, int | None]:
    """(CLOCK_REALTIME - CLOCK_MONOTONIC, CLOCK_BOOTTIME - CLOCK_MONOTONIC), µs; None for a
    clock that cannot be read (some LD_PRELOAD time shifters fail CLOCK_BOOTTIME)."""
    mono = time.monotonic_ns()
    real = time.time_ns()
    try:
        boot: int | None = (time.clock_gettime_ns(time.CLOCK_BOOTTIME) - mono) // 1000
    except OSError:
        boot = None
    return (real - mono) // 1000, boot


#: this host's clocks, as every reader on CLOCK_MONOTONIC looks at them
host_offsets = HostClocks(_read_host_offsets)


def _spacing(raws: Sequence[int]) -> int:
    """The least rise from one stamp to the next in the buffer's order (0: none): a sample period,
    or less where stamps jitter (`_one_run`)."""
    return min((b - a for a, b in zip(raws, raws[1:]) if b > a), default=0)


def _one_run(earlier: int, later: int, gap: int) -> bool:
    """Whether two stamps next to one another in the buffer are of one run on one clock: the later
    above the earlier by no more than two of the buffer's `gap` (`_spacing`)."""
    return 0 < later - earlier <= 2 * gap


@dataclass
class Segment:
    """A stretch of the driver's clock between two steps."""

    #: raw stamp - steady stamp, for the samples taken in it
    offset: int
    #: the followed host clock's offset from the reader's clock then, µs
    host: int
    #: the reader's time of the last call before it began (None: the first segment)
    began_us: int | None = None
    #: the reader's time of the first call after it ended (None: the current one)
    ended_us: int | None = None


@dataclass(eq=False)
class StampMap:
    """One device's driver clock: raw stamps to steady ones and back."""

    #: the host clocks' offsets from the reader's clock (None: steps are not looked for)
    host: HostOffsets | None = None
    #: the host clock the driver's stamps follow (None: not known yet; -1: neither)
    follows: int | None = None
    segments: list[Segment] = field(default_factory=lambda: [Segment(0, 0)])
    #: the reader's time of the latest look at the host clocks
    seen_at: int | None = None
    #: per kind, while a step is recent: raw stamp -> (steady stamp, its segment's index)
    seen: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    #: per kind, while none is: the latest answers' raw stamps and keys, with their offset and
    #: segment (made into `seen` when a step comes: one append per call until then)
    history: dict[str, deque[tuple[Sequence[int], Sequence[object] | None, int, int]]] = field(
        default_factory=dict)
    #: per kind listed by key (process samples, by pid), while a step is recent: raw stamp -> the
    #: keys listed at it when it was first seen (every sample of that stamp then)
    who: dict[str, dict[int, set[object]]] = field(default_factory=dict)
    #: per kind: steady stamp -> raw stamp
    raw: dict[str, dict[int, int]] = field(default_factory=dict)
    #: per kind, while a step is recent: the raw stamps of `seen`, in order
    ordered: dict[str, list[int]] = field(default_factory=dict)
    #: per segment index: the runs of stamps taken on clocks between it and the one before, never
    #: seen: (first raw stamp, last, the spacing, raw - steady) (`_between`)
    between: dict[int, list[tuple[int, int, int, int]]] = field(default_factory=dict)
    #: the kinds whose latest call ended with a step found: their next call asks for the whole buffer
    stepped: set[str] = field(default_factory=set)
    #: how many segments there have been (the index of the first of `segments`)
    dropped: int = 0
    #: the latest steps found: (reader's time, µs the driver's clock moved)
    steps: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=16))
    #: while what the driver follows is not known and answers matched no clock: (the reader's
    #: time of the first, the newest stamp of the latest less its time)
    _unmatched: tuple[int, int] | None = field(default=None, repr=False)
    #: the host clocks' offsets as last read (at `seen_at`)
    _offsets: Sequence[int | None] | None = field(default=None, repr=False)
    #: per kind: the reader's time its latest call began
    _calls: dict[str, int] = field(default_factory=dict, repr=False)
    #: per kind: the reader's time its latest answered call began, and the raw stamp it asked with
    _answered: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    @property
    def current(self) -> int:
        """The index of the current segment."""
        return self.dropped + len(self.segments) - 1

    def ask(self, kind: str, steady: int, now_us: int | None = None) -> int:
        """The raw stamp to ask the driver with for samples after `steady` (0: all), for
        a call made at the reader's time `now_us` (its steps are looked for first)."""
        if now_us is not None:
            self._observe(now_us, (), False)
            self._calls[kind] = now_us
        if steady == 0 or kind in self.stepped:
            self.stepped.discard(kind)
            return 0
        # (no step recent: nothing remembered by steady stamp)
        raws = self.raw.get(kind)
        raw = raws.get(steady) if raws else None
        if raw is not None:
            place = self.seen.get(kind, {}).get(raw)
            if place is not None and place[1] == self.current:
                return raw
            return 0  # from before a step: the whole buffer, which the map places
        if len(self.segments) > 1:
            return 0
        return steady + self.segments[-1].offset

    def set_back_during(self, began_us: int, ended_us: int) -> bool:
        """Whether the driver's clock was found set back as a call made from `began_us` to
        `ended_us` ended: its answer lacks the samples taken after the step (stamped below
        the stamp it was asked with), which the next call, asked with 0, brings."""
        return ended_us != began_us and any(at == ended_us and moved < 0 for at, moved in self.steps)

    def steady(self, kind: str, raws: Sequence[int], now_us: int, asked: int = 0,
               keys: Sequence[object] | None = None) -> list[int]:
        """The steady stamps of `raws` (in the driver's order), returned by a call
        that ended at the reader's time `now_us` and was asked with raw stamp `asked`
        (the host clocks are looked at again when `now_us` is not the time `ask` was
        given: a step between the two was inside the call)."""
        self._observe(now_us, raws, keys is None)
        began = self._calls.get(kind, now_us)
        before = self._answered.get(kind)
        self._answered[kind] = (began, asked)
        if self.steps and self.steps[-1][0] == now_us != began:
            # found as the call ended: its answer lacks any samples of a step back that a later step
            # forward hid (stamped below the one asked with), which the next call, asked with 0, brings
            self.stepped.add(kind)
        if self.follows is None or self.follows < 0:
            return list(raws)
        segments = self.segments
        if len(segments) == 1:
            offset = segments[0].offset
            if raws:
                answers = self.history.get(kind)
                if answers is None:
                    answers = self.history[kind] = deque(maxlen=HISTORY)
                answers.append((raws, keys, offset, self.current))
            return [raw - offset for raw in raws] if offset else list(raws)
        seen, back = self._memory(kind)
        ordered = self.ordered[kind]
        placed = self._placed(kind, raws, now_us, asked, keys, before)
        new = set() if keys is None else set(raws).difference(seen)
        for raw, place in zip(raws, placed):
            known = seen.get(raw)
            if known is None or keys is None and known != place:
                # new, or a new sample with an old one's stamp (the later; by key, `_placed` tells)
                if known is None:
                    insort(ordered, raw)
                seen[raw] = place
                back[place[0]] = raw
        for raw, key in zip(raws, keys or ()):
            if raw in new:
                self.who[kind].setdefault(raw, set()).add(key)
        while len(seen) > SEEN:
            oldest = next(iter(seen))
            self._forget(kind, oldest)
        return [steady for steady, _ in placed]

    def _forget(self, kind: str, raw: int) -> None:
        steady, _ = self.seen[kind].pop(raw)
        self.raw[kind].pop(steady, None)
        self.who[kind].pop(raw, None)
        ordered = self.ordered[kind]
        del ordered[bisect_left(ordered, raw)]

    def _memory(self, kind: str) -> tuple[dict[int, tuple[int, int]], dict[int, int]]:
        """`seen` and `raw` of `kind`, made from its answers of before the step the first time."""
        seen = self.seen.get(kind)
        if seen is None:
            seen = self.seen[kind] = {}
            back = self.raw[kind] = {}
            who = self.who[kind] = {}
            for raws, keys, offset, index in self.history.pop(kind, ()):
                for raw in raws:
                    if raw not in seen:
                        seen[raw] = (raw - offset, index)
                        back[raw - offset] = raw
                for raw, key in zip(raws, keys or ()):
                    who.setdefault(raw, set()).add(key)
            self.ordered[kind] = sorted(seen)  # (`steady` keeps no more than `SEEN`)
        return seen, self.raw[kind]

    def _placed(self, kind: str, raws: Sequence[int], now_us: int, asked: int,
                keys: Sequence[object] | None, before: tuple[int, int] | None) -> list[tuple[int, int]]:
        """(steady stamp, segment index) while a step is recent: seen stamps keep their
        place, new ones go to the newest segment they can have been taken in."""
        seen, ordered = self.seen[kind], self.ordered[kind]
        answer = set(raws)
        # the driver answers with every sample stamped after `asked` that it still holds:
        # one seen there and not in the answer is gone, and a stamp like it from now on is new
        gone = [raw for raw in ordered[bisect_right(ordered, asked):] if raw not in answer]
        if gone:
            # and the buffer is first in, first out: every sample taken before one gone is gone
            # too, though it was stamped below `asked`, or its stamp is listed again (after a
            # step back of a whole number of periods, a new sample's)
            newest = max((seen[raw][1], seen[raw][0]) for raw in gone)
            gone += [raw for raw, (steady, index) in seen.items()
                     if (index, steady) < newest and (raw <= asked or raw in answer)]
        for raw in gone:
            self._forget(kind, raw)
        counts: dict[tuple[object, int], int] = {}
        listed = Counter(zip(raws, keys)) if keys is not None else None
        out: list[tuple[int, int] | None] = []
        new = [False] * len(raws)
        # a sample the buffer lists after one seen before was taken after the kind's last answered call
        # began (else it would have been in its answer; a call that failed answered nothing): in the
        # first segment, no older
        after = None
        for position, raw in enumerate(raws):
            key = (None if keys is None else keys[position], raw)
            repeat = counts.get(key, 0)
            counts[key] = repeat + 1
            known = seen.get(raw)
            if known is not None and listed is not None and key[0] not in self.who[kind].get(raw, ()):
                known = None  # listed at a stamp seen before without it: a new sample with an old one's stamp
            older = listed is not None and listed[raw, key[0]] > repeat + 1  # (the same stamp again after it)
            if known is None and listed is not None and not older:
                # samples listed per process carry the stamps of the device's, which their order placed
                known = next((other[raw] for other in self.seen.values() if other is not seen and raw in other), None)
            if known is not None and repeat == 0:
                out.append(known)
                if keys is None:
                    after = None if before is None else before[0]
                continue
            lower = None if known else self._taken_after(raw, after, None if keys is not None else before)
            index = self._newest_plausible(raw, now_us, self.current - 1 if older else None, lower)
            out.append(None if index is None else self._in(raw, index))
            new[position] = index is not None
        if keys is None:
            self._whole_runs(raws, out, new, now_us, after, before)
            self._fallen(raws, out, new, now_us, after, before)
        lost = {position for position, place in enumerate(out) if place is None}
        if lost:
            self._between(raws, out, keys is None)
        if keys is None and any(new):
            self._in_order(raws, out, new, lost, now_us)  # type: ignore[arg-type]
        if keys is None:
            # never ahead of the reader's now (a stream would wait that long for its next sample): such a
            # place (a clock no look saw) is now.  (Process samples may be stamped on another clock than the
            # device's, as the simulator's `sample_clock` plays.)
            first = self.segments[0]
            limit = now_us + first.host - first.offset + AHEAD_US
            for position, place in enumerate(out):
                if place is not None and place[0] > limit:
                    out[position] = (limit, place[1])
        return out  # type: ignore[return-value]  # (every None placed by `_between`)

    def _whole_runs(self, raws: Sequence[int], out: list[tuple[int, int] | None], new: list[bool], now_us: int,
                    after: int | None, before: tuple[int, int] | None) -> None:
        """A run of new samples stamped a period or two apart, in the buffer's order, was taken on one
        clock: of the newest segment every one of them can have been taken in, or, where none holds
        them all (a clock between two looks, of which a part fits a stretch seen), of none."""
        gap = _spacing(raws)
        begin = 0
        while begin < len(raws):
            end = begin + 1
            if out[begin] is None or new[begin]:
                while (end < len(raws) and (out[end] is None or new[end])
                       and _one_run(raws[end - 1], raws[end], gap)):
                    end += 1
            indices = {place[1] if place else None for place in out[begin:end]}
            if end - begin > 1 and len(indices) > 1:
                first, last = raws[begin], raws[end - 1]
                lower = self._taken_after(first, after, before)
                index = next((index for index in range(self.current, self.dropped - 1, -1)
                              if self._fits(first, now_us, index, lower) and self._fits(last, now_us, index, lower)),
                             None)
                for position in range(begin, end):
                    out[position] = None if index is None else self._in(raws[position], index)
                    new[position] = index is not None
            begin = end

    @staticmethod
    def _taken_after(raw: int, after: int | None, before: tuple[int, int] | None) -> int | None:
        """The reader's time a new sample was taken after, where one is known: `after` (it follows a
        sample seen before in the answer), or as the call `before` began ((its time, the stamp it asked
        with)) where it is stamped above that stamp and yet was not in that call's answer."""
        if after is not None:
            return after
        return before[0] if before is not None and raw > before[1] else None

    def _fallen(self, raws: Sequence[int], out: list[tuple[int, int] | None], new: list[bool], now_us: int,
                after: int | None, previous: tuple[int, int] | None) -> None:
        """A buffer answers in the order its samples were taken: new samples stamped below the one
        before them in its segment, by more than every step back found that can lie between the two
        (the one before taken while the stretch that step ended held, no sooner than the last call
        that answered began where it is new: `after`, `previous`), were taken on a clock that held
        only between two looks (a step back, then one forward, inside one call), and so were the new
        ones after them on that clock (rising, in that segment, below where they fell from): of no
        segment, for `_between` to place."""
        top: tuple[int, int] | None = None  # (the stamp they fell from, its segment)
        for position in range(1, len(raws)):
            place, before, raw = out[position], out[position - 1], raws[position]
            if place is None or not new[position]:
                top = None
            elif top is not None and place[1] == top[1] and raws[position - 1] < raw < top[0]:
                out[position] = None
            elif (before is not None and before[1] == place[1] and raws[position - 1] - raw > AHEAD_US
                  and not self._fell_across(raws[position - 1], raw, now_us, new[position - 1],
                                            self._taken_after(raws[position - 1], after, previous))):
                top, out[position] = (raws[position - 1], place[1]), None
            else:
                top = None

    def _fell_across(self, earlier: int, later: int, now_us: int, new: bool, lower: int | None) -> bool:
        """Whether stamps that fall from `earlier` to `later`, from one sample to the next, can have
        fallen across a step back found: one of no less than the fall (a sample stamped late is no
        step), with the earlier sample, where `new`, taken while the segment that step ended held (no
        sooner than the reader's time `lower`, where one is known)."""
        return any(newer.offset - older.offset <= later - earlier + AHEAD_US
                   and (not new or self._fits(earlier, now_us, index, lower))
                   for index, (older, newer) in enumerate(zip(self.segments, self.segments[1:]), self.dropped))

    def _in(self, raw: int, index: int) -> tuple[int, int]:
        return raw - self.segments[index - self.dropped].offset, index

    def _in_order(self, raws: Sequence[int], out: list[tuple[int, int]], new: list[bool], lost: set[int],
                  now_us: int) -> None:
        """A buffer of samples answers in the order they were taken: a sample of a segment newer
        than the one after it, or stamped above it (taken before a step back between the two), is
        of an older segment, the newest it can have been taken in; a new one placed in a newer
        segment than the one before it, yet before it, is of that one's (a step shorter than the
        time between two looks leaves no other way to tell its side).  Samples of no segment
        (`lost`, placed by `_between` on clocks of no look) tell nothing, and are not moved."""
        limit = self.current
        for position in range(len(raws) - 1, -1, -1):
            if position + 1 < len(raws) and position + 1 not in lost:
                after = out[position + 1][1]
                back = self._stepped_back(raws[position] - raws[position + 1], after)
                limit = min(limit, after - 1 if back else after)
            if position not in lost and out[position][1] > limit >= self.dropped:
                index = self._newest_plausible(raws[position], now_us, limit)
                out[position] = self._in(raws[position], limit if index is None else index)
        gap = _spacing(raws)
        for position in range(1, len(raws)):
            (steady, index), (before, was) = out[position], out[position - 1]
            if not (new[position] and index > was and steady < before):
                continue
            moved = self._in(raws[position], was)
            if moved[0] - before <= 2 * gap and self._fits(raws[position], now_us, was):
                out[position] = moved
            elif position - 1 not in lost:
                # no: the new samples before it, placed after it (and those stamped in one run with
                # them), were stamped on a clock between two steps inside one call (the first shorter
                # than the call), and go between; where they have no room there (the sample before
                # them is less than their span and a period before it), or it follows one seen before,
                # it and the new samples of its run after it were (between two looks, a step, then a
                # shorter one)
                run, end = position - 1, position
                while run > 0 and new[run - 1] and out[run - 1][1] == was and (
                        out[run - 1][0] > steady or _one_run(raws[run - 1], raws[run], gap)):
                    run -= 1
                if not new[run] or run and steady - out[run - 1][0] < raws[position - 1] - raws[run] + gap:
                    run, end = position, position + 1
                    while (end < len(raws) and new[end] and out[end][1] == index
                           and _one_run(raws[end - 1], raws[end], gap)):
                        end += 1
                out[run:end] = [None] * (end - run)  # type: ignore[list-item]
                self._between(raws, out, True)  # type: ignore[arg-type]

    def _between(self, raws: Sequence[int], out: list[tuple[int, int] | None], ordered: bool) -> None:
        """Place the stamps taken in no segment seen: on clocks that held between two looks at
        the host clocks (two steps or more between them).  Each run of them stamped on one such
        clock (`ordered`: in the buffer's order) keeps its spacing, the runs follow one another a
        period apart, and together they go between the samples of the older segments and those of
        the current one in the answer, midway; one place for every kind of sample (their stamps
        match), after later steps too (a kind asked with a stamp above them gets them later)."""
        current = self.current
        runs = self.between.setdefault(current, [])
        lost = [raw for raw, place in zip(raws, out) if place is None and self._run_of(raw) is None]
        if lost:
            lost = list(dict.fromkeys(lost)) if ordered else sorted(set(lost))
            placed = [place for place in out if place is not None]
            before = max((steady for steady, index in placed if index < current), default=None)
            after = min((steady for steady, index in placed if index == current), default=None)
            stamps = sorted(steady for steady, _ in placed)
            # (the answer's period where the lost stamps are too few to show it: two alone, a clock apart, are two runs)
            gap = min((gap for gap in (_spacing(lost), _spacing(stamps)) if gap), default=0)
            # a run ends where the stamps fall, or leap (a step between them)
            ends = [at for at in range(1, len(lost)) if not _one_run(lost[at - 1], lost[at], gap)] + [len(lost)]
            chain = [lost[begin:end] for begin, end in zip([0, *ends], ends)]
            span = sum(run[-1] - run[0] for run in chain) + gap * (len(chain) - 1)
            if before is not None and after is not None:
                start = (before + after - span) // 2
            elif before is not None:
                start = before + gap
            else:
                start = lost[0] - self.segments[-1].offset if after is None else after - gap - span
            for run in chain:
                runs.append((run[0], run[-1], gap, run[0] - start))
                start += run[-1] - run[0] + gap
        for position, place in enumerate(out):
            if place is None:
                raw = raws[position]
                index, offset = self._run_of(raw)  # type: ignore[misc]  # (placed above, where not before)
                out[position] = (raw - offset, index)

    def _run_of(self, raw: int) -> tuple[int, int] | None:
        """The segment index and the offset (raw - steady) of the run of `_between` that `raw` is of, the
        newest first: a run placed before a later step, from another kind's answer, is theirs too."""
        for index in sorted(self.between, reverse=True):
            if index > self.dropped:
                for first, last, gap, offset in self.between[index]:
                    if first - gap <= raw <= last + gap:
                        return index - 1, offset
        return None

    def _set_back_before(self, raws: Sequence[int], now_us: int) -> None:
        """A step back before the first look at the host clocks, which the first answer shows:
        samples stamped ahead of the clock's now, before one stamped below them, were stamped
        before it (on a clock that no look saw, as far as the gaps between samples tell)."""
        current = self.segments[0]
        ahead = now_us + current.host + AHEAD_US
        fall = max(range(1, len(raws)), key=lambda at: raws[at - 1] - raws[at], default=0)
        if not fall or raws[fall - 1] <= max(ahead, raws[fall] + STEP_US):
            return
        ordered = sorted(raws)
        gaps = sorted(b - a for a, b in zip(ordered, ordered[1:]) if b > a)
        gap = gaps[len(gaps) // 2] if gaps else 0
        moved = raws[fall] - raws[fall - 1] - gap
        taken = raws[fall] - current.host  # the first sample after the step, on the reader's clock
        current.host -= moved
        current.ended_us = now_us
        self.segments.append(Segment(current.offset + moved, current.host + moved, taken - gap))
        self.steps.append((now_us, moved))

    def _stepped_back(self, descent: int, index: int) -> bool:
        """Whether stamps that fall by `descent` from one sample to the next, the later of segment
        `index`, fell across the step back that began it (no more than it: a sample stamped late
        is no step)."""
        if descent <= 0 or index <= self.dropped:
            return False
        step = self.segments[index - self.dropped].offset - self.segments[index - self.dropped - 1].offset
        return step < 0 and descent <= AHEAD_US - step

    def _newest_plausible(self, raw: int, now_us: int, newest: int | None = None,
                          after: int | None = None) -> int | None:
        """The index of the newest segment (up to `newest`) `raw` can have been taken in (None: none);
        in the first segment, taken no sooner than the reader's time `after`."""
        top = self.current if newest is None else newest
        return next((index for index in range(top, self.dropped - 1, -1) if self._fits(raw, now_us, index, after)),
                    None)

    def _fits(self, raw: int, now_us: int, index: int, after: int | None = None) -> bool:
        """Whether `raw` can have been taken while segment `index` held (the first: no sooner than `after`)."""
        segment = self.segments[index - self.dropped]
        taken = raw - segment.host  # when it was taken, by the reader's clock, were it of this segment
        began = after if segment.began_us is None else segment.began_us
        ended = now_us if segment.ended_us is None else segment.ended_us
        return (began is None or taken >= began - SLACK_US) and taken <= ended + AHEAD_US

    def _observe(self, now_us: int, raws: Sequence[int], ordered: bool) -> None:
        """Look at the host clocks: learn which one the driver follows, and find its steps
        (`ordered`: `raws` are in the order their samples were taken)."""
        if self.host is None:
            if self.follows is None:
                self.follows = -1
            return
        if self.follows is not None:
            if self.follows < 0:
                return  # a clock of the driver's own: nothing to look at
            if now_us == self.seen_at and self._offsets is not None:
                # looked at for this call already (its `ask`): the same readings would find
                # no step now (one found then began the segment they belong to)
                return
        earlier, looked_at = self._offsets, self.seen_at
        shared = self.host.looks if isinstance(self.host, HostClocks) else ()
        # the looks other devices' maps took since this one's last
        between = [look for look in shared if (looked_at or 0) < look[0] < now_us]
        if now_us != self.seen_at or self._offsets is None:
            self._offsets = self.host()  # once per call: `ask` and `steady` of one call share it
            if isinstance(self.host, HostClocks):
                self.host.took(now_us, self._offsets)
        offsets = self._offsets
        if self.follows is None:
            self.seen_at = now_us
            if not raws or (not ordered and self._unmatched is not None):
                # (the device's samples near no clock so far decide: process samples may be
                # stamped on another clock than theirs, as the simulator's `sample_clock` plays)
                return
            # learnt from the clocks as the call began (its `ask`) or as it ended: a step inside
            # the first call leaves its stamps on one of them; the segment is the first one's.
            # And from the looks before (every device's map's, its own among them): steps
            # other devices' calls saw before this one's first look
            own = [] if earlier is None or looked_at is None else [(looked_at, earlier)]
            looks = [*([look for look in shared if look[0] < now_us] or own), (now_us, offsets)]
            newest = raws[-1] if ordered else max(raws)
            follows = next((which for at, reading in looks for which, offset in enumerate(reading)
                            if offset is not None and abs(newest - (offset + at)) < FOLLOW_US), None)
            unmatched = self._unmatched
            if follows is None:
                # near no clock: a driver on one of its own, or a step just before the first
                # answer (its stamps on the clock as it read before): the next answers tell
                since = now_us if unmatched is None else unmatched[0]
                self._unmatched = (since, newest - now_us)
                if now_us - since > LEARN_US:
                    self.follows = -1
                return
            self.follows = follows
            self.seen_at, first = (own or looks)[0] if unmatched else looks[0]
            between = [] if unmatched else looks[1:-1]
            # the clock as the stamps before followed it: as the call began, or, where answers
            # before matched no clock, as far as their newest stamp tells (a lag of 0)
            start = first[follows]
            self.segments[0].host = unmatched[1] if unmatched else offsets[follows] or 0 if start is None else start
            if ordered and not unmatched:
                self._set_back_before(raws, now_us)
        for at, looked in [*between, (now_us, offsets)]:
            current = self.segments[-1]
            reading = looked[self.follows]
            moved = 0 if reading is None else reading - current.host  # unread this time: no step seen
            if abs(moved) > STEP_US:
                current.ended_us = at
                self.segments.append(Segment(current.offset + moved, current.host + moved, self.seen_at))
                self.steps.append((at, moved))
            self.seen_at = at
        while len(self.segments) > 1 and now_us - (self.segments[1].began_us or now_us) > FORGET_US:
            self.segments.pop(0)
            self.dropped += 1
            if len(self.segments) == 1:  # no step recent: back to remembering answers
                self.seen, self.raw, self.ordered, self.between, self.who = {}, {}, {}, {}, {}
