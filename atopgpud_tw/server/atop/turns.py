"""Taking turns: every connection's queued requests served one at a time, round-robin.

A connection's first request is answered as it arrives (a client that asks and
waits, as atop does, never waits for a turn); the requests it sent beyond that
one wait in its buffer, and `Turns` serves them one per connection in turn,
through a `twisted.internet.task.Cooperator` that gives the reactor back after
each time slice.  So a client flooding requests gets one reply per turn, and
every other client's request is answered before its next one.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Protocol

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import Cooperator, SchedulerStopped
from twisted.python.failure import Failure


class Server(Protocol):
    """A connection with requests to serve."""

    def serve_one(self) -> bool:
        """Answer one queued request; whether another is queued after it."""


class Turns:
    """The connections waiting for a turn, and the cooperative task that serves them."""

    def __init__(self, clock: IReactorTime) -> None:
        self._waiting: deque[Server] = deque()
        self._queued: set[Server] = set()
        self._cooperator = Cooperator(scheduler=lambda step: clock.callLater(0, step))
        self._running = False

    def waiting(self, server: Server) -> bool:
        """Whether `server` is queued for a turn already."""
        return server in self._queued

    def queue(self, server: Server) -> None:
        """Give `server` a turn after those already waiting."""
        if server in self._queued:
            return
        self._queued.add(server)
        self._waiting.append(server)
        if not self._running:
            self._running = True
            self._cooperator.cooperate(self._serve()).whenDone().addErrback(self._stopped)

    def forget(self, server: Server) -> None:
        """A connection that closed takes no more turns."""
        if server in self._queued:
            self._queued.discard(server)
            self._waiting.remove(server)

    def stop(self) -> None:
        """Serve no more turns (the factory stops)."""
        self._cooperator.stop()

    def _serve(self) -> Iterator[None]:
        try:
            while self._waiting:
                server = self._waiting.popleft()
                if server.serve_one():
                    self._waiting.append(server)
                else:
                    self._queued.discard(server)
                yield None
        finally:
            self._running = False

    def _stopped(self, failure: Failure) -> None:
        failure.trap(SchedulerStopped)
        self._running = False
