"""What is logged once, not at every poll or every event: the one home of that rule.

A trouble once when it starts and once when it ends (`ProblemLog`, over each
poll's `Problems`); a condition when it changes (`Latch`); a burst of events by
its first and, when it is over, a count of the rest (`BurstLog`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from twisted.internet.interfaces import IReactorTime

from atopgpud_tw.lognames import ClassLogger


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


class ProblemLog:
    """Tracks the set of current problems, each keyed by its cause.

    A reader or the poller reports, after every poll, the problems it has now
    (``{cause: description}``); a new cause is logged once as a warning, a cause
    that is no longer reported is logged once as recovered.
    """

    log = ClassLogger("atopgpud_tw.problems.ProblemLog")

    def __init__(self, subject: str) -> None:
        self.subject = subject
        self.active: dict[str, str] = {}

    def report(self, problems: Mapping[str, str]) -> None:
        """Log what started and what ended since the previous report."""
        for cause, text in problems.items():
            if cause not in self.active:
                self.log.warn("{subject}: {problem}", subject=self.subject, problem=text)
        for cause, text in self.active.items():
            if cause not in problems:
                self.log.info(
                    "{subject}: recovered ({problem})", subject=self.subject, problem=text
                )
        # a cause keeps the words it was first logged with, so its recovery names it
        self.active = {cause: self.active.get(cause, text) for cause, text in problems.items()}


class Problems(Mapping[str, str]):
    """The troubles found in one poll (or one reading), for `ProblemLog.report`.

    The contract between a reader and its log: each trouble is kept under a key
    that names its cause and stays the same from poll to poll while the trouble
    lasts: its subject first (a device or card key, a bus id, ``init``,
    ``preamble``), then what went wrong there (``lost``, ``mig-empty``, an NVML
    error's name, an element's path).  A key reported again is the same trouble,
    not logged again; a key no longer reported has recovered.  The text is what is
    logged; a trouble keeps the words it was first logged with, so that its
    recovery names it.  Of two texts under one key in one poll, the later stands.
    """

    def __init__(self) -> None:
        self._found: dict[str, str] = {}

    def add(self, key: str, text: str) -> None:
        """A trouble under `key`, described by `text`."""
        self._found[key] = text

    def setdefault(self, key: str, text: str) -> str:
        """A trouble under `key` unless one is there already (whose text stays)."""
        return self._found.setdefault(key, text)

    def update(self, other: Mapping[str, str]) -> None:
        """Every trouble of `other` (another part of the poll) added."""
        self._found.update(other)

    def __getitem__(self, key: str) -> str:
        return self._found[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._found)

    def __len__(self) -> int:
        return len(self._found)

    def __repr__(self) -> str:
        return f"Problems({self._found!r})"


class BurstLog:
    """Logs the first of a burst of events, and a count when the burst is over.

    A flood of refused connections costs one line at its start and one at its end,
    however many there were.
    """

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

    def _over(self) -> None:
        self._call = None
        if self._more:
            self.log.warn("{count} more {what} in that burst", count=self._more, what=self._what)

    def stop(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None
