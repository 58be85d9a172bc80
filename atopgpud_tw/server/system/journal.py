"""Log lines the systemd journal understands: each with its syslog priority, no timestamp of
their own, and ``--log-level``.

Where standard output is the journal's stream (systemd names it in ``JOURNAL_STREAM``,
``device:inode``, systemd.exec(5)), each line starts with sd-daemon(3)'s ``<N>`` prefix
(``SyslogLevelPrefix=`` is on by default), so ``journalctl -p warning`` and log shippers
keep the level, and carries no timestamp.  Elsewhere the lines are twistd's.  The
observer is twistd's ``logger`` (`install`), for ``atopgpud`` and ``twistd -n atopgpud`` alike.
"""

from __future__ import annotations

import os
import sys
from typing import IO, Any, Mapping, MutableMapping

from twisted.logger import (
    FilteringLogObserver,
    ILogObserver,
    LogEvent,
    LogLevel,
    LogLevelFilterPredicate,
    eventAsText,
    textFileLogObserver,
)
from zope.interface import implementer

#: syslog priorities (sd-daemon(3), syslog(3)) of Twisted's log levels
PRIORITIES = {LogLevel.debug: 7, LogLevel.info: 6, LogLevel.warn: 4, LogLevel.error: 3, LogLevel.critical: 2}
#: what ``--log-level`` takes, lowest first: Twisted's levels
LEVELS = tuple(level.name for level in LogLevel.iterconstants())
DEFAULT_LEVEL = "info"


def to_journal(stream: IO[Any] | None = None, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `stream` (standard output by default) is the journal's stream that systemd
    names in ``JOURNAL_STREAM`` (``device:inode``, both decimal)."""
    device, _, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        found = os.fstat((stream or sys.stdout).fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (found.st_dev, found.st_ino) == (int(device), int(inode))


@implementer(ILogObserver)
class JournalObserver:
    """Each event as ``<N>[namespace#level] text``, every line of it with the priority
    (a traceback's lines too: the journal takes each line as an entry of its own)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def __call__(self, event: LogEvent) -> None:
        text = eventAsText(event, includeTimestamp=False)
        if not text:
            return
        prefix = f"<{PRIORITIES.get(event.get('log_level', LogLevel.info), 6)}>"
        self.stream.write("".join(f"{prefix}{line}\n" for line in text.splitlines()))
        self.stream.flush()


def observer(journal: bool, level: str, stream: IO[str] | None = None) -> ILogObserver:
    """The daemon's log observer: the journal's form or twistd's text, events below `level` left out."""
    stream = stream or sys.stdout
    shown = JournalObserver(stream) if journal else textFileLogObserver(stream)
    if level == DEFAULT_LEVEL and not journal:
        return shown
    return FilteringLogObserver(shown, [LogLevelFilterPredicate(LogLevel.levelWithName(level))])


def install(twistd_options: MutableMapping[str, Any], level: str) -> str | None:
    """Give twistd (its `twistd_options`, the plugin's parent) the observer, where there is
    something to change: standard output is the journal's, or `level` is not the default.

    Returns why `level` cannot be had (twistd logs to a file or to syslog: give those
    their own levels), or None."""
    if twistd_options.get("logger"):
        return None  # twistd --logger: the caller's own observer
    elsewhere = twistd_options.get("syslog") or twistd_options.get("logfile") not in (None, "", "-") \
        or not twistd_options.get("nodaemon")
    journal = not elsewhere and to_journal()
    if not journal and level == DEFAULT_LEVEL:
        return None
    if elsewhere:
        return "--log-level is for a daemon that logs to standard output or the journal (atopgpud, twistd -n)"
    # twistd takes its logger by name (it imports it after the options are parsed), so the
    # choice waits here for it: one daemon a process
    _chosen[:] = [journal, level]
    twistd_options["logger"] = f"{__name__}.{twistd_observer.__name__}"
    return None


#: (journal, level) that `install` chose, for `twistd_observer`
_chosen: list[Any] = [False, DEFAULT_LEVEL]


def twistd_observer() -> ILogObserver:
    journal, level = _chosen
    return observer(journal, level)
