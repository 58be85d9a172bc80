"""What is logged once, not at every poll or every event, the one home of that rule: a trouble when it
starts and ends (`ProblemLog`), damped when it keeps coming back (`Damping`); a condition when it changes
(`Latch`); a burst of events by its first and a count (`BurstLog`, `UidBurstLogs`).  Texts shown as data."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Container, Mapping, NamedTuple

from twisted.internet.interfaces import IReactorTime

from atopgpud_tw.codec.text import printable
from atopgpud_tw.lognames import ClassLogger

#: the starts of a cause that are logged one by one, each with its recovery
SAID_STARTS = 2
#: then the seconds a cause goes without a line, one window after another (the last repeats)
DAMPING = (60.0, 600.0, 3600.0)
#: a cause that starts again this long after its last change is a new trouble, not a flap
FLAP_MEMORY = 3600.0


class Latch:
    """One condition that is logged when it changes, not while it holds (a poll
    failing and its cause, replies cut or not): `change` says whether it did."""

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def change(self, value: Any) -> bool:
        """Whether `value` differs from the condition's last one (which it becomes)."""
        if value == self.value:
            return False
        self.value = value
        return True


def span_words(seconds: float) -> str:
    """A length of time in words: ``45 s``, ``10 min``, ``1 h``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{round(seconds / 60, 1):g} min"
    return f"{round(seconds / 3600, 1):g} h"


@dataclass(slots=True)
class _Flaps:
    """One cause's recent history: how often it started, and what is held back."""

    #: the words it was first logged with, when, and its last start or recovery
    text: str
    first: float
    changed: float
    starts: int = 0
    #: while damped: the end of the window in which nothing of it is logged
    until: float | None = None
    step: int = 0
    held_starts: int = 0
    held_ends: int = 0


class Start(NamedTuple):
    """A start to be said (`Damping.started`); `flapping`: the one after `SAID_STARTS`, said with
    its `starts` in `span` seconds and that it is now counted, a line every `every` seconds."""

    flapping: bool
    starts: int = 0
    span: float = 0.0
    every: float = 0.0


class Count(NamedTuple):
    """A damped cause's window that is over (`Damping.windows_over`): what was held back in it."""

    cause: str
    #: the words the cause was first said with
    text: str
    failed: int
    recovered: int
    #: the window's length in seconds, and the next window's
    span: float
    every: float
    failing: bool


class Damping:
    """Which starts and ends of causes that come and go are said, and the counts said in their place
    (docs/reliability.md, "A fault that keeps coming back")."""

    def __init__(self) -> None:
        #: the causes remembered (while it is empty, `windows_over` has nothing to end or forget)
        self.flaps: dict[str, _Flaps] = {}

    def started(self, cause: str, text: str, now: float) -> Start | None:
        """A cause starts (`text`: its words): how to say it, or None while it is damped."""
        flaps = self.flaps.get(cause)
        if flaps is None or (flaps.until is None and now - flaps.changed >= FLAP_MEMORY):
            flaps = self.flaps[cause] = _Flaps(text, now, now)
        flaps.changed = now
        if flaps.until is not None:
            flaps.held_starts += 1
            return None
        if not flaps.starts:
            flaps.text, flaps.first = text, now
        flaps.starts += 1
        if flaps.starts <= SAID_STARTS:
            return Start(False)
        flaps.step, flaps.until = 0, now + DAMPING[0]
        return Start(True, flaps.starts, now - flaps.first, DAMPING[0])

    def ended(self, cause: str, now: float) -> bool:
        """A cause ends: whether to say so (not while it is damped)."""
        flaps = self.flaps.get(cause)
        if flaps is not None:
            flaps.changed = now
            if flaps.until is not None:
                flaps.held_ends += 1
                return False
        return True

    def windows_over(self, now: float, active: Container[str]) -> list[Count]:
        """The count of each damped cause whose window is over and held something back (`active`:
        the causes failing now)."""
        counts = []
        for cause, flaps in list(self.flaps.items()):
            if flaps.until is None:
                if cause not in active and now - flaps.changed >= FLAP_MEMORY:
                    del self.flaps[cause]  # long recovered: forgotten
                continue
            if now < flaps.until:
                continue
            began = flaps.until - DAMPING[flaps.step]
            if not flaps.held_starts and not flaps.held_ends:
                # quiet for a whole window: the last line said is still true; an hour of it ends the damping
                if now - flaps.changed >= FLAP_MEMORY:
                    flaps.until, flaps.starts = None, 0
                else:
                    flaps.until = now + DAMPING[flaps.step]
                continue
            flaps.step = min(flaps.step + 1, len(DAMPING) - 1)
            counts.append(
                Count(cause, flaps.text, flaps.held_starts, flaps.held_ends, now - began, DAMPING[flaps.step],
                      cause in active)
            )
            flaps.until = now + DAMPING[flaps.step]
            flaps.held_starts = flaps.held_ends = 0
        return counts


