"""Log a trouble once when it starts and once when it ends, not at every poll."""

from __future__ import annotations

from typing import Mapping

from twisted.logger import Logger


class ProblemLog:
    """Tracks the set of current problems, each keyed by its cause.

    A reader or the poller reports, after every poll, the problems it has now
    (``{cause: description}``); a new cause is logged once as a warning, a cause
    that is no longer reported is logged once as recovered.
    """

    log = Logger()

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
