"""Hung NVML calls: what the reader's thread is calling, watched from the reactor.

An NVML call can hang in the driver, for minutes or for good (docs/reliability.md);
the thread cannot be interrupted and no poll starts meanwhile.  The thread notes each
call in a `CallWatch` (attribute writes, no lock), and a `HangWatchdog` looks at it
every second while a poll is in flight: one warning when a call has run `after`
seconds, one line when it returns.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait
from typing import Any, Callable, NamedTuple, TypeVar

from twisted.internet.interfaces import IDelayedCall, IReactorTime

from atopgpud_tw.lognames import ClassLogger
from atopgpud_tw.problems import printable

T = TypeVar("T")

#: seconds an NVML call may run before it is logged as hung (--hang-warning)
HANG_AFTER = 10.0
#: the longest the watchdog waits between two looks
TICK = 1.0


class Call(NamedTuple):
    """One NVML call in progress."""

    serial: int
    function: str
    #: what it was called on, "GPU 00000000:17:00.0" (None: the library itself)
    where: str | None
    started: float

    def describe(self) -> str:
        return f"NVML call {self.function}" + (f" on {printable(self.where)}" if self.where else "")


class CallWatch:
    """The NVML call in progress: written by the reader's thread, read by the reactor (each
    write replaces one attribute with an immutable value: never half of one is seen)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        #: what `Call.started` is read from
        self.clock = clock
        self._serial = 0
        #: the call in progress, or None between calls
        self.current: Call | None = None
        #: (serial, seconds it took) of the last call that ran `long_after` seconds or more
        self.long_after = float("inf")
        self.long: tuple[int, float] | None = None

    def begin(self, function: str, where: str | None = None) -> None:
        """A call starts (in the reader's thread)."""
        self._serial = serial = self._serial + 1
        # the tuple made in C: a NamedTuple's own constructor is Python, and this runs at every call
        self.current = _new_call(Call, (serial, function, where, self.clock()))

    def run(self, function: str, where: str | None, bound: Callable[..., T], *args: Any) -> T:
        """``bound(*args)`` between `begin` and `end` (a device's every call)."""
        self.begin(function, where)
        try:
            return bound(*args)
        finally:
            self.end()

    def end(self) -> None:
        """The call in progress returned or raised (in the reader's thread)."""
        call = self.current
        if call is None:
            return
        took = self.clock() - call.started
        if took >= self.long_after:
            self.long = (call.serial, took)
        self.current = None


#: `Call`'s fields as a tuple made into a `Call` without its Python constructor
_new_call = tuple.__new__


class HangWatchdog:
    """Logs an NVML call that has not returned after `after` seconds, once, and its return, once."""

    log = ClassLogger("atopgpud_tw.watchdog.HangWatchdog")

    def __init__(self, watch: CallWatch, clock: IReactorTime, after: float = HANG_AFTER) -> None:
        self.watch = watch
        self.clock = clock
        self.after = after
        #: the longest between two looks: a second, less for a short `after`
        self._tick = min(TICK, after / 10)
        watch.long_after = after
        #: calls that ran for `after` seconds or more since start
        self.hung_calls = 0
        self._warned: Call | None = None
        #: the next look while a poll is in flight (`arm`)
        self._next: IDelayedCall | None = None

    def arm(self) -> None:
        """A poll starts: look at its calls every tick until `disarm`."""
        if self._next is None:
            self._next = self.clock.callLater(self._tick, self._look)

    def disarm(self) -> None:
        """The poll ended: one last look (a call warned of has returned: say so), then no tick until the next."""
        if self._next is not None:
            self._next.cancel()
            self._next = None
            if self._warned is not None or self.watch.current is not None:
                self.check()  # (with neither, a look finds nothing to say)

    def _look(self) -> None:
        self._next = self.clock.callLater(self._tick, self._look)
        self.check()

    def stop(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None

    def running_seconds(self) -> float:
        """How long the call in progress has been running (0 between calls)."""
        call = self.watch.current
        return 0.0 if call is None else max(0.0, self.clock.seconds() - call.started)

    def check(self) -> None:
        """One look: warn of a call that has run too long, or say that the one warned of returned."""
        call = self.watch.current
        now = self.clock.seconds()
        warned = self._warned
        if warned is not None and (call is None or call.serial != warned.serial):
            long = self.watch.long
            took = long[1] if long is not None and long[0] == warned.serial else now - warned.started
            self.log.info("{call} returned after {took:.1f} s", call=warned.describe(), took=took)
            self._warned = None
        if call is not None and self._warned is None and now - call.started >= self.after:
            self._warned = call
            self.hung_calls += 1
            self.log.warn(
                "{call} has not returned for {after:g} s; no poll starts until it does",
                call=call.describe(),
                after=self.after,
            )


#: seconds an NVML call may run while the reader is opened at start-up (--start-timeout)
START_TIMEOUT = 30.0


def open_watched(
    open_reader: Callable[[], T],
    watch: CallWatch,
    clock: Callable[[], float],
    after: float = HANG_AFTER,
    bound: float = START_TIMEOUT,
    say: Callable[[str], None] = lambda text: None,
) -> T:
    """`open_reader()` run in a daemon thread while this one watches its calls (opening runs
    before the reactor, whose watchdog cannot see it): a call that has run `after` seconds is
    said once through `say`, one that runs `bound` seconds raises `StartupHang`; the thread
    is left stuck in the driver (a daemon thread: the process can still exit)."""
    result: Future[T] = Future()

    def run() -> None:
        try:
            result.set_result(open_reader())
        except BaseException as error:
            result.set_exception(error)

    threading.Thread(target=run, name="atopgpud-open", daemon=True).start()
    step = min(TICK, after / 10, bound / 10)
    warned: Call | None = None
    while not wait([result], step).done:
        call = watch.current
        if call is None:
            continue
        running = clock() - call.started
        if running >= bound:
            raise StartupHang(f"{call.describe()} has not returned after {bound:g} s (--start-timeout)")
        if running >= after and (warned is None or warned.serial != call.serial):
            warned = call
            say(f"{call.describe()} has not returned for {after:g} s; start-up waits for it "
                f"up to {bound:g} s (--start-timeout)")
    value = result.result()
    if warned is not None:
        long = watch.long
        took = f" after {long[1]:.1f} s" if long is not None and long[0] == warned.serial else ""
        say(f"{warned.describe()} returned{took}; start-up goes on")
    return value


class StartupHang(Exception):
    """An NVML call did not return while the reader was opened at start-up; the message names it."""