class ProblemLog:
    """The current problems (``{cause: description}``), reported after every poll: a new cause logged
    once as a warning, one no longer reported once as recovered, one that comes and goes damped."""

    log = ClassLogger("atopgpud_tw.problems.ProblemLog")

    def __init__(self, subject: str, clock: Callable[[], float] | None = None) -> None:
        self.subject = subject
        self.active: dict[str, str] = {}
        #: the seconds the windows are measured in; a monotonic clock where none is given
        self.clock = time.monotonic if clock is None else clock
        self._damping = Damping()

    def report(self, problems: Mapping[str, str]) -> None:
        """Log what started and what ended since the previous report, and the counts of windows now over."""
        if not self._damping.flaps and problems.keys() == self.active.keys():
            # the same causes as last time (at most polls: none): nothing starts, nothing
            # ends, no window is open to end; one comparison instead of the walk below
            return
        now = self.clock()
        for cause, text in problems.items():
            if cause not in self.active:
                self._started(cause, text, now)
        for cause, text in self.active.items():
            if cause not in problems and self._damping.ended(cause, now):
                self.log.info("{subject}: recovered ({problem})", subject=printable(self.subject),
                              problem=printable(text))
        # a cause keeps the words it was first logged with, so its recovery names it
        self.active = {cause: self.active.get(cause, text) for cause, text in problems.items()}
        if not self._damping.flaps:
            return
        for count in self._damping.windows_over(now, self.active):
            emit = self.log.warn if count.failing else self.log.info
            emit(
                "{subject}: {problem}: {failed} more failures and {recovered} recoveries in the last {span}, "
                "not logged one by one; {state} now; counted again for {every}",
                subject=printable(self.subject), problem=printable(count.text), failed=count.failed,
                recovered=count.recovered, span=span_words(count.span),
                state="failing" if count.failing else "recovered", every=span_words(count.every),
                held=count.failed + count.recovered,
            )

    def _started(self, cause: str, text: str, now: float) -> None:
        start = self._damping.started(cause, text, now)
        if start is None:
            return
        subject, problem = printable(self.subject), printable(text)
        if not start.flapping:
            self.log.warn("{subject}: {problem}", subject=subject, problem=problem)
            return
        self.log.warn(
            "{subject}: {problem} (again: {count} times in {span}; from now on counted, "
            "and said at most once every {every})",
            subject=subject, problem=problem, count=start.starts, span=span_words(start.span),
            every=span_words(start.every),
        )


class Problems(dict[str, str]):
    """The troubles found in one poll, for `ProblemLog.report`: each under a key that names its
    cause and stays the same while it lasts, its subject first (a device key, a bus id,
    ``init``), then what went wrong (``lost``, an NVML error's name, an element's path).
    Each kind has its cause and action in `problem_kinds.KINDS`."""

    def add(self, key: str, text: str) -> None:
        self[key] = text


class BurstLog:
    """Logs the first of a burst of events (a flood of refused connections), and a count when it is over."""

    log = ClassLogger("atopgpud_tw.access.BurstLog")

    def __init__(self, clock: IReactorTime, quiet: float = 10.0) -> None:
        self.clock = clock
        self.quiet = quiet
        self.total = 0
        self._more = 0
        self._call: Any = None
        self._what = ""

    def event(self, first_line: Callable[[], None], what: str) -> None:
        """Count one event; `first_line` logs it if it starts a burst."""
        self.total += 1
        if self._call is not None and self._call.active():
            self._more += 1
            self._call.reset(self.quiet)
            return
        first_line()
        self._what = what
        self._more = 0
        self._call = self.clock.callLater(self.quiet, self._over)

    @property
    def active(self) -> bool:
        """Whether a burst is going on (its end not logged yet)."""
        return self._call is not None and self._call.active()

    def _over(self) -> None:
        self._call = None
        if self._more:
            self.log.warn("{count} more {what} in that burst", count=self._more, what=self._what)

    def stop(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None


class UidBurstLogs:
    """A `BurstLog` per uid, for at most `most` uids at once (a user with many subordinate
    uids cannot make a line each); the rest share one."""

    def __init__(self, clock: IReactorTime, quiet: float = 10.0, most: int = 32) -> None:
        self.clock = clock
        self.quiet = quiet
        self.most = most
        self._logs: dict[int | None, BurstLog] = {}
        self._others = BurstLog(clock, quiet)
        self._forgotten = 0

    def event(self, uid: int | None, first_line: Callable[[], None], what: str) -> None:
        """Count one event of `uid`; `first_line` logs it if it starts that uid's burst."""
        burst = self._logs.get(uid)
        if burst is None:
            if len(self._logs) >= self.most:
                for quiet_uid in [u for u, b in self._logs.items() if not b.active]:
                    self._forgotten += self._logs.pop(quiet_uid).total
            if len(self._logs) >= self.most:
                self._others.event(first_line, "events of other uids")
                return
            burst = self._logs[uid] = BurstLog(self.clock, self.quiet)
        burst.event(first_line, what)

    @property
    def total(self) -> int:
        return sum(b.total for b in self._logs.values()) + self._others.total + self._forgotten

    def stop(self) -> None:
        for burst in [*self._logs.values(), self._others]:
            burst.stop()
