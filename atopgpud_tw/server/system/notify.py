"""Telling systemd the truth (``Type=notify``): ready, what the daemon serves, stopping.

To the datagram socket of ``NOTIFY_SOCKET`` (without it nothing is sent or
scheduled): ``READY=1`` once the reactor runs (the reader is open and every
listener listens by then, or start-up failed), a ``STATUS=`` line for ``systemctl
status`` whenever it changes, and ``STOPPING=1`` at shutdown.  A reader that waits
for its driver (not loaded yet at boot) holds ``READY=1`` back, saying so in the
status, until it has its GPUs or `ready_within` seconds passed: units ordered after
this one (atop asks for the GPUs once, when it starts) start once they are known.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, MutableMapping

from twisted.application.service import Service
from twisted.internet.task import LoopingCall

from atopgpud_tw.lognames import ClassLogger

#: how often the status line is looked at (it is sent only when it changed)
STATUS_EVERY = 5.0
#: how often, while READY=1 is held for the reader (a driver not loaded yet), it is looked at
READY_CHECK = 0.5
#: seconds READY=1 is held at most for a reader that waits for its driver (--driver-wait)
DRIVER_WAIT = 60.0


class Notifier:
    log = ClassLogger("atopgpud_tw.notify.Notifier")

    def __init__(self, environ: MutableMapping[str, str] = os.environ) -> None:
        # taken out of the environment so that no child (nvidia-smi) speaks for the daemon
        path = environ.pop("NOTIFY_SOCKET", "")
        self.address = "\0" + path[1:] if path.startswith("@") else path
        self._failed = False

    @property
    def active(self) -> bool:
        return bool(self.address)

    def send(self, **fields: str) -> None:
        """One message, e.g. ``send(READY="1", STATUS="...")``."""
        if not self.address:
            return
        message = "\n".join(f"{key}={value}" for key, value in fields.items()).encode("utf-8", "replace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self.address)
        except OSError as error:
            if not self._failed:  # once: systemd gone away is not worth a line per status
                self._failed = True
                self.log.warn("cannot tell systemd ({address}): {error}", address=self.address, error=error)


class NotifyService(Service):
    """READY=1 and the first status when the reactor runs (or once the reader stops
    waiting for its driver); STOPPING=1 at stop."""

    log = ClassLogger("atopgpud_tw.notify.NotifyService")

    def __init__(
        self,
        notifier: Notifier,
        status: Callable[[], str],
        clock: Any,
        waiting: Callable[[], str | None] = lambda: None,
        ready_within: float = DRIVER_WAIT,
    ) -> None:
        self.notifier = notifier
        self.status = status
        self.clock = clock
        self.waiting = waiting
        self.ready_within = ready_within
        self.ready = False
        self._sent: str | None = None
        self._loop: LoopingCall | None = None
        self._began = 0.0

    def startService(self) -> None:
        super().startService()
        if self.notifier.active:
            self.clock.callWhenRunning(self._ready)

    def _ready(self) -> None:
        if not self.running:
            return
        if self.waiting() is None:
            self._say_ready()
            return
        self._began = self.clock.seconds()
        self.refresh()
        self._repeat(self._until_ready, READY_CHECK)

    def _until_ready(self) -> None:
        waiting = self.waiting()
        if waiting is None:
            self._say_ready()
        elif self.clock.seconds() - self._began >= self.ready_within:
            self.log.warn(
                "ready without GPUs: still {waiting} after {within:g} s (--driver-wait); an atop that "
                "starts before the driver is loaded shows no GPU until it is restarted",
                waiting=waiting, within=self.ready_within,
            )
            self._say_ready()
        else:
            self.refresh()

    def _say_ready(self) -> None:
        self.ready = True
        self._sent = self.status()
        self.notifier.send(READY="1", STATUS=self._sent)
        self._repeat(self.refresh, STATUS_EVERY)

    def _repeat(self, function: Callable[[], None], every: float) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = LoopingCall(function)
        self._loop.clock = self.clock
        self._loop.start(every, now=False)

    def refresh(self) -> None:
        status = self.status()
        if status != self._sent:
            self._sent = status
            self.notifier.send(STATUS=status)

    def stopService(self) -> None:
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        self.notifier.send(STOPPING="1", STATUS="stopping")
