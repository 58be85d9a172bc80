"""Signals a daemon is sent: SIGHUP, SIGUSR1, SIGUSR2, and SIGTERM twice.

The reactor handles SIGTERM and SIGINT; SIGHUP, SIGUSR1 and SIGUSR2 keep their
default action, to die at once (no socket file removed, no lock released, NVML not
shut down), and a second SIGTERM before the reactor stopped logs a ReactorNotRunning
traceback.  ``SignalService`` installs as it starts (the listeners may already take
clients), and wraps SIGTERM and SIGINT once the reactor runs:

- SIGHUP: the log file reopened when twistd logs to one (after logrotate moved it),
  and each of `hangup_hooks` called (``--web-config`` re-read); else logged;
- SIGUSR1: twistd's own handler where it logs to a file (rotation); else logged;
- SIGUSR2: logged and ignored;
- SIGTERM, SIGINT: the reactor's handler, once; a repeat is logged and ignored.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any, Callable

from twisted.application.service import Service
from twisted.python import logfile

from atopgpud_tw.lognames import ClassLogger

Handler = Callable[[int, "FrameType | None"], Any]


def twistd_log_file() -> logfile.BaseLogFile | None:
    """The log file twistd writes to, found through the SIGUSR1 handler it installs
    for it (twistd keeps no other reference to it); None when it logs elsewhere."""
    rotate = signal.getsignal(signal.SIGUSR1)
    for cell in getattr(rotate, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, logfile.BaseLogFile):
            return value
    return None


class SignalService(Service):
    """Installs the handlers above once the reactor runs; puts back the old ones at stop."""

    log = ClassLogger("atopgpud_tw.signals.SignalService")

    def __init__(self, reactor: Any) -> None:
        self.reactor = reactor
        self.previous: dict[int, Any] = {}
        self.stopping = False
        #: called on SIGHUP, in the reactor's thread
        self.hangup_hooks: list[Callable[[], None]] = []

    def startService(self) -> None:
        super().startService()
        self.install()
        self.reactor.callWhenRunning(self.wrap_stops)

    def install(self) -> None:
        log_file = twistd_log_file()
        handlers: dict[int, Handler] = {
            signal.SIGHUP: self._in_reactor(self.hangup, log_file),
            signal.SIGUSR2: self._in_reactor(self.ignored, "SIGUSR2"),
        }
        if log_file is None:
            handlers[signal.SIGUSR1] = self._in_reactor(self.ignored, "SIGUSR1")
        for number, handler in handlers.items():
            self.previous[number] = signal.signal(number, handler)

    def wrap_stops(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            current = signal.getsignal(signum)
            if callable(current) and current is not signal.default_int_handler:
                self.previous[signum] = signal.signal(signum, self._once(signum, current))

    def stopService(self) -> None:
        super().stopService()
        # SIGTERM and SIGINT stay wrapped until the process ends: a repeat may come late.
        for signum in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            if signum in self.previous:
                signal.signal(signum, signal.SIG_IGN)

    def _in_reactor(self, action: Callable[..., None], *args: Any) -> Handler:
        def handler(signum: int, frame: FrameType | None) -> None:
            self.reactor.callFromThread(action, *args)

        return handler

    def _once(self, signum: int, original: Handler) -> Handler:
        name = signal.Signals(signum).name

        def handler(number: int, frame: FrameType | None) -> None:
            if self.stopping:
                self.reactor.callFromThread(self.log.info, "{signal} again: already shutting down", signal=name)
                return
            self.stopping = True
            original(number, frame)

        return handler

    def hangup(self, log_file: logfile.BaseLogFile | None) -> None:
        for hook in self.hangup_hooks:
            hook()
        if log_file is not None:
            log_file.reopen()
            self.log.info("SIGHUP: log file {path} reopened", path=log_file.path)
        elif not self.hangup_hooks:
            self.log.info("SIGHUP: ignored (no log file to reopen)")

    def ignored(self, name: str) -> None:
        self.log.info("{signal}: ignored", signal=name)
