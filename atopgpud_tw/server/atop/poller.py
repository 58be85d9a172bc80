"""The poller: ask the reader for a Snapshot every interval and fold it in.

A `LoopingCall` on an injected clock that waits for each poll's Deferred, so polls
never overlap; a failing poll is logged once per cause (and its recovery once),
a cause that flaps damped as every such cause is (`problems.Damping`), and the loop
never stops.  A poll that runs past the next tick makes the loop skip ticks; each
poll is handed over with its time in the loop's ticks (so a poll after a skipped
tick covers two intervals), for the counters' time-weighted sums.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.application.service import Service
from twisted.internet.defer import Deferred, maybeDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import Damping, Latch, span_words
from atopgpud_tw.readers.base import IReader, PollError
from atopgpud_tw.server.atop.board import Board

#: polls in a row that read no GPU (every call failing, every GPU lost, none found) before
#: the daemon says it is not ready (/-/ready): one poll's fault that passes is not enough
UNREAD_POLLS = 3


class PollerService(Service):
    log = ClassLogger("atopgpud_tw.poller.PollerService")

    def __init__(self, reader: IReader, board: Board, interval: float, clock: IReactorTime) -> None:
        self.reader = reader
        self.board = board
        self.interval = interval
        self.clock = clock
        self.polls = 0
        self.failed_polls: dict[str, int] = {}
        #: polls in a row, up to the latest, that read no GPU, and the GPUs the latest had
        self.unread_polls = 0
        self._unread_gpus = 0
        #: the cause the latest poll failed with (None: it worked)
        self._failing = Latch()
        #: what of failing polls and their recoveries is said, for a cause that flaps
        self._damping = Damping()
        self._loop: LoopingCall | None = None
        self._ticks = 0
        #: what the reader waited for (the driver, at boot) at its latest poll or start-up
        self._waiting_for: Callable[[], str | None] = getattr(reader, "waiting_for", lambda: None)
        self.waiting = self._waiting_for()

    @property
    def failing(self) -> str | None:
        return self._failing.value

    @property
    def unread(self) -> str | None:
        """Why no GPU has been read in the last `UNREAD_POLLS` polls that worked; None when one was."""
        if self.unread_polls < UNREAD_POLLS:
            return None
        if not self._unread_gpus:
            return f"no GPU found in the last {self.unread_polls} polls"
        gpus = "the GPU" if self._unread_gpus == 1 else f"any of the {self._unread_gpus} GPUs"
        return f"could not read {gpus} in the last {self.unread_polls} polls"

    def status(self) -> str:
        """One line for ``systemctl status`` (notify.py): the reader, the GPUs, failing polls."""
        devices = self.board.counters.devices
        lost = sum(not device.present for device in devices)
        text = f"{self.reader.name}: {len(devices) - lost} GPU{'' if len(devices) - lost == 1 else 's'}"
        if lost:
            text += f", {lost} lost"
        if self.waiting is not None:
            text += f"; {self.waiting}"
        if self.failing is not None:
            text += f"; polls failing: {self.failing}"
        return text

    def startService(self) -> None:
        super().startService()
        self._loop = LoopingCall.withCount(self._tick)
        self._loop.clock = self.clock
        self._loop.start(self.interval, now=True).addErrback(self._loop_died)

    def stopService(self) -> Deferred:
        # Unlike TimerService, which this is otherwise, stopping does not wait for the
        # poll in flight: one stuck in the driver never ends; the reader's close is bounded.
        super().stopService()
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None
        return maybeDeferred(self.reader.close)

    def _tick(self, count: int) -> Deferred:
        # count: the intervals since the previous call, more than 1 after a slow poll
        self._ticks += count
        return self.poll_once(self._ticks * self.interval, (self._ticks - count) * self.interval)

    def poll_once(self, taken: float | None = None, since: float = 0.0) -> Deferred:
        """One poll, at `taken` (the previous at `since`); the returned Deferred never fails."""
        result = maybeDeferred(self.reader.poll)  # (a Deferred, as every reader's is, handed back as it is)
        result.addCallbacks(self._polled, self._failed, callbackArgs=(taken, since))
        return result

    def _polled(self, snapshot: Any, taken: float | None = None, since: float = 0.0) -> None:
        self.board.fold(snapshot, taken, since)
        self.polls += 1
        if any(device.read() for device in snapshot.devices):
            self.unread_polls = 0
        else:
            self.unread_polls += 1
            self._unread_gpus = len(snapshot.devices)
        self.waiting = self._waiting_for()
        failed_with = self._failing.value
        if failed_with is None and not self._damping.flaps:
            return  # worked, as the last did: no recovery to say, and nothing flaps: no count due
        now = self.clock.seconds()
        if self._failing.change(None) and self._damping.ended(failed_with, now):
            self.log.info("polls work again (they failed with {cause})", cause=failed_with)
        self._counts_due(now)

    def _failed(self, failure: Failure) -> None:
        cause = _cause(failure)
        self.failed_polls[cause] = self.failed_polls.get(cause, 0) + 1
        failed_with = self._failing.value
        now = self.clock.seconds()
        if self._failing.change(cause):
            if failed_with is not None:
                self._damping.ended(failed_with, now)  # another cause now: said as the new one's start
            start = self._damping.started(cause, cause, now)
            if start is not None:
                text = "poll failed: {cause}"
                fields: dict[str, Any] = {"cause": cause}
                if start.flapping:
                    text += (
                        " (again: {count} times in {span}; from now on counted, and said at most once every {every})"
                    )
                    fields.update(count=start.starts, span=span_words(start.span), every=span_words(start.every))
                if failure.check(PollError):
                    self.log.warn(text, **fields)
                else:
                    self.log.failure(text, failure, **fields)
        self._counts_due(now)

    def _counts_due(self, now: float) -> None:
        failing = () if self._failing.value is None else (self._failing.value,)
        for count in self._damping.windows_over(now, failing):
            emit = self.log.warn if count.failing else self.log.info
            emit(
                "poll failed: {cause}: {failed} more failures and {recovered} recoveries in the last {span}, "
                "not logged one by one; {state} now; counted again for {every}",
                cause=count.cause, failed=count.failed, recovered=count.recovered, span=span_words(count.span),
                state="failing" if count.failing else "working", every=span_words(count.every),
                held=count.failed + count.recovered,
            )

    def _loop_died(self, failure: Failure) -> None:
        # poll_once never fails, so this is a bug; say so rather than go quiet
        self.log.failure("the poll loop stopped", failure)


def _cause(failure: Failure) -> str:
    """A key for "the same failure again": the exception type and its first line."""
    message = failure.getErrorMessage().splitlines()[0] if failure.getErrorMessage() else ""
    return f"{failure.type.__name__}: {message}"[:200]
