"""One daemon thread that runs blocking calls (NVML) in order, off the reactor.

Twisted's thread pool joins its threads at shutdown, so one NVML call stuck in
the driver (they are, at times, for good: docs/reliability.md) would keep the
daemon from stopping.  This worker's thread is a daemon thread: a stuck call pins
it, the reactor never waits for it, and the process can still exit.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorFromThreads
from twisted.python.failure import Failure

_STOP = object()


class SerialWorker:
    """Runs submitted callables one at a time in a daemon thread."""

    def __init__(self, reactor: IReactorFromThreads, name: str = "atopgpud-reader") -> None:
        self._reactor = reactor
        self._name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, function: Callable[..., Any], *args: Any) -> Deferred:
        """Run ``function(*args)`` in the thread; the Deferred fires in the reactor."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        result: Deferred = Deferred()
        self._jobs.put((result, function, args))
        return result

    def stop(self) -> None:
        """Let the thread end after the job it is running, without waiting for it."""
        if self._thread is not None:
            self._jobs.put(_STOP)
            self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            result, function, args = job
            try:
                value = function(*args)
            except BaseException:
                value = Failure()
            self._reactor.callFromThread(_fire, result, value)


def _fire(result: Deferred, outcome: Any) -> None:
    """Fire a job's Deferred (a Failure fires its errbacks), unless it was given up on (cancelled, timed out)."""
    if not result.called:
        result.callback(outcome)
